"""Is this pytest process one rank of a job another launcher started?

Three launchers are read: torchrun (and launchers that give its variables: WORLD_SIZE,
RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), ``srun`` starting pytest directly (SLURM's
task variables) and ``mpirun`` (OpenMPI's). Under ``srun`` and ``mpirun`` rank 0 hosts the
launch's store, and the harness gives the process torchrun's variables (``export``), so
code under test written for torchrun finds them.

Imports no torch (``auto_backend`` does, called for a detected launch only): the plugin
asks at configure time, before any test needs ranks.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from harness.common.hostlist import HostListError, expand_hosts, expand_tasks_per_node

# Set in every harness rank worker: a pytest run inside a test's rank is not a launch, even
# when the test gave it torchrun's variables (launch=True).
IN_RANK_WORKER = "HARNESS_RANK_WORKER"
# "0" turns detection off: a process with torchrun's variables that must run as plain pytest.
LAUNCHED_SWITCH = "HARNESS_LAUNCHED"
# Which launcher's variables the harness turned into torchrun's (see export): read them again.
LAUNCHED_BY = "HARNESS_LAUNCHED_BY"
# Ports derived for srun and mpirun when MASTER_PORT is not given: from the job, in this range.
DERIVED_PORTS = (15000, 17000)  # first port, how many: 15000-31999, below the ephemeral ports


class LaunchError(Exception):
    """A launcher's variables are there but do not describe a rank: names the fix."""


@dataclass(frozen=True)
class Launch:
    """This process's place in the launched job, from its launcher's environment."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool  # the launcher's agent hosts the store; every rank is a client
    run_key: str  # the run id and restart count: store keys of one attempt of one job
    launcher: str = "torchrun"  # who started the ranks: torchrun, srun or mpirun
    node: int | None = None  # this rank's node as the launcher numbers them, if it does
    host: str = ""  # this node's name

    @property
    def node_name(self) -> str:
        """'node 1 (host n2)', or 'host n2' where the launcher numbers no nodes."""
        host = self.host or "?"
        return f"host {host}" if self.node is None else f"node {self.node} (host {host})"


def detect(environ: Mapping[str, str] = os.environ) -> Launch | None:
    """The launch this process is a rank of, or None for a plain pytest session.

    A launch is a world of more than one rank outside a harness worker: torchrun's variables
    (WORLD_SIZE > 1, RANK and LOCAL_RANK set), else an ``srun`` task of a step of several
    tasks, else a rank of ``mpirun``.
    """
    if environ.get(IN_RANK_WORKER) or environ.get(LAUNCHED_SWITCH) == "0":
        return None
    by = environ.get(LAUNCHED_BY)
    if by in _READERS:
        return _READERS[by](environ)
    if {"WORLD_SIZE", "RANK", "LOCAL_RANK"} <= set(environ):
        return _from_torchrun(environ)
    if environ.get("SLURM_STEP_ID") is not None and "SLURM_PROCID" in environ:
        return _from_srun(environ)
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return _from_mpirun(environ)
    return None


def _from_torchrun(environ: Mapping[str, str]) -> Launch | None:
    world = _int(environ, "WORLD_SIZE")
    if world <= 1:
        return None
    rank, local = _int(environ, "RANK"), _int(environ, "LOCAL_RANK")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is not a rank of WORLD_SIZE={world}: {_FIX}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name):
            raise LaunchError(f"{name} is not set (RANK={rank}, WORLD_SIZE={world}): {_FIX}")
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    node = environ.get("GROUP_RANK")
    return Launch(
        world_size=world,
        rank=rank,
        local_rank=local,
        local_world_size=_int(environ, "LOCAL_WORLD_SIZE", world),
        master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT"),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        run_key=f"{run_id}/{restart}",
        node=int(node) if node is not None and node.isdigit() else None,
        host=socket.gethostname(),
    )


def _from_srun(environ: Mapping[str, str]) -> Launch | None:
    """An ``srun`` task: SLURM_PROCID, the step's task count, SLURM_LOCALID, its node's task
    count, and the step's first node as the store's host (rank 0 runs there and hosts it)."""
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    if world <= 1:
        return None
    rank, node = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NODEID", 0)
    if not 0 <= rank < world:
        raise LaunchError(f"SLURM_PROCID={rank} is not a task of {world}: {_SRUN_FIX}")
    try:
        hosts = expand_hosts(_first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
        per_node = expand_tasks_per_node(
            _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        )
    except HostListError as exc:
        raise LaunchError(f"{exc}: {_SRUN_FIX}") from None
    if not hosts or not 0 <= node < len(per_node):
        raise LaunchError(f"SLURM_NODEID={node} is not a node of this step: {_SRUN_FIX}")
    job, step = environ.get("SLURM_JOB_ID", "0"), environ.get("SLURM_STEP_ID", "0")
    return Launch(
        world_size=world,
        rank=rank,
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_world_size=per_node[node],
        master_addr=environ.get("MASTER_ADDR") or hosts[0],
        master_port=_port(environ, f"slurm {job}.{step}"),
        agent_store=False,
        run_key=f"slurm-{job}.{step}/0",
        launcher="srun",
        node=node,
        host=environ.get("SLURMD_NODENAME") or socket.gethostname(),
    )


def _from_mpirun(environ: Mapping[str, str]) -> Launch | None:
    """An OpenMPI rank: OMPI_COMM_WORLD_*; the store's host is MASTER_ADDR, or this machine
    when every rank runs on it. OpenMPI names no first host: across nodes it must be given."""
    world = _int(environ, "OMPI_COMM_WORLD_SIZE")
    if world <= 1:
        return None
    rank = _int(environ, "OMPI_COMM_WORLD_RANK")
    local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    address = environ.get("MASTER_ADDR")
    if not address and local_world != world:
        raise LaunchError(
            f"mpirun runs these {world} ranks on several nodes ({local_world} on this one) and "
            f"MASTER_ADDR is not set: the ranks cannot tell which node hosts the harness's "
            f"store. Give every rank the first host's address and a free port (mpirun -x "
            f"MASTER_ADDR=<first host> -x MASTER_PORT=<port> ...), or launch with srun or "
            f"torchrun"
        )
    job = next((environ[n] for n in _OMPI_JOB_VARIABLES if environ.get(n)), "")
    if not job and not environ.get("MASTER_PORT"):
        raise LaunchError(
            f"mpirun gave rank {rank} of {world} no job id to derive a port from, and "
            f"MASTER_PORT is not set: pass one (mpirun -x MASTER_PORT=<port> ...)"
        )
    return Launch(
        world_size=world,
        rank=rank,
        local_rank=_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world,
        master_addr=address or "127.0.0.1",
        master_port=_port(environ, f"mpirun {job}"),
        agent_store=False,
        run_key=f"mpirun-{job or environ.get('MASTER_PORT')}/0",
        launcher="mpirun",
        host=socket.gethostname(),
    )


# Where OpenMPI (4 and 5) says which job a rank belongs to: the same on every rank of it.
_OMPI_JOB_VARIABLES = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")


def _port(environ: Mapping[str, str], job: str) -> int:
    """MASTER_PORT if given, else one derived from the job (the same on every rank)."""
    if environ.get("MASTER_PORT"):
        return _int(environ, "MASTER_PORT")
    first, count = DERIVED_PORTS
    return first + zlib.crc32(job.encode()) % count


def _first(environ: Mapping[str, str], *names: str) -> str:
    for name in names:
        if environ.get(name):
            return environ[name]
    raise LaunchError(f"{' and '.join(names)} are not set: {_SRUN_FIX}")


_READERS = {"srun": _from_srun, "mpirun": _from_mpirun}


def export(launch: Launch, environ: MutableMapping[str, str] = os.environ) -> None:
    """Under srun or mpirun, give this process torchrun's variables for its rank (code under
    test reads them: ``init_process_group()`` from the environment, say), and note whose
    they are; torchrun gave them already. Rank 0's store takes in env:// groups' keys too."""
    if launch.launcher == "torchrun":
        return
    environ.update(
        {
            "RANK": str(launch.rank),
            "WORLD_SIZE": str(launch.world_size),
            "LOCAL_RANK": str(launch.local_rank),
            "LOCAL_WORLD_SIZE": str(launch.local_world_size),
            "MASTER_ADDR": launch.master_addr,
            "MASTER_PORT": str(launch.master_port),
            LAUNCHED_BY: launch.launcher,
        }
    )
    if launch.node is not None:
        environ["GROUP_RANK"] = str(launch.node)


_FIX = (
    "start pytest with torchrun (torchrun --nproc-per-node N -m pytest ...), or set "
    f"{LAUNCHED_SWITCH}=0 to run it as a plain session"
)
_SRUN_FIX = (
    "start pytest as srun's tasks (srun --ntasks N python -m pytest ...), or set "
    f"{LAUNCHED_SWITCH}=0 to run each task as a plain session"
)


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(str(text))
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer: {_FIX}") from None


def auto_backend(launch: Launch) -> str:
    """nccl where this rank has its GPU (cuda:LOCAL_RANK, or the one GPU the launcher made
    visible to it), gloo otherwise. Imports torch: called only for a detected launch."""
    import torch

    if not torch.cuda.is_available():
        return "gloo"
    count = torch.cuda.device_count()
    return "nccl" if count > launch.local_rank or count == 1 else "gloo"
