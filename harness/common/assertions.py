"""Assertions made on every rank together, so a failure never desynchronises the ranks.

Each helper is a collective: every rank of the group calls it at the same point. Every rank
learns every rank's verdict, and all of them raise the same AssertionError naming the
ranks that differ, instead of one rank raising while its peers wait in the next collective.
The error's ``origin_rank`` is the first rank that differs: the harness reports that rank as
the root cause and the others as collateral.
"""

from __future__ import annotations

from typing import Any


def assert_on_all_ranks(condition: object, message: str = "", group: Any = None) -> None:
    """Assert `condition` on every rank; all ranks raise together if any rank's is false."""
    import torch.distributed as dist

    verdicts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, (bool(condition), str(message)), group=group)
    failing = [rank for rank, (ok, _) in enumerate(verdicts) if not ok]
    if failing:
        details = "; ".join(f"rank {r}: {verdicts[r][1]}" for r in failing if verdicts[r][1])
        suffix = f" ({details})" if details else ""
        error = AssertionError(f"condition false on rank(s) {failing} of {len(verdicts)}{suffix}")
        error.origin_rank = failing[0]  # type: ignore[attr-defined]  # the root cause
        raise error


def assert_close_across_ranks(
    tensor: Any, rtol: float | None = None, atol: float | None = None, group: Any = None
) -> None:
    """Assert `tensor` is close to rank 0's on every rank (torch.testing.assert_close rules)."""
    import torch
    import torch.distributed as dist

    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, tensor.detach().cpu(), group=group)
    reference = values[0]
    differing: dict[int, str] = {}
    for rank, value in enumerate(values[1:], start=1):
        try:
            torch.testing.assert_close(value, reference, rtol=rtol, atol=atol)
        except AssertionError as exc:
            differing[rank] = str(exc).strip().splitlines()[0]
    if differing:
        error = AssertionError(
            f"tensor differs from rank 0's on {len(differing)} of {len(values)} ranks: "
            + "; ".join(f"rank {rank}: {first}" for rank, first in differing.items())
        )
        error.origin_rank = min(differing)  # type: ignore[attr-defined]  # the root cause
        raise error
