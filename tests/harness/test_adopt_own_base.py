"""A project adopts its own multi-rank test base: its adopter lives in the project's conftest
(outside the harness), registered with the pytest_harness_adopters hook, and
``--rank-adopt`` names it as it names torch's and DeepSpeed's."""

from __future__ import annotations

import pytest

# A project's own base, as projects write them: each test spawns `world_size` processes, each
# setting a gloo group up from a file store and running the body; the parent checks rank 0's
# exit status alone (the false green torch's MultiProcessTestCase has too).
MYBASE = """
import multiprocessing, os, tempfile
import torch.distributed as dist


class DistTest:
    world_size = 2

    def spawn(self, body):
        store = os.path.join(tempfile.mkdtemp(), "store")  # a fresh path
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(
                target=run_rank,
                args=(type(self), body.__name__, self.world_size, store),
                kwargs={"rank": r},
            )
            for r in range(self.world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert procs[0].exitcode == 0, f"rank 0 exited with {procs[0].exitcode}"


def run_rank(cls, name, world_size, store, *, rank):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size)
    dist.barrier()  # every rank's group is up (a rank that returns at once tears its own down)
    try:
        getattr(cls(), name)(rank)
    finally:
        dist.destroy_process_group()
"""

# The project's adopter: the base's spawn, pointed at the harness.
CONFTEST = """
import os
import tempfile
import harness
import pytest
import mybase


class MyBaseAdopter(harness.Adopter):
    name = "mybase"

    def claims(self, cls):
        return issubclass(cls, mybase.DistTest)

    def calling(self, item):
        case = getattr(item, "instance", None)
        if not isinstance(case, mybase.DistTest):
            return

        def spawn(body):
            store = os.path.join(tempfile.mkdtemp(), "store")  # a fresh path
            self.run(item, case.world_size, mybase.run_rank, type(case), body.__name__,
                     case.world_size, store)

        case.spawn = spawn


@pytest.hookimpl(optionalhook=True)  # a session with -p no:harness knows no such hook
def pytest_harness_adopters(config):
    return [MyBaseAdopter()]
"""

TESTS = """
import os, sys
import torch, torch.distributed as dist
from mybase import DistTest


class TestMine(DistTest):
    def _sum(self, rank):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == self.world_size

    def test_sum(self):
        self.spawn(self._sum)

    def _exits(self, rank):
        if rank == 1:
            sys.exit(3)

    def test_rank_1_exits(self):
        self.spawn(self._exits)
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(mybase=MYBASE, test_mine=TESTS)
    pytester.makeconftest(CONFTEST)
    pytester.syspathinsert()
    return pytester


def test_a_projects_own_base_runs_on_warm_ranks_when_asked(project: pytest.Pytester) -> None:
    """As it is, rank 1's sys.exit(3) passes (rank 0's status alone is read); adopted, the
    harness judges every rank: it fails, naming rank 1."""
    as_it_is = project.runpytest_subprocess("-p", "harness", "-rA")
    as_it_is.assert_outcomes(passed=2)
    adopted = project.runpytest_subprocess("-p", "harness", "--rank-adopt", "mybase", "-rA")
    adopted.assert_outcomes(passed=1, failed=1)
    adopted.stdout.fnmatch_lines(
        [
            "*rank 1 failed: called sys.exit(3)  [[]2 ranks, "
            "test_mine.py::TestMine::test_rank_1_exits[]]"
        ]
    )
    adopted.stdout.no_fnmatch_line("*not adopted*")


def test_the_documented_conftest_holds_with_the_harness_off(project: pytest.Pytester) -> None:
    """`-p no:harness` with the documented conftest was an INTERNALERROR ("unknown hook
    'pytest_harness_adopters'"): its hook is marked optional, and the suite runs as it is."""
    result = project.runpytest_subprocess("-p", "no:harness", "-rA")
    result.assert_outcomes(passed=2)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_another_adopter_names_the_one_to_ask_for(project: pytest.Pytester) -> None:
    """Under --rank-adopt torch the project's classes run as they are, and the summary says
    which adopter takes them."""
    result = project.runpytest_subprocess("-p", "harness", "--rank-adopt", "torch")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "harness: not adopted, runs as before: test_mine.TestMine: mybase's test base "
            "starts processes of its own; add mybase to --rank-adopt to run it on warm ranks"
        ]
    )


def test_rank_adopt_takes_the_registered_names_and_refuses_others(
    project: pytest.Pytester,
) -> None:
    result = project.runpytest_subprocess("-p", "harness", "--rank-adopt", "mine")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*invalid rank_adopt 'mine' from --rank-adopt: use torch, deepspeed, mybase*"]
    )


def test_an_adopter_that_cannot_be_registered_says_why(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "import harness\n\nclass Again(harness.Adopter):\n    name = 'torch'\n\n"
        "def pytest_harness_adopters(config):\n    return [Again()]\n"
    )
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "harness")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*Again: its name 'torch' must be new*(taken: torch, deepspeed)*"])


def test_an_adopter_in_a_conftest_below_the_rootdir_is_registered(
    pytester: pytest.Pytester,
) -> None:
    """A conftest pytest reaches only as it collects (sub/conftest.py) registers its adopter
    too: --rank-adopt's names are checked once the tests are collected. With the harness off
    the same suite runs as it is."""
    sub = pytester.mkpydir("sub")
    (sub / "conftest.py").write_text(CONFTEST)
    (sub / "test_mine.py").write_text(TESTS)
    pytester.makepyfile(mybase=MYBASE)
    pytester.syspathinsert()
    adopted = pytester.runpytest_subprocess("-p", "harness", "--rank-adopt", "mybase", "-rA")
    adopted.assert_outcomes(passed=1, failed=1)
    adopted.stdout.fnmatch_lines(["*rank 1 failed: called sys.exit(3)*test_rank_1_exits*"])
    off = pytester.runpytest_subprocess("-p", "no:harness", "-rA")
    off.assert_outcomes(passed=2)
    wrong = pytester.runpytest_subprocess("-p", "harness", "--rank-adopt", "mine")
    assert wrong.ret == pytest.ExitCode.USAGE_ERROR
    wrong.stderr.fnmatch_lines(["*invalid rank_adopt 'mine'*use torch, deepspeed, mybase*"])


# A base that is a function, as ColossalAI's `spawn(fn, nprocs)`: each process runs
# `fn(rank)` (through `_run(rank, ...)`); the parent reads rank 0's exit status alone.
SPAWN_BASE = """
import multiprocessing, os, tempfile
import torch.distributed as dist


def _run(rank, fn, nprocs, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nprocs)
    dist.barrier()  # every rank's group is up (a rank that returns at once tears its own down)
    try:
        fn(rank)
    finally:
        dist.destroy_process_group()


def spawn(fn, nprocs):
    store = os.path.join(tempfile.mkdtemp(), "store")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_run, args=(r, fn, nprocs, store)) for r in range(nprocs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert procs[0].exitcode == 0, f"rank 0 exited with {procs[0].exitcode}"
"""

SPAWN_CONFTEST = """
import os, tempfile
import harness, pytest
import spawnbase

_real = spawnbase.spawn


class SpawnAdopter(harness.Adopter):
    name = "spawnbase"

    def calling(self, item):  # a function test: no class to claim; its spawn on warm ranks
        def spawn(fn, nprocs):
            store = os.path.join(tempfile.mkdtemp(), "store")
            self.run_function(item, nprocs, spawnbase._run, fn, nprocs, store)

        spawnbase.spawn = spawn

    def ended(self, config):
        spawnbase.spawn = _real


@pytest.hookimpl(optionalhook=True)
def pytest_harness_adopters(config):
    return [SpawnAdopter()]
"""

SPAWN_TESTS = """
import sys
import torch, torch.distributed as dist
import spawnbase


def _sum(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


def _exits(rank):
    if rank == 1:
        sys.exit(3)


def test_sum():
    spawnbase.spawn(_sum, 2)


def test_rank_1_exits():
    spawnbase.spawn(_exits, 2)
"""


def test_a_base_that_is_a_function_is_adopted(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(spawnbase=SPAWN_BASE, test_spawned=SPAWN_TESTS)
    pytester.makeconftest(SPAWN_CONFTEST)
    pytester.syspathinsert()
    pytester.runpytest_subprocess("-p", "harness", "-rA").assert_outcomes(passed=2)  # as it is
    adopted = pytester.runpytest_subprocess("-p", "harness", "--rank-adopt", "spawnbase", "-rA")
    adopted.assert_outcomes(passed=1, failed=1)
    adopted.stdout.fnmatch_lines(
        ["*rank 1 failed: called sys.exit(3)  [[]2 ranks, test_spawned.py::test_rank_1_exits[]]"]
    )


@pytest.mark.parametrize("mistake", ["never runs it", "runs an earlier test's item"])
def test_an_adopter_that_claims_a_test_and_does_not_run_it_is_named(
    pytester: pytest.Pytester, mistake: str
) -> None:
    if mistake == "never runs it":
        calling = "        pass  # forgot to point the base's spawn at self.run"
    else:
        calling = (
            "        first = self.__dict__.setdefault('first', item)  # kept from the first test\n"
            "        case = item.instance\n"
            "        case.spawn = lambda body: self.run(first, 2, mybase.run_rank, type(case),\n"
            "                                           body.__name__, 2, '/nonexistent')"
        )
    conftest = CONFTEST.split("    def calling(self, item):")[0]
    conftest += f"    def calling(self, item):\n{calling}\n\n\n"
    conftest += "@pytest.hookimpl(optionalhook=True)\ndef pytest_harness_adopters(config):\n"
    conftest += "    return [MyBaseAdopter()]\n"
    pytester.makepyfile(mybase=MYBASE, test_mine=TESTS)
    pytester.makeconftest(conftest)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess("-p", "harness", "--rank-adopt", "mybase", "-p",
                                           "no:randomly")  # fmt: skip
    if mistake == "never runs it":
        result.assert_outcomes(failed=2)
        result.stdout.fnmatch_lines(
            ["*AdopterError: harness: adopter 'mybase' (MyBaseAdopter) claims "
             "test_mine.py::TestMine::test_rank_1_exits but did not run it on ranks*"]
        )  # fmt: skip
    else:
        result.assert_outcomes(failed=1, passed=1)  # the first test is its own
        result.stdout.fnmatch_lines(
            ["*AdopterError: harness: adopter 'mybase' (MyBaseAdopter) ran "
             "test_mine.py::TestMine::test_sum while test_mine.py::TestMine::test_rank_1_exits "
             "was being called*"]
        )  # fmt: skip


def test_unittest_s_skip_in_ranks_skips_as_pytest_takes_it(project: pytest.Pytester) -> None:
    """pytest takes ``unittest.SkipTest`` as a skip in any test: raised on every rank, under a
    project's adopter or in a ranks test, the test is skipped with its reason (it failed)."""
    project.makepyfile(
        test_skips="""
        import unittest, pytest
        from mybase import DistTest

        class TestSkips(DistTest):
            def _skips(self, rank):
                raise unittest.SkipTest("needs 2 GPUs")

            def test_skips(self):
                self.spawn(self._skips)

        @pytest.mark.ranks(2)
        def test_ranks_skip(rank):
            raise unittest.SkipTest("needs 2 GPUs")
        """
    )
    result = project.runpytest_subprocess(
        "-p", "harness", "--rank-adopt", "mybase", "-rs", "test_skips.py"
    )
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["SKIPPED [[]*needs 2 GPUs"] * 2)
