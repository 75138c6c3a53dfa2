"""The public surface is exactly the specification's names, sorted, and nothing more."""

from __future__ import annotations

import rankwise

SPEC_NAMES = [
    "DistributedProcessGroup",
    "DistributedState",
    "DistributionPlan",
    "ParallelState",
    "all_reduce",
    "backend",
    "barrier",
    "broadcast_from",
    "distributed_run",
    "distribution_plan",
    "fsdp2_wrap",
    "gather_bytes",
    "gather_state_dicts",
    "is_available",
    "is_distributed_launch",
    "is_distributed_run",
    "is_fsdp2_model",
    "is_initialized",
    "is_master",
    "rank",
    "set_distribution_plan",
    "size",
]


def test_rankwise_exports_the_spec_names_sorted() -> None:
    assert rankwise.__all__ == sorted(SPEC_NAMES)
    assert all(getattr(rankwise, name).__doc__ for name in rankwise.__all__)
    public = {n for n in vars(rankwise) if not n.startswith("_")}
    assert public == set(SPEC_NAMES) | {"annotations"}
