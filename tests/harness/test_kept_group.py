"""A clean test's process group is kept for the next test on the same ranks (gloo), and
never after a failure, a changed group, or when a test or the session asks for a fresh one."""

from __future__ import annotations

import pytest

GROUPS = """
import weakref
import pytest, torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

# The default group of each test: the same object while the group is kept. (Weakly: keeping
# the groups themselves would keep a failed test's sockets open, and its peers waiting.)
SEEN = []  # the module lives as long as the rank

def same(a, b):
    return a() is not None and a() is b()

def note_group():
    SEEN.append(weakref.ref(c10d._get_default_group()))
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
    assert all(same(seen, SEEN[0]) for seen in SEEN), "every clean test ran on the same group"
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
    assert not same(SEEN[-1], SEEN[-2]), "a failed test's group is never reused"

@pytest.mark.ranks(2)
def test_d_makes_a_subgroup(rank):
    note_group()
    sub = dist.new_group([0, 1])
    dist.barrier(group=sub)

@pytest.mark.ranks(2)
def test_e_subgroup_gone(rank):
    note_group()
    assert same(SEEN[-1], SEEN[-2])
    assert len(c10d._world.pg_map) == 1, "the test's subgroups die with it"

@pytest.mark.ranks(2)
@pytest.mark.allow_leftovers("group")
def test_f_destroys_it(rank):
    note_group()
    dist.destroy_process_group()

@pytest.mark.ranks(2)
def test_g_after_destroy(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])

@pytest.mark.ranks(2, fresh_group=True)
def test_h_asks_for_fresh(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])
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
    assert not any(same(a, b) for a, b in zip(SEEN, SEEN[1:]))
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
def test_b_gets_no_stale_message(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2]), "counts that differ mean a fresh group"
    t = torch.full((1,), 7.0)
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)  # on a kept group: the last test's 1.0
    assert t.item() == 7.0

@pytest.mark.ranks(2)
def test_c_a_send_received(rank):
    note_group()
    t = torch.ones(1)
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)

@pytest.mark.ranks(2)
def test_d_kept_when_every_count_agrees(rank):
    note_group()
    assert same(SEEN[-1], SEEN[-2])
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=4)


def test_sends_no_rank_received_get_a_fresh_group_even_when_counts_agree(
    inner: pytest.Pytester,
) -> None:
    """Each rank sends to the other and never receives: each made one operation, so the
    counts agree, but the next test's receive would get the stale message."""
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
def test_a_sends_crossed_never_received(rank):
    dist.isend(torch.full((1,), 100.0 + rank), dst=1 - rank)
    # Both sends posted before either rank returns: one that returned at once tore its
    # group down (its send unfinished), and a peer posting its own send after that (a busy
    # machine) met a closed connection: a race of the test's own, not a verdict.
    dist.barrier()

@pytest.mark.ranks(2)  # the same bound as the last test: it may run on its group
def test_b_gets_no_stale_message(rank):
    t = torch.zeros(1)
    if rank == 0:
        dist.send(torch.full((1,), 7.0), dst=1)
        dist.recv(t, src=1)
        assert t.item() == 8.0
    else:
        dist.recv(t, src=0)  # on a kept group: rank 0's stale 100.0
        dist.send(torch.full((1,), 8.0), dst=0)
        assert t.item() == 7.0
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_a_rank_without_the_kept_group_gets_every_rank_a_fresh_one(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        GROUPS
        + """
def lose_the_group_before_the_next_test():  # as if something took it away between tests
    from harness.rank import kept_group
    real = kept_group.reusable
    def once(group_id):
        kept_group.reusable = real
        return False
    kept_group.reusable = once

@pytest.mark.ranks(2)
def test_a_rank_0_loses_it(rank):
    note_group()
    if rank == 0:
        lose_the_group_before_the_next_test()

@pytest.mark.ranks(2)
def test_b_fresh(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])

@pytest.mark.ranks(2)
def test_d_rank_1_loses_it(rank):
    note_group()
    assert same(SEEN[-1], SEEN[-2])
    if rank == 1:
        lose_the_group_before_the_next_test()

@pytest.mark.ranks(2)
def test_e_fresh(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=4)


def test_a_collective_left_unfinished_gets_a_fresh_group(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
def test_a_leaves_an_all_reduce_unmatched(rank):
    note_group()
    if rank == 0:
        dist.all_reduce(torch.ones(2), async_op=True)  # rank 1 never joins it

@pytest.mark.ranks(2)
def test_b_still_correct(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0]
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_a_test_that_changed_the_groups_timeout_gets_the_next_one_a_fresh_group(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(
        GROUPS
        + """
from datetime import timedelta

SET_UP_WITH = []

def group_timeout():
    pg = c10d._get_default_group()
    return pg._get_backend(torch.device("cpu")).options._timeout

@pytest.mark.ranks(2, timeout=30)
def test_a_shortens_it(rank):
    note_group()
    SET_UP_WITH.append(group_timeout())
    c10d._set_pg_timeout(timedelta(seconds=3), c10d._get_default_group())

@pytest.mark.ranks(2, timeout=30)
def test_b_has_the_harness_timeout(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2]), "a group whose timeout a test changed is never reused"
    assert group_timeout() == SET_UP_WITH[0] != timedelta(seconds=3)
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=2)


def test_groups_torn_down_are_freed_not_leaked(inner: pytest.Pytester) -> None:
    # Freed on a thread of the rank (group_release): a reference left behind would keep each
    # group's sockets and threads, about ten per test here.
    inner.makepyfile(
        GROUPS
        + """
import os

COUNTS = []

@pytest.mark.ranks(2, fresh_group=True)
@pytest.mark.parametrize("i", range(24))
def test_fresh(rank, i):
    note_group()
    COUNTS.append((len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))))

@pytest.mark.ranks(2)
def test_counts_stay_flat(rank):
    fds, tasks = zip(*COUNTS[4:])  # the first tests start the pools' own helpers
    # A leak grows by a group's sockets and threads every test (about 100 fds over these
    # 20); up to three groups still being freed on their threads when a test counts (a
    # fast machine frees them later than it sets the next up) move the counts too.
    assert max(fds) - min(fds) <= 30, str(fds)
    assert max(tasks) - min(tasks) <= 16, str(tasks)
"""
    )
    inner.runpytest("-p", "harness").assert_outcomes(passed=25)


def test_collectives_left_unfinished_in_step_get_a_fresh_group(inner: pytest.Pytester) -> None:
    # Counts agree (two operations each) but they never match: both of gloo's threads stay
    # stuck on them, and the next test's all_reduce would queue behind them.
    inner.makepyfile(
        GROUPS
        + """
LEFT = []

@pytest.mark.ranks(2)
def test_a_leaves_mismatched_collectives_unwaited(rank):
    note_group()
    t = torch.ones(4)
    if rank == 0:
        LEFT.extend(dist.all_reduce(t.clone(), async_op=True) for _ in range(2))
    else:
        LEFT.extend(dist.broadcast(t.clone(), src=0, async_op=True) for _ in range(2))

@pytest.mark.ranks(2)
def test_b_fresh_and_correct(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])
"""
    )
    # The collective check names the mismatch (its own test, in test_verdicts.py): off here.
    args = ("-p", "harness", "--rank-timeout", "10", "--rank-no-collective-check")
    inner.runpytest(*args).assert_outcomes(passed=2)


def test_a_message_left_under_another_tag_gets_a_fresh_group(inner: pytest.Pytester) -> None:
    # One send and one receive between the same ranks, but under different tags: neither
    # matched, and the next test's receive would get the stale message.
    inner.makepyfile(
        GROUPS
        + """
LEFT = []

@pytest.mark.ranks(2)
def test_a_tags_that_never_match(rank):
    note_group()
    if rank == 0:
        LEFT.append(dist.isend(torch.tensor([111.0]), dst=1))
    else:
        LEFT.append(dist.irecv(torch.zeros(1), src=0, tag=1))

@pytest.mark.ranks(2)
def test_b_gets_its_own_message(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])
    t = torch.tensor([42.0])
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    assert t.item() == 42.0
"""
    )
    inner.runpytest("-p", "harness", "--rank-timeout", "10").assert_outcomes(passed=2)


def test_a_subgroup_some_ranks_made_gets_a_fresh_group(inner: pytest.Pytester) -> None:
    # torch names unnamed groups by a per-rank count: after a group made on rank 0 only, the
    # next test's new_group would meet under different names on its ranks.
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
def test_a_group_on_rank_0_only(rank):
    note_group()
    if rank == 0:
        dist.new_group([0])

@pytest.mark.ranks(2)
def test_b_new_group_on_every_rank(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])
    group = dist.new_group([0, 1])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    assert t.item() == 3.0
"""
    )
    inner.runpytest("-p", "harness", "--rank-timeout", "10").assert_outcomes(passed=2)


def test_functional_collectives_left_unwaited_get_a_fresh_group(inner: pytest.Pytester) -> None:
    # DeviceMesh and DTensor go through torch's functional collectives, which reach the
    # group without its Python methods. Left unwaited and unmatched, they hold gloo's
    # threads: the next test's collectives would queue behind them or pair with them. torch's
    # work registry keeps them for the process's life: the ranks are replaced, saying why.
    inner.makepyfile(
        GROUPS
        + """
import torch.distributed._functional_collectives as funcol

@pytest.mark.ranks(2)
def test_a_leaves_functional_collectives_unwaited(rank):
    note_group()
    t = torch.ones(4) * (rank + 1)
    if rank == 0:
        funcol.all_reduce(t, "sum", dist.group.WORLD)
    else:
        funcol.broadcast(t, 1, dist.group.WORLD)

@pytest.mark.ranks(2)
def test_b_fresh_and_correct(rank):
    note_group()
    assert SEEN[:-1] == []  # new ranks: the left collectives stayed with the old ones
    gathered = [torch.zeros(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    assert [g.item() for g in gathered] == [0.0, 1.0]

@pytest.mark.ranks(2)
def test_c_waited_functional_collectives_keep_it(rank):
    note_group()
    out = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
    assert out.tolist() == [2.0, 2.0]

@pytest.mark.ranks(2)
def test_d_kept(rank):
    note_group()
    assert same(SEEN[-1], SEEN[-2])
"""
    )
    warned = ("-W", "always::harness.RanksReplacedWarning")
    result = inner.runpytest("-p", "harness", "--rank-timeout", "120", *warned)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*rank ? left 1 functional collective unwaited*"])


def test_a_coalescing_block_left_by_an_error_gets_a_fresh_group(inner: pytest.Pytester) -> None:
    # torch's _coalescing_manager has no finally: an error in its block leaves the group in
    # coalescing state, and the next test's collectives would only be queued, never run.
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
def test_a_error_inside_coalescing(rank):
    note_group()
    with pytest.raises(ValueError):
        with dist._coalescing_manager():
            dist.all_reduce(torch.ones(2))
            raise ValueError("boom")

@pytest.mark.ranks(2)
def test_b_fresh_and_correct(rank):
    note_group()
    assert not same(SEEN[-1], SEEN[-2])
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    assert t.item() == 3
"""
    )
    inner.runpytest("-p", "harness", "--rank-timeout", "10").assert_outcomes(passed=2)


def test_each_test_on_a_kept_group_gets_its_own_store_keys(inner: pytest.Pytester) -> None:
    # Keys a test writes to the default store, itself or through new_group (groups named by
    # a hash of their ranks, use_local_synchronization=True, get the same keys each time),
    # must not be read by the next test on the same kept group.
    inner.makepyfile(
        GROUPS
        + """
@pytest.mark.ranks(2)
@pytest.mark.parametrize("value", ["first", "second"])
def test_share_through_the_store(rank, value):
    note_group()
    store = c10d._get_default_store()
    if rank == 1:
        assert not store.check(["answer"]), "a key the last test wrote"
        store.set("checked", "1")
        assert store.get("answer").decode() == value
    else:
        store.wait(["checked"])
        store.set("answer", value)
    if value == "second":
        assert same(SEEN[-1], SEEN[-2])

@pytest.mark.ranks(2)
@pytest.mark.parametrize("i", range(3))
def test_a_group_named_by_its_ranks(rank, i):
    note_group()
    store = c10d._get_default_store()
    if rank == 0:
        store.set("go", "1")
    else:
        store.wait(["go"])  # rank 1 comes to new_group after rank 0
    group = dist.new_group([0, 1], use_local_synchronization=True)
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t, group=group)
    assert t.item() == 3
    if i > 0:
        assert same(SEEN[-1], SEEN[-2])
"""
    )
    inner.runpytest("-p", "harness", "--rank-timeout", "10").assert_outcomes(passed=5)


def test_a_slow_peer_is_waited_for_and_one_waiting_on_a_returned_rank_fails_at_once(
    inner: pytest.Pytester,
) -> None:
    """A rank that returned gave its kept group up once a peer was still running 3 s later
    (0.25 s before that), a guess in seconds. Now only a peer that issued an operation the
    returned ranks will never match makes them give the group up: a slow one is waited for,
    and one that calls a collective alone still fails at once (not at its 120 s timeout),
    naming the rank that returned."""
    inner.makepyfile(
        GROUPS
        + """
import threading

@pytest.mark.ranks(2)
def test_a_slow_peer(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:  # slower than the old guess, as a rank on a loaded machine can be
        threading.Event().wait(4.0)
        assert dist.get_world_size() == 2

@pytest.mark.ranks(2, timeout=120)
def test_b_a_collective_on_one_rank(rank):
    if rank == 1:
        dist.all_reduce(torch.ones(1))
"""
    )
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*rank 0 returned while rank 1 waited in all_reduce*"])
    assert "timeout" not in result.stdout.str().split("short test summary")[-1]
