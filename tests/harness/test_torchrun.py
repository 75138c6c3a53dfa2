"""pytest started by torchrun: every launched process is one rank, and the session gives one
verdict. Each test runs ``torchrun --standalone`` (gloo, CPU) over generated test files."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.common.launch_detect import IN_RANK_WORKER, LaunchError, detect
from tests.harness.conftest import HEADER

LAUNCH_TIMEOUT_S = 240  # torchrun starting 2-4 pytest processes that import torch, on 2 cores


@dataclass
class Launched:
    returncode: int
    output: str
    junit: Path

    @property
    def sessions_reported(self) -> int:
        return self.output.count("test session starts")

    def exit_codes(self) -> list[int]:
        """Every failed rank's exit code, from torchrun's summary (none when all passed)."""
        return [int(code) for code in re.findall(r"exitcode\s+:\s*(-?\d+)", self.output)]


def torchrun(
    directory: Path,
    nproc: int,
    *args: str,
    timeout: float = LAUNCH_TIMEOUT_S,
    extra_env: dict[str, str] | None = None,
) -> Launched:
    junit = directory / "junit.xml"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "pytest",
        "-p",
        "harness",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-rA",
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env or {})
    done = subprocess.run(
        command,
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Launched(done.returncode, done.stdout + done.stderr, junit)


def junit_cases(path: Path) -> dict[str, str]:
    """Each test case's name and how it ended: passed, failed, error or skipped."""
    cases = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        ended = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        cases[case.get("name", "")] = ended[0] if ended else "passed"
    return cases


def write(pytester: pytest.Pytester, **files: str) -> Path:
    pytester.makepyfile(**{name: HEADER + source for name, source in files.items()})
    return pytester.path


VERDICTS = """
@pytest.mark.ranks
def test_passes(rank, world_size, device):
    t = torch.ones(1) * rank
    dist.all_reduce(t)
    assert t.item() == sum(range(world_size)) and device.type == "cpu"

@pytest.mark.ranks(2)
def test_rank_1_fails(rank):
    print(f"rank {rank} speaking")
    if rank == 1:
        assert [rank, 2] == [0, 2]
    dist.barrier()

@pytest.mark.ranks(2)
def test_rank_1_exits(rank):
    if rank == 1:
        sys.exit(3)
    dist.barrier()

@pytest.mark.ranks(4)
def test_needs_four(rank):
    pass

@pytest.mark.ranks(2)
@pytest.mark.fault(rank=1, kind="raise", exc=ValueError("injected"))
@pytest.mark.expect(rank=1, does=raises(ValueError), others=returns())
def test_expected_fault(rank):
    pass

@pytest.mark.ranks(2)
def test_leaves_env(rank, monkeypatch):
    monkeypatch.setenv("PATCHED_IS_FINE", "1")
    if rank == 1:
        os.environ["LEFT_BEHIND"] = "1"

@pytest.mark.ranks(2)
def test_replaces_environ(rank):
    os.environ = dict(os.environ, REPLACED="1")

def test_plain_sees_no_group():
    assert not dist.is_initialized()
    assert "REPLACED" not in os.environ and type(os.environ).__name__ == "_Environ"

@pytest.mark.ranks(2, launch=True)
def test_launch_mode_makes_its_own_group(rank):
    assert not dist.is_initialized() and os.environ["RANK"] == str(rank)
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()

@pytest.mark.ranks(2)
def test_group_is_back(rank, shared_tmp_path):
    (shared_tmp_path / str(rank)).write_text("here")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2 and len(list(shared_tmp_path.iterdir())) == 2

def test_fake_world_works_in_one_process(fake_world):
    fake_world(64, rank=3)
    assert dist.get_world_size() == 64 and dist.get_rank() == 3

@pytest.mark.ranks(2)
@pytest.mark.fault(rank=1, kind="raise", at="all_reduce:sizes")
def test_a_fault_at_a_rankwise_label(rank):
    rw.all_reduce("sizes", lambda: rank, sum)

def _value(scale):
    return dist.get_rank() * scale

def test_run_on_ranks_in_the_launch(run_on_ranks):
    assert run_on_ranks(_value, 10, world_size=2).values == [0, 10]

class _NoLoadBack:
    def __init__(self, needed):
        self.needed = needed

    def __reduce__(self):  # leaves out what __init__ needs: its pickle does not load
        return (_NoLoadBack, ())

def _unloadable_on_rank_1():
    return _NoLoadBack(1) if dist.get_rank() == 1 else "fine"

def test_a_value_whose_pickle_does_not_load_back(run_on_ranks):
    out = run_on_ranks(_unloadable_on_rank_1, world_size=2)
    assert out[0].value == "fine"
    with pytest.raises(ValueError, match="its pickle does not load back"):
        out[1].value
"""


@pytest.mark.slow
def test_one_verdict_across_two_launched_ranks(pytester: pytest.Pytester) -> None:
    result = torchrun(write(pytester, test_verdicts=VERDICTS), 2)
    out = result.output
    assert result.sessions_reported == 1, out  # rank 1 is quiet
    assert "rank 1 failed: raised AssertionError" in out and "At index 0 diff: 1 != 0" in out
    assert "stdout [rank 1]" in out or "rank 1 captured stdout" in out, out
    assert "rank 1 failed: called sys.exit(3)" in out
    assert "needs 4 ranks, launched with 2" in out
    assert "hygiene: rank 1 changed environment variables LEFT_BEHIND" in out
    assert "hygiene: rank 0 replaced os.environ itself" in out
    assert "PATCHED_IS_FINE" not in out.split("hygiene:")[1].splitlines()[0]
    assert junit_cases(result.junit) == {
        "test_passes": "passed",
        "test_rank_1_fails[ranks2]": "failure",
        "test_rank_1_exits[ranks2]": "failure",
        "test_needs_four[ranks4]": "skipped",
        "test_expected_fault[ranks2]": "passed",
        "test_leaves_env[ranks2]": "error",
        "test_replaces_environ[ranks2]": "error",
        "test_plain_sees_no_group": "passed",
        "test_launch_mode_makes_its_own_group[ranks2]": "passed",
        "test_group_is_back[ranks2]": "passed",
        "test_run_on_ranks_in_the_launch": "passed",
        "test_a_value_whose_pickle_does_not_load_back": "passed",
        "test_fake_world_works_in_one_process": "passed",
        "test_a_fault_at_a_rankwise_label[ranks2]": "failure",
    }
    assert "rank 1 failed: raised RuntimeError: fault injected by the harness on rank 1" in out
    assert result.returncode != 0
    assert result.exit_codes() == [1, 1], out  # every process ends with the same status


@pytest.mark.slow
def test_four_launched_ranks_name_the_root_cause(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.ranks(2, 4)
def test_rank_2_fails(rank):
    if rank == 2:
        raise ValueError("rank two is wrong")
    dist.barrier()

@pytest.mark.ranks(4)
def test_after(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4
"""
    result = torchrun(write(pytester, test_four=source), 4)
    assert "rank 2 failed: raised ValueError: rank two is wrong" in result.output
    assert junit_cases(result.junit) == {
        "test_rank_2_fails[ranks2]": "skipped",
        "test_rank_2_fails[ranks4]": "failure",
        "test_after[ranks4]": "passed",
    }
    assert result.exit_codes() == [1, 1, 1, 1], result.output
    root = torchruns_root_cause(result.output)
    assert "rank      : 2 (local_rank: 2)" in root, result.output[-6000:]
    assert "test_four.py::test_rank_2_fails[ranks4]: rank 2 failed: raised ValueError" in root
    assert "error_file: <N/A>" not in root
    said = "collateral: test_four.py::test_rank_2_fails[ranks4]: rank 2 failed"
    assert torchruns_failures(result.output).count(said) == 3


def torchruns_root_cause(output: str) -> str:
    """torchrun's own summary, from "Root Cause" to its closing rule."""
    assert "Root Cause (first observed failure):" in output, output[-4000:]
    return output.split("Root Cause (first observed failure):", 1)[1].split("=====", 1)[0]


def torchruns_failures(output: str) -> str:
    """torchrun's summary of the failures that are not its root cause."""
    return output.split("Failures:", 1)[1].split("Root Cause (first observed failure):", 1)[0]


@pytest.mark.slow
def test_torchruns_summary_names_the_rank_of_the_first_failed_test(
    pytester: pytest.Pytester,
) -> None:
    """torchrun said "Root Cause: rank 0 ... error_file: <N/A>" under our report naming rank 1:
    each rank now writes its error file, the root cause's with its own report."""
    source = """
def test_plain_fails_on_rank_1():
    assert int(os.environ["RANK"]) != 1, "rank 1's own check"

@pytest.mark.ranks(2)
def test_rank_0_fails_later(rank):
    assert rank != 0
"""
    result = torchrun(write(pytester, test_first=source), 2)
    assert result.exit_codes() == [1, 1], result.output
    root = torchruns_root_cause(result.output)
    assert "rank      : 1 (local_rank: 1)" in root, result.output[-6000:]
    assert "test_first.py::test_plain_fails_on_rank_1: rank 1 failed" in root
    assert "rank 1's own check" in root  # its own report, traceback and all
    others = torchruns_failures(result.output)
    assert "collateral: test_first.py::test_plain_fails_on_rank_1: rank 1 failed" in others


@pytest.mark.slow
def test_a_passing_launch_exits_zero_everywhere(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.ranks
def test_ok(rank):
    dist.barrier()
"""
    result = torchrun(write(pytester, test_ok=source), 2)
    assert result.returncode == 0, result.output
    assert junit_cases(result.junit) == {"test_ok": "passed"}, result.output


@pytest.mark.slow
def test_a_hang_is_reported_with_stacks_and_ends_the_session(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.ranks(2, timeout=3)
def test_rank_1_hangs(rank):
    if rank == 1:
        threading.Event().wait()
    dist.barrier()

def test_never_runs():
    pass
"""
    result = torchrun(write(pytester, test_hang=source), 2)
    out = result.output
    assert "rank 1 failed: hung outside any collective" in out
    assert "threading.Event().wait()" in out  # rank 1's stack, from the test's frame
    assert re.search(r"rank 0 \(pid \d+\), waiting in barrier: hung in barrier", out), out
    assert "rank 0: it hung waiting on a peer (collateral); rank 1: it hung" in out, out
    assert "tests not run (1):" in out and "test_hang.py::test_never_runs" in out
    assert junit_cases(result.junit) == {"test_rank_1_hangs[ranks2]": "failure"}, result.output
    assert result.exit_codes() == [1, 1], out


@pytest.mark.slow
@pytest.mark.parametrize("dead", [1, 0])
def test_a_dead_rank_is_named_with_its_cause(pytester: pytest.Pytester, dead: int) -> None:
    source = f"""
@pytest.mark.ranks(2)
@pytest.mark.fault(rank={dead}, kind="signal", signal="SIGKILL")
def test_a_rank_dies(rank):
    dist.barrier()

def test_never_runs():
    pass
"""
    result = torchrun(write(pytester, test_dies=source), 2)
    out = result.output
    assert f"rank {dead} failed: died of SIGKILL" in out
    assert "it died: SIGKILL at start, a fault injected by the harness" in out
    assert "test_dies.py::test_never_runs" in out.split("tests not run")[1]
    assert result.sessions_reported == 1, out
    if dead == 0:  # rank 1 speaks instead, without junit (rank 0 was to write it)
        assert "rank 0 is gone" in out and "rank 1 reports" in out
    else:
        assert junit_cases(result.junit) == {"test_a_rank_dies[ranks2]": "failure"}, result.output
    assert sorted(result.exit_codes()) == [-9, 1], out  # the other rank ends as agreed


@pytest.mark.slow
def test_a_rank_that_dies_in_a_plain_test_is_reported_as_gone(pytester: pytest.Pytester) -> None:
    # No harness fault and no rank worker: its peer only sees that it went silent.
    source = """
def test_plain_dies_on_rank_1():
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)

def test_after():
    pass
"""
    result = torchrun(write(pytester, test_gone=source), 2)
    out = result.output
    # On this machine its process is looked at: ended, so gone after a few missed beats.
    assert re.search(r"rank 1: no sign of life for [\d.]+ s: its process ended", out), out
    assert "did not answer" not in out
    assert sorted(result.exit_codes()) == [-9, 1], out


@pytest.mark.slow
def test_ranks_that_collect_different_tests_stop_at_the_start(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.parametrize("i", range(3 if os.environ["RANK"] == "1" else 2))
def test_depends_on_the_node(i):
    pass
"""
    result = torchrun(write(pytester, test_collect=source), 2)
    out = result.output
    assert "the launched ranks collected different tests" in out
    named = "test_collect.py::test_depends_on_the_node[2]"
    host = socket.gethostname()
    assert f"rank 1 (node 0 (host {host})) collected 1 test(s) rank 0 did not ({named})" in out
    assert result.exit_codes() == [2, 2], out


@pytest.mark.slow
def test_a_module_that_exits_on_one_rank_is_named_as_the_cause(pytester: pytest.Pytester) -> None:
    """sys.exit() while importing a test module on rank 1 alone was reported as the ranks
    having collected different tests, and the SystemExit was lost."""
    source = """
if os.environ["RANK"] == "1":
    sys.exit(4)

def test_b():
    pass
"""
    result = torchrun(write(pytester, test_exits_on_import=source), 2)
    out = result.output
    assert "collected different tests" not in out, out
    assert "rank 1 could not collect" in out and "SystemExit: 4" in out, out
    assert 'test_exits_on_import.py", line 6' in out, out  # where it was raised
    assert result.exit_codes() == [2, 2], out


@pytest.mark.slow
def test_a_rank_that_ends_while_collecting_is_not_said_to_collect_other_tests(
    pytester: pytest.Pytester,
) -> None:
    """Found by an adversarial pass: os._exit() at import on rank 1 was reported as the
    ranks collecting different tests, with advice to make collection node-independent."""
    source = """
if os.environ["RANK"] == "1":
    os._exit(0)

def test_b():
    pass
"""
    result = torchrun(write(pytester, test_ends_on_import=source), 2)
    out = result.output
    assert "collected different tests" not in out, out
    assert "rank 1 did not finish collecting" in out and "its process ended" in out, out
    assert 2 in result.exit_codes(), out


# ---- detection, in this process -----------------------------------------------------------

TORCHRUN = {
    "WORLD_SIZE": "4",
    "RANK": "2",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_RESTART_COUNT": "1",
}


def test_a_launch_is_detected_from_torchruns_environment() -> None:
    launch = detect(TORCHRUN)
    assert launch is not None
    assert (launch.world_size, launch.rank, launch.local_rank, launch.local_world_size) == (
        4,
        2,
        0,
        2,
    )
    assert launch.agent_store and launch.run_key == "job7/1"


@pytest.mark.parametrize(
    "change",
    [{"WORLD_SIZE": "1"}, {IN_RANK_WORKER: "1"}, {"HARNESS_LAUNCHED": "0"}],
    ids=["one process", "a harness worker", "switched off"],
)
def test_no_launch_where_there_is_none(change: dict[str, str]) -> None:
    assert detect({**TORCHRUN, **change}) is None
    assert detect({k: v for k, v in TORCHRUN.items() if k != "RANK"}) is None


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"RANK": "4"}, "RANK=4 is not a rank of WORLD_SIZE=4"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
    ],
)
def test_a_broken_launch_environment_says_what_to_fix(change: dict[str, str], said: str) -> None:
    with pytest.raises(LaunchError, match=re.escape(said)) as caught:
        detect({**TORCHRUN, **change})
    assert "HARNESS_LAUNCHED=0" in str(caught.value)


@pytest.mark.slow
def test_xdist_under_a_launch_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    env = {**TORCHRUN, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        result = pytester.runpytest_subprocess("-p", "harness", "-n", "2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*under torchrun every launched process is one rank*-n 2*"])


@pytest.mark.slow
@pytest.mark.gpu
def test_an_nccl_launch_over_every_gpu(pytester: pytest.Pytester) -> None:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        pytest.skip(f"a launch needs 2 CUDA GPUs or more, this machine has {gpus}")
    source = f"""
@pytest.mark.ranks
def test_every_gpu(rank, device):
    assert dist.get_backend() == "nccl" and device == torch.device("cuda", rank)
    t = torch.ones(1, device=device) * rank
    dist.all_reduce(t)
    assert t.item() == sum(range({gpus}))

@pytest.mark.ranks
def test_rank_1_fails(rank, device):
    assert rank != 1
"""
    result = torchrun(write(pytester, test_nccl=source), gpus)
    assert junit_cases(result.junit) == {
        "test_every_gpu": "passed",
        "test_rank_1_fails": "failure",
    }, result.output
    assert "rank 1 failed: raised AssertionError" in result.output
    assert result.exit_codes() == [1] * gpus, result.output


# ---- ranks kept in step: found by an adversarial review ------------------------------------

IN_STEP = """
import subprocess, time

@pytest.fixture(scope="session")
def server():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()

def _where(tag):
    return f"{tag} on rank {dist.get_rank()}"

def test_a_plain_fails_on_rank_1_before_a_call(run_on_ranks):
    assert os.environ["RANK"] != "1", "rank 1 stops here"
    run_on_ranks(_where, "p1", timeout=30)

def test_b_calls_pair_within_their_test(run_on_ranks):
    assert run_on_ranks(_where, "p2").values == ["p2 on rank 0", "p2 on rank 1"]

@pytest.fixture
def slow_fixture():
    time.sleep(4)  # the workload: set-up longer than the test's timeout

@pytest.mark.ranks(2, timeout=3)
def test_c_set_up_time_is_not_body_time(rank, slow_fixture):
    dist.barrier()

@pytest.mark.ranks(2)
def test_d_a_session_fixtures_process_is_no_leftover(rank, server):
    assert server.poll() is None

def test_e_and_it_is_still_running(server):
    assert server.poll() is None

def test_f_a_plain_test_leaves_a_one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)

@pytest.mark.ranks(2)
def test_g_the_session_group_is_back(rank):
    assert dist.get_world_size() == 2

_seen = {}

@pytest.mark.ranks(2)
def test_h_first_group(rank):
    _seen["world"] = dist.group.WORLD

@pytest.mark.ranks(2, fresh_group=True)
def test_i_a_fresh_group_is_fresh(rank):
    assert dist.group.WORLD is not _seen["world"]

@pytest.fixture
def fails_on_rank_0(rank):
    if rank == 0:
        raise RuntimeError("no data on rank 0")
    dist.broadcast(torch.ones(1), 0)  # rank 1 waits on rank 0 here

@pytest.mark.ranks(2, timeout=20)
def test_j_set_up_fails_on_one_rank(rank, fails_on_rank_0):
    pass

@pytest.mark.ranks(2)
def test_k_after(rank):
    dist.barrier()
"""

FIXTURE_FAULTS = """
@pytest.fixture
def rank_faults():
    return [harness.Fault(rank=1, kind="raise", exc=ValueError("from the fixture"))]

@pytest.mark.ranks(2)
def test_the_rank_faults_fixture_applies(rank):
    dist.barrier()
"""


@pytest.mark.slow
def test_ranks_stay_in_step_and_tests_do_not_touch_each_other(pytester: pytest.Pytester) -> None:
    directory = write(
        pytester, test_a_in_step=IN_STEP, test_b_faults="import harness\n" + FIXTURE_FAULTS
    )
    result = torchrun(directory, 2, f"--basetemp={directory / 'tmp'}")
    out = result.output
    assert "it had moved on to the end of test_a_in_step.py::test_a" in out, out
    assert "rank 1 failed: raised ValueError: from the fixture" in out
    assert "ERROR at setup of test_j_set_up_fails_on_one_rank[ranks2]" in out
    assert "RuntimeError: no data on rank 0" in out
    assert junit_cases(result.junit) == {
        "test_a_plain_fails_on_rank_1_before_a_call": "failure",
        "test_b_calls_pair_within_their_test": "passed",
        "test_c_set_up_time_is_not_body_time[ranks2]": "passed",
        "test_d_a_session_fixtures_process_is_no_leftover[ranks2]": "passed",
        "test_e_and_it_is_still_running": "passed",
        "test_f_a_plain_test_leaves_a_one_rank_group": "passed",
        "test_g_the_session_group_is_back[ranks2]": "passed",
        "test_h_first_group[ranks2]": "passed",
        "test_i_a_fresh_group_is_fresh[ranks2]": "passed",
        "test_j_set_up_fails_on_one_rank[ranks2]": "error",
        "test_k_after[ranks2]": "passed",
        "test_the_rank_faults_fixture_applies[ranks2]": "failure",
    }
    assert result.exit_codes() == [1, 1], out


# A stand-in for a report plugin with a file option (pytest-html's --html is read the same
# way): it writes the file in pytest_configure, where it sees the option's value.
REPORT_FILE_PLUGIN = """
import os

def pytest_addoption(parser):
    parser.addoption("--html", dest="htmlpath", default=None)

def pytest_configure(config):
    if config.option.htmlpath:
        with open(config.option.htmlpath, "a") as f:
            f.write(f"written by rank {os.environ['RANK']}\\n")
"""


@pytest.mark.slow
def test_report_files_are_written_by_rank_0_alone(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.ranks(2)
def test_on_ranks(rank):
    pass

def test_plain():
    pass
"""
    pytester.makeconftest(REPORT_FILE_PLUGIN)
    result = torchrun(
        write(pytester, test_reports=source), 2, "--report-log=log.jsonl", "--html=report.html"
    )
    assert result.returncode == 0, result.output
    log = (pytester.path / "log.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in log]  # one writer: every line whole
    kinds = [r["$report_type"] for r in records]
    assert kinds.count("SessionStart") == kinds.count("SessionFinish") == 1, log
    calls = [r["nodeid"] for r in records if r.get("when") == "call"]
    assert calls == ["test_reports.py::test_on_ranks[ranks2]", "test_reports.py::test_plain"]
    html = (pytester.path / "report.html").read_text().splitlines()
    assert html == ["written by rank 0"], html


@pytest.mark.slow
def test_a_plain_test_failing_on_one_rank_fails_everywhere_and_x_stops_all(
    pytester: pytest.Pytester,
) -> None:
    source = """
def test_fails_on_rank_1_only():
    assert os.environ["RANK"] != "1", "only rank 1 sees this"

def test_never_runs():
    pass
"""
    result = torchrun(write(pytester, test_plain=source), 2, "-x")
    assert "rank 1 failed this test (it did not fail on rank 0)" in result.output
    assert "only rank 1 sees this" in result.output
    assert junit_cases(result.junit) == {"test_fails_on_rank_1_only": "failure"}, result.output
    assert result.exit_codes() == [1, 1], result.output


@pytest.mark.slow
def test_a_rank_dying_between_rank_tests_fails_the_test_it_was_in(
    pytester: pytest.Pytester,
) -> None:
    source = """
def test_rank_1_exits_hard():
    if os.environ["RANK"] == "1":
        os._exit(7)

def test_never_runs():
    pass
"""
    result = torchrun(write(pytester, test_gone=source), 2)
    out = result.output
    assert "not every rank finished this test: rank 1:" in out
    assert junit_cases(result.junit) == {"test_rank_1_exits_hard": "failure"}, result.output
    assert sorted(result.exit_codes()) == [1, 7], out


@pytest.mark.slow
def test_a_sigterm_fault_kills_its_rank_as_on_warm_ranks(pytester: pytest.Pytester) -> None:
    source = """
@pytest.mark.ranks(2)
@pytest.mark.fault(rank=1, kind="signal", signal="SIGTERM")
@pytest.mark.expect(rank=1, does=killed(signal.SIGTERM), others=returns())
def test_killed_as_expected(rank):
    pass
"""
    result = torchrun(write(pytester, test_term=source), 2)
    assert junit_cases(result.junit) == {"test_killed_as_expected[ranks2]": "passed"}, result.output
    assert sorted(result.exit_codes()) == [-15, 1], result.output  # the session ended there


# ---- found by an adversarial pass over launch mode --------------------------------------

AFTER_A_FAILED_INIT = """
@pytest.mark.ranks(launch=True)
def test_a_failed_init_on_rank_0_is_caught(rank):
    if rank == 0:
        with pytest.raises(ValueError):  # gloo refuses a CPU device_id, after torch named it
            dist.init_process_group("gloo", device_id=torch.device("cpu"))

@pytest.mark.ranks(2)
def test_b_the_next_group_comes_up(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2

def test_c_skipped_on_rank_1_only():
    if os.environ["RANK"] == "1":
        pytest.skip("rank 1 has no data")

def test_d_xfailed_on_rank_1_only():
    if os.environ["RANK"] == "1":
        pytest.xfail("flaky on rank 1")

def test_e_skipped_everywhere():
    pytest.skip("not here")
"""


@pytest.mark.slow
def test_a_failed_init_leaves_no_trace_and_a_partial_skip_is_no_pass(
    pytester: pytest.Pytester,
) -> None:
    """A group set up after an init that failed on one rank only came up under another name
    there and hung for the group timeout; a plain test skipped or xfailed on one rank only
    passed (the other rank's report was the verdict)."""
    result = torchrun(write(pytester, test_launch=AFTER_A_FAILED_INIT), 2, "--rank-timeout", "10")
    out = result.output
    assert junit_cases(result.junit) == {
        "test_a_failed_init_on_rank_0_is_caught": "passed",
        "test_b_the_next_group_comes_up[ranks2]": "passed",
        "test_c_skipped_on_rank_1_only": "failure",
        "test_d_xfailed_on_rank_1_only": "skipped",  # junit's word for an xfail
        "test_e_skipped_everywhere": "skipped",
    }, out
    assert "rank 1 skipped this test (rank 1 has no data) while rank 0 ran it" in out, out


# ---- tests that set their own group up from torchrun's environment ------------------------

OWN_GROUPS = """
import time


def straggle_on_rank_0():
    if os.environ["RANK"] == "0":
        time.sleep(1)  # rank 1 reaches the rendezvous first, where the last group's keys are


def own_group_all_reduce(straggle):
    if straggle:
        straggle_on_rank_0()
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
    dist.destroy_process_group()


@pytest.mark.ranks(2, launch=True)
@pytest.mark.parametrize("straggle", [False, True])
def test_launch_mode(rank, straggle):
    own_group_all_reduce(straggle)


@pytest.mark.parametrize("straggle", [False, True])
def test_plain(straggle):
    own_group_all_reduce(straggle)


@pytest.fixture(scope="module")
def module_group():
    straggle_on_rank_0()
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def test_module_group(module_group):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""

OWN_GROUPS_NEXT_MODULE = """
import time


@pytest.fixture(scope="module")
def module_group():
    if os.environ["RANK"] == "0":
        time.sleep(1)
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def test_next_module_group(module_group):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


@pytest.mark.slow
def test_each_group_a_test_sets_up_from_the_environment_meets_on_fresh_keys(
    pytester: pytest.Pytester,
) -> None:
    """torchrun's agent store outlives every group: a test's init_process_group() read the
    last group's addresses there when its peer came late, failed to connect, and left the
    peer hung (the session ended)."""
    directory = write(pytester, test_a=OWN_GROUPS, test_b=OWN_GROUPS_NEXT_MODULE)
    result = torchrun(directory, 2, "--rank-timeout", "30")
    assert junit_cases(result.junit) == {
        "test_launch_mode[ranks2-False]": "passed",
        "test_launch_mode[ranks2-True]": "passed",
        "test_plain[False]": "passed",
        "test_plain[True]": "passed",
        "test_module_group": "passed",
        "test_next_module_group": "passed",
    }, result.output


def test_an_env_rendezvous_gets_the_prefix_it_is_given_until_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket

    import torch.distributed as dist

    from harness.launched.rendezvous import give_each_set_up_its_keys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    prefixes = iter(["t3/1", "t3/2"])
    undo = give_each_set_up_its_keys(lambda: next(prefixes))
    try:
        store, rank, world_size = next(dist.rendezvous("env://"))
        assert (rank, world_size) == (0, 1)
        store.set("rank_0", "here")
        raw = dist.TCPStore("127.0.0.1", port, is_master=False)
        assert raw.get("t3/1/rank_0") == b"here"
        assert raw.check(["rank_0"]) is False
    finally:
        undo()
    store, _, _ = next(dist.rendezvous("env://"))
    assert type(store).__name__ == "TCPStore"  # torch's own handler is back


# ---- found by an adversarial pass over existing torchrun suites ----------------------------

FIXTURE_MADE_GROUPS = """
@pytest.fixture(scope="session")
def pg():
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def test_a_plain(pg):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


def test_b_plain_again(pg):
    assert dist.get_world_size() == 2


@pytest.mark.ranks(launch=True)
def test_c_launch_mode(rank, pg):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


@pytest.mark.ranks(launch=True)
def test_d_launch_mode_again(rank, pg):
    assert dist.is_initialized()
"""


@pytest.mark.slow
def test_a_group_a_fixture_set_up_is_the_fixtures(pytester: pytest.Pytester) -> None:
    """The harness destroyed the default group before each test without ranks and each
    launch=True test, whoever made it: a session fixture's group was gone from the second
    test on, and a launch=True test was blamed for leaving the fixture's group."""
    result = torchrun(write(pytester, test_pg=FIXTURE_MADE_GROUPS), 2, "--rank-timeout", "30")
    assert junit_cases(result.junit) == {
        "test_a_plain": "passed",
        "test_b_plain_again": "passed",
        "test_c_launch_mode": "passed",
        "test_d_launch_mode_again": "passed",
    }, result.output
    assert result.returncode == 0, result.output


TEARDOWN_ON_ONE_RANK = """
@pytest.fixture
def breaks_on_rank_1():
    yield
    if os.environ["RANK"] == "1":
        raise RuntimeError("teardown broke on rank 1")


def test_a_plain(breaks_on_rank_1):
    pass


@pytest.mark.ranks(2)
def test_b_ranks(rank, breaks_on_rank_1):
    pass


def test_c_after():
    pass
"""


@pytest.mark.slow
def test_a_teardown_that_fails_on_one_rank_is_an_error_everywhere(
    pytester: pytest.Pytester,
) -> None:
    """Only the body's outcome was exchanged: rank 0 reported "2 passed" (junit too) while
    rank 1's teardown had failed, shown nowhere, and every process exited 1."""
    result = torchrun(write(pytester, test_td=TEARDOWN_ON_ONE_RANK), 2, "--rank-timeout", "30")
    assert junit_cases(result.junit) == {
        "test_a_plain": "error",
        "test_b_ranks[ranks2]": "error",
        "test_c_after": "passed",
    }, result.output
    assert "rank 1's teardown failed" in result.output, result.output
    assert "teardown broke on rank 1" in result.output, result.output


DIES_IN_TEARDOWN_ON_ONE_RANK = """
@pytest.fixture
def dies_on_rank_1():
    yield
    if os.environ["RANK"] == "1":
        os._exit(0)  # a status of 0: only a missing teardown result tells


def test_a_last(dies_on_rank_1):
    pass
"""


@pytest.mark.slow
def test_a_rank_that_dies_in_a_teardown_fails_the_test_and_the_run(
    pytester: pytest.Pytester,
) -> None:
    """Only ranks that published a teardown result were looked at: rank 0 reported "1
    passed" and torchrun exited 0 (a false green)."""
    result = torchrun(write(pytester, test_tdexit=DIES_IN_TEARDOWN_ON_ONE_RANK), 2)
    assert junit_cases(result.junit) == {"test_a_last": "error"}, result.output
    assert "not every rank finished this test's teardown: rank 1" in result.output, result.output
    assert result.returncode != 0, result.output


HOLDS_THE_GIL_ON_ONE_RANK = """
import ctypes


@pytest.mark.ranks(timeout=60)
def test_a_long_call_on_rank_1(rank):
    if rank == 1:
        ctypes.PyDLL(None).sleep(18)  # one C call that keeps the GIL: no thread runs meanwhile
"""


@pytest.mark.slow
def test_a_rank_busy_in_one_long_call_is_not_taken_for_dead(pytester: pytest.Pytester) -> None:
    """A rank's heartbeat is a thread, which cannot run while the main thread holds the GIL
    (a long regex, json.loads): its peers took it for dead at 15 s and failed the test."""
    result = torchrun(write(pytester, test_gil=HOLDS_THE_GIL_ON_ONE_RANK), 2)
    assert result.returncode == 0, result.output
    assert junit_cases(result.junit) == {"test_a_long_call_on_rank_1": "passed"}


COLLECTS = """
@pytest.mark.ranks
def test_sum(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
"""

FAILS_TO_IMPORT_ON_RANK_1 = """
if os.environ.get("RANK") == "1":
    raise ImportError("missing optional dependency on this node")
"""


@pytest.mark.slow
def test_a_collection_error_on_one_rank_ends_every_rank_showing_it(
    pytester: pytest.Pytester,
) -> None:
    """Both ranks collected the same tests, so the check passed; rank 1 stopped for its
    error and rank 0 waited for it in the first test's set-up: about 5 minutes, and the
    error was shown nowhere."""
    directory = write(pytester, test_a=COLLECTS, test_b=FAILS_TO_IMPORT_ON_RANK_1)
    result = torchrun(directory, 2, timeout=120)
    assert result.returncode != 0, result.output
    assert "rank 1 could not collect" in result.output, result.output
    assert "missing optional dependency on this node" in result.output, result.output


FAILS_ON_EVERY_RANK_ITS_OWN_WAY = """
def test_each_rank_fails():
    assert False, f"rank {os.environ['RANK']}'s own failure"
"""


@pytest.mark.slow
def test_a_plain_test_failing_on_several_ranks_shows_each_ranks_failure(
    pytester: pytest.Pytester,
) -> None:
    """Rank 0's report showed its own failure alone: rank 1's was lost."""
    result = torchrun(write(pytester, test_each=FAILS_ON_EVERY_RANK_ITS_OWN_WAY), 2)
    assert junit_cases(result.junit) == {"test_each_rank_fails": "failure"}, result.output
    assert "rank 0's own failure" in result.output, result.output
    assert "rank 1 failed this test too" in result.output, result.output
    assert "rank 1's own failure" in result.output, result.output


@pytest.mark.slow
def test_with_continue_on_collection_errors_rank_0_shows_another_ranks_error(
    pytester: pytest.Pytester,
) -> None:
    """The session goes on, and rank 1's error was shown nowhere: rank 0 reported "1 passed"
    while the run exited 1."""
    directory = write(pytester, test_a=COLLECTS, test_b=FAILS_TO_IMPORT_ON_RANK_1)
    result = torchrun(directory, 2, "--continue-on-collection-errors", timeout=120)
    assert "harness: collection errors on other ranks" in result.output, result.output
    assert "missing optional dependency on this node" in result.output, result.output
    assert junit_cases(result.junit) == {"test_sum": "passed"}, result.output


FAILS_WHILE_A_PEER_WAITS = """
import time


@pytest.fixture
def pg():
    dist.init_process_group("gloo")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_fails_on_rank_1(pg):
    print(f"hello from {dist.get_rank()}")
    if dist.get_rank() == 1:
        assert False, "rank 1 broke"
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits for rank 1, which never comes


def test_b_slow_on_rank_1():
    if os.environ["RANK"] == "1":
        time.sleep(8)  # past --timeout on rank 1 only


def test_c_after():
    pass


@pytest.fixture
def slow_on_rank_1():
    if os.environ["RANK"] == "1":
        time.sleep(8)  # past --timeout on rank 1 only


@pytest.mark.ranks(2)
def test_d_set_up_slow_on_rank_1(rank, slow_on_rank_1):
    pass
"""


SESSION_GROUP_AFTER_A_FAILURE = """
import time


@pytest.fixture(scope="session")
def session_pg():
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def test_e_fails_on_rank_1_while_rank_0_computes(session_pg):
    if dist.get_rank() == 1:
        assert False, "rank 1 broke early"
    time.sleep(2.5)  # rank 0 computes, in no collective: rank 1 must keep the group


def test_f_the_session_group_still_works(session_pg):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


@pytest.mark.slow
def test_a_plain_test_failing_on_one_rank_releases_its_peers(pytester: pytest.Pytester) -> None:
    """A test without ranks that failed on rank 1 waited for rank 0's verdict while rank 0
    waited for rank 1 in all_reduce (gloo's 30 minutes); the rank that waited for a slow
    peer hit pytest-timeout in the harness's own wait: an INTERNALERROR, no tests ran."""
    directory = write(
        pytester, test_wait=FAILS_WHILE_A_PEER_WAITS, test_wait_2=SESSION_GROUP_AFTER_A_FAILURE
    )
    result = torchrun(directory, 2, "--rank-timeout", "30", "--timeout", "5")
    assert junit_cases(result.junit) == {
        "test_a_fails_on_rank_1": "failure",
        "test_b_slow_on_rank_1": "failure",
        "test_c_after": "passed",
        "test_d_set_up_slow_on_rank_1[ranks2]": "error",
        "test_e_fails_on_rank_1_while_rank_0_computes": "failure",
        "test_f_the_session_group_still_works": "passed",
    }, result.output
    assert "INTERNALERROR" not in result.output, result.output
    assert "rank 1's set-up failed (Failed: Timeout (>5.0s)" in result.output, result.output
    assert "rank 1 failed this test (root cause); rank 0 collateral" in result.output
    assert "rank 1 broke" in result.output, result.output
    assert "Captured stdout call [rank 1]" in result.output, result.output
    assert "hello from 1" in result.output, result.output
    assert "Timeout" in result.output, result.output


TIMED_OUT_SET_UP_THEN_A_SLOW_GROUP_RELEASE = """
import threading
import torch.distributed.distributed_c10d as c10d


def _release_after_the_fixture_timer(update_default_pg):
    # The harness frees the group once rank 1's set-up has failed; this release is slow,
    # as gloo's can be on a busy machine: it lasts until the harness's fixture timer ends.
    def slow(pg):
        if pg is None:
            for thread in threading.enumerate():
                if thread.name == "harness-fixture-timer":
                    thread.join(60)
        update_default_pg(pg)

    return slow


@pytest.fixture
def times_out_on_rank_1(monkeypatch):
    if os.environ["RANK"] == "1":
        update = c10d._update_default_pg
        monkeypatch.setattr(c10d, "_update_default_pg", _release_after_the_fixture_timer(update))
        threading.Event().wait(60)  # until pytest-timeout's signal fails the set-up


@pytest.mark.ranks(2)
def test_a_set_up_times_out_on_rank_1(rank, times_out_on_rank_1):
    pass


@pytest.mark.ranks(2)
def test_b_after(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


@pytest.mark.slow
def test_a_set_up_pytest_timeout_failed_is_not_a_hang_while_the_group_is_freed(
    pytester: pytest.Pytester,
) -> None:
    """pytest-timeout failed rank 1's fixture; the harness then freed the group (peers
    blocked on it fail at once) and the fixtures' own timer, ending a moment after
    pytest-timeout's, found the main thread in torch.distributed: it took the release for
    a fixture blocked there, reported a hang and ended rank 1's session (seen under load)."""
    directory = write(pytester, test_slow_release=TIMED_OUT_SET_UP_THEN_A_SLOW_GROUP_RELEASE)
    result = torchrun(directory, 2, "--timeout", "5")
    assert junit_cases(result.junit) == {
        "test_a_set_up_times_out_on_rank_1[ranks2]": "error",
        "test_b_after[ranks2]": "passed",
    }, result.output
    assert "rank 1's set-up failed (Failed: Timeout (>5.0s)" in result.output, result.output
    assert "still running at pytest-timeout's bound" not in result.output, result.output


SET_UP_FAILS_BEFORE_THE_RENDEZVOUS = """
@pytest.fixture(scope="session")
def pg():
    if os.environ["RANK"] == "1":
        raise RuntimeError("no GPU on rank 1")
    dist.init_process_group("gloo")  # rank 0 waits here for rank 1, which never comes
    yield
    dist.destroy_process_group()


def test_a(pg):
    pass
"""


@pytest.mark.slow
def test_a_peer_blocked_where_the_failing_rank_cannot_release_it_ends_the_session(
    pytester: pytest.Pytester,
) -> None:
    """Rank 1's fixture failed before the rendezvous rank 0 waited in: rank 1 waited for
    rank 0's verdict for 10 minutes, rank 0 for rank 1 for gloo's 30 (and nothing said why)."""
    result = torchrun(
        write(pytester, test_blocked=SET_UP_FAILS_BEFORE_THE_RENDEZVOUS), 2, "--rank-timeout", "5"
    )
    out = result.output
    assert "harness: rank 0 is gone (blocked in torch.distributed, waiting on this rank)" in out
    assert "ERROR at setup of test_a" in out and "no GPU on rank 1" in out, out
    assert "ranks out of step at test_blocked.py::test_a" in out, out


EXIT_IN_A_RANKS_BODY = """
@pytest.mark.ranks(2)
def test_a_stops_the_session(rank):
    if rank == 1:
        pytest.exit("enough for today", returncode=3)
    dist.barrier()
"""
EXIT_IN_A_PLAIN_TEST = """
def test_a_stops_the_session():
    if os.environ["RANK"] == "1":
        pytest.exit("enough for today", returncode=3)
"""
EXIT_IN_A_SET_UP = """
@pytest.fixture(scope="module")
def stops_on_rank_1():
    if os.environ["RANK"] == "1":
        pytest.exit("enough for today", returncode=3)

@pytest.mark.ranks(2)
def test_a_stops_the_session(rank, stops_on_rank_1):
    dist.barrier()
"""
# Found by an adversarial pass: with the peer blocked in a collective on the group a session
# fixture set up, it waited there until the launch was killed.
SESSION_GROUP = """
import pytest, torch.distributed as dist

@pytest.fixture(scope="session")
def pg():
    dist.init_process_group("gloo")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
"""
EXIT_WHILE_THE_PEER_WAITS = """
def test_a_stops_the_session(pg):
    if os.environ["RANK"] == "1":
        pytest.exit("enough for today", returncode=3)
    dist.all_reduce(torch.ones(1))
"""
INTERRUPT_WHILE_THE_PEER_WAITS = """
def test_a_stops_the_session(pg):
    if os.environ["RANK"] == "1":
        raise KeyboardInterrupt
    dist.all_reduce(torch.ones(1))
"""
# Found by an adversarial pass: reported as a collection error (status 2), as different
# backends, and the words and status lost.
EXIT_WHILE_COLLECTING = """
import os, pytest

def pytest_collection_modifyitems(config, items):
    if os.environ["RANK"] == "1":
        pytest.exit("enough for today", returncode=3)
"""
EXIT_AT_THE_SESSIONS_START = """
import os, pytest

def pytest_sessionstart(session):
    if os.environ["RANK"] == "1":
        pytest.exit("enough for today", returncode=3)
"""
A_TEST = """
def test_a(pg=None):
    pass
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("conftest", "source", "said", "status"),
    [
        ("", EXIT_IN_A_RANKS_BODY, "enough for today", 3),
        ("", EXIT_IN_A_PLAIN_TEST, "enough for today", 3),
        ("", EXIT_IN_A_SET_UP, "enough for today", 3),
        (SESSION_GROUP, EXIT_WHILE_THE_PEER_WAITS, "enough for today", 3),
        (SESSION_GROUP, INTERRUPT_WHILE_THE_PEER_WAITS, "KeyboardInterrupt", 2),
        (EXIT_WHILE_COLLECTING, A_TEST, "enough for today", 3),
        (EXIT_AT_THE_SESSIONS_START, A_TEST, "enough for today", 3),
    ],
    ids=[
        "ranks-body",
        "plain-test",
        "set-up",
        "peer-in-a-collective",
        "keyboard-interrupt",
        "collection-hook",
        "session-start-hook",
    ],
)
def test_pytest_exit_on_one_rank_ends_the_session_on_every_rank(
    pytester: pytest.Pytester, conftest: str, source: str, said: str, status: int
) -> None:
    """pytest.exit() on rank 1 alone ended rank 1's session only: rank 0 waited for it until
    the test's timeout (in a plain test, the 600 s wait for its peers) and reported it as
    gone or hung, and the reason was lost."""
    if conftest:
        pytester.makeconftest(conftest)
    source += "\ndef test_b_never_runs():\n    pass\n"
    result = torchrun(
        write(pytester, test_exit=source), 2, "--rank-timeout", "120", timeout=LAUNCH_TIMEOUT_S
    )
    out = result.output
    assert f"Exit: [rank 1] {said}" in out, out
    ended = [name for name in junit_cases(result.junit) if name]  # pytest leaves one unnamed
    assert ended == [], out  # no test ended: the session stopped in one, as pytest stops
    assert "gone" not in out and "hung" not in out and "out of step" not in out, out
    assert "collection error" not in out and "different backends" not in out, out
    assert result.exit_codes() and set(result.exit_codes()) == {status}, out


TEARDOWN_FAILS_WHILE_THE_PEER_WAITS = """
@pytest.fixture
def synced(pg):
    yield
    if os.environ["RANK"] == "1":
        raise RuntimeError("rank 1's teardown broke")
    dist.barrier()

def test_a_teardown_fails_on_rank_1(synced):
    pass

def test_b_after(pg):
    pass
"""


@pytest.mark.slow
def test_a_teardown_failing_on_one_rank_frees_a_peer_blocked_in_its_own(
    pytester: pytest.Pytester,
) -> None:
    """Found by an adversarial pass: rank 1's teardown failed while rank 0's waited in a
    barrier on the session fixture's group; rank 1 did not leave the group (as it does when
    a body fails), and both waited until the launch was killed, each then blaming the
    other."""
    pytester.makeconftest(SESSION_GROUP)
    result = torchrun(write(pytester, test_teardown=TEARDOWN_FAILS_WHILE_THE_PEER_WAITS), 2)
    out = result.output
    cases = junit_cases(result.junit)
    assert cases == {"test_a_teardown_fails_on_rank_1": "error", "test_b_after": "passed"}, out
    assert "rank 1's teardown failed" in out and "rank 1's teardown broke" in out, out
    assert "gone" not in out and "out of step" not in out, out
    assert result.exit_codes() == [1, 1], out


RETURNS_A_VALUE = """
@pytest.mark.ranks(2)
def test_returns_a_value(rank):
    return rank + 1
"""


@pytest.mark.slow
def test_a_ranks_test_returning_a_value_warns_as_on_warm_ranks(pytester: pytest.Pytester) -> None:
    """Under torchrun the sequence after a body was a copy of the warm one that had drifted:
    such a test passed silently, and with filterwarnings = error it failed on warm ranks only."""
    strict = ("-W", "error::pytest.PytestReturnNotNoneWarning")
    directory = write(pytester, test_returns=RETURNS_A_VALUE)
    launched = torchrun(directory, 2, *strict)
    assert junit_cases(launched.junit) == {"test_returns_a_value[ranks2]": "failure"}, (
        launched.output
    )
    assert "test functions should return None" in launched.output, launched.output
    warm = pytester.runpytest_subprocess("-p", "harness", "-p", "no:cacheprovider", *strict)
    warm.assert_outcomes(failed=1)
    warm.stdout.fnmatch_lines(["*test functions should return None*"])


FORGES_THE_STORE = """
import os, pickle
from datetime import timedelta

from harness.common import launch_detect


class Payload:
    def __reduce__(self):
        return (open, ({marker!r}, "w"))  # creates the marker file if ever unpickled


def _keys():
    per_rank = ("died", "exit", "status", "collected", "beat", "at", "pid", "stopped", "backend")
    keys = [f"{{k}}/{{r}}" for k in per_rank for r in (0, 1)] + ["final"]
    for t in range(0, 4):
        for kind in ("outcome", "setup", "plain", "teardown"):
            if (t, kind) != (1, "setup"):  # test_after sets up, so its outcome is read
                keys += [f"t{{t}}/{{kind}}/{{r}}" for r in (0, 1)]
            keys += [f"t{{t}}/c1/{{kind}}/{{r}}" for r in (0, 1)]
        keys.append(f"t{{t}}/shared_tmp_path")
    return keys


def _store():
    launch = launch_detect.detect()
    store = dist.TCPStore(
        launch.master_addr, launch.master_port, is_master=False, timeout=timedelta(seconds=60)
    )
    return dist.PrefixStore(f"harness/{{launch.run_key}}/0", store)


def _as_nobody(blob):  # the same keys, set by user nobody through the store's port
    import importlib.util

    spec = importlib.util.spec_from_file_location("other_user", os.environ["OTHER_USER"])
    other_user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other_user)
    launch = launch_detect.detect()
    prefix = f"harness/{{launch.run_key}}/0/"
    other_user.write(launch.master_port, {{prefix + key: blob for key in _keys()}})


@pytest.mark.ranks(2)
def test_forges(rank):
    if rank == 1:  # as another process that reaches the launch's store would
        blob = pickle.dumps(Payload())
        if os.environ.get("OTHER_USER"):
            _as_nobody(blob)
        else:
            store = _store()
            for key in _keys():
                store.set(key, blob)
        open({marker!r} + ".forged", "w").close()  # every key was written
    dist.barrier()


@pytest.mark.ranks(2)
def test_after(rank):
    if rank == 1:  # returns once rank 0 has published its outcome, and reads rank 1's
        try:  # under keys named with a secret, the forger never sees it published
            _store().wait(["t1/outcome/0"], timedelta(seconds=float(os.environ["FORGER_WAIT_S"])))
        except Exception:
            pass


def test_plain():
    pass


def _returns(x):
    return x


def test_a_call(run_on_ranks):
    run_on_ranks(_returns, 1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("forger", ["another_process", "another_user"])
def test_a_pickle_written_under_every_harness_key_is_never_run(
    pytester: pytest.Pytester, forger: str
) -> None:
    """Each launched rank loaded its peers' outcomes with pickle.loads from torchrun's store,
    which anything reaching its port can write: a process of another user ran code as the
    test's user inside rank 0. Now every value read there is data, checked on arrival."""
    from tests.harness import other_user

    env = {"FORGER_WAIT_S": "60"}
    if forger == "another_user":
        if other_user.skip_reason() is not None:
            pytest.skip(other_user.skip_reason())
        env["OTHER_USER"] = other_user.__file__
    marker = pytester.path / "ran-the-forged-pickle"
    source = FORGES_THE_STORE.format(marker=str(marker))
    result = torchrun(write(pytester, test_forged=source), 2, extra_env=env)
    assert not marker.exists(), result.output
    # A wrong verdict at worst (which forged value a rank reads first is a race), and the
    # report says the session ran unsigned.
    assert "this launched session ran unsigned" in result.output, result.output
    assert Path(f"{marker}.forged").exists(), result.output  # the forger wrote every key


@pytest.mark.slow
def test_with_a_secret_values_written_under_the_harness_keys_change_no_verdict(
    pytester: pytest.Pytester,
) -> None:
    """With a secret the keys' names carry a tag the forger cannot compute, and every value
    is signed: the same forgery reaches nothing."""
    marker = pytester.path / "ran-the-forged-pickle"
    source = FORGES_THE_STORE.format(marker=str(marker))
    directory = write(pytester, test_forged=source)
    secret = {"HARNESS_SECRET": "s3cret-of-this-job", "FORGER_WAIT_S": "3"}
    result = torchrun(directory, 2, extra_env=secret)
    assert not marker.exists(), result.output
    assert set(junit_cases(result.junit).values()) == {"passed"}, result.output
    assert "ran unsigned" not in result.output and "not an outcome" not in result.output


@pytest.mark.slow
def test_a_secret_file_others_can_read_is_refused(pytester: pytest.Pytester) -> None:
    secret = pytester.path / "secret"
    secret.write_text("a-secret-of-thirty-two-characters")
    secret.chmod(0o644)
    directory = write(pytester, test_ok="def test_ok():\n    pass\n")
    result = torchrun(directory, 2, f"--rank-secret-file={secret}")
    assert result.returncode != 0
    assert f"chmod 600 {secret}" in result.output, result.output
    secret.chmod(0o600)
    assert torchrun(directory, 2, f"--rank-secret-file={secret}").returncode == 0
    short = torchrun(directory, 2, extra_env={"HARNESS_SECRET": "short"})
    assert short.returncode != 0 and "has 5 bytes; give at least 16" in short.output


A_FIXTURE_COLLECTIVE_TIMES_OUT = """
from datetime import timedelta


@pytest.fixture
def all_reduce_on_rank_1_at_teardown():
    yield
    if os.environ["RANK"] == "1":  # rank 0 never joins: it times out, left queued in gloo
        work = dist.all_reduce(torch.full((1,), 100.0), async_op=True)
        work.wait(timeout=timedelta(seconds=2))


@pytest.mark.ranks(2)
def test_a_teardown_times_out(rank, all_reduce_on_rank_1_at_teardown):
    pass


@pytest.mark.ranks(2)
def test_b_next(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


@pytest.mark.slow
def test_a_group_a_fixtures_collective_broke_is_not_used_again(pytester: pytest.Pytester) -> None:
    """After a teardown's collective timed out, the session's group was reused: the next
    test's all_reduce met the one left queued (wrong data, or gloo's pair closed)."""
    result = torchrun(write(pytester, test_fx=A_FIXTURE_COLLECTIVE_TIMES_OUT), 2)
    assert junit_cases(result.junit) == {
        "test_a_teardown_times_out[ranks2]": "error",
        "test_b_next[ranks2]": "passed",
    }, result.output


BLOCKED_IN_A_FIXTURE = """
@pytest.fixture
def all_reduce_on_rank_1_at_teardown():
    yield
    if os.environ["RANK"] == "1":
        dist.all_reduce(torch.ones(1))  # rank 0 never joins: blocked until the group's bound


@pytest.mark.ranks(2)
def test_a_teardown_blocks(rank, all_reduce_on_rank_1_at_teardown):
    pass


def test_b_not_reached():
    pass
"""


@pytest.mark.slow
def test_a_fixture_blocked_in_a_collective_ends_at_pytest_timeouts_bound(
    pytester: pytest.Pytester,
) -> None:
    """pytest-timeout's SIGALRM cannot interrupt a collective blocked in C: a fixture ran
    135 s under --timeout 15 (the group's own bound). The rank's timer reports it at 15 s
    with its stacks, as a body's hang is reported, and the session ends there."""
    result = torchrun(write(pytester, test_fxh=BLOCKED_IN_A_FIXTURE), 2, "--timeout", "15")
    assert result.returncode != 0, result.output
    assert "ERROR at teardown of test_a_teardown_blocks" in result.output, result.output
    assert "still running at pytest-timeout's bound (15 s)" in result.output, result.output
    assert "all_reduce_on_rank_1_at_teardown" in result.output, result.output  # its stack
    assert "test_b_not_reached" in result.output, result.output  # listed as not run


def test_a_session_leaves_no_crash_report_files(tmp_path: Path) -> None:
    """Each launched rank with a neighbour on its node writes faulthandler's crash report to
    a file of its own (crashes.py); a session that ends removes them, so none pile up."""
    (tmp_path / "test_one.py").write_text(
        "import pytest, torch.distributed as dist\n\n"
        "@pytest.mark.ranks(2)\ndef test_meets(rank):\n    dist.barrier()\n"
    )
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    launched = torchrun(tmp_path, 2, "test_one.py", extra_env={"TMPDIR": str(private_tmp)})
    assert launched.returncode == 0, launched.output[-4000:]
    reports = private_tmp / f"rankwise-crashes-{os.getuid()}"
    assert reports.is_dir(), sorted(p.name for p in private_tmp.iterdir())  # they were made
    assert list(reports.iterdir()) == []
