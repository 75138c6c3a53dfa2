"""The harness across nodes, on the cluster `make test-cluster` builds (network namespaces as
nodes, Debian's SLURM, torchrun's c10d rendezvous across them).

Faults across nodes, each bounded (the launches docs/clusters.md shows are run in
test_docs.py): a node killed, frozen or cut off mid-collective, at 2, 3 and 4 nodes, whichever
node it is; a link cut mid-rendezvous; a remote rank's segfault; one rank hung alone; a node
that collects other tests, a node with another rankwise. Each gives, on every surviving node,
a verdict naming what failed; no INTERNALERROR, no C++ frames from a rank, torchrun's error
files written, nothing left running on any node.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.conftest import NODES, PYTHON, Cluster, address

pytestmark = pytest.mark.cluster

BOUND_S = 300  # one launch, start to end, on 2 cores: far above its normal half minute
TIMEOUT = 30  # the tests' own timeout in the fault scenarios (--rank-timeout)

TESTS = """
import os, socket, time
from pathlib import Path
import pytest, torch, torch.distributed as dist

MARKS = Path(os.environ["MARKS"])

def wait_for(name, bound=120):
    deadline = time.monotonic() + bound
    while not (MARKS / name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)

@pytest.mark.ranks
def test_first(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size

@pytest.mark.ranks
def test_mid(rank, world_size):
    (MARKS / f"in-{rank}").write_text(socket.gethostname())
    victims = os.environ.get("VICTIM_RANKS", "").split()
    if str(rank) in victims:
        wait_for("never")  # the node this test loses: it never reaches the collective
    wait_for("go")  # every survivor in the collective before the loss
    t = torch.ones(1)
    dist.all_reduce(t)

@pytest.mark.ranks
def test_after(rank):
    dist.barrier()
"""


@dataclass
class Node:
    name: str
    code: int
    output: str
    log_dir: Path
    took: float = 0.0  # when its agent ended (time.monotonic())

    def error_files(self) -> list[dict[str, object]]:
        """torchrun's error files its workers wrote (under --log-dir)."""
        return [json.loads(p.read_text()) for p in sorted(self.log_dir.rglob("error.json"))]


def _torchrun(
    nodes: int, per_node: int, endpoint: str, log_dir: Path, *pytest_args: str
) -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run", f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=cluster-test", f"--log-dir={log_dir}", "--tee=3",
        "-m", "pytest", "-p", "harness", "-p", "no:cacheprovider", "-v", "-rA",
        f"--rank-timeout={TIMEOUT}", *pytest_args,
    ]  # fmt: skip


def _marks(tmp_path: Path) -> Path:
    marks = tmp_path / "marks"
    marks.mkdir()
    return marks


def _wait_for(path: Path, count: int, pattern: str = "in-*") -> None:
    deadline = time.monotonic() + BOUND_S
    while len(list(path.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"{count} ranks never reached {pattern}"
        time.sleep(0.1)


def _agents(
    cluster: Cluster, tmp_path: Path, nodes: tuple[str, ...], env: dict[str, str],
    pytest_args: tuple[str, ...] = (), per_node: int = 2,
) -> dict[str, subprocess.Popen[str]]:  # fmt: skip
    """One torchrun agent per node, all meeting at the first node's address."""
    endpoint = f"{address(nodes[0])}:29611"
    procs = {}
    for node in nodes:
        argv = _torchrun(len(nodes), per_node, endpoint, tmp_path / f"logs-{node}", *pytest_args)
        procs[node] = cluster.start(node, argv, tmp_path, env)
    return procs


def _ends(
    procs: dict[str, subprocess.Popen[str]], tmp_path: Path, workers_of: Cluster | None = None
) -> dict[str, Node]:
    """Every agent's end, each with when it came (the output is read by a thread per agent,
    so that one node's wait never delays noting another's end). With `workers_of`, a node
    ends when its workers have (its agent, left waiting on a frozen rendezvous, is killed)."""
    deadline = time.monotonic() + BOUND_S
    outputs: dict[str, list[str]] = {node: [] for node in procs}
    readers = [
        threading.Thread(target=lambda p=proc, o=outputs[node]: o.extend(p.stdout or []))
        for node, proc in procs.items()
    ]
    for reader in readers:
        reader.start()
    ended: dict[str, float] = {}
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for node, proc in procs.items():
            if node not in ended and (proc.poll() is not None or _workers_gone(workers_of, node)):
                ended[node] = time.monotonic()
        time.sleep(0.1)
    for proc in procs.values():  # every agent ended or killed before any output is joined
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    for reader in readers:
        reader.join(10)
    found = {}
    for node, proc in procs.items():
        if proc.stdout:
            proc.stdout.close()
        text = "".join(outputs[node])
        if node not in ended:
            text += f"\n(the agent on {node} did not end within {BOUND_S} s)"
        log_dir = tmp_path / f"logs-{node}"
        found[node] = Node(node, proc.returncode, text, log_dir, ended.get(node, time.monotonic()))
    return found


def _workers_gone(cluster: Cluster | None, node: str) -> bool:
    """Whether no pytest worker runs on `node` any more (never, without a cluster given)."""
    if cluster is None:
        return False
    return not any("-m pytest" in cmd for cmd in cluster.processes(node).values())


def _clean(node: Node) -> None:
    """What every node's output must never hold."""
    assert "INTERNALERROR" not in node.output, node.output[-6000:]
    logs = sorted(node.log_dir.rglob("std*.log"))  # --tee: what the ranks wrote, apart
    assert logs, f"no rank logs under {node.log_dir}"
    workers = "".join(p.read_text(errors="replace") for p in logs)
    assert "frame #" not in workers, workers[-6000:]


def _worker_output(node: Node) -> str:
    """What the workers printed on `node` (stdout and stderr; under --log-dir they go there)."""
    return node.output + "".join(
        p.read_text(errors="replace") for p in sorted(node.log_dir.rglob("std*.log"))
    )


# ---- launches that give one verdict ---------------------------------------------------------


# One failing test and two passing, at any world size: "1 failed, 2 passed", naming rank 3.
ONE_VERDICT = """
    import pytest, torch, torch.distributed as dist

    @pytest.mark.ranks
    def test_sum(rank, world_size):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world_size

    @pytest.mark.ranks
    def test_rank_3_fails(rank):
        assert rank != 3

    def test_plain():
        pass
"""


MPI_AGENT = """#!/bin/sh
# OpenMPI's rsh agent on this cluster: "ssh" into a node is entering its namespaces.
node=$1; shift
exec nsenter --net=/run/netns/rw-$node unshare --uts --mount sh -c \\
    'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec sh -c "$*"' \\
    "$node" "{hosts}" "$@"
"""


def _mpirun(cluster: Cluster, tmp_path: Path, hosts: str, ranks: int, *extra: str) -> str:
    agent = tmp_path / "mpi-agent"
    agent.write_text(MPI_AGENT.format(hosts=cluster.directory / "hosts"))
    agent.chmod(0o755)
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks),
            "--host", hosts, "--mca", "plm_rsh_agent", str(agent), "-x", "PATH", "-x",
            "OMP_NUM_THREADS", "--mca", "btl_tcp_if_include", "eth0", "--mca",
            "oob_tcp_if_include", "eth0", *extra, PYTHON, "-m", "pytest", "-p", "harness",
            "-p", "no:cacheprovider", "-rA", "--color=no", "test_one.py"]  # fmt: skip
    proc = cluster.start("n1", argv, tmp_path)
    out, _ = proc.communicate(timeout=BOUND_S)
    return out


def test_mpirun_across_nodes_without_master_addr_says_what_to_do(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "test_one.py").write_text(textwrap.dedent(ONE_VERDICT))
    out = _mpirun(quiet_after, tmp_path, "n1:2,n2:2", 4)
    assert "MASTER_ADDR is not set" in out and "mpirun -x MASTER_ADDR=" in out, out[-4000:]
    assert "test session starts" not in out


# ---- faults across nodes ----------------------------------------------------------------------


GRACE_S = 60  # docs/clusters.md: a lost node is named within the test's timeout plus this


@dataclass
class Layout:
    """A launch of `count` nodes (2 ranks each) and the node lost in it."""

    count: int
    victim: int  # index of the lost node

    @property
    def nodes(self) -> tuple[str, ...]:
        return NODES[: self.count]

    @property
    def lost(self) -> str:
        return self.nodes[self.victim]

    @property
    def ranks(self) -> str:
        first = 2 * self.victim
        return f"ranks {first}, {first + 1}"


# Every node count the lane has, each with rank 0's node and the last lost, and a middle one
# at 3 nodes (at 4 it is found as at 3: the lane's time goes to the other cases).
LAYOUTS = [Layout(2, 0), Layout(2, 1), Layout(3, 0), Layout(3, 1), Layout(3, 2),
           Layout(4, 0), Layout(4, 3)]  # fmt: skip


def _layout_id(layout: Layout) -> str:
    where = "rank 0's" if layout.victim == 0 else (
        "the last" if layout.victim == layout.count - 1 else "a middle")  # fmt: skip
    return f"{layout.count} nodes, {where} node"


def _lose_mid_test(
    cluster: Cluster, tmp_path: Path, nodes: tuple[str, ...], victim: str, how: str
) -> tuple[dict[str, Node], float]:
    """Start one agent per node; once every rank is in test_mid (the victim's ranks short of
    its collective, the others in it), lose the victim node (`how`: "lose", "freeze" or
    "cut"). Every surviving node's end, and when the loss came."""
    (tmp_path / "test_nodes.py").write_text(TESTS)
    marks = _marks(tmp_path)
    index = nodes.index(victim)
    victims = " ".join(str(r) for r in range(2 * index, 2 * index + 2))
    env = {"MARKS": str(marks), "VICTIM_RANKS": victims}
    procs = _agents(cluster, tmp_path, nodes, env, ("test_nodes.py",))
    _wait_for(marks, 2 * len(nodes))
    (marks / "go").touch()  # the survivors enter the collective; the victim's ranks do not
    time.sleep(1.0)  # let them reach it: the loss is to come mid-collective (a pause, not a wait)
    getattr(cluster, how)(victim)
    lost_at = time.monotonic()
    survivors = {node: proc for node, proc in procs.items() if node != victim}
    # torchrun's agents wait on a frozen rendezvous host without a bound, and on a cut one
    # until TCP gives up (docs/limits.md): there, a node ends when its ranks have
    rendezvous_unheard = how in ("freeze", "cut") and victim == nodes[0]
    ends = _ends(survivors, tmp_path, cluster if rendezvous_unheard else None)
    cluster.mend(victim)
    cluster.lose(victim)  # a frozen or cut node's processes need not end by themselves
    procs[victim].communicate(timeout=BOUND_S)
    return ends, lost_at


@pytest.mark.parametrize("how", ["lose", "freeze", "cut"], ids=["killed", "frozen", "link cut"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_a_lost_node_is_named_on_every_surviving_node(
    quiet_after: Cluster, tmp_path: Path, layout: Layout, how: str
) -> None:
    """Every surviving node, whichever node is lost and however: a verdict naming the lost
    node and its ranks within the test's timeout plus the grace, its error files written,
    torchrun's root cause naming it, and one exit status."""
    ends, lost_at = _lose_mid_test(quiet_after, tmp_path, layout.nodes, layout.lost, how)
    wrong = {name: _survivor_wrongs(node, layout, lost_at) for name, node in ends.items()}
    wrong = {name: found for name, found in wrong.items() if found}
    assert not wrong, "\n\n".join(f"{name}: " + "\n".join(found) for name, found in wrong.items())
    if not (how in ("freeze", "cut") and layout.victim == 0):  # agents killed (docs/limits.md)
        assert {node.code for node in ends.values()} == {1}, {n: e.code for n, e in ends.items()}


def _survivor_wrongs(node: Node, layout: Layout, lost_at: float) -> list[str]:
    """What a surviving node got wrong about the lost one (nothing, if all is well)."""
    said, wrong = _worker_output(node), []
    if not re.search(rf"node \d \(host {layout.lost}\) was lost.*\({layout.ranks}\)", said):
        wrong.append(f"no verdict naming {layout.lost} ({layout.ranks}): {said[-3000:]}")
    logs = sorted(node.log_dir.rglob("std*.log"))  # --tee: what the ranks wrote, apart
    workers = "".join(p.read_text(errors="replace") for p in logs)
    if "INTERNALERROR" in said or "frame #" in workers or not logs:
        wrong.append(f"INTERNALERROR, or C++ frames from a rank: {said[-3000:]}")
    if node.took - lost_at > TIMEOUT + GRACE_S:
        wrong.append(f"ended {node.took - lost_at:.0f} s after the loss")
    files = node.error_files()
    if len(files) != 2 or not all(f"(host {layout.lost})" in json.dumps(f) for f in files):
        wrong.append(f"error files: {files}")
    if layout.victim == 0:
        return wrong  # torchrun's agents lost their rendezvous: no summary (docs/limits.md)
    cause = node.output.split("Root Cause (first observed failure):", 1)[-1].split("=====", 1)[0]
    if "error_file: <N/A>" in cause or f"(host {layout.lost})" not in cause:
        wrong.append(f"torchrun's root cause: {cause}")
    return wrong


FAULTS = """
import ctypes, os
from pathlib import Path
import pytest, torch, torch.distributed as dist

VICTIM = int(os.environ["VICTIM_RANK"])

@pytest.mark.ranks
def test_crash(rank):
    dist.barrier()
    (Path(os.environ["MARKS"]) / f"in-{rank}").touch()
    if rank == VICTIM:
        ctypes.string_at(0)  # SIGSEGV
    t = torch.ones(1)
    dist.all_reduce(t)

@pytest.mark.ranks
def test_alone(rank):
    if rank == VICTIM:
        t = torch.ones(1)
        dist.all_reduce(t)  # alone: every other rank returned
"""

LONG_TIMEOUT = 120  # the crash tests': a verdict well inside it came from the crash, not it


@pytest.mark.parametrize(
    ("count", "victim"), [(2, 1), (2, 2), (3, 2), (3, 4), (4, 6)],
    ids=["2 nodes, rank 0's node's", "2 nodes, the last node's", "3 nodes, a middle node's",
         "3 nodes, the last node's", "4 nodes, the last node's"],
)  # fmt: skip
def test_a_remote_segfault_is_named_by_its_signal_on_every_node(
    quiet_after: Cluster, tmp_path: Path, count: int, victim: int
) -> None:
    """A rank on another node dies of SIGSEGV: every node's verdict names the rank and the
    signal well inside the test's timeout (the rank beside it on its node says so)."""
    (tmp_path / "test_faults.py").write_text(FAULTS)
    marks = _marks(tmp_path)
    env = {"MARKS": str(marks), "VICTIM_RANK": str(victim)}
    args = ("test_faults.py", "-k", "crash", f"--rank-timeout={LONG_TIMEOUT}")
    procs = _agents(quiet_after, tmp_path, NODES[:count], env, args)
    _wait_for(marks, 2 * count)
    crashed_at = time.monotonic()
    ends = _ends(procs, tmp_path)
    for name, node in ends.items():
        said = _worker_output(node)
        assert f"rank {victim} failed: died of SIGSEGV" in said, (name, said[-4000:])
        assert node.took - crashed_at < LONG_TIMEOUT / 2, (name, node.took - crashed_at)
        _clean(node)
    assert "FAILED test_faults.py::test_crash" in _worker_output(ends["n1"])
    assert {node.code for node in ends.values()} == {1}, {n: e.code for n, e in ends.items()}


@pytest.mark.parametrize(
    ("count", "victim"), [(2, 3), (3, 2), (4, 6)],
    ids=["2 nodes, the last node's", "3 nodes, a middle node's", "4 nodes, the last node's"],
)  # fmt: skip
def test_a_rank_hung_alone_is_the_root_cause_with_its_stack(
    quiet_after: Cluster, tmp_path: Path, count: int, victim: int
) -> None:
    """One rank waits in all_reduce while every other rank returned: the report blames it
    alone and shows its stack without -v; torchrun's root cause on its node is that rank."""
    (tmp_path / "test_faults.py").write_text(FAULTS)
    env = {"MARKS": str(_marks(tmp_path)), "VICTIM_RANK": str(victim)}
    args = ("test_faults.py", "-k", "alone", "-q")
    ends = _ends(_agents(quiet_after, tmp_path, NODES[:count], env, args), tmp_path)
    said = _worker_output(ends["n1"])
    assert f"rank {victim} waited in all_reduce while" in said, said[-6000:]
    assert "[root cause]: returned" not in said, said[-6000:]
    assert re.search(r"test_faults.py\", line \d+ in test_alone", said), said[-6000:]
    home = NODES[victim // 2]
    cause = ends[home].output.split("Root Cause (first observed failure):", 1)[-1]
    assert f"rank      : {victim}" in cause.split("=====", 1)[0], _worker_output(ends[home])[-8000:]
    for node in ends.values():
        _clean(node)
        assert node.code == 1


def test_a_link_cut_mid_rendezvous_is_named(quiet_after: Cluster, tmp_path: Path) -> None:
    """The cut comes while the ranks meet at the session's start (a conftest holds them
    there until every rank has arrived): the survivors end the session naming the node."""
    (tmp_path / "test_nodes.py").write_text(TESTS)
    (tmp_path / "conftest.py").write_text(AT_THE_START)
    marks = _marks(tmp_path)
    procs = _agents(quiet_after, tmp_path, ("n1", "n2"), {"MARKS": str(marks)}, ("test_nodes.py",))
    _wait_for(marks, 4, "started-*")
    quiet_after.cut("n2")
    (marks / "go").touch()
    ends = _ends(procs, tmp_path)
    said = _worker_output(ends["n1"])
    assert "not every launched rank started its session (node 1 (ranks 2, 3)" in said, said
    assert "its node or the link to it went down" in said, said[-6000:]
    for node in ends.values():
        _clean(node)


AT_THE_START = """
import os, socket, time
from pathlib import Path
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    marks = Path(os.environ["MARKS"])
    (marks / f"started-{os.environ['RANK']}").write_text(socket.gethostname())
    deadline = time.monotonic() + 120
    while not (marks / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_a_node_that_collects_other_tests_ends_the_session_naming_it(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "test_nodes.py").write_text(TESTS)
    (tmp_path / "test_only_on_n1.py").write_text(
        "import socket, pytest\n\nif socket.gethostname() != 'n1':\n"
        "    pytest.skip('not here', allow_module_level=True)\n\n"
        "def test_here():\n    pass\n"
    )
    marks = _marks(tmp_path)
    procs = _agents(quiet_after, tmp_path, ("n1", "n2"), {"MARKS": str(marks)})
    ends = _ends(procs, tmp_path)
    said = _worker_output(ends["n1"])
    assert "the launched ranks collected different tests" in said, said[-6000:]
    assert "ranks 2, 3 (node 1 (host n2)) collected not 1 test(s)" in said, said[-6000:]
    for node in ends.values():
        _clean(node)
        assert node.code != 0


def test_a_node_with_another_rankwise_ends_the_session_naming_it(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    """n2's processes find another rankwise first on their path (its metadata says 0.2.9)."""
    (tmp_path / "test_nodes.py").write_text(TESTS)
    other = tmp_path / "other" / "rankwise-0.2.9.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: rankwise\nVersion: 0.2.9\n")
    marks = _marks(tmp_path)
    env = {"MARKS": str(marks)}
    endpoint = f"{address('n1')}:29611"
    procs = {
        node: quiet_after.start(
            node,
            _torchrun(2, 2, endpoint, tmp_path / f"logs-{node}", "test_nodes.py"),
            tmp_path,
            {**env, "PYTHONPATH": str(other.parent)} if node == "n2" else env,
        )
        for node in ("n1", "n2")
    }
    ends = _ends(procs, tmp_path)
    said = _worker_output(ends["n1"])
    assert re.search(r"rankwise 0\.2\.9 on ranks 2, 3 \(node 1 \(host n2\)\)", said), said[-6000:]
    assert "install the same rankwise on every node" in said
    for node in ends.values():
        _clean(node)
        assert node.code != 0


def test_every_node_of_the_cluster_is_up(cluster: Cluster) -> None:
    """The lane's own check: SLURM sees every node, each its own host."""
    cluster.slurm_ready()  # an earlier test cut links: their nodes may be down in SLURM
    out = subprocess.run(
        cluster.command("n1", ["srun", f"--nodes={len(NODES)}", "hostname"]),
        env=cluster.env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert sorted(out.split()) == list(NODES)
