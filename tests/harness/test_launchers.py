"""pytest started directly by srun or mpirun, without torchrun: each task is one rank of one
session, from SLURM's or OpenMPI's variables (detection in this process; whole sessions of
several processes given those variables, as srun and mpirun give them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.common.hostlist import HostListError, expand_hosts, expand_tasks_per_node
from harness.common.launch_detect import DERIVED_PORTS, LaunchError, detect, export
from tests.harness.conftest import HEADER

# What srun gives task 3 of `srun --nodes 2 --ntasks-per-node 2` (job 4242, step 0).
SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[07-08]",
    "SLURMD_NODENAME": "node08",
}
# What OpenMPI's mpirun gives rank 1 of `mpirun -np 2` on one machine.
MPIRUN = {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_NAMESPACE": "prterun-vm-1234@1",
}


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-3,7],m2", ["n1", "n2", "n3", "n7", "m2"]),
        ("gpu-a[08-10]", ["gpu-a08", "gpu-a09", "gpu-a10"]),
        ("r[1-2]c[1-2]", ["r1c1", "r1c2", "r2c1", "r2c2"]),
    ],
)
def test_slurm_host_lists_expand_as_scontrol_shows_them(text: str, hosts: list[str]) -> None:
    assert expand_hosts(text) == hosts


def test_slurm_tasks_per_node_expand() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    for bad in ("n[1-", "n[3-1]", "n[a-b]"):
        with pytest.raises(HostListError):
            expand_hosts(bad)
    with pytest.raises(HostListError):
        expand_tasks_per_node("2(y3)")


def test_an_srun_task_is_a_rank_with_the_first_node_hosting_the_store() -> None:
    launch = detect(SRUN)
    assert launch is not None and launch.launcher == "srun"
    assert (launch.world_size, launch.rank, launch.local_rank, launch.local_world_size) == (
        4,
        3,
        1,
        2,
    )
    assert (launch.master_addr, launch.agent_store) == ("node07", False)
    assert launch.node_name == "node 1 (host node08)"
    first, count = DERIVED_PORTS
    assert first <= launch.master_port < first + count
    again = detect({**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    assert again is not None and again.master_port == launch.master_port  # every task alike
    given = detect({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"})
    assert given is not None and (given.master_addr, given.master_port) == ("10.0.0.1", 29400)


def test_srun_gives_code_under_test_torchruns_variables() -> None:
    launch = detect(SRUN)
    assert launch is not None
    environ = dict(SRUN)
    export(launch, environ)
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    assert (environ["MASTER_ADDR"], environ["GROUP_RANK"]) == ("node07", "1")
    assert detect(environ) == launch  # read again as srun's, not as torchrun's


def test_torchrun_under_srun_is_torchruns_launch() -> None:
    """The docs' SLURM line: srun starts one torchrun per node, whose workers carry both."""
    torchrun = {
        "WORLD_SIZE": "8",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job",
    }
    launch = detect({**SRUN, "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", **torchrun})
    assert launch is not None and launch.launcher == "torchrun" and launch.rank == 5
    assert launch.node == 1


@pytest.mark.parametrize(
    "change",
    [
        {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},
        {"SLURM_STEP_ID": None},  # a batch script or salloc's shell: no step, no tasks
        {"HARNESS_LAUNCHED": "0"},
    ],
    ids=["one task", "not a step", "switched off"],
)
def test_no_srun_launch_where_there_is_none(change: dict[str, str | None]) -> None:
    environ = {k: v for k, v in {**SRUN, **change}.items() if v is not None}
    assert detect(environ) is None


def test_a_broken_srun_environment_says_what_to_fix() -> None:
    with pytest.raises(LaunchError, match="SLURM_PROCID=4 is not a task of 4") as caught:
        detect({**SRUN, "SLURM_PROCID": "4"})
    assert "srun --ntasks N python -m pytest" in str(caught.value)
    with pytest.raises(LaunchError, match=re.escape("unbalanced '[' in host list 'node[07'")):
        detect({**SRUN, "SLURM_STEP_NODELIST": "node[07"})


def test_an_mpirun_rank_on_one_machine_derives_the_store_address() -> None:
    launch = detect(MPIRUN)
    assert launch is not None and launch.launcher == "mpirun"
    assert (launch.world_size, launch.rank, launch.local_rank) == (2, 1, 1)
    assert launch.master_addr == "127.0.0.1" and not launch.agent_store
    given = detect({**MPIRUN, "MASTER_ADDR": "node07", "MASTER_PORT": "29400"})
    assert given is not None and (given.master_addr, given.master_port) == ("node07", 29400)


def test_mpirun_across_nodes_without_master_addr_is_refused_with_the_fix() -> None:
    with pytest.raises(LaunchError) as caught:
        detect({**MPIRUN, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    said = str(caught.value)
    assert "MASTER_ADDR is not set" in said and "mpirun -x MASTER_ADDR=" in said
    with pytest.raises(LaunchError, match=re.escape("pass one (mpirun -x MASTER_PORT=")):
        detect({k: v for k, v in MPIRUN.items() if k != "PMIX_NAMESPACE"})


SESSION = """
@pytest.mark.ranks
def test_sum(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size == 4

@pytest.mark.ranks
def test_rank_2_fails(rank):
    print(f"rank {rank} here")
    assert rank != 2

@pytest.mark.ranks(launch=True)
def test_a_group_from_the_environment(rank):
    dist.init_process_group("gloo")  # torchrun's variables, as the harness gave them
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()

def test_plain():
    assert os.environ["WORLD_SIZE"] == "4"
"""


def _tasks(directory: Path, environs: list[dict[str, str]]) -> list[tuple[int, str]]:
    """One pytest process per task, each given `environs[i]`, as srun or mpirun starts them."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    command = [sys.executable, "-m", "pytest", "-p", "harness", "-p", "no:cacheprovider", "-rA"]
    procs = [
        subprocess.Popen(
            command,
            cwd=directory,
            env={**base, "OMP_NUM_THREADS": "1", **environ},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for environ in environs
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        results.append((proc.returncode, out))
    return results


def _srun_task(rank: int, job: str = "4243") -> dict[str, str]:
    node = rank // 2
    return {
        **SRUN,
        "SLURM_JOB_ID": job,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 2),
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURMD_NODENAME": f"n{node + 1}",
    }


@pytest.mark.slow
def test_pytest_started_by_srun_directly_gives_one_verdict(pytester: pytest.Pytester) -> None:
    """`srun --nodes 2 --ntasks-per-node 2 python -m pytest` ran the whole suite once per
    task, each on warm ranks of its own (4 sessions, 4 verdicts, 16 ranks)."""
    pytester.makepyfile(test_s=HEADER + SESSION)
    results = _tasks(pytester.path, [_srun_task(r) for r in range(4)])
    assert [code for code, _ in results] == [1, 1, 1, 1], results
    rank_0 = results[0][1]
    assert rank_0.count("test session starts") == 1
    assert re.search(r"1 failed, 3 passed", rank_0), rank_0
    assert "rank 2 failed: raised AssertionError: assert 2 != 2  [4 ranks" in rank_0, rank_0
    assert "rank 2 here" in rank_0  # every rank's output, in rank 0's report
    for _, quiet in results[1:]:  # the others print nothing of their own
        assert "test session starts" not in quiet and "FAILED" not in quiet, quiet


@pytest.mark.slow
def test_pytest_started_by_mpirun_directly_gives_one_verdict(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_s=HEADER + SESSION.replace("== 4", "== 2").replace('"4"', '"2"'))
    environs = [
        {**MPIRUN, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
         "PMIX_NAMESPACE": "prterun-vm-99@1"}
        for r in range(2)
    ]  # fmt: skip
    results = _tasks(pytester.path, environs)
    assert [code for code, _ in results] == [0, 0], results  # rank 2 does not exist here
    assert "4 passed" in results[0][1], results[0][1]
