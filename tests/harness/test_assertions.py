"""Cross-rank assertions: every rank fails together, naming the ranks that differ."""

from __future__ import annotations

import pytest

from tests.harness.conftest import HEADER


def test_cross_rank_assertions_fail_every_rank_together(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        HEADER
        + """
from harness import assert_close_across_ranks, assert_on_all_ranks

CONDITION = r"condition false on rank\\(s\\) \\[2\\] of 4 \\(rank 2: loss is nan\\)"
CLOSE = r"differs from rank 0's on 1 of 4 ranks: rank 3: "

@pytest.mark.ranks(4)
@pytest.mark.expect(raises(AssertionError, match=CONDITION))
def test_condition(rank):
    assert_on_all_ranks(rank != 2, "loss is nan" if rank == 2 else "")
    dist.barrier()  # every rank raised above: nobody waits here

@pytest.mark.ranks(4)
@pytest.mark.expect(raises(AssertionError, match=CLOSE))
def test_close(rank):
    assert_close_across_ranks(torch.ones(3) + (0.5 if rank == 3 else 0.0))

@pytest.mark.ranks(4)
def test_agreeing(rank):
    assert_on_all_ranks(True)
    assert_close_across_ranks(torch.ones(3) * (1 + rank * 1e-9), rtol=1e-6, atol=0)
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=3)
