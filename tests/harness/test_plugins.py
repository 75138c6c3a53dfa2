"""The plugins real CI runs, against ranks tests (make test-plugins; marker `plugins`):
pytest-cov and `coverage run`, pytest-randomly, hypothesis, pytest-rerunfailures,
pytest-repeat, at 2 and 4 ranks, on warm ranks and on fresh ones. Each runs a whole pytest
session in a subprocess, as CI does."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.plugins

MEASURED = """
def branchy(x):
    if x > 0:
        return "positive"
    return "not positive"


def only_rank_3():
    return 3


def only_before_a_failure():
    return "the rank fails next, and is replaced"
"""
MEASURED_TESTS = """
import os
import pytest
import measured_mod


@pytest.mark.ranks(2, 4)
def test_each_rank_takes_a_branch(rank, world_size):
    assert measured_mod.branchy(rank) in ("positive", "not positive")
    if rank == 3:
        assert measured_mod.only_rank_3() == 3


@pytest.mark.ranks(2)
def test_fails_and_the_ranks_are_replaced(rank):
    if rank == 1:
        measured_mod.only_before_a_failure()
    assert rank == 0  # rank 1 fails: the lines it ran before are saved all the same
"""


def _session(pytester: pytest.Pytester, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _line_of(report: str, module: str) -> str:
    return next((line for line in report.splitlines() if line.startswith(module)), report)


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_pytest_cov_counts_the_lines_the_ranks_run(pytester: pytest.Pytester, start: str) -> None:
    """`pytest --cov` on a module whose functions run only in ranks reported 50%, every line
    the ranks ran missing: the ranks wrote no data."""
    pytester.makepyfile(measured_mod=MEASURED, test_measured=MEASURED_TESTS)
    run = _session(
        pytester,
        "pytest",
        "-p",
        "harness",
        "--rank-start-method",
        start,
        "--cov=measured_mod",
        "--cov-report=term-missing",
    )
    assert "2 passed, 1 failed" in run.stdout or "1 failed, 2 passed" in run.stdout, run.stdout
    line = _line_of(run.stdout, "measured_mod.py")
    assert line.split()[-1] == "100%", run.stdout[-3000:]


NEIGHBOUR_TESTS = """
import subprocess, sys


def test_a_neighbour_session_starts_here_mid_session():
    # Another pytest-cov session in the same directory: it erases .coverage.* as it starts,
    # and combines (then deletes) the .coverage.* files it finds as it ends.
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:harness", "-p", "no:cacheprovider",
         "--cov=measured_mod", "-q", "neighbour_check.py"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
"""
NEIGHBOUR_CHECK = """
def test_nothing_of_the_measured_module():
    assert True
"""


@pytest.mark.parametrize("cov", ["pytest-cov", "coverage run"])
def test_rank_data_survives_a_neighbour_coverage_session_in_the_same_directory(
    pytester: pytest.Pytester, cov: str
) -> None:
    """A plain pytest-cov session started in the same directory erased the ranks'
    `.coverage.harness-rank.*` files (and combined them into its own report): the ranks
    session then reported 44% instead of 83%. The ranks' data lives in the session's own
    work directory and is combined into the session's measurement in memory."""
    pytester.makepyfile(
        measured_mod=MEASURED,
        test_1_measured=MEASURED_TESTS,
        test_2_neighbour=NEIGHBOUR_TESTS,
        neighbour_check=NEIGHBOUR_CHECK,
    )
    tests = ["test_1_measured.py", "test_2_neighbour.py"]
    if cov == "pytest-cov":
        run = _session(pytester, "pytest", "-p", "harness", "-p", "no:randomly",
                       "--cov=measured_mod", "--cov-report=term-missing", *tests)  # fmt: skip
        report = run.stdout
    else:
        run = _session(pytester, "coverage", "run", "--source=measured_mod", "-m", "pytest",
                       "-p", "harness", "-p", "no:randomly", *tests)  # fmt: skip
        report = _session(pytester, "coverage", "report", "-m").stdout
    assert "1 failed, 3 passed" in run.stdout or "3 passed, 1 failed" in run.stdout, run.stdout
    line = _line_of(report, "measured_mod.py")
    assert line.split()[-1] == "100%", report[-3000:]
    assert not list(pytester.path.glob(".coverage.harness-rank*")), "rank data left in the cwd"


def test_coverage_run_counts_the_lines_the_ranks_run(pytester: pytest.Pytester) -> None:
    """`coverage run -m pytest`, then `coverage report`, as it is: no combine step."""
    pytester.makepyfile(measured_mod=MEASURED, test_measured=MEASURED_TESTS)
    run = _session(pytester, "coverage", "run", "--source=measured_mod", "-m", "pytest", "-p",
                   "harness")  # fmt: skip
    assert "1 failed" in run.stdout, run.stdout[-3000:]
    report = _session(pytester, "coverage", "report", "-m")
    line = _line_of(report.stdout, "measured_mod.py")
    assert line.split()[-1] == "100%", report.stdout + report.stderr


@pytest.mark.slow
def test_pytest_cov_under_torchrun_combines_every_ranks_lines_once(
    pytester: pytest.Pytester,
) -> None:
    """Each launched pytest measured itself and combined every data file into one
    `.coverage` at once: an INTERNALERROR (no such table: coverage_schema)."""
    pytester.makepyfile(
        measured_mod=MEASURED,
        test_measured="""
        import pytest
        import measured_mod

        @pytest.mark.ranks(2)
        def test_each_rank_takes_a_branch(rank):
            assert measured_mod.branchy(rank) in ("positive", "not positive")
        """,
    )
    run = _session(
        pytester,
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pytest",
        "-p",
        "harness",
        "--cov=measured_mod",
        "--cov-report=term-missing",
    )
    assert "INTERNALERROR" not in run.stdout + run.stderr, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout, run.stdout[-3000:]
    line = _line_of(run.stdout, "measured_mod.py")
    # every rank's lines but the two functions this test never calls
    assert "75%" in line.split() and line.endswith("8, 12"), run.stdout[-3000:]


ORDER_FREE = """
import random
import pytest
import torch.distributed as dist


@pytest.mark.ranks(2, 4)
def test_kept(rank, world_size):
    dist.barrier()


@pytest.mark.ranks(2, 4, fresh_group=True)
def test_fresh(rank, world_size):
    dist.barrier()


@pytest.mark.ranks(2, 4)
def test_seeded(rank, world_size):
    print("DRAWN", rank, random.random())


def test_plain():
    pass
"""


@pytest.mark.parametrize("seed", ["1", "2"])
def test_pytest_randomly_shuffles_ranks_tests_and_seeds_the_ranks(
    pytester: pytest.Pytester, seed: str
) -> None:
    pytester.makepyfile(ORDER_FREE)
    args = ("pytest", "-p", "harness", "-p", "randomly", f"--randomly-seed={seed}", "-s", "-v")
    first, again = _session(pytester, *args), _session(pytester, *args)
    assert "7 passed" in first.stdout, first.stdout[-3000:]
    assert f"harness: ranks seeded from {seed} (pytest-randomly)" in first.stdout
    drawn = sorted(line for line in first.stdout.splitlines() if "DRAWN" in line)
    assert drawn and drawn == sorted(line for line in again.stdout.splitlines() if "DRAWN" in line)


FLAKY = """
import os
import pytest


@pytest.mark.ranks(2, 4)
def test_fails_once_per_world(rank, world_size):
    marker = os.path.join(os.environ["FLAKY_DIR"], f"seen{world_size}-{rank}")
    seen = os.path.exists(marker)
    open(marker, "w").close()
    assert seen, "fails the first time on every rank"
"""


def test_pytest_rerunfailures_reruns_a_ranks_test_on_fresh_ranks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLAKY_DIR", str(pytester.path))
    pytester.makepyfile(FLAKY)
    run = _session(pytester, "pytest", "-p", "harness", "-p", "rerunfailures", "--reruns", "1",
                   "-v", "-rAR")  # fmt: skip
    assert "2 passed, 2 rerun" in run.stdout, run.stdout[-3000:]
    # Its summary keeps pytest's `WORD nodeid` shape (it said `RERUN on 4 ranks test_...`).
    summary = run.stdout.split("rerun test summary info")[-1]
    reruns = [line for line in summary.splitlines() if line.startswith("RERUN ")]
    assert len(reruns) == 2, summary
    assert all(line.split()[1].endswith("::test_fails_once_per_world[ranks4]")
               or line.split()[1].endswith("::test_fails_once_per_world[ranks2]")
               for line in reruns), summary  # fmt: skip
    assert " on 4 ranks" not in summary and " on 2 ranks" not in summary, summary


@pytest.mark.parametrize("fresh", [False, True])
def test_pytest_repeat_repeats_ranks_tests(pytester: pytest.Pytester, fresh: bool) -> None:
    pytester.makepyfile(ORDER_FREE)
    args = ["pytest", "-p", "harness", "--count", "3"] + (["--rank-fresh-group"] if fresh else [])
    run = _session(pytester, *args)
    assert "21 passed" in run.stdout, run.stdout[-3000:]


def test_xdist_runs_ranks_tests_in_each_worker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ORDER_FREE)
    run = _session(pytester, "pytest", "-p", "harness", "-n", "2", "--dist", "loadgroup")
    assert "7 passed" in run.stdout, run.stdout[-3000:]


GIVEN = """
import os
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, strategies as st


@pytest.mark.ranks(2, 4)
@given(n=st.integers(min_value=0, max_value=1000))
def test_every_rank_gets_the_same_examples(rank, world_size, n):
    mine = torch.tensor([n])
    gathered = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    assert all(int(g) == n for g in gathered), f"rank {rank} drew {n}, others {gathered}"
    with open(os.path.join(os.environ["SEEN_DIR"], f"r{world_size}-{rank}"), "a") as f:
        f.write(f"{n}\\n")


@pytest.mark.ranks(2)
@given(n=st.integers(min_value=0, max_value=1000))
def test_fails_past_500_on_rank_1(rank, n):
    if rank == 1:
        assert n <= 500, f"too big on rank 1: {n}"
"""


def test_hypothesis_runs_the_same_examples_on_every_rank_and_reports_a_failure_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With hypothesis's defaults `@given` on a ranks test failed its health check
    (function-scoped fixture `rank`); suppressed, each rank drew and shrank its own
    examples, the headline changed between runs, and both ranks wrote one database."""
    seen = pytester.mkdir("seen")
    monkeypatch.setenv("SEEN_DIR", str(seen))
    pytester.makepyfile(GIVEN)
    run = _session(pytester, "pytest", "-p", "harness", "-rf")
    assert "1 failed, 2 passed" in run.stdout, run.stdout[-4000:]
    for world in (2, 4):  # every rank ran the same examples, in the same order
        drawn = [(seen / f"r{world}-{r}").read_text() for r in range(world)]
        assert len(set(drawn)) == 1 and len(drawn[0].split()) > 10, drawn
    out = run.stdout
    assert "test_fails_past_500_on_rank_1(" in out and "n=501," in out, out[-4000:]  # shrunk
    assert out.count("n=501,") == 1  # reported once
    assert "harness/" not in out.split("FAILURES")[1]  # no harness line offered as the cause
    assert "rank 1 failed: raised AssertionError: too big on rank 1: 501" in out
    again = _session(pytester, "pytest", "-p", "harness", "-rf", "-k", "fails_past")
    assert "n=501" in again.stdout  # replayed from the one database


@pytest.mark.slow
def test_hypothesis_under_torchrun_draws_alike_on_every_rank(pytester: pytest.Pytester) -> None:
    """Each launched rank searches for itself, seeded alike from the session's seed: the
    same examples on every rank (an all_gather of each example agrees)."""
    pytester.makepyfile(
        """
        import pytest, torch, torch.distributed as dist
        from hypothesis import given, strategies as st

        @pytest.mark.ranks(2)
        @given(n=st.integers(min_value=0, max_value=1000))
        def test_same(rank, world_size, n):
            got = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
            dist.all_gather(got, torch.tensor([n]))
            assert all(int(g) == n for g in got), (rank, n, got)
        """
    )
    run = _session(pytester, "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   "-m", "pytest", "-p", "harness")  # fmt: skip
    assert "1 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
