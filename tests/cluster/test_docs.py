"""docs/clusters.md's launch blocks, read from the page and run as written on the lane's
cluster: each gives one verdict, and two SLURM jobs from the page's script, side by side on
the nodes they share, each get their own.

Every block runs from a directory whose tests/ holds the lane's tests, with HOME a fresh
directory (the secret block made its secret there) and GPUS=2; the page says so.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.conftest import ROOT, Cluster, address
from tests.cluster.test_cluster import BOUND_S, MPI_AGENT
from tests.cluster.test_cluster import ONE_VERDICT as TESTS

pytestmark = pytest.mark.cluster

PAGE = ROOT / "docs" / "clusters.md"
_BLOCK = re.compile(r"<!-- cluster-lane: (?P<name>[^>]+?) -->\n```bash\n(?P<body>.*?)```", re.S)


def blocks() -> dict[str, str]:
    """Every marked shell block of the page, by its marker's name."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(PAGE.read_text())}


@dataclass
class Job:
    """A directory to launch from (tests/ in it) and the HOME the secret block wrote to."""

    directory: Path
    home: Path

    @property
    def env(self) -> dict[str, str]:
        return {"HOME": str(self.home), "GPUS": "2"}

    def script(self, name: str) -> Path:
        path = self.directory / f"{name.replace(' ', '-').replace(',', '')}.sh"
        path.write_text(blocks()[name])
        return path


def _job(cluster: Cluster, root: Path) -> Job:
    job = Job(root / "job", root / "home")
    (job.directory / "tests").mkdir(parents=True)
    job.home.mkdir()
    (job.directory / "tests" / "test_one.py").write_text(textwrap.dedent(TESTS))
    made = cluster.start("n1", ["bash", str(job.script("secret"))], job.directory, job.env)
    out, _ = made.communicate(timeout=60)
    secret = job.home / ".harness-secret"
    assert made.returncode == 0 and secret.stat().st_mode & 0o077 == 0, out
    return job


@pytest.fixture
def job(quiet_after: Cluster, tmp_path: Path) -> Iterator[Job]:
    yield _job(quiet_after, tmp_path)


def _verdict(out: str, ranks: int, sessions: int = 1) -> None:
    """`sessions` launches' verdicts, each the page's tests on `ranks` ranks, signed; no C++
    frames (torchrun's agents' included) and no INTERNALERROR."""
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # mpirun gives rank 0 a terminal: colours
    assert out.count("test session starts") == sessions, out[-6000:]
    assert out.count("1 failed, 2 passed") == sessions, out[-6000:]
    assert f"rank 3 failed: raised AssertionError: assert 3 != 3  [{ranks} ranks" in out, out
    assert "ran unsigned" not in out, out[-6000:]
    assert "frame #" not in out and "INTERNALERROR" not in out, out[-6000:]


def _run(cluster: Cluster, node: str, argv: list[str], job: Job, **env: str) -> str:
    proc = cluster.start(node, argv, job.directory, {**job.env, **env})
    out, _ = proc.communicate(timeout=BOUND_S)
    return out


def test_torchrun_on_one_machine(job: Job, quiet_after: Cluster) -> None:
    argv = ["bash", str(job.script("torchrun, one machine"))]
    _verdict(_run(quiet_after, "n1", argv, job, GPUS="4"), 4)


def test_torchrun_on_several_machines(job: Job, quiet_after: Cluster) -> None:
    once = _run(
        quiet_after, "n1", ["bash", str(job.script("torchrun, several machines, once"))], job
    )
    assert (job.home / ".harness-run-id").exists(), once
    each = job.script("torchrun, several machines, each node")
    env = {"NODES": "2", "HEAD": address("n1"), "PORT": "29620"}
    agents = {n: quiet_after.start(n, ["bash", str(each)], job.directory, {**job.env, **env})
              for n in ("n1", "n2")}  # fmt: skip
    outs = {n: proc.communicate(timeout=BOUND_S)[0] for n, proc in agents.items()}
    _verdict(outs["n1"], 4)
    assert "test session starts" not in outs["n2"] and "frame #" not in outs["n2"], outs["n2"]
    assert all(proc.returncode == 1 for proc in agents.values()), outs


def _sbatch(cluster: Cluster, job: Job) -> subprocess.Popen[str]:
    argv = ["sbatch", "--wait", "--oversubscribe", "--output=slurm.out", str(job.script("sbatch"))]
    return cluster.start("n1", argv, job.directory, job.env)


def test_the_sbatch_script(job: Job, quiet_after: Cluster) -> None:
    proc = _sbatch(quiet_after, job)
    said, _ = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 1, said  # the job's status: a test failed
    _verdict((job.directory / "slurm.out").read_text(), 4)


def test_the_sbatch_script_in_salloc(job: Job, quiet_after: Cluster) -> None:
    argv = ["salloc", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2", "bash",
            str(job.script("sbatch"))]  # fmt: skip
    _verdict(_run(quiet_after, "n1", argv, job), 4)


def test_two_jobs_from_the_sbatch_script_side_by_side(quiet_after: Cluster, tmp_path: Path) -> None:
    """Two users' jobs on the nodes they share, started 2 s apart: each its own verdict; the
    port and run id came from each job."""
    jobs = [_job(quiet_after, tmp_path / name) for name in ("first", "second")]
    procs = []
    for job in jobs:
        procs.append(_sbatch(quiet_after, job))
        time.sleep(2.0)  # the spacing the report gave, not a synchronisation
    for job, proc in zip(jobs, procs, strict=True):
        proc.communicate(timeout=BOUND_S)
        out = (job.directory / "slurm.out").read_text()
        _verdict(out, 4)
        assert "the launcher stopped the job" not in out and "another job's" not in out, out


def test_srun_starting_pytest(job: Job, quiet_after: Cluster) -> None:
    _verdict(_run(quiet_after, "n1", ["bash", str(job.script("srun"))], job), 4)


def test_mpirun_starting_pytest(job: Job, quiet_after: Cluster) -> None:
    """Both lines: on one machine, then across two (OpenMPI's settings for this cluster, its
    rsh agent and interfaces, come from the environment: the block stays as written)."""
    agent = job.directory / "mpi-agent"
    agent.write_text(MPI_AGENT.format(hosts=quiet_after.directory / "hosts"))
    agent.chmod(0o755)
    env = {
        "OMPI_MCA_plm_rsh_agent": str(agent),
        "OMPI_MCA_btl_tcp_if_include": "eth0",
        "OMPI_MCA_oob_tcp_if_include": "eth0",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    out = _run(quiet_after, "n1", ["bash", str(job.script("mpirun"))], job, **env)
    _verdict(out, 4, sessions=2)
    assert "[8 ranks" in out, out[-6000:]


RUN_HERE = {
    "secret": "every job fixture",
    "torchrun, one machine": test_torchrun_on_one_machine,
    "torchrun, several machines, once": test_torchrun_on_several_machines,
    "torchrun, several machines, each node": test_torchrun_on_several_machines,
    "sbatch": test_the_sbatch_script,
    "srun": test_srun_starting_pytest,
    "mpirun": test_mpirun_starting_pytest,
}
