"""DeepSpeed's own tests, from a source checkout, adopted (make test-deepspeed DEEPSPEED_SRC=DIR).

Runs in .venv-deepspeed (ci/deepspeed builds it: DeepSpeed's requirements and pytest below
8.4), each session in DeepSpeed's tests/ folder on CPU (DS_ACCELERATOR=cpu, LOCAL_SIZE=2:
DeepSpeed's skip rule reads the device count from it), as a DeepSpeed developer runs them.
Skipped, with the reason, without DEEPSPEED_SRC.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import adopt_deepspeed as bench  # its tests_beside is no test of ours

SRC = os.environ.get("DEEPSPEED_SRC", "")
pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        not SRC or not (Path(SRC) / "tests" / "unit" / "common.py").is_file(),
        reason="set DEEPSPEED_SRC to a DeepSpeed checkout (make test-deepspeed DEEPSPEED_SRC=DIR)",
    ),
]

# A handful, run both ways: DeepSpeed's own pools take about 25 s a test here.
BOTH_WAYS = (
    "unit/comm/test_dist.py::TestDistArgs",
    "unit/comm/test_dist.py::TestGroupedDistTest",
    "unit/comm/test_dist.py::TestWorldSizeOverrideDistTest",
    "unit/comm/test_dist.py::TestDistributedFixture",
    "unit/comm/test_dist.py::TestInit",
)


def _session(tests: Path, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".cache" / "torch_extensions"))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore", *args]
    return subprocess.run(
        command, cwd=tests, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _shared_memory_buffers() -> set[str]:
    return {path.name for path in bench.buffers_written()}


def _outcomes(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """test id -> PASSED/FAILED/ERROR, and each skip's reason -> SKIPPED, from -rA's short
    summary (a skip's place differs: DeepSpeed's code as it is, the test adopted)."""
    found = {}
    for line in re.sub(r"\x1b\[[0-9;]*m", "", result.stdout).splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            found[rest.split(" - ")[0]] = word
        elif word == "SKIPPED":
            found[rest.split(": ", 1)[-1]] = word
    return found


def test_the_selection_passes_adopted() -> None:
    tests = Path(SRC) / "tests"
    adopt = ("-p", "harness", "--rank-adopt", "deepspeed")
    before = _shared_memory_buffers()
    result = _session(tests, *adopt, *bench.NOT_ON_THIS_CPU, *bench.SELECTION)
    tail = result.stdout[-4000:]
    # DeepSpeed's all-reduce never unlinks its 66 MB buffers: each rank process's is removed
    assert _shared_memory_buffers() - before == set(), tail
    assert result.returncode == 0, tail
    assert "not adopted" not in result.stdout, tail
    assert " passed" in tail and "failed" not in tail.splitlines()[-1], tail


def test_what_passes_as_it_is_passes_adopted() -> None:
    tests = Path(SRC) / "tests"
    before = _shared_memory_buffers()
    with bench.buffers_left_removed():
        as_it_is = _session(tests, "-p", "no:harness", "-rA", *BOTH_WAYS)
    # DeepSpeed's own pools leave their 66 MB buffers: the lane removes what they made
    assert _shared_memory_buffers() - before == set(), sorted(_shared_memory_buffers())
    adopted = _session(tests, "-p", "harness", "--rank-adopt", "deepspeed", "-rA", *BOTH_WAYS)
    was, now = _outcomes(as_it_is), _outcomes(adopted)
    tails = (as_it_is.stdout[-3000:], adopted.stdout[-3000:])
    assert "PASSED" in was.values(), tails  # not a checkout where everything fails both ways
    assert was == now, tails


def test_deepspeed_failures_get_the_harness_verdicts(tmp_path: Path) -> None:
    """DeepSpeed's base itself, beside the checkout (its conftest, pytest.ini, unit/common.py
    and helpers copied; deepspeed from the checkout): rank 1's assertion is the root cause at
    once (as it is: a 600 s wait, then its teardown blamed), and sys.exit(0) on rank 1 under
    non_daemonic_procs fails naming it (as it is: a pass)."""
    tests = bench.tests_beside(Path(SRC), tmp_path)  # the benchmark's failing tests, two of them
    (tests / "unit" / "test_failing.py").write_text(textwrap.dedent(bench.FAILING_TESTS))
    chosen = [f"unit/test_failing.py::{name}" for name in ("TestAssertWhilePeerWaits",
                                                           "TestExitNonDaemonic")]  # fmt: skip
    os.environ["PYTHONPATH"] = SRC  # deepspeed from the checkout, as its conftest has it
    try:
        adopt = ("-p", "harness", "--rank-adopt", "deepspeed")
        result = _session(tests, *adopt, *chosen, timeout=300)
    finally:
        del os.environ["PYTHONPATH"]
    out = result.stdout
    assert "2 failed" in out, out[-3000:]
    assert "rank 1 failed: raised AssertionError: rank 1's own assertion" in out, out[-3000:]
    assert "rank 1 failed: called sys.exit(0)" in out, out[-3000:]
