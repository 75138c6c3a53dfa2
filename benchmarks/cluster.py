"""Per-test overhead of launched ranks (torchrun, one agent per node, c10d rendezvous) against
the same tests on warm ranks, at 2x2, 3x2 and 4x4 ranks, and how each grows with ranks.

Each shape runs one suite of trivial ranks tests (an all_reduce and an assert) twice in the
same run: under torchrun with `nodes` agents of `per_node` ranks each on this machine (loopback;
the agents are the nodes), and as a plain session on warm ranks (`--ranks nodes*per_node`).
Measured: each test's wall time on rank 0 (set-up, call and teardown; the first test, which
sets the group up, left out), its median, and the launched/warm ratio. With 2 cores, 16 ranks
oversubscribe the CPU several times: compare within a row, and the growth across rows.

`python -m benchmarks.cluster --namespaces` runs the launched side on the cluster `make
test-cluster` builds instead (keep it up with `CLUSTER_KEEP=1 bash ci/cluster`; CLUSTER_DIR
names it): one agent per node, each node a network namespace with an address of its own, so
the store's traffic crosses a bridge rather than loopback.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from benchmarks._common import TIMING_CONFTEST, print_and_exit

SHAPES = ((2, 2), (4, 2), (4, 4))  # (nodes, ranks per node): 4, 8 and 16 ranks
TARGET_RATIO = 2.0  # launched / warm at 2x2, at most
TARGET_GROWTH = 1.5  # launched growth from 4 to 16 ranks / warm growth, at most
TESTS = 30
ROUNDS = 3  # sessions of each side per shape, launched and warm in turn
BOUND_S = 900  # one session, a safety net far above its minute

SUITE = f"""
import pytest, torch, torch.distributed as dist

@pytest.mark.ranks
@pytest.mark.parametrize("i", range({TESTS}))
def test_trivial(rank, world_size, i):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
"""
# Rank 0 alone records the times under a launch (every rank runs every test).
CONFTEST = TIMING_CONFTEST.replace(
    "def pytest_sessionfinish(session):\n",
    "def pytest_sessionfinish(session):\n    _save_store_operations()\n"
    "    if os.environ.get('RANK', '0') != '0':\n        return\n",
)
# Under a launch, each rank counts the operations its main thread sends to the launch's store
# during each test (set-up, call, teardown; the heartbeat thread's, one a second, left out)
# and saves them as ops-<rank>.json beside the times.
CONFTEST += """
import threading

_operations = {"now": 0}
_per_test = {}

try:
    from harness.launched import store as _store
except ImportError:
    _store = None
if _store is not None and "RANK" in os.environ:
    _answered = _store.Peers._answered

    def _counted(self, operation, undone):
        if threading.current_thread() is threading.main_thread():
            _operations["now"] += 1
        return _answered(self, operation, undone)

    _store.Peers._answered = _counted
    _drop = _store.Peers.drop

    def _counted_drop(self, keys):  # deletes, one operation each (the heartbeat thread sends them)
        _operations["now"] += len(keys)
        return _drop(self, keys)

    _store.Peers.drop = _counted_drop


class _CountPerTest:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = _operations["now"]
        yield
        _per_test[item.nodeid] = _operations["now"] - before


def pytest_configure(config):
    config.pluginmanager.register(_CountPerTest(), "bench-store-operations")


def _save_store_operations():
    if "RANK" in os.environ:
        folder = os.path.dirname(os.environ["BENCH_TIMES"])
        with open(os.path.join(folder, f"ops-{os.environ['RANK']}.json"), "w") as f:
            json.dump(list(_per_test.values()), f)
"""


def _folder(parent: Path, name: str) -> Path:
    folder = parent / name
    folder.mkdir()
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_suite.py").write_text(textwrap.dedent(SUITE))
    return folder


def _env(times: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    return {**env, "BENCH_TIMES": str(times), "OMP_NUM_THREADS": "1"}


SUBNET = "10.213.47"  # ci/cluster's: node i is SUBNET.i, inside its namespaces only


def _on_node(index: int, argv: list[str]) -> list[str]:
    """`argv` run on the lane's node n<index+1>: its network namespace and hostname."""
    node = f"n{index + 1}"
    hosts = Path(os.environ["CLUSTER_DIR"]) / "hosts"
    script = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
    return ["nsenter", f"--net=/run/netns/rw-{node}", "unshare", "--uts", "--mount",
            "sh", "-c", script, node, str(hosts), *argv]  # fmt: skip


def launched(
    folder: Path, nodes: int, per_node: int, port: int, namespaces: bool = False
) -> list[float]:
    """Each test's time on rank 0 of a torchrun launch of `nodes` agents: on this machine
    (loopback), or one on each of the lane's namespace nodes."""
    times = folder / "times.json"
    host = f"{SUBNET}.1" if namespaces else "127.0.0.1"
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={host}:{port}", f"--rdzv-id=bench-{port}",
        "-m", "pytest", "-q", "-p", "harness", "-p", "no:cacheprovider", ".",
    ]  # fmt: skip
    quiet = subprocess.DEVNULL
    agents = [
        subprocess.Popen(
            _on_node(i, command) if namespaces else command,
            cwd=folder,
            env=_env(times),
            stdout=quiet,
            stderr=quiet,
        )
        for i in range(nodes)
    ]
    for agent in agents:
        agent.wait(timeout=BOUND_S)
    return _times(times)


def warm(folder: Path, ranks: int) -> list[float]:
    times = folder / "times.json"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "harness", "-p", "no:cacheprovider",
         f"--ranks={ranks}", "."],
        cwd=folder, env=_env(times), timeout=BOUND_S, check=False, capture_output=True,
    )  # fmt: skip
    return _times(times)


def _times(path: Path) -> list[float]:
    if not path.exists():
        return []
    found = json.loads(path.read_text())
    assert all(o == "passed" for o in found["outcomes"].values()), found["outcomes"]
    return list(found["times"].values())[1:]  # the first test sets the group up


def _operations(folder: Path, ranks: int) -> tuple[float, int] | None:
    """The store operations per test per rank under a launch: the median over ranks of each
    rank's median (the first test left out), and the most any rank sent for one test."""
    medians, most = [], 0
    for rank in range(ranks):
        path = folder / f"ops-{rank}.json"
        if not path.exists():
            return None
        counts = json.loads(path.read_text())[1:]
        if not counts:
            return None
        medians.append(statistics.median(counts))
        most = max(most, *counts)
    return statistics.median(medians), most


def main(namespaces: bool = False) -> list[str]:
    where = (
        "one agent on each of the lane's namespace nodes (own addresses, a bridge between)"
        if namespaces
        else "one agent per node on this machine (loopback)"
    )
    lines = [
        "",
        "## Launched ranks against warm ranks (`benchmarks/cluster.py`)",
        "",
        f"A suite of {TESTS} trivial ranks tests (all_reduce, assert), per test on rank 0 "
        f"(median over {ROUNDS} sessions of each side, run in turn; each session's first test "
        f"left out), under torchrun with {where}, and on warm ranks:",
        "",
        "| nodes x ranks | launched (torchrun) | warm ranks | launched / warm | store "
        "operations per test per rank (median; most) |",
        "|---|---|---|---|---|",
    ]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        for i, (nodes, per_node) in enumerate(SHAPES):
            ranks = nodes * per_node
            out: list[float] = []
            here: list[float] = []
            ops = None
            for round_ in range(ROUNDS):  # alternating: a busy spell hits both sides alike
                folder = _folder(Path(tmp), f"launched-{i}-{round_}")
                out += launched(folder, nodes, per_node, 29630 + i * ROUNDS + round_, namespaces)
                here += warm(_folder(Path(tmp), f"warm-{i}-{round_}"), ranks)
                ops = _operations(folder, ranks) or ops
            if not out or not here:
                lines.append(f"| {nodes}x{per_node} | no result | no result | - | - |")
                continue
            a, b = statistics.median(out), statistics.median(here)
            rows.append((ranks, a, b))
            counted = "-" if ops is None else f"{ops[0]:g}; {ops[1]}"
            lines.append(
                f"| {nodes}x{per_node} ({ranks}) | {a * 1e3:.1f} ms | {b * 1e3:.1f} ms | "
                f"{a / b:.2f}x | {counted} |"
            )
    lines.append("")
    if rows and rows[0][0] == 4 and rows[0][1] / rows[0][2] > TARGET_RATIO:
        lines.append(f"- MISSED: launched / warm at 2x2 is above {TARGET_RATIO:g}x")
    if len(rows) >= 2:
        (r0, a0, b0), (r1, a1, b1) = rows[0], rows[-1]
        growth = (a1 / a0) / (b1 / b0)
        lines.append(
            f"From {r0} to {r1} ranks the launched per-test time grows {a1 / a0:.1f}x and the "
            f"warm one {b1 / b0:.1f}x ({r1 / r0:.0f}x the ranks; 2 cores): {growth:.2f}x "
            f"warm's growth (target: at most {TARGET_GROWTH:g}x)."
        )
        if growth > TARGET_GROWTH:
            lines.append(f"- MISSED: launched growth above {TARGET_GROWTH:g}x warm's")
    return lines


if __name__ == "__main__":
    on_namespaces = "--namespaces" in sys.argv[1:]
    if on_namespaces and not (Path(os.environ.get("CLUSTER_DIR", "/-")) / "hosts").exists():
        sys.exit("benchmarks.cluster --namespaces: no cluster (CLUSTER_KEEP=1 bash ci/cluster)")
    print_and_exit(main(on_namespaces))
