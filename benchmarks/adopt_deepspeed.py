"""DeepSpeed's own unit tests, as they are and adopted (--rank-adopt deepspeed), back to back.

Run by ``benchmarks/adopt.py --suite deepspeed --deepspeed-src DIR [--python PY]``: DIR is a
DeepSpeed source checkout (its tests/ with conftest.py and unit/common.py), PY a Python whose
environment has DeepSpeed's requirements, pytest below 8.4 (DeepSpeed's pin) and rankwise
(``make .venv-deepspeed DEEPSPEED_SRC=DIR`` builds one). On CPU: ``DS_ACCELERATOR=cpu``,
``LOCAL_SIZE=2`` (else every 2-rank test skips), gloo; JIT-built ops are kept in
``TORCH_EXTENSIONS_DIR`` (benchmarks/out/torch_extensions unless set), built before timing.

Two parts:
- a selection of CPU-runnable test files, each side one pytest session over all of them: the
  same verdicts, the whole selection's ratio (target 20x), the median adopted test and its
  spread, and every replacement of ranks with its reason;
- DeepSpeed-style tests that fail on purpose (an assertion while the peer waits, sys.exit on
  one rank, the same under non_daemonic_procs), each in a session of its own on each side:
  the time to a verdict and what the verdict names.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import OUT, TIMING_CONFTEST, Sample, replaced_ranks
from harness.adopt.deepspeed import shm_buffers

SELECTION = (  # CPU-runnable with gloo: comm, runtime, utils, ZeRO stages 1-3 on small models
    "unit/comm/test_dist.py",
    "unit/runtime/test_runtime_utils.py",
    "unit/runtime/test_data.py",
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/runtime/test_multi_output_model.py",
    "unit/runtime/test_pld.py",
    "unit/utils/test_groups.py",
    "unit/utils/test_partition_balanced.py",
    "unit/runtime/zero/test_ignore_unused_parameters.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_context.py",
    "unit/runtime/zero/test_zero_context_return.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_zero_linear_direct_init.py",
    "unit/runtime/zero/test_zero_allreduce_fetch_params.py",
    "unit/runtime/zero/test_zero_config.py",
    "unit/runtime/zero/test_zero_context_ancestry.py",
    "unit/runtime/zero/test_zero_dynamic_class.py",
    "unit/runtime/zero/test_zero_hook_attribute_delegation.py",
    "unit/runtime/zero/test_zero_late_module_attach.py",
)
# The shared-memory all-reduce kernels for bf16 and fp16 need AVX-512 in DeepSpeed releases
# before 0.19.8: without it they die of SIGILL, and as they are their pool then waits 600 s.
# TestGatheredParametersAllRanksErrorOnModification passes a bare rank as a device string:
# it fails on CPU, as it is and adopted.
NOT_ON_THIS_CPU = (
    "-k",
    "not TestDistInferenceAllReduce and not TestGatheredParametersAllRanksErrorOnModification",
)
TARGET = 20.0
SESSION_TIMEOUT_S = 3600.0  # the selection as it is: about 30 s a test
FAILING_TIMEOUT_S = 180.0  # a failing test as it is: DeepSpeed's own bound is 600 s
ADOPTED = ("-p", "harness", "--rank-adopt", "deepspeed")
ADOPTED_WARNINGS = ("-W", "always::harness.RanksReplacedWarning")
AS_IS = ("-p", "no:harness")

FAILING_TESTS = """
import sys
import torch
import deepspeed.comm as dist
from unit.common import DistributedTest


class TestAssertWhilePeerWaits(DistributedTest):
    world_size = 2

    def test(self):
        if dist.get_rank() == 1:
            assert dist.get_rank() == 0, "rank 1's own assertion"
        dist.all_reduce(torch.ones(1))


class TestExitOnOneRank(DistributedTest):
    world_size = 2

    def test(self):
        if dist.get_rank() == 1:
            sys.exit(0)


class TestExitNonDaemonic(DistributedTest):
    world_size = 2
    non_daemonic_procs = True

    def test(self):
        if dist.get_rank() == 1:
            sys.exit(0)


class TestRaiseNonDaemonic(DistributedTest):
    world_size = 2
    non_daemonic_procs = True

    def test(self):
        if dist.get_rank() == 1:
            raise ValueError("rank 1's own error")
        dist.barrier()
"""
FAILING = {
    "TestAssertWhilePeerWaits": "rank 1 asserts while rank 0 waits in all_reduce",
    "TestExitOnOneRank": "rank 1 calls sys.exit(0)",
    "TestExitNonDaemonic": "rank 1 calls sys.exit(0), non_daemonic_procs",
    "TestRaiseNonDaemonic": "rank 1 raises ValueError, non_daemonic_procs",
}


@dataclass(frozen=True)
class Session:
    """One pytest process: each test's time, outcome and failure message, and its output."""

    found: dict[str, Any]
    seconds: float
    killed: bool
    output: str


def _environment(plugin_dir: Path, times: Path, path: tuple[str, ...] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("LOCAL_SIZE", "2")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(OUT / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), *path, env.get("PYTHONPATH", "")])
    env["BENCH_TIMES"] = str(times)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@contextlib.contextmanager
def buffers_left_removed() -> Iterator[None]:
    """The all-reduce buffers DeepSpeed's own pools leave in /dev/shm (66 MB a rank process,
    never unlinked: see harness/adopt/deepspeed/shm_buffers.py), those made or rewritten while
    this runs, removed after it: a machine that runs DeepSpeed's tests as they are fills its
    memory."""
    before = buffers_written()
    try:
        yield
    finally:
        for path, written in buffers_written().items():
            if before.get(path) != written:
                path.unlink(missing_ok=True)


def buffers_written() -> dict[Path, float]:
    """This user's DeepSpeed buffers in /dev/shm, with when each was last written."""
    found = {}
    for path in shm_buffers.SHM_DIR.glob(f"{shm_buffers.PREFIX}_{os.getuid()}_*"):
        with contextlib.suppress(OSError):  # gone meanwhile
            found[path] = path.stat().st_mtime
    return found


def run_session(
    python: str, tests: Path, args: list[str], timeout: float, path: tuple[str, ...] = ()
) -> Session:
    """pytest in DeepSpeed's tests/ folder with the timing plugin; killed past `timeout`."""
    with tempfile.TemporaryDirectory(prefix="bench-ds-") as tmp, buffers_left_removed():
        folder = Path(tmp)
        (folder / "bench_timing.py").write_text(TIMING_CONFTEST)
        times, log = folder / "times.json", folder / "output.txt"
        command = [python, "-m", "pytest", "-p", "bench_timing", "-p", "no:cacheprovider", *args]
        env = _environment(folder, times, path)
        start = time.perf_counter()
        with log.open("w") as out:
            proc = subprocess.Popen(
                command, cwd=tests, env=env, stdout=out, stderr=out, start_new_session=True
            )
            try:
                proc.wait(timeout=timeout)
                killed = False
            except subprocess.TimeoutExpired:  # its forkserver and pool workers go too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
        seconds = time.perf_counter() - start
        found = json.loads(times.read_text()) if times.exists() else {}
        empty: dict[str, Any] = {"times": {}, "outcomes": {}, "messages": {}}
        return Session({**empty, **found}, seconds, killed, log.read_text())


def warm_extensions(python: str, tests: Path) -> None:
    """DeepSpeed's JIT ops the selection loads, built once before anything is timed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = _environment(Path(tmp), Path(tmp) / "unused")
        code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
        subprocess.run([python, "-c", code], cwd=tests.parent, env=env, check=False,
                       capture_output=True, timeout=1800)  # fmt: skip


def selection(python: str, src: Path) -> list[str]:
    tests = src / "tests"
    files = [f for f in SELECTION if (tests / f).exists()]
    warm_extensions(python, tests)
    before = run_session(python, tests, [*AS_IS, *NOT_ON_THIS_CPU, *files], SESSION_TIMEOUT_S)
    adopted = [*ADOPTED, *ADOPTED_WARNINGS, *NOT_ON_THIS_CPU, *files]
    after = run_session(python, tests, adopted, SESSION_TIMEOUT_S)
    was, now = before.found["outcomes"], after.found["outcomes"]
    passing = [n for n, o in was.items() if o == "passed"]
    same = all(now.get(n) == "passed" for n in passing) and was == now
    ratio = before.seconds / after.seconds if after.seconds else 0.0
    adopted_times = [s for n, s in after.found["times"].items() if now.get(n) == "passed"]
    as_is_times = [s for n, s in before.found["times"].items() if was.get(n) == "passed"]
    return [
        f"## DeepSpeed's unit tests ({len(was)} tests in {len(files)} files, CPU, gloo), "
        f"one session each",
        "",
        f"Files: {', '.join(files)}.",
        "",
        "| run | whole session | median passing test (spread) | verdicts |",
        "|---|---|---|---|",
        f"| as it is | {before.seconds:.1f} s{' (killed)' if before.killed else ''} "
        f"| {_sample(as_is_times)} | {_counts(was)} |",
        f"| --rank-adopt deepspeed | {after.seconds:.1f} s{' (killed)' if after.killed else ''} "
        f"| {_sample(adopted_times)} | {_counts(now)} |",
        "",
        f"- {'HOLDS' if same else 'MISSED'}: the same verdicts"
        f"{'' if same else ': ' + _differences(was, now, after.found['messages'])}",
        f"- {'HOLDS' if ratio >= TARGET else 'MISSED'}: at least {TARGET:.0f}x faster over the "
        f"whole session ({ratio:.1f}x)",
        f"- replaced ranks: {replaced_ranks(after.output)}",
        "",
    ]


def failing(python: str, src: Path) -> list[str]:
    """Each deliberately failing test in a session of its own, as it is and adopted."""
    with tempfile.TemporaryDirectory(prefix="bench-ds-failing-") as tmp:
        tests = tests_beside(src, Path(tmp))
        (tests / "unit" / "test_failing_on_purpose.py").write_text(textwrap.dedent(FAILING_TESTS))
        rows = []
        for name, what in FAILING.items():
            node = f"unit/test_failing_on_purpose.py::{name}"
            path = (str(src),)  # deepspeed from the checkout, as its conftest has it
            before = run_session(python, tests, [*AS_IS, node], FAILING_TIMEOUT_S, path)
            after = run_session(python, tests, [*ADOPTED, node], FAILING_TIMEOUT_S, path)
            rows.append(f"| {what} | {_verdict(before)} | {_verdict(after)} |")
    return [
        "## DeepSpeed-style tests that fail on purpose, 2 ranks, one session each",
        "",
        "| test | as it is: time to a verdict, what it names | adopted |",
        "|---|---|---|",
        *rows,
        "",
    ]


def tests_beside(src: Path, where: Path) -> Path:
    """A tests/ folder beside none of the checkout's files but its test base: its conftest,
    pytest.ini and unit/{__init__,common,util,simple_model}.py (the checkout stays as it
    is)."""
    tests = where / "tests"
    (tests / "unit").mkdir(parents=True)
    for name in ("conftest.py", "pytest.ini"):
        shutil.copy(src / "tests" / name, tests / name)
    for name in ("__init__.py", "common.py", "util.py", "simple_model.py"):
        shutil.copy(src / "tests" / "unit" / name, tests / "unit" / name)
    return tests


def _verdict(run: Session) -> str:
    outcomes = list(run.found["outcomes"].values())
    if run.killed or not outcomes:
        return f"no verdict after {run.seconds:.0f} s (killed)"
    outcome = outcomes[0]
    message = next(iter(run.found["messages"].values()), "")
    said = message.splitlines()[0][:140] if message else ""
    return f"{outcome} after {run.seconds:.1f} s{': ' + _cell(said) if said else ''}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _sample(values: list[float]) -> str:
    return Sample.of(values).s() if values else "n/a"


def _counts(outcomes: dict[str, str]) -> str:
    values = list(outcomes.values())
    return ", ".join(f"{values.count(o)} {o}" for o in ("passed", "failed", "skipped"))


def _differences(was: dict[str, str], now: dict[str, str], messages: dict[str, str]) -> str:
    return "; ".join(
        f"{n}: {was.get(n)} as it is, {now.get(n)} adopted ({messages.get(n, '')[:100]})"
        for n in sorted(set(was) | set(now))
        if was.get(n) != now.get(n)
    )


def deepspeed_suite(src: str | None, python: str | None) -> list[str]:
    if not src:
        return ["## DeepSpeed: not measured (give --deepspeed-src DIR, a DeepSpeed checkout)", ""]
    checkout = Path(src).resolve()
    if not (checkout / "tests" / "unit" / "common.py").is_file():
        raise SystemExit(f"{checkout} has no tests/unit/common.py: give a DeepSpeed checkout")
    py = os.path.abspath(python) if python else sys.executable  # not resolved: a venv's link
    return [*selection(py, checkout), *failing(py, checkout)]
