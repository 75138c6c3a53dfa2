"""Existing suites on warm ranks: torch's MultiProcessTestCase family adopted with
--rank-adopt torch, harness.spawn in place of torch.multiprocessing.spawn, and rank_pool in
place of a hand-written pool of processes."""

from __future__ import annotations

import warnings

import pytest

# Loaded once here: in-process pytester runs restore sys.modules, and torch's test utilities
# are slow to import and set process-wide state when they load. Without hypothesis installed
# they warn (ImportWarning) on import; that is theirs, not ours.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", ImportWarning)
    import torch.testing._internal.common_distributed  # noqa: F401

PROCESS_BASE = """
import os, sys, threading, unittest
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase, TEST_SKIPS


class TwoRanks(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass

    def join_group(self):  # as torch's own suites do: a FileStore at self.file_name
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
"""

PROCESS_CASES = (
    PROCESS_BASE
    + """

class TestVerdicts(TwoRanks):
    def test_all_reduce(self):
        self.join_group()
        t = torch.ones(1)
        dist.all_reduce(t)
        self.assertEqual(t.item(), 2)

    def test_assert_on_rank1(self):
        self.join_group()
        if self.rank == 1:
            assert [self.rank, 2] == [1, 3]
        dist.barrier()

    def test_exit_on_rank1(self):
        if self.rank == 1:
            sys.exit(3)

    def test_skip_status(self):
        sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)

    def test_skip_status_hard(self):
        os._exit(TEST_SKIPS["small_worldsize"].exit_code)

    def test_skip_test(self):
        self.skipTest("no such device here")

    @unittest.skip("decorated away")
    def test_unittest_skip(self):
        raise AssertionError("never runs")


class TestKeepsGroup(TwoRanks):
    @property
    def destroy_pg_upon_exit(self):
        return False

    def test_group_left_for_the_harness(self):
        self.join_group()
        dist.barrier()

    def test_group_made_again_on_the_same_ranks(self):
        self.join_group()  # raises if the last test's group were still the default one
        dist.barrier()


class TestThreeRanks(TwoRanks):
    @property
    def world_size(self):
        return 3

    def test_world_size_override(self):
        self.join_group()
        assert dist.get_world_size() == 3
        # gloo's set-up returns on a rank once its own pairs connect: without a collective,
        # rank 1 could end (and close its pairs) while ranks 0 and 2 still connect theirs,
        # under torch's own spawn as here.
        dist.barrier()


class TestOwnEntryPoint(TwoRanks):
    @classmethod
    def _run(cls, rank, test_name, file_name, parent_pipe, **kwargs):
        cls.entered_on = rank  # a subclass's per-rank entry point is the one each rank runs
        super()._run(rank, test_name, file_name, parent_pipe, **kwargs)

    def test_entry_point_override_ran(self):
        assert type(self).entered_on == self.rank


class TestSetUpClass(TwoRanks):
    classes_set_up = 0

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.classes_set_up += 1
        os.environ["ADOPTED_SUITE_FLAG"] = "set in setUpClass"

    def test_sees_the_environment(self):
        assert os.environ["ADOPTED_SUITE_FLAG"] == "set in setUpClass"

    def test_set_up_once(self):
        assert type(self).classes_set_up == 0  # a rank's class: setUpClass ran in pytest only
"""
)


@pytest.mark.slow
def test_adopted_cases_get_strict_verdicts_and_root_cause_first(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_cases=PROCESS_CASES)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "-rs", "-v")
    result.assert_outcomes(passed=7, failed=2, skipped=4)
    result.stdout.fnmatch_lines_random(
        [
            "*TestVerdicts::test_all_reduce PASSED*",
            "*TestKeepsGroup::test_group_left_for_the_harness PASSED*",
            "*TestKeepsGroup::test_group_made_again_on_the_same_ranks PASSED*",
            "*TestThreeRanks::test_world_size_override PASSED*",
            "*TestOwnEntryPoint::test_entry_point_override_ran PASSED*",
            "*TestSetUpClass::test_sees_the_environment PASSED*",
            "*TestSetUpClass::test_set_up_once PASSED*",
            "rank 1 failed: raised AssertionError: assert [[]1, 2[]] == [[]1, 3[]]; rank 0 coll*",
            "*At index 1 diff: 2 != 3*",
            "rank 1 failed: called sys.exit(3)  [[]2 ranks, *test_exit_on_rank1[]]",
            "SKIPPED * Need at least 2 CUDA devices",
            "SKIPPED * Skipped due to small world size.",
            "SKIPPED * no such device here",
            "SKIPPED * decorated away",
        ]
    )


REAL_BASES = """
import torch, torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
from torch.testing._internal.common_distributed import DistributedTestBase
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class TestDTensor(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_shard(self):
        mesh = DeviceMesh(self.device_type, list(range(self.world_size)))
        t = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
        assert t.to_local().numel() == 2 and t.full_tensor().sum().item() == 6.0


class TestDistributedBase(DistributedTestBase):
    @property
    def world_size(self):
        return 2

    def test_create_pg(self):
        pg = self.create_pg("cpu")
        t = torch.ones(1)
        dist.all_reduce(t, group=pg)
        assert t.item() == 2
"""


@pytest.mark.slow
def test_torchs_own_subclasses_are_adopted(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_real=REAL_BASES)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*not adopted*")


# Found by an adversarial pass over adopted suites: with_comms destroys the group when the
# test raises, but the mesh (in the traceback's frames, and torch's mesh caches) still held
# it, its sockets stayed open, and rank 0 waited in destroy_pg's barrier until the failure
# grace killed it (5 s, against 2.6 s for the whole test under torch).
DTENSOR_FAILS_ON_RANK_1 = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class TestDTensorFails(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_rank_1_disagrees(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        full = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).full_tensor()
        if self.rank == 1:
            self.assertEqual(full.sum().item(), 0.0)

    @with_comms
    def test_after(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        assert distribute_tensor(torch.ones(4), mesh, [Shard(0)]).to_local().numel() == 2
"""


@pytest.mark.slow
def test_a_failed_rank_that_still_holds_a_group_it_destroyed_frees_its_peers(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("_HARNESS_TEST_FAILURE_GRACE_S", "3")
    inner.makepyfile(test_dtensor_fails=DTENSOR_FAILS_ON_RANK_1)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "rank 1 failed: raised AssertionError" in text, text
    assert "after a peer failed; killed" not in text, text  # its peer failed as soon as it did
    result.stdout.fnmatch_lines(["rank 0 (pid *), waiting in *: its collective failed as a peer *"])


@pytest.mark.slow
def test_without_the_option_a_rank_exit_passes_as_under_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cases=PROCESS_CASES)
    result = pytester.runpytest_subprocess("-p", "harness", "-k", "test_exit_on_rank1", timeout=120)
    result.assert_outcomes(passed=1)  # the false green the adoption turns red


@pytest.mark.slow
def test_a_class_that_joins_its_own_way_runs_as_before_with_the_reason(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_cases=PROCESS_BASE
        + """

class TestOwnJoin(TwoRanks):
    def _join_processes(self, fn):
        super()._join_processes(fn)

    def test_runs(self):
        pass
"""
    )
    result = pytester.runpytest_subprocess("-p", "harness", "--rank-adopt", "torch", timeout=120)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "harness: not adopted, runs as before: test_cases.TestOwnJoin: "
            "TestOwnJoin overrides _join_processes"
        ]
    )


HANGS = (
    PROCESS_BASE
    + """
import time, harness, pytest


class TestHang(TwoRanks):
    def test_a_hang_on_rank1(self):
        self.join_group()
        if self.rank == 1:
            while True:
                time.sleep(0.05)
        dist.barrier()

    def test_b_after(self):
        self.join_group()
        dist.barrier()


def stall(i):
    while i == 0:
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_spawn_hang():
    from torch.multiprocessing.spawn import ProcessExitedException
    try:
        harness.spawn(stall, nprocs=2, timeout=2)
    except ProcessExitedException as exc:
        assert exc.error_index == 0 and exc.signal_name == "SIGKILL", exc
        assert "still running at the 2 s timeout; killed" in str(exc)
    else:
        raise AssertionError("the hang was not reported")
"""
)


@pytest.mark.slow
def test_a_hang_is_bounded_with_every_ranks_stack(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_cases=HANGS)
    # pytest-timeout's bound becomes the harness's, and its own timer stays off.
    result = pytester.runpytest_subprocess(
        "-p", "harness", "--rank-adopt", "torch", "--timeout", "3", "-v", timeout=120
    )
    result.assert_outcomes(failed=1, passed=2)
    result.stdout.no_fnmatch_line("*+++ Timeout +++*")
    result.stdout.fnmatch_lines(
        [
            "*test_a_hang_on_rank1 FAILED*",
            "*test_b_after PASSED*",
            "rank 1 failed: hung outside any collective; rank 0 collateral*",
            "still running at the 3 s timeout; killed",
            "-- Python stacks at the deadline --",
            '*File "*test_cases.py", line * in test_a_hang_on_rank1',
            "*rank 0 (pid *): hung in barrier [[]collateral[]]*",
        ]
    )


CONTINUOUS_CASES = """
import os, torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest, TEST_SKIPS


class TestContinuous(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        os.environ["CONTINUOUS_FLAG"] = "1"

    def test_a_all_reduce(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2 and os.environ["CONTINUOUS_FLAG"] == "1"

    def test_b_assert_on_rank1(self):
        if self.rank == 1:
            assert self.rank == 0, "rank 1 disagrees"
        dist.barrier()

    def test_c_after_a_failure(self):
        dist.barrier()

    def test_d_skip_status(self):
        raise SystemExit(TEST_SKIPS["no_cuda"].exit_code)
"""


@pytest.mark.slow
def test_continuous_cases_run_one_by_one_and_a_failure_poisons_nothing(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(test_continuous=CONTINUOUS_CASES)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "-rs", "-v")
    result.assert_outcomes(passed=2, failed=1, skipped=1)
    result.stdout.fnmatch_lines_random(
        [
            "*test_a_all_reduce PASSED*",
            "*test_c_after_a_failure PASSED*",
            "rank 1 failed: raised AssertionError: rank 1 disagrees; rank 0 collateral*",
            "SKIPPED * CUDA is not available.",
        ]
    )


# Found by an adversarial pass over adopted suites: the rank's traceback ended at the
# RuntimeError; its cause (JSONDecodeError) and torch's "direct cause" line were lost.
CHAINED_ERRORS = """
import json
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest,
    MultiProcessTestCase,
)


def load_config(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeError("the config for this rank is invalid") from e


def read_or_fail(text):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise KeyError("no config at all")


class TestChainedErrors(MultiProcessTestCase):
    world_size = 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_explicit_cause(self):
        if self.rank == 1:
            load_config("{not json")

    def test_implicit_context(self):
        if self.rank == 1:
            read_or_fail("{not json")


class TestChainedErrorsContinuous(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    def test_explicit_cause(self):
        if self.rank == 1:
            load_config("{not json")
"""


@pytest.mark.slow
def test_an_adopted_tests_exception_keeps_its_chain(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_chained=CHAINED_ERRORS)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(failed=3)
    text = result.stdout.str()

    def rank_1s_traceback(test: str) -> str:  # not torch's own log of it, in its stderr
        failure = text.split(f"{test} _")[1]
        return failure.split("======== rank 1 (pid")[1].split("-- rank 1 captured")[0]

    for test in ("TestChainedErrors", "TestChainedErrorsContinuous"):
        shown = rank_1s_traceback(f"{test}.test_explicit_cause")
        assert "JSONDecodeError: Expecting property name" in shown, shown
        assert "direct cause of the following exception" in shown, shown
        assert "harness/adopt/" not in shown, shown  # the harness's frames are not the test's
    shown = rank_1s_traceback("TestChainedErrors.test_implicit_context")
    assert "JSONDecodeError" in shown and "During handling of the above" in shown, shown
    assert "KeyError: 'no config at all" in shown, shown


CONTINUOUS_WITHOUT_COLLECTIVES = """
from torch.testing._internal.common_distributed import MultiProcContinuousTest, TEST_SKIPS


class TestNoCollectives(MultiProcContinuousTest):
    world_size = 4

    @classmethod
    def backend_str(cls):
        return "gloo"


def _returns(self):
    pass


def _skips(self):
    raise SystemExit(TEST_SKIPS["no_cuda"].exit_code)


for i in range(12):
    setattr(TestNoCollectives, f"test_returns_{i}", _returns)
    setattr(TestNoCollectives, f"test_skips_{i}", _skips)
"""


@pytest.mark.slow
def test_continuous_cases_with_no_collective_never_break_a_slower_ranks_set_up(
    inner: pytest.Pytester,
) -> None:
    # Each adopted test sets the class's group up and tears it down: a rank whose test does
    # no collective must not close its connections while a peer is still connecting.
    inner.makepyfile(test_quick=CONTINUOUS_WITHOUT_COLLECTIVES)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(passed=12, skipped=12)


CONTINUOUS_SLOW_SET_UP = """
import os, time
from torch.testing._internal.common_distributed import MultiProcContinuousTest

SET_UP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank1_set_up")


class TestSlowSetUp(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        super()._init_pg(rank, world_size, rdvz_file)
        if rank == 1:
            time.sleep(1)  # a straggler still finishing its set-up
            open(SET_UP, "w").close()

    def test_starts_once_every_rank_is_set_up(self):
        assert os.path.exists(SET_UP), "rank 0 started before rank 1 was set up"
"""


@pytest.mark.slow
def test_an_adopted_continuous_test_starts_once_every_rank_is_set_up(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(test_slow_set_up=CONTINUOUS_SLOW_SET_UP)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(passed=1)


SPAWN_AND_POOL = """
import os, sys, pytest, torch, torch.distributed as dist
import harness
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException


def all_reduce_ones(i, path, world_size):
    store = dist.FileStore(path, world_size)
    dist.init_process_group("gloo", store=store, rank=i, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
    dist.destroy_process_group()


def raises_on_rank1(i):
    if i == 1:
        raise ValueError(f"rank {i} refuses")


def exits_on_rank1(i):
    if i == 1:
        sys.exit(3)


def test_spawn_runs_fn_on_each_index(tmp_path):
    assert harness.spawn(all_reduce_ones, args=(str(tmp_path / "store"), 2), nprocs=2) is None


def test_spawn_raises_torchs_type_for_an_exception():
    with pytest.raises(ProcessRaisedException, match="ValueError: rank 1 refuses") as info:
        harness.spawn(raises_on_rank1, nprocs=2)
    assert info.value.error_index == 1
    assert "-- Process 1 terminated with the following error:" in str(info.value)
    assert "rank 1 failed: raised ValueError: rank 1 refuses" in info.value.report


def test_spawn_raises_torchs_type_for_an_exit():
    with pytest.raises(ProcessExitedException, match="process 1 terminated with exit code 3"):
        harness.spawn(exits_on_rank1, nprocs=2)


def test_spawn_without_join_returns_a_context(tmp_path):
    context = harness.spawn(all_reduce_ones, args=(str(tmp_path / "s"), 2), nprocs=2, join=False)
    assert context.join(timeout=60) is True
    assert len(context.pids()) == 2


def summed(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return t.item()


def fails_on_rank0(rank, world_size):
    if rank == 0:
        raise KeyError("rank 0 broke")
    dist.barrier()


def dies_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(7)
    dist.barrier()


def test_pool_runs_fn_with_rank_and_world_size(rank_pool):
    assert rank_pool.world_size == 2
    assert rank_pool.run(summed, 1) == [3.0, 3.0]


def test_pool_failure_raises_the_report_and_the_next_run_works(rank_pool):
    with pytest.raises(harness.RankPoolError, match="rank 0 failed: raised KeyError"):
        rank_pool.run(fails_on_rank0)
    with pytest.raises(harness.RankPoolError, match="rank 1 failed: process exited with status 7"):
        rank_pool.run(dies_on_rank1)
    assert rank_pool.run(summed, offset=2) == [5.0, 5.0]
"""


def test_spawn_and_pool_keep_their_callers_assertions(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_launchers=SPAWN_AND_POOL)
    result = inner.runpytest("-p", "harness", "-v")
    result.assert_outcomes(passed=6)


# Found by an adversarial pass over adopted suites: a test that left its group (as FSDPTest
# does) set up with env:// on the class's MASTER_PORT failed the next test, 3 runs in 5: the
# group was freed on a thread, and its store still listened on the port when the next began.
GROUP_LEFT_ON_A_PORT = """
import os, socket, harness, torch.distributed as dist


def joins_on_the_port_and_leaves_its_group(i, port):
    if i == 0:  # the port the last run's store listened on is free again
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method="env://", rank=i, world_size=2)
    dist.barrier()  # no destroy: under torch the process ends here, and its port with it


KEPT = []


def destroys_its_group_but_keeps_a_subgroup(i, port):
    joins_on_the_port_and_leaves_its_group(i, port)
    KEPT.append(dist.new_group([0, 1]))  # a module's cache: its store is the port's
    dist.destroy_process_group()  # the test tidies up, as torch's tests do


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_run_finds_the_port_free():
    port = free_port()
    for _ in range(3):
        harness.spawn(joins_on_the_port_and_leaves_its_group, args=(port,), nprocs=2)


def test_a_subgroup_kept_past_the_run_does_not_keep_the_port():
    port = free_port()
    for _ in range(3):
        harness.spawn(destroys_its_group_but_keeps_a_subgroup, args=(port,), nprocs=2)
"""


def test_a_group_a_run_leaves_on_a_port_is_gone_before_the_next_run(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(test_port=GROUP_LEFT_ON_A_PORT)
    result = inner.runpytest("-p", "harness")
    result.assert_outcomes(passed=2)


# Found by an adversarial pass over suites written for mp.spawn: each passed (a false green).
SPAWN_LIKE_TORCH = """
import os, random, signal, numpy, pytest, torch, torch.distributed as dist
from datetime import timedelta
import harness
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException


class Trainer:
    def __init__(self, scale):
        self.scale = scale

    def check(self, rank, expected):
        assert isinstance(self, Trainer) and self.scale == expected, (self, expected)

    def pooled(self, rank, world_size):
        return self.scale * rank


def test_spawn_calls_a_bound_method_on_its_instance():
    harness.spawn(Trainer(3).check, args=(3,), nprocs=2)
    with pytest.raises(ProcessRaisedException, match="AssertionError"):
        harness.spawn(Trainer(3).check, args=(4,), nprocs=2)


class Locked:
    def __init__(self):
        import threading
        self.lock = threading.Lock()

    def run(self, rank):
        pass


def test_a_bound_method_whose_instance_cannot_travel_says_so():
    with pytest.raises(ValueError, match="the instance of the bound method Locked.run cannot"):
        harness.spawn(Locked().run, nprocs=1)


def test_the_pool_calls_a_bound_method_on_its_instance(rank_pool):
    assert rank_pool.run(Trainer(5).pooled) == [0, 5]


def forks_and_the_child_returns(i):
    pid = os.fork()
    if pid == 0:
        return  # a careless child: it returns into its parent's caller
    os.waitpid(pid, 0)
    raise AssertionError(f"the parent on rank {i} fails")


@pytest.fixture
def forks_at_teardown(rank):
    yield
    if os.fork() == 0:
        return  # the child comes back into the harness from the fixture's teardown
    os.wait()


@pytest.mark.ranks(2)
def test_a_fixture_forks_at_teardown(rank, forks_at_teardown):
    pass


@pytest.mark.ranks(2)
def test_and_the_next_test_runs_on_the_ranks_themselves(rank):
    dist.barrier()


def test_a_forked_child_that_returns_is_not_taken_for_the_rank():
    with pytest.raises(ProcessRaisedException, match="the parent on rank 0 fails"):
        harness.spawn(forks_and_the_child_returns, nprocs=2)


def fails_on_rank_1(i):
    assert i != 1, "rank 1 of the unjoined run fails"


def test_z_an_unjoined_spawn_that_fails_errors_at_its_tests_teardown():
    harness.spawn(fails_on_rank_1, nprocs=2, join=False)  # never joined: its failure is ours


@pytest.fixture
def breaks_at_teardown():
    yield
    raise RuntimeError("the fixture's teardown broke")


def test_z_an_unjoined_failure_is_kept_when_a_teardown_breaks(breaks_at_teardown):
    harness.spawn(fails_on_rank_1, nprocs=2, join=False)


def test_z_an_unjoined_spawn_that_passes_is_waited_for(tmp_path):
    harness.spawn(noop, nprocs=2, join=False)


def noop(i):
    pass


def server(i, path):
    store = dist.FileStore(path, 2)
    store.set_timeout(timedelta(seconds=20))
    store.wait(["hello"])  # from the client, spawned while this run goes on


def client(i, path):
    dist.FileStore(path, 2).set("hello", "1")


def test_two_spawns_at_once_each_get_their_own_ranks(tmp_path):
    harness.spawn(noop, nprocs=1)  # the ranks for one process are warm: both runs want them
    path = str(tmp_path / "store")
    serving = harness.spawn(server, args=(path,), nprocs=1, join=False)
    harness.spawn(client, args=(path,), nprocs=1)
    assert serving.join(timeout=60)


def waits_to_be_killed(i, path):
    store = dist.FileStore(path, 2)
    store.set_timeout(timedelta(seconds=30))
    store.wait(["never set"])


def test_a_running_spawns_pids_can_be_signalled(tmp_path):
    context = harness.spawn(waits_to_be_killed, args=(str(tmp_path / "s"),), nprocs=2, join=False)
    pids = context.pids()  # torch's context knows them at once: a test may kill one
    assert len(pids) == 2 and os.getpid() not in pids
    os.kill(pids[1], signal.SIGKILL)
    killed = "process 1 terminated with signal SIGKILL"
    with pytest.raises(ProcessExitedException, match=killed) as info:
        context.join(timeout=60)
    assert info.value.error_pid == pids[1] and context.pids() == pids


def half_collective(i, path):
    dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=i, world_size=2)
    if i == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never comes: it returns


def test_a_rank_returning_while_its_peer_waits_is_named_with_no_made_up_exit_code(tmp_path):
    with pytest.raises(ProcessExitedException, match="process 1 returned while") as info:
        harness.spawn(half_collective, args=(str(tmp_path / "s"),), nprocs=2)
    assert info.value.exit_code == 0


def test_a_queue_in_args_says_what_to_pass_instead():
    import multiprocessing
    with pytest.raises(ValueError, match="use a file or a torch.distributed store"):
        harness.spawn(noop, args=(multiprocessing.get_context("spawn").Queue(),), nprocs=1)


def skips(i):
    pytest.skip("no data here")


def test_a_skip_on_every_spawned_rank_is_reported_at_the_test():
    harness.spawn(skips, nprocs=2)


@pytest.mark.ranks(2)
def test_one_that_seeds_every_rank_alike(rank):
    torch.manual_seed(0), random.seed(0), numpy.random.seed(0)


@pytest.mark.ranks(2)
def test_each_rank_draws_its_own_random_numbers(rank):
    drawn = torch.tensor([torch.rand(1).item(), random.random(), numpy.random.rand()])
    every = [torch.zeros(3) for _ in range(2)]
    dist.all_gather(every, drawn)
    assert (every[0] != every[1]).all(), every
"""


# A server a module's fixture spawns and stops: its run is the fixture's, not the first test's.
SERVED_BY_A_FIXTURE = """
from datetime import timedelta
import pytest, torch.distributed as dist
import harness


def serve_until_stopped(i, path):
    store = dist.FileStore(path, 2)
    store.set_timeout(timedelta(seconds=30))
    store.wait(["stop"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("server") / "store")
    running = harness.spawn(serve_until_stopped, args=(path,), nprocs=1, join=False)
    yield path
    dist.FileStore(path, 2).set("stop", "1")
    assert running.join(timeout=60)


def test_first_use(server):
    pass


def test_second_use(server):
    pass
"""


def test_spawned_ranks_behave_as_torchs_spawned_processes(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_like_torch=SPAWN_LIKE_TORCH, test_served=SERVED_BY_A_FIXTURE)
    result = inner.runpytest("-p", "harness", "-v", "-rs")
    result.assert_outcomes(passed=17, errors=2, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_z_an_unjoined_failure_is_kept*",
            "*the fixture's teardown broke*",
            "*rank 1 of the unjoined run fails*",
        ]
    )
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_like_torch.py:*: no data here"])
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_z_an_unjoined_spawn_that_fails*",
            "*harness.spawn(join=False) run this test started was never joined*",
            "*rank 1 of the unjoined run fails*",
        ]
    )


def test_an_unjoined_run_still_going_when_its_test_fails_is_ended_after_the_grace(
    inner: pytest.Pytester,
) -> None:
    # A server the test spawned waits for a client that failed first: nobody will join it.
    # It is ended after the grace peers of a failure get, not waited for until the run's
    # timeout, and its end is no second error: the client's failure is the test's report.
    # A run that failed on its own before that still is.
    inner.makepyfile(
        """
        import threading, pytest, torch.distributed as dist
        from datetime import timedelta
        import harness

        def serve_forever(i):
            threading.Event().wait()

        def test_client_fails():
            harness.spawn(serve_forever, nprocs=2, join=False)
            assert False, "the client failed"

        def fails_on_rank_1_then_serves(i, path):
            if i == 1:
                dist.FileStore(path, 3).set("failing", "1")
                raise ValueError("the server broke on rank 1")
            threading.Event().wait()

        def test_server_broke_first(tmp_path):
            path = str(tmp_path / "store")
            harness.spawn(fails_on_rank_1_then_serves, args=(path,), nprocs=2, join=False)
            store = dist.FileStore(path, 3)
            store.set_timeout(timedelta(seconds=60))
            store.wait(["failing"])
            assert False, "the client failed too"

        def test_the_ranks_serve_the_next_test():
            harness.spawn(print, nprocs=2)

        def test_a_run_that_ended_before_its_test_failed():
            context = harness.spawn(print, nprocs=2, join=False)
            context._thread.join(60)  # ended, never joined
            assert False, "the client failed after its server ended"

        def test_no_cut_is_left_for_a_later_run():
            context = harness.spawn(print, nprocs=2, join=False)  # maybe on a reused thread
            assert context.join(60)
        """
    )
    result = inner.runpytest("-p", "harness", "--rank-timeout", "30")
    result.assert_outcomes(failed=3, errors=1, passed=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_server_broke_first*",
            "*run this test started was never joined*",
            "*the server broke on rank 1*",
        ]
    )


def test_several_unjoined_runs_each_report_their_failure(inner: pytest.Pytester) -> None:
    # Every unjoined run's failure is reported, not the first one's alone; once one has
    # failed, a run still going is ended after the grace (nobody will join it), whichever
    # was started first, and the next test gets the ranks.
    inner.makepyfile(
        """
        import threading
        import harness, pytest

        def fails(i, what):
            raise ValueError(f"{what} failed on rank {i}")

        def serve_forever(i):
            threading.Event().wait()

        def test_two_runs_fail():
            harness.spawn(fails, args=("run A",), nprocs=2, join=False)
            harness.spawn(fails, args=("run B",), nprocs=2, join=False)

        def test_one_fails_after_one_that_never_ends():
            harness.spawn(serve_forever, nprocs=2, join=False)
            harness.spawn(fails, args=("run C",), nprocs=2, join=False)

        def skips(i):
            pytest.skip("no resource")

        def test_a_skip_in_one_run_hides_no_failure_of_another():
            harness.spawn(skips, nprocs=2, join=False)
            harness.spawn(fails, args=("run D",), nprocs=1, join=False)

        def test_a_skip_in_every_run_skips():
            harness.spawn(skips, nprocs=2, join=False)

        def test_the_ranks_serve_the_next_test():
            harness.spawn(print, nprocs=2)
        """
    )
    result = inner.runpytest("-p", "harness", "--rank-timeout", "30")
    result.assert_outcomes(errors=3, passed=5, skipped=1)  # a teardown skip: passed + skipped
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a_skip_in_one_run*", "*run D failed*"])
    out = result.stdout.str()
    first, second = out.split("ERROR at teardown of test_one_fails_after")
    second = second.split("ERROR at teardown of test_a_skip")[0]
    assert "2 harness.spawn(join=False) runs this test started were never joined" in first
    assert "run A failed on rank 0" in first and "run B failed on rank 0" in first
    assert "run C failed on rank 0" in second
    assert "hung" not in second and "timeout" not in second  # cut after the grace, quietly


def test_a_failed_run_a_fixture_started_and_never_joined_fails_the_session(
    inner: pytest.Pytester,
) -> None:
    # A fixture's run is the fixture's to join; one that never does must not lose the run's
    # failure: the session reports it and fails. One still running at the end is ended.
    inner.makepyfile(
        """
        import threading
        import pytest, harness

        def fails(i):
            raise ValueError(f"the fixture's run failed on rank {i}")

        def serves(i):
            threading.Event().wait()

        @pytest.fixture
        def forgets_its_run():
            context = harness.spawn(fails, nprocs=2, join=False)
            context.pids()
            yield

        @pytest.fixture(scope="module")
        def leaves_a_server():
            harness.spawn(serves, nprocs=1, join=False)
            yield

        def test_uses_it(forgets_its_run, leaves_a_server):
            pass

        def test_next():
            harness.spawn(print, nprocs=2)
        """
    )
    result = inner.runpytest("-p", "harness", "--rank-timeout", "30")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*harness.spawn(join=False) runs started outside a test body and never joined*",
            "*started while setting up *test_uses_it*",
            "*the fixture's run failed on rank*",
        ]
    )
    lost = result.stdout.str().split("never joined, which failed")[1]
    assert lost.count("-- started while") == 1, lost  # the server, ended at the end: no failure


def test_spawn_says_what_to_do_outside_a_session() -> None:
    from harness.adopt.spawn import _configs

    saved = list(_configs)
    _configs.clear()
    try:
        with pytest.raises(RuntimeError, match="runs ranks from a pytest session"):
            __import__("harness").spawn(print, nprocs=2)
    finally:
        _configs.extend(saved)


def test_a_bad_adopt_value_names_its_source(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest("-p", "harness", "--rank-adopt", "unittest")
    result.stderr.fnmatch_lines(["*invalid rank_adopt 'unittest' from --rank-adopt*use torch*"])


def test_a_continuous_class_that_spawns_nothing_still_runs_its_tests(
    inner: pytest.Pytester,
) -> None:
    """torch's local-tensor bases run each test in the pytest process and spawn nothing: the
    test runs there, as under torch (it passed without running)."""
    inner.makepyfile(
        test_local="""
from torch.testing._internal.distributed._tensor.common_dtensor import (
    LocalDTensorContinuousTestBase,
)


class TestLocal(LocalDTensorContinuousTestBase):
    world_size = 2

    def test_fails(self):
        self.assertEqual(1, 2, "this test must fail")

    def test_passes(self):
        self.assertEqual(1, 1)
"""
    )
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(passed=1, failed=1)


LEFTOVERS = (
    PROCESS_BASE
    + """
import threading, harness

STOP = threading.Event()


def start_a_thread(*_):  # never ends: found at the test's bound, and the ranks replaced
    threading.Thread(target=STOP.wait, name="beat").start()


class TestLeaves(TwoRanks):
    def test_a_leaves_a_thread(self):
        start_a_thread()


def test_spawn(tmp_path):
    with pytest.raises(Exception, match="left non-daemon threads running: beat"):
        harness.spawn(start_a_thread, nprocs=2)


def test_pool(rank_pool):
    with pytest.raises(harness.RankPoolError, match="left non-daemon threads running: beat"):
        rank_pool.run(start_a_thread)
"""
)


def test_what_adopted_spawned_and_pooled_runs_leave_behind_is_reported(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(test_leaves="import pytest\n" + LEFTOVERS)
    # A thread left running is found at the test's bound: one a saturated machine's fresh
    # ranks meet with room (5 s was crossed there, at a load of 11 on 2 cores).
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "--rank-timeout", "15")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*hygiene: rank * left non-daemon threads running: beat*"])


def test_a_class_with_no_ranks_is_skipped_saying_why(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_none=PROCESS_BASE
        + """
class TestNoGpus(TwoRanks):
    @property
    def world_size(self):
        return 0  # torch.cuda.device_count() on a machine without GPUs

    def test_nothing(self):
        raise AssertionError("never runs")
"""
    )
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*world_size is 0: no rank to run the test on*"])


def test_without_a_harness_timeout_torchs_own_per_test_timeout_applies(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_torch_timeout=PROCESS_BASE
        + """
import threading
from torch.testing._internal import common_distributed

common_distributed.TIMEOUT_OVERRIDE["test_hang"] = 2  # as torch's suites name slow tests


class TestTimeouts(TwoRanks):
    def test_hang(self):
        if self.rank == 1:
            threading.Event().wait()
"""
    )
    result = pytester.runpytest("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["still running at the 2 s timeout; killed"])


# ---- found by an adversarial pass over adopted torch suites ---------------------------------

ADOPTED_CORNERS = """
import multiprocessing, sys, time
from torch.testing._internal.common_distributed import (
    MultiProcContinuousTest, MultiProcessTestCase, TEST_SKIPS,
)


def sleeps():
    time.sleep(300)


class TestNeedsGpus(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)  # as FSDPTestContinuous does on CPU

    def test_skipped_with_torchs_reason(self):
        pass


class TestPrints(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def test_passes_and_prints(self):
        print(f"out of rank {self.rank}")

    def test_leaves_a_daemonic_child(self):
        # multiprocessing ends it when torch's rank process exits: no leftover there
        multiprocessing.get_context("fork").Process(target=sleeps, daemon=True).start()
"""


@pytest.mark.slow
def test_an_init_skip_skips_and_a_passing_ranks_output_is_kept(inner: pytest.Pytester) -> None:
    """A continuous class whose _init_pg exits with a skip status failed (the base then
    destroys a group that never was); a passing adopted test's rank output was dropped; a
    daemonic child, which multiprocessing ends at the process's exit, was a leftover."""
    inner.makepyfile(test_corners=ADOPTED_CORNERS)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "-rA")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED * Need at least 2 CUDA devices",
            "*Captured stdout [[]rank 0[]] call*",
            "out of rank 0",
            "*Captured stdout [[]rank 1[]] call*",
            "out of rank 1",
        ]
    )


TEARDOWN_HANGS = """
import time
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestTearDownHangs(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        if self.rank is None or self.rank < 0:  # the pytest process's own tearDown
            time.sleep(60)  # waits for something that never comes
        super().tearDown()

    def test_body_passes(self):
        pass
"""


@pytest.mark.slow
def test_pytest_timeout_still_bounds_an_adopted_tests_own_set_up_and_tear_down(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_td=TEARDOWN_HANGS)
    result = pytester.runpytest_subprocess(
        "-p", "harness", "--rank-adopt", "torch", "--timeout", "5", timeout=120
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Timeout (>5.0s) from pytest-timeout*"])


# torch's own distributed suite, wrapped as PyTorch's test/distributed/test_distributed_spawn.py
# wraps it (the suite ships in torch's wheel; only the wrapper is ours, the benchmark's own).
DISTRIBUTED_SELECTION = {
    "all_reduce_sum", "all_reduce_max", "all_reduce_sum_async", "broadcast",
    "broadcast_full_group", "barrier", "barrier_full_group", "reduce_sum", "reduce_sum_twice",
    "all_gather", "all_reduce_sum_cuda",  # the last: a skip on CPU
}  # fmt: skip
# The selection, in a conftest: the class's setUp refers to test methods by name.
SELECTED_BY_NAME = """
SELECTED = {selected!r}


def pytest_collection_modifyitems(config, items):
    items[:] = [item for item in items if item.name.removeprefix("test_") in SELECTED]
"""


@pytest.mark.slow
def test_torchs_shipped_distributed_test_passes_adopted_as_it_does_as_it_is(
    pytester: pytest.Pytester,
) -> None:
    """Every rank of torch's DistributedTest ends with sys.exit(0), its base's protocol:
    adopted, 10 of 10 tests that pass as they are failed ("called sys.exit(0)")."""
    from benchmarks.adopt import DISTRIBUTED_SOURCE

    pytester.makepyfile(test_distributed_spawn=DISTRIBUTED_SOURCE.format(world_size=2))
    pytester.makeconftest(SELECTED_BY_NAME.format(selected=DISTRIBUTED_SELECTION))
    select = ("-p", "no:cacheprovider", "-W", "ignore", "-rA")
    as_is = pytester.runpytest_subprocess(*select, "-p", "no:harness")
    adopted = pytester.runpytest_subprocess(*select, "-p", "harness", "--rank-adopt", "torch")
    verdicts = as_is.parseoutcomes()
    assert verdicts == {"passed": 10, "skipped": 1}, as_is.stdout.str()
    assert adopted.parseoutcomes() == verdicts, adopted.stdout.str()


REPLACED_AND_IMPORT_OUTPUT = (
    """
print("LOADING THE SUITE, as a library's load warning would")
"""
    + PROCESS_BASE
    + """
import threading

HELD = []


class TestReplacements(TwoRanks):
    def test_a_leaves_a_daemon_thread(self):
        threading.Thread(target=threading.Event().wait, daemon=True).start()

    def test_b_holds_its_group(self):
        self.join_group()
        HELD.append(dist.new_group([0, 1]))  # a cache that outlives the test
        dist.destroy_process_group()

    def test_c_after(self):
        self.join_group()
        dist.barrier()
        dist.destroy_process_group()
"""
)


@pytest.mark.slow
def test_adopted_tests_say_why_their_ranks_were_replaced_and_show_import_output(
    pytester: pytest.Pytester,
) -> None:
    """RanksReplacedWarning was issued for ranks-marked tests only: adopted tests' ranks
    were replaced (a daemon thread, a group something still held) and nothing said why.
    And what a rank printed while importing the test module was in no report."""
    pytester.makepyfile(test_replaced=REPLACED_AND_IMPORT_OUTPUT)
    result = pytester.runpytest_subprocess(
        "-p", "harness", "--rank-adopt", "torch", "-rA", "-W", "ignore::ImportWarning"
    )
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert (
        "RanksReplacedWarning: test_replaced.py::TestReplacements::test_a_leaves_a_daemon_thread"
        in out
    ), out
    assert "left daemon threads running" in out, out
    assert (
        "RanksReplacedWarning: test_replaced.py::TestReplacements::test_b_holds_its_group" in out
    ), out
    assert "something still holds its torn-down process group" in out, out
    assert "LOADING THE SUITE, as a library's load warning would" in out, out


DTENSOR_BASE = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class TestDTensor(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_a_async_output(self):
        mesh = self.build_device_mesh()
        dt = distribute_tensor(torch.ones((4, 2)), mesh, [Shard(0)])
        out = dt.redistribute(mesh, [Replicate()], async_op=True).to_local()
        self.assertEqual(out.view(-1) + 1, torch.ones(8) + 1)

    @with_comms
    def test_b_after(self):
        mesh = init_device_mesh("cpu", (self.world_size,))
        assert distribute_tensor(torch.ones(4), mesh, [Shard(0)]).to_local().numel() == 2
"""


def test_an_adopted_dtensor_test_keeps_its_warm_ranks(inner: pytest.Pytester) -> None:
    """After DTensorTestBase's test_dtensor_async_output the ranks were replaced, and the
    next test paid 12-37 s of fresh ranks: torch's DTensor caches held the test's mesh,
    and with it the torn-down group (it reads as a rank that cannot let it go)."""
    inner.makepyfile(test_dtensor_base=DTENSOR_BASE)
    args = ("-p", "harness", "--rank-adopt", "torch", "-W", "error::harness.RanksReplacedWarning")
    inner.runpytest(*args).assert_outcomes(passed=2)


SLOW_TO_IMPORT_ADOPTED = (
    """
if os.environ.get("HARNESS_RANK_WORKER"):  # in the ranks: an import as slow as a big library's
    threading.Event().wait(60)
"""
    + PROCESS_BASE
    + """

class TestOne(TwoRanks):
    def test_all_reduce(self):
        self.join_group()
        dist.all_reduce(torch.ones(1))
"""
)


@pytest.mark.parametrize("where", ["test_slow_adopted", "slow_cases"])
def test_an_adopted_modules_import_has_the_import_bound_and_says_so(
    inner: pytest.Pytester, where: str
) -> None:
    """The import of an adopted test's module on the ranks was bounded by the test's own
    timeout (at least 120 s), not --rank-import-timeout as for a ranks test, and a hang
    there read as the test's ("hung outside any collective", 90 importlib frames). A class
    from a module not named like a test file (imported into the test module) is loaded
    through the same phase, by its name."""
    inner.makepyfile(**{where: "import os, threading\n" + SLOW_TO_IMPORT_ADOPTED})
    if where != "test_slow_adopted":
        inner.makepyfile(test_slow_adopted=f"from {where} import TestOne\n")
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "--rank-import-timeout", "1")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"*rank ? still importing {where} after 1 s (--rank-import-timeout)*"]
    )
    assert "<frozen importlib._bootstrap>" not in result.stdout.str()  # folded


DEEPSPEED_LIKE = """
class DistributedExec:  # DeepSpeed's tests/unit/common.py, reduced to its shape
    world_size = 2

    def _launch_procs(self, num_procs, init_method):
        raise AssertionError("not called here")

    def _dist_run(self, local_rank, num_procs, master_port, init_method, skip_msg=""):
        raise AssertionError("not called here")


class DistributedTest(DistributedExec):
    pass


class TestFirst(DistributedTest):
    def test_one(self):
        pass

    def test_two(self):
        pass


class TestSecond(DistributedTest):
    def test_three(self):
        pass


class TestPlain:
    def test_four(self):
        pass
"""


def test_another_projects_base_runs_as_before_and_the_session_says_so_once(
    inner: pytest.Pytester,
) -> None:
    """DeepSpeed's DistributedTest classes ran as they are under --rank-adopt torch, and
    nothing said that they were not adopted."""
    inner.makepyfile(test_ds=DEEPSPEED_LIKE)
    result = inner.runpytest("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(passed=4)
    said = [line for line in result.outlines if "not adopted" in line]
    assert said == [
        "harness: not adopted, runs as before: 2 classes (test_ds.TestFirst, "
        "test_ds.TestSecond): DeepSpeed's DistributedTest starts its own process pool per "
        "test; add deepspeed to --rank-adopt (--rank-adopt torch,deepspeed) to run it on warm "
        "ranks"
    ], result.outlines
    # Only classes whose tests ran are named: -k leaves the others out.
    picked = inner.runpytest("-p", "harness", "--rank-adopt", "torch", "-k", "three or four")
    picked.assert_outcomes(passed=2, deselected=2)
    said = [line for line in picked.outlines if "not adopted" in line]
    assert said == [
        "harness: not adopted, runs as before: test_ds.TestSecond: DeepSpeed's DistributedTest "
        "starts its own process pool per test; add deepspeed to --rank-adopt (--rank-adopt "
        "torch,deepspeed) to run it on warm ranks"
    ], picked.outlines
    quiet = inner.runpytest("-p", "harness")  # adoption not asked for: nothing to say
    quiet.assert_outcomes(passed=4)
    assert not [line for line in quiet.outlines if "not adopted" in line]
