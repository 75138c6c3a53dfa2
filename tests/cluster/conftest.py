"""The cluster `make test-cluster` builds (ci/cluster), as the tests here use it: run a
command on a node, lose a node, cut its link, and see what is left running on each.

A node is a network namespace (rw-n1 ... rw-n4) with an address on a bridge of its own; a
command runs there with the node's hostname and the cluster's /etc/hosts. Outside that lane
there is no cluster, and every test here is skipped, saying so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

NODES = ("n1", "n2", "n3", "n4")
SUBNET = "10.213.47"  # ci/cluster's: node i is SUBNET.i, inside the lane's namespaces only
DAEMONS = ("slurmd", "slurmctld", "slurmscriptd", "slurmstepd")  # the cluster's, not a test's
PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[2]


def address(node: str) -> str:
    return f"{SUBNET}.{NODES.index(node) + 1}"


@dataclass
class Cluster:
    directory: Path

    @property
    def env(self) -> dict[str, str]:
        """This environment for a command on a node: SLURM's config, the venv first on PATH,
        one thread per rank (2 cores), nothing of this pytest session's."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
        env["SLURM_CONF"] = str(self.directory / "slurm.conf")
        env["PATH"] = f"{Path(PYTHON).parent}:{env.get('PATH', '')}"
        env["OMP_NUM_THREADS"] = "1"
        return env

    def command(self, node: str, argv: list[str]) -> list[str]:
        """`argv` as run on `node`: its network namespace, its hostname, the cluster's hosts."""
        script = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
        return [
            "nsenter", f"--net=/run/netns/rw-{node}", "unshare", "--uts", "--mount",
            "sh", "-c", script, node, str(self.directory / "hosts"), *argv,
        ]  # fmt: skip

    def start(
        self, node: str, argv: list[str], cwd: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Start `argv` on `node` in a session of its own, its output in a pipe."""
        return subprocess.Popen(
            self.command(node, argv),
            cwd=cwd,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def slurm_ready(self, bound_s: float = 180.0) -> None:
        """Every node up in SLURM. A node whose link a test cut is marked down by slurmctld,
        and with ReturnToService=2 comes back only as it registers again, at slurmctld's
        next ping (up to 100 s later): a srun started before then waits in the queue. Down
        nodes are resumed here, and SLURM's word on them awaited (a bound)."""
        deadline = time.monotonic() + bound_s
        while True:
            states = self._slurm_states()
            down = [node for node, state in states.items() if state not in _SLURM_UP]
            if not down:
                return
            assert time.monotonic() < deadline, f"SLURM's nodes not up in {bound_s:g} s: {states}"
            for node in [node for node in down if state_needs_resume(states[node])]:
                resume = ["scontrol", "update", f"NodeName={node}", "State=RESUME"]
                subprocess.run(
                    self.command("n1", resume),
                    env=self.env, capture_output=True, timeout=60, check=False,
                )  # fmt: skip
            time.sleep(1.0)  # a poll of SLURM's state, not a wait in its place

    def _slurm_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it ("idle", "down*": '*' for not responding)."""
        out = subprocess.run(
            self.command("n1", ["sinfo", "-h", "-N", "-o", "%N %T"]),
            env=self.env, capture_output=True, text=True, timeout=60, check=False,
        ).stdout  # fmt: skip
        found = dict(line.split(maxsplit=1) for line in out.splitlines() if " " in line.strip())
        return {node: found.get(node, "unknown").strip().lower() for node in NODES}

    def processes(self, node: str) -> dict[int, str]:
        """What runs on `node` besides the cluster's daemons: {pid: command}."""
        found = {}
        pids = subprocess.run(
            ["ip", "netns", "pids", f"rw-{node}"], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in map(int, pids):
            with contextlib.suppress(OSError):
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                if name not in DAEMONS:
                    found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        return {pid: cmd.decode(errors="replace")[:200] for pid, cmd in found.items()}

    def lose(self, node: str) -> None:
        """The node goes down: every process on it but the cluster's daemons killed at once."""
        for pid in self.processes(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def freeze(self, node: str) -> None:
        """The node stops: every process on it but the cluster's daemons stopped (SIGSTOP),
        its connections open and silent."""
        for pid in self.processes(node):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def cut(self, node: str) -> None:
        """Its link goes down: its processes live on, reaching no one (nor reached)."""
        subprocess.run(["ip", "-n", f"rw-{node}", "link", "set", "eth0", "down"], check=True)

    def mend(self, node: str) -> None:
        subprocess.run(["ip", "-n", f"rw-{node}", "link", "set", "eth0", "up"], check=True)

    def wait_quiet(self, timeout: float) -> dict[str, dict[int, str]]:
        """Wait until nothing of the tests runs on any node (a bound); what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = {node: self.processes(node) for node in NODES}
            left = {node: procs for node, procs in left.items() if procs}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    directory = os.environ.get("CLUSTER_DIR", "")
    if not directory or not (Path(directory) / "slurm.conf").exists():
        pytest.skip("no cluster here: `make test-cluster` builds one (ci/cluster) and runs these")
    found = Cluster(Path(directory))
    yield found
    for node in NODES:  # a test that failed midway leaves no link down, nothing running
        with contextlib.suppress(Exception):
            found.mend(node)
            found.lose(node)


_SLURM_UP = ("idle", "mixed", "allocated", "completing")


def state_needs_resume(state: str) -> bool:
    """Whether a node in `state` comes back only when told (down or drained)."""
    return any(word in state for word in ("down", "drain", "fail"))


@pytest.fixture
def quiet_after(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, checked after the test: nothing of it left running on any node; every
    node up in SLURM before it (a link cut by an earlier test leaves its node down there)."""
    for node in NODES:
        cluster.mend(node)
    cluster.slurm_ready()
    yield cluster
    left = cluster.wait_quiet(240)  # a cut node's torchrun agent ends as TCP gives up (~100 s)
    for node in NODES:
        cluster.mend(node)
        cluster.lose(node)
    assert not left, f"left running after the test: {left}"
