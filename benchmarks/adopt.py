"""An existing MultiProcessTestCase suite, as it is and adopted (--rank-adopt torch), in one run.

The suite (2 ranks, gloo, a FileStore group at ``self.file_name`` as torch's own suites do)
mixes passes, skips by torch's exit statuses, ``self.skipTest`` and ``unittest.skip``, and two
tests that pass under torch only because torch checks rank 0's exit status alone. Both runs
must give the same verdicts except those false greens, which the adoption turns red.

``--suite`` also runs torch's own suites, shipped in its wheel, each as one whole file:
DistributedTest, the RPC suites (TensorPipe agent) and DDP under dist autograd; and
``--suite deepspeed --deepspeed-src DIR`` DeepSpeed's own tests from a checkout
(benchmarks/adopt_deepspeed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import TIMING_CONFTEST, missed, replaced_ranks, run_pytest

PASSING = 24
WORLD_SIZE = 2
TARGET_RATIO = 20.0

_HEADER = """
import os, sys, unittest
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase, TEST_SKIPS


class Suite(MultiProcessTestCase):
    @property
    def world_size(self):
        return {world_size}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass

    def join_group(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
"""

_PASS = """
    def test_all_reduce_{i:02d}(self):
        self.join_group()
        t = torch.full((4,), float(self.rank + {i}))
        dist.all_reduce(t)
        self.assertEqual(t[0].item(), sum(r + {i} for r in range(self.world_size)))
"""

_SKIPS = """
    def test_skip_no_gpus(self):
        sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)

    def test_skip_no_cuda(self):
        sys.exit(TEST_SKIPS["no_cuda"].exit_code)

    def test_skip_small_world(self):
        sys.exit(TEST_SKIPS["small_worldsize"].exit_code)

    def test_skip_test_here(self):
        self.skipTest("not on this machine")

    def test_skip_test_reason(self):
        self.skipTest("needs a feature")

    @unittest.skip("decorated")
    def test_skip_decorated(self):
        pass
"""

# Green under torch (only rank 0's exit status is read), red under the harness.
FALSE_GREENS = {
    "test_false_green_exit": "rank 1 calls sys.exit(3)",
    "test_false_green_hard_exit": "rank 1 ends with os._exit(0) before the collective",
}
_FALSE_GREENS = """
    def test_false_green_exit(self):
        if self.rank == 1:
            sys.exit(3)

    def test_false_green_hard_exit(self):
        if self.rank == 1:
            os._exit(0)
"""


def suite_source() -> str:
    body = "".join(_PASS.format(i=i) for i in range(PASSING))
    return _HEADER.format(world_size=WORLD_SIZE) + body + _SKIPS + _FALSE_GREENS


def measure() -> tuple[dict[str, Any], dict[str, Any]]:
    source = suite_source()
    as_is = run_pytest(source, ["-p", "harness"])
    adopted = run_pytest(source, ["-p", "harness", "--rank-adopt", "torch"])
    return as_is, adopted


def _short(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


def main() -> list[str]:
    as_is, adopted = measure()
    before, after = as_is["outcomes"], adopted["outcomes"]
    changed = sorted(_short(n) for n in before if before[n] != after.get(n))
    expected = sorted(FALSE_GREENS)
    total_before, total_after = sum(as_is["times"].values()), sum(adopted["times"].values())
    ratio = total_before / total_after if total_after else 0.0
    median_before = statistics.median(as_is["times"].values())
    median_after = statistics.median(adopted["times"].values())
    counts = {o: list(after.values()).count(o) for o in ("passed", "failed", "skipped")}
    lines = [
        f"## Existing suites: {len(before)} MultiProcessTestCase tests, as is and adopted",
        "",
        f"{PASSING} passing tests, 6 skips, 2 false greens; world size {WORLD_SIZE}, gloo.",
        "",
        "| run | all tests | median test | verdicts |",
        "|---|---|---|---|",
        f"| torch, as is | {total_before:.1f} s | {median_before * 1e3:.0f} ms "
        f"| {_counts(before)} |",
        f"| --rank-adopt torch | {total_after:.1f} s | {median_after * 1e3:.0f} ms "
        f"| {_counts(after)} |",
        "",
        f"- verdicts that differ: {', '.join(changed) or 'none'}",
        *(f"  - {name}: {why}" for name, why in FALSE_GREENS.items()),
        f"- {'HOLDS' if changed == expected else 'MISSED'}: the same verdicts except the "
        f"false greens, which turn red",
        f"- {'HOLDS' if ratio >= TARGET_RATIO else 'MISSED'}: at least {TARGET_RATIO:.0f}x "
        f"faster over the whole suite ({ratio:.0f}x; per median test "
        f"{median_before / median_after:.0f}x)",
        f"- adopted: {counts}",
        "",
    ]
    return lines


# torch's own DistributedTest, wrapped as PyTorch's test/distributed/test_distributed_spawn.py
# wraps it (the suite ships in torch's wheel), on 2 ranks as the issue ran it (PyTorch's
# run_test.py uses 3 for gloo on CPU: the same 39 skips, 14.4x). The selection: every test of
# its collectives and point-to-point families (names starting with the operation) but those
# for CUDA or NCCL.
DISTRIBUTED_WORLD_SIZE = 2
DISTRIBUTED_FAMILIES = (
    "all_gather", "all_reduce", "all_to_all", "barrier", "batch_isend_irecv", "broadcast",
    "gather", "irecv", "isend", "reduce", "scatter", "send_recv",
)  # fmt: skip
DISTRIBUTED_TESTS = 105  # what the families hold in torch 2.13 (ci/constraints.txt)
DISTRIBUTED_TARGET = 10.0
DISTRIBUTED_SOURCE = """
import os
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "{world_size}")

from torch.testing._internal.distributed.distributed_test import (
    DistributedTest, TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
"""
# The selection, in a conftest: the class's setUp refers to test methods by name.
DISTRIBUTED_CONFTEST = """
FAMILIES = {families!r}


def selected(name):
    name = name.removeprefix("test_")
    return name.startswith(FAMILIES) and "cuda" not in name and "nccl" not in name


def pytest_collection_modifyitems(config, items):
    items[:] = [item for item in items if selected(item.name)]
"""


def distributed_test() -> list[str]:
    """torch's DistributedTest selection, whole file, as it is and adopted."""
    conftest = DISTRIBUTED_CONFTEST.format(families=DISTRIBUTED_FAMILIES)
    source = DISTRIBUTED_SOURCE.format(world_size=DISTRIBUTED_WORLD_SIZE)
    tests, ranks = DISTRIBUTED_TESTS, DISTRIBUTED_WORLD_SIZE
    title = f"torch's DistributedTest ({tests} tests, {ranks} ranks, gloo)"
    return whole_file(title, source, conftest, tests, DISTRIBUTED_TARGET)


# torch's RPC suites, generated as PyTorch's test/distributed/rpc/test_tensorpipe_agent.py
# generates them (each class mixed with the TensorPipe fixture and the spawning base).
RPC_SOURCE = """
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import (
    GENERIC_TESTS, TENSORPIPE_TESTS, generate_tests,
)

globals().update(
    generate_tests(
        "TensorPipe", TensorPipeRpcAgentTestFixture, GENERIC_TESTS + TENSORPIPE_TESTS, __name__
    )
)
"""
# Fast CPU tests (RPC, RRefs, dist autograd, 4 ranks), by class: names repeat across classes.
RPC_SELECTION = (
    "RpcTest.self_add", "RpcTest.send_to_rank", "RpcTest.add", "RpcTest.add_with_id",
    "RpcTest.scalar_add", "RpcTest.async_add", "RpcTest.nonzero", "RpcTest.multi_rpc",
    "RpcTest.py_built_in", "RpcTest.py_user_defined", "RpcTest.rpc_return_rref",
    "RpcTest.rref_forward_chain", "RpcTest.local_rref_no_fork",
    "RpcTest.profiler_rpc_key_names",  # unittest.skipIf(IS_LINUX)
    "DistAutogradTest.autograd_context", "DistAutogradTest.graph_for_builtin_call",
    "DistAutogradTest.backward_simple", "DistAutogradTest.context_cleanup_tensor_with_grad",
    "TensorPipeAgentRpcTest.infer_backend_from_options",
    # skip_if_lt_x_gpu(2): a skip by the ranks' exit status on CPU
    "TensorPipeAgentRpcTest.dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda",
)  # fmt: skip
RPC_TARGET = 3.0
# generate_tests names each class "TensorPipe" + the suite's class.
CLASS_CONFTEST = """
SELECTED = {selected!r}


def pytest_collection_modifyitems(config, items):
    def key(item):
        suite = item.cls.__name__.removeprefix("TensorPipe") if item.cls else ""
        return f"{{suite}}.{{item.name.removeprefix('test_')}}"

    items[:] = [item for item in items if key(item) in SELECTED]
"""


def rpc_suite() -> list[str]:
    """torch's RPC suites (TensorPipe agent), a CPU selection, as it is and adopted."""
    conftest = CLASS_CONFTEST.format(selected=set(RPC_SELECTION))
    title = f"torch's RPC suites ({len(RPC_SELECTION)} tests, TensorPipe agent, 4 ranks)"
    return whole_file(title, RPC_SOURCE, conftest, len(RPC_SELECTION), RPC_TARGET)


# DDP under dist autograd, generated as test_tensorpipe_agent.py generates these two classes
# of GENERIC_TESTS: the classes need an agent's fixture, which only the generated ones get.
DDP_SOURCE = """
from torch.testing._internal.distributed.ddp_under_dist_autograd_test import (
    DdpComparisonTest, DdpUnderDistAutogradTest,
)
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.distributed.rpc_utils import generate_tests

globals().update(
    generate_tests(
        "TensorPipe",
        TensorPipeRpcAgentTestFixture,
        [DdpUnderDistAutogradTest, DdpComparisonTest],
        __name__,
    )
)
"""
DDP_TESTS = 8  # every test of both classes; all CPU (gloo)
DDP_TARGET = 3.0


def ddp_under_dist_autograd() -> list[str]:
    """torch's DdpUnderDistAutogradTest and DdpComparisonTest, as it is and adopted."""
    title = f"torch's DDP under dist autograd ({DDP_TESTS} tests, 4 and 2 ranks)"
    return whole_file(title, DDP_SOURCE, "", DDP_TESTS, DDP_TARGET)


# ---- one test file, as it is and adopted --------------------------------------------------

FILE_TIMEOUT_S = 900.0
# How long a run may take to exit after its summary before it counts as hung and is killed
# (torch's RPC suites, as they are, were reported hanging there until killed).
EXIT_GRACE_S = 60.0
AS_IS = ("-p", "no:harness", "-W", "ignore")
# torch's suites warn a lot; the harness's replacement warnings are kept for the report.
ADOPTED = ("-p", "harness", "--rank-adopt", "torch", "-W", "ignore")
ADOPTED_WARNINGS = ("-W", "always::harness.RanksReplacedWarning")


@dataclass(frozen=True)
class FileRun:
    """One pytest process on a test file: what the timing conftest found and how it ended."""

    found: dict[str, Any]  # run_pytest's times, outcomes and messages
    summary_s: float  # from the start to the session's end (its summary)
    exit_s: float  # from the start to the process's exit, or to its kill
    hung: bool  # still running EXIT_GRACE_S after its summary, or past FILE_TIMEOUT_S
    summarised: bool  # the session ended (a hung run's verdicts still stand)
    output: str

    def ending(self) -> str:
        after = self.exit_s - self.summary_s
        if not self.summarised:
            return f"no summary: {'killed' if self.hung else 'ended'} after {self.exit_s:.0f} s"
        if self.hung:
            return f"hung at exit, killed after {after:.0f} s"
        return "exited at once" if after < 2 else f"exited {after:.0f} s after its summary"


def run_file(source: str, args: list[str], conftest: str) -> FileRun:
    """run_pytest, but a process that hangs after its summary is killed and reported, not
    raised: the summary's verdicts stand."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(TIMING_CONFTEST + textwrap.dedent(conftest))
        (folder / "test_bench.py").write_text(textwrap.dedent(source))
        times, log = folder / "times.json", folder / "output.txt"
        env = {**os.environ, "BENCH_TIMES": str(times), "PYTHONDONTWRITEBYTECODE": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, tmp]
        with log.open("w") as out:
            start = time.perf_counter()
            # A session of its own: a kill reaches the ranks it spawned too.
            proc = subprocess.Popen(
                command, cwd=folder, env=env, stdout=out, stderr=out, start_new_session=True
            )
            summary_s = _until_summary(proc, times, start)
            hung = _ended_or_killed(proc, max(0.0, FILE_TIMEOUT_S - summary_s))
            exit_s = time.perf_counter() - start
        summarised = times.exists()
        found = json.loads(times.read_text()) if summarised else {}
        empty: dict[str, Any] = {"times": {}, "outcomes": {}, "messages": {}}
        return FileRun({**empty, **found}, summary_s, exit_s, hung, summarised, log.read_text())


def _until_summary(proc: subprocess.Popen[bytes], times: Path, start: float) -> float:
    """Seconds until the timing conftest wrote its file (the session ended) or `proc` ended."""
    while not times.exists() and proc.poll() is None:
        if time.perf_counter() - start > FILE_TIMEOUT_S:
            break
        time.sleep(0.05)
    return time.perf_counter() - start


def _ended_or_killed(proc: subprocess.Popen[bytes], left_s: float) -> bool:
    """Wait for `proc` to exit; True when it had to be killed."""
    try:
        proc.wait(timeout=min(EXIT_GRACE_S, left_s))
        return False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def whole_file(title: str, source: str, conftest: str, tests: int, target: float) -> list[str]:
    """The markdown section for one test file run as it is and adopted, one after the other."""
    before = run_file(source, list(AS_IS), conftest)
    after = run_file(source, [*ADOPTED, *ADOPTED_WARNINGS], conftest)
    outcomes_before, outcomes_after = before.found["outcomes"], after.found["outcomes"]
    same = outcomes_before == outcomes_after and len(outcomes_before) == tests
    ratio = before.summary_s / after.summary_s if after.summary_s else 0.0
    return [
        f"## {title}, whole file",
        "",
        "| run | to its summary (pytest's start included) | to its exit "
        "| median test (fastest passing) "
        "| verdicts |",
        "|---|---|---|---|---|",
        _row("as it is", before),
        _row("--rank-adopt torch", after),
        "",
        f"- as it is: {before.ending()}; adopted: {after.ending()}",
        f"- {'HOLDS' if same else 'MISSED'}: the same verdicts",
        *_differences(before, after),
        f"- {'HOLDS' if ratio >= target else 'MISSED'}: at least {target:.0f}x faster over "
        f"the whole file, to its summary ({ratio:.1f}x)",
        _passed_only(before, after),
        f"- replaced ranks: {replaced_ranks(after.output)}",
        "",
    ]


def _passed_only(before: FileRun, after: FileRun) -> str:
    """The whole file as if it held only the tests that passed in both runs: a skip costs
    torch a spawn but the adopted run almost nothing, so skips flatter the whole-file ratio.
    Each run keeps what is not a test's own time (pytest's start, collection and end)."""
    passed = [
        nodeid
        for nodeid, outcome in before.found["outcomes"].items()
        if outcome == "passed" and after.found["outcomes"].get(nodeid) == "passed"
    ]
    was, now = (_without_others(run, passed) for run in (before, after))
    ratio = f"{was / now:.1f}x" if now else "n/a"
    return (
        f"- without the tests not passed in both (skips): {was:.1f} s as it is, {now:.1f} s "
        f"adopted, {ratio} (the {len(passed)} tests that passed in both, with each run's "
        f"pytest start, collection and end)"
    )


def _without_others(run: FileRun, kept: list[str]) -> float:
    """`run`'s time to its summary less the tests not in `kept`."""
    times: dict[str, float] = run.found["times"]
    return run.summary_s - sum(s for nodeid, s in times.items() if nodeid not in kept)


def _row(name: str, run: FileRun) -> str:
    times = run.found["times"]
    median = statistics.median(times.values()) if times else 0.0
    outcomes = run.found["outcomes"]
    fastest = min((s for n, s in times.items() if outcomes.get(n) == "passed"), default=0.0)
    return (
        f"| {name} | {run.summary_s:.1f} s | {run.exit_s:.1f} s | {median * 1e3:.0f} ms "
        f"({fastest * 1e3:.0f} ms) "
        f"| {_counts(run.found['outcomes'])} |"
    )


def _differences(before: FileRun, after: FileRun) -> list[str]:
    """One line per test whose verdict differs, with the adopted run's failure message."""
    was, now = before.found["outcomes"], after.found["outcomes"]
    lines = []
    for nodeid in sorted(set(was) | set(now)):
        if was.get(nodeid) != now.get(nodeid):
            message = after.found["messages"].get(nodeid, "")
            lines.append(
                f"  - {_short(nodeid)}: {was.get(nodeid, 'not run')} as it is, "
                f"{now.get(nodeid, 'not run')} adopted{': ' + message if message else ''}"
            )
    return lines


def _counts(outcomes: dict[str, str]) -> str:
    values = list(outcomes.values())
    return ", ".join(f"{values.count(o)} {o}" for o in ("passed", "failed", "skipped"))


SUITES: dict[str, Callable[[], list[str]]] = {
    "synth": main,
    "distributed": distributed_test,
    "rpc": rpc_suite,
    "ddp": ddp_under_dist_autograd,
}


def _cli() -> None:
    parser = argparse.ArgumentParser(description="existing suites, as they are and adopted")
    parser.add_argument("--suite", choices=[*SUITES, "deepspeed", "all"], default="all")
    parser.add_argument("--deepspeed-src", help="a DeepSpeed checkout (for --suite deepspeed)")
    parser.add_argument("--python", help="the Python that runs DeepSpeed's tests (default: this)")
    options = parser.parse_args()
    lines: list[str] = []
    for name, suite in SUITES.items():
        if options.suite in (name, "all"):
            lines += suite()
            print("\n".join(lines), flush=True)
    if options.suite == "deepspeed" or (options.suite == "all" and options.deepspeed_src):
        from benchmarks.adopt_deepspeed import deepspeed_suite

        found = deepspeed_suite(options.deepspeed_src, options.python)
        print("\n".join(found), flush=True)
        lines += found
    sys.exit(1 if missed(lines) else 0)


if __name__ == "__main__":
    _cli()
