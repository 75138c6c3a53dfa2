"""The harness across nodes, on the cluster `make test-cluster` builds (network namespaces as
nodes, Debian's SLURM, torchrun's c10d rendezvous across them).

Launches that give one verdict: torchrun per node started by srun (docs/clusters.md's line as
written), srun starting pytest directly, mpirun starting it directly. Faults across nodes, each
bounded: a worker node lost, the node of rank 0 and the store lost, a link cut mid-collective and
mid-rendezvous, a node that collects other tests, a node with another rankwise. Each gives, on
every surviving node, a verdict naming the lost node and its ranks; no INTERNALERROR, no C++
frames, torchrun's error files written, nothing left running on any node.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.conftest import NODES, PYTHON, ROOT, Cluster, address

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

    def error_files(self) -> list[dict[str, object]]:
        """torchrun's error files its workers wrote (under --log-dir)."""
        return [json.loads(p.read_text()) for p in sorted(self.log_dir.rglob("error.json"))]


def _torchrun(
    nodes: int, per_node: int, endpoint: str, log_dir: Path, *pytest_args: str
) -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run", f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=cluster-test", f"--log-dir={log_dir}",
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


def _ends(procs: dict[str, subprocess.Popen[str]], tmp_path: Path) -> dict[str, Node]:
    found = {}
    for node, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += f"\n(the agent on {node} did not end within {BOUND_S} s)"
        found[node] = Node(node, proc.returncode, out, tmp_path / f"logs-{node}")
    return found


def _clean(node: Node) -> None:
    """What every node's output must never hold."""
    assert "INTERNALERROR" not in node.output, node.output[-6000:]
    workers = "".join(p.read_text(errors="replace") for p in node.log_dir.rglob("std*.log"))
    assert "frame #" not in workers, workers[-6000:]


def _worker_output(node: Node) -> str:
    """What the workers printed on `node` (stdout and stderr; under --log-dir they go there)."""
    return node.output + "".join(
        p.read_text(errors="replace") for p in sorted(node.log_dir.rglob("std*.log"))
    )


# ---- launches that give one verdict ---------------------------------------------------------


def _docs_block(marker: str) -> str:
    """The shell block of docs/clusters.md that follows the line holding `marker`."""
    text = (ROOT / "docs" / "clusters.md").read_text()
    after = text[text.index(marker) :]
    return after.split("```bash\n", 1)[1].split("```", 1)[0]


def test_torchrun_per_node_started_by_srun_gives_one_verdict(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    """docs/clusters.md's SLURM line, as written (its NODES and GPUS set to this cluster's),
    inside an allocation of 2 nodes: one torchrun per node, one session, one verdict."""
    (tmp_path / "test_one.py").write_text(textwrap.dedent(ONE_VERDICT))
    script = tmp_path / "job.sh"
    script.write_text("set -e\n" + _docs_block("<!-- cluster-lane: torchrun under srun -->"))
    env = {"NODES": "2", "GPUS": "2", "TESTS": "test_one.py", "HOME": str(tmp_path)}
    proc = quiet_after.start(
        "n1", ["salloc", "--nodes=2", "--ntasks-per-node=1", "bash", str(script)], tmp_path, env
    )
    out, _ = proc.communicate(timeout=BOUND_S)
    assert proc.returncode != 0, out
    assert out.count("test session starts") == 1, out[-6000:]
    assert "1 failed, 2 passed" in out, out[-6000:]
    assert "rank 3 failed: raised AssertionError: assert 3 != 3  [4 ranks" in out, out[-6000:]
    assert "INTERNALERROR" not in out


ONE_VERDICT = """
    import pytest, torch, torch.distributed as dist

    @pytest.mark.ranks
    def test_sum(rank, world_size):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world_size == 4

    @pytest.mark.ranks
    def test_rank_3_fails(rank):
        assert rank != 3

    def test_plain():
        pass
"""


def test_srun_starting_pytest_directly_gives_one_verdict(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    """`srun --nodes 2 --ntasks-per-node 2 python -m pytest` ran the suite once per task (4
    sessions, 4 verdicts, 16 ranks): now the tasks are the ranks, the first node's rank 0
    hosting the store."""
    (tmp_path / "test_one.py").write_text(textwrap.dedent(ONE_VERDICT))
    argv = ["srun", "--nodes=2", "--ntasks-per-node=2", PYTHON, "-m", "pytest", "-p", "harness",
            "-p", "no:cacheprovider", "-rA", "test_one.py"]  # fmt: skip
    proc = quiet_after.start("n1", argv, tmp_path)
    out, _ = proc.communicate(timeout=BOUND_S)
    assert out.count("test session starts") == 1, out[-6000:]
    assert "1 failed, 2 passed" in out, out[-6000:]
    assert "rank 3 failed: raised AssertionError: assert 3 != 3  [4 ranks" in out
    assert "INTERNALERROR" not in out


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


def test_mpirun_starting_pytest_directly_gives_one_verdict(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "test_one.py").write_text(textwrap.dedent(ONE_VERDICT))
    across = _mpirun(quiet_after, tmp_path, "n1:2,n2:2", 4,
                     "-x", "MASTER_ADDR=n1", "-x", "MASTER_PORT=29712")  # fmt: skip
    assert across.count("test session starts") == 1, across[-6000:]
    assert "1 failed, 2 passed" in across, across[-6000:]
    assert "rank 3 failed: raised AssertionError: assert 3 != 3  [4 ranks" in across


def test_mpirun_across_nodes_without_master_addr_says_what_to_do(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "test_one.py").write_text(textwrap.dedent(ONE_VERDICT))
    out = _mpirun(quiet_after, tmp_path, "n1:2,n2:2", 4)
    assert "MASTER_ADDR is not set" in out and "mpirun -x MASTER_ADDR=" in out, out[-4000:]
    assert "test session starts" not in out


# ---- faults across nodes ----------------------------------------------------------------------


def _lose_mid_test(
    cluster: Cluster, tmp_path: Path, nodes: tuple[str, ...], victim: str, how: str
) -> dict[str, Node]:
    """Start one agent per node; once every rank is in test_mid (the victim's ranks short of
    its collective, the others in it), lose the victim node (`how`: "lose" or "cut")."""
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
    return _ends(procs, tmp_path)


def _names_the_lost_node(node: Node, lost: str, ranks: str) -> None:
    said = _worker_output(node)
    assert re.search(rf"node \d \(host {lost}\) was lost.*\({ranks}\)", said), said[-6000:]
    assert "FAILED test_nodes.py::test_mid" in said, said[-6000:]


@pytest.mark.parametrize("victim", ["n2", "n1"], ids=["a worker node", "rank 0's and the store's"])
def test_a_lost_node_is_named_on_every_surviving_node(
    quiet_after: Cluster, tmp_path: Path, victim: str
) -> None:
    nodes = ("n1", "n2", "n3")
    started = time.monotonic()
    ends = _lose_mid_test(quiet_after, tmp_path, nodes, victim, "lose")
    took = time.monotonic() - started
    ranks = {"n1": "ranks 0, 1", "n2": "ranks 2, 3"}[victim]
    for name, node in ends.items():
        if name == victim:
            continue  # every process of it killed: nothing to say
        _names_the_lost_node(node, victim, ranks)
        _clean(node)
        assert node.code != 0
        files = node.error_files()
        assert files and all(victim in json.dumps(f) for f in files), (name, files)
    assert took < BOUND_S


def test_a_link_cut_mid_collective_is_named_and_ends_every_node(
    quiet_after: Cluster, tmp_path: Path
) -> None:
    """No FIN arrives through a cut link: the survivors' collective waits to the test's
    timeout, and the cut node's ranks reach no store; every process ends all the same."""
    ends = _lose_mid_test(quiet_after, tmp_path, ("n1", "n2"), "n2", "cut")
    _names_the_lost_node(ends["n1"], "n2", "ranks 2, 3")
    for node in ends.values():
        _clean(node)
    assert ends["n1"].error_files()


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
    out = subprocess.run(
        cluster.command("n1", ["srun", f"--nodes={len(NODES)}", "hostname"]),
        env=cluster.env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert sorted(out.split()) == list(NODES)
