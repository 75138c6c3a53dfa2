"""The assertions made on every rank together, tested on thread-ranks in this process (the
harness's `threaded_world`): every rank raises the same error naming the ranks that differ,
and the error's origin is the first of them; and the exceptions `harness.spawn` raises keep
torch's own types."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from harness.adopt.spawn_errors import RankExited, RankRaised
from harness.common.assertions import assert_close_across_ranks, assert_on_all_ranks

pytestmark = pytest.mark.unit  # thread-ranks in this process: make unit-fast


def _raised(check: Any) -> tuple[str, int] | None:
    try:
        check()
    except AssertionError as exc:
        return str(exc), exc.origin_rank  # type: ignore[attr-defined]
    return None


def _false_on_two_and_three(rank: int) -> tuple[str, int] | None:
    return _raised(lambda: assert_on_all_ranks(rank < 2, f"saw {rank}"))


def _true_everywhere(rank: int) -> tuple[str, int] | None:
    return _raised(lambda: assert_on_all_ranks(True, "unused"))


def test_a_condition_false_on_some_ranks_fails_every_rank_alike(threaded_world: Any) -> None:
    said = threaded_world(_false_on_two_and_three, world_size=4)
    expected = "condition false on rank(s) [2, 3] of 4 (rank 2: saw 2; rank 3: saw 3)"
    assert said == [(expected, 2)] * 4  # the first rank that differs is the root cause
    assert threaded_world(_true_everywhere, world_size=4) == [None] * 4


def _differs_on_rank_1(rank: int) -> tuple[str, int] | None:
    tensor = torch.ones(3) * (2.0 if rank == 1 else 1.0)
    return _raised(lambda: assert_close_across_ranks(tensor))


def test_a_tensor_unlike_rank_0s_fails_every_rank_naming_it(threaded_world: Any) -> None:
    said = threaded_world(_differs_on_rank_1, world_size=3)
    text, origin = said[0]
    assert said == [(text, 1)] * 3 and origin == 1
    assert text.startswith("tensor differs from rank 0's on 1 of 3 ranks: rank 1: ")


def test_spawns_errors_are_torchs_own_types_with_the_harnesss_report() -> None:
    raised = RankRaised("ValueError: x", 2, 1234)
    exited = RankExited("rank 1 exited", 1, 99, -9, "SIGKILL")
    assert isinstance(raised, ProcessRaisedException) and raised.error_index == 2
    assert isinstance(exited, ProcessExitedException) and exited.exit_code == -9
    assert raised.report == "" and raised.outcomes == []  # filled in where raised
