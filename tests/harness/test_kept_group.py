"""A clean test's process group is kept for the next test on the same ranks (gloo), and
never after a failure, a changed group, or when a test or the session asks for a fresh one."""

from __future__ import annotations

import pytest

GROUPS = """
import pytest, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

# The default group's store in each test: the same object while the group is kept. (Keeping
# the groups themselves would keep a failed test's sockets open, and its peers waiting.)
SEEN = []  # the module lives as long as the rank

def note_group():
    SEEN.append(c10d._get_default_store())
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
"""


def test_consecutive_clean_tests_share_one_group(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(3))
def test_clean(rank, i):
    note_group()

@pytest.mark.ranks(2)
def test_check(rank):
    note_group()
    assert all(store is SEEN[0] for store in SEEN), "every clean test ran on the same group"
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=4)


def test_a_fresh_group_after_a_failure_a_change_or_when_asked(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        GROUPS
        + """
from harness import raises

@pytest.mark.ranks(2)
def test_a_clean(rank):
    note_group()

@pytest.mark.ranks(2)
@pytest.mark.expect(rank=1, does=raises(ValueError), others=raises(RuntimeError))
def test_b_fails(rank):
    note_group()
    if rank == 1:
        raise ValueError("boom")
    dist.barrier()

@pytest.mark.ranks(2)
def test_c_after_failure(rank):
    note_group()
    assert SEEN[-1] is not SEEN[-2], "a failed test's group is never reused"

@pytest.mark.ranks(2)
def test_d_makes_a_subgroup(rank):
    note_group()
    sub = dist.new_group([0, 1])
    dist.barrier(group=sub)

@pytest.mark.ranks(2)
def test_e_subgroup_gone(rank):
    note_group()
    assert SEEN[-1] is SEEN[-2]
    assert len(c10d._world.pg_map) == 1, "the test's subgroups die with it"

@pytest.mark.ranks(2)
@pytest.mark.allow_leftovers("group")
def test_f_destroys_it(rank):
    note_group()
    dist.destroy_process_group()

@pytest.mark.ranks(2)
def test_g_after_destroy(rank):
    note_group()
    assert SEEN[-1] is not SEEN[-2]

@pytest.mark.ranks(2, fresh_group=True)
def test_h_asks_for_fresh(rank):
    note_group()
    assert SEEN[-1] is not SEEN[-2]
"""
    )
    inner.runpytest("-p", "harness", "-v").assert_outcomes(passed=8)


def test_the_session_can_ask_for_fresh_groups(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(3))
def test_clean(rank, i):
    note_group()
    assert len(set(map(id, SEEN))) == len(SEEN)
"""
    )
    inner.runpytest("-p", "harness", "--rank-fresh-group").assert_outcomes(passed=3)


def test_ranks_out_of_step_after_a_clean_test_get_a_fresh_group(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
def test_a_leaves_a_send_unreceived(rank):
    note_group()
    if rank == 0:
        dist.isend(torch.ones(1), dst=1)  # rank 1 never receives it

@pytest.mark.ranks(2)
def test_b_still_correct(rank):
    note_group()
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    assert t.item() == 3.0
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)
