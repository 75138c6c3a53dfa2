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
