"""pytest started directly by srun or mpirun, without torchrun: each task is one rank of one
session, from SLURM's or OpenMPI's variables (detection in this process; whole sessions of
several processes given those variables, as srun and mpirun give them)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.common.hostlist import HostListError, expand_hosts, expand_tasks_per_node
from harness.common.launch_detect import DERIVED_PORTS, LaunchError, detect, export
from harness.common.outcome import Ending, RankOutcome
from harness.common.report_text import failure_text, without_cpp_frames
from harness.launched.terminal import stop_report
from tests.harness.conftest import HEADER, assert_all_gone, kill_quietly

LAUNCH_BOUND_S = 240  # torchrun starting 4 pytest processes that import torch, on 2 cores

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


def test_derived_ports_stay_below_the_ephemeral_ports() -> None:
    """A derived port among Linux's ephemeral ports (32768 and up by default) may be taken by
    any outgoing connection on rank 0's node when its store starts."""
    first, count = DERIVED_PORTS
    assert first + count <= 32768
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ranges.exists():
        assert first + count <= int(ranges.read_text().split()[0])


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


# ---- a lost node, as the report says it (no processes) ----------------------------------------


def test_a_lost_node_is_named_once_with_its_ranks_as_the_root_cause() -> None:
    """Its ranks gave no outcome: the summary names the node and its ranks once, ahead of
    the ranks that hung at the deadline waiting on it (a hang's time is when it was found,
    not when it began), and their sections are not repeated."""
    lost = "node 1 (host n2) was lost: none of its ranks gave an outcome"
    outcomes = [
        RankOutcome("k", 0, 100, Ending.HUNG, at=30.0, notes=("still running at the timeout",)),
        RankOutcome("k", 1, 101, Ending.HUNG, at=30.0),
        RankOutcome("k", 2, 0, Ending.LOST, message=lost, at=31.0),
        RankOutcome("k", 3, 0, Ending.LOST, message=lost, at=31.0),
    ]
    text = failure_text(outcomes)
    assert text is not None
    assert text.splitlines()[0] == f"{lost} (ranks 2, 3); ranks 0, 1 also failed"
    assert "rank 2 (pid unknown)" in text and "rank 3 (pid" not in text, text


def test_torchs_cpp_frames_are_cut_from_what_a_rank_printed() -> None:
    said = (
        "[W TCPStore.cpp:106] sendBytes failed: Broken pipe\n"
        "Exception raised from sendBytes at Utils.hpp:758 (most recent call first):\n"
        "frame #0: c10::Error::Error() + 0x9d\n"
        "frame #1: c10::DistError::DistError() + 0x72\n"
        "<omitting python frames>\n"
        "frame #33: _start + 0x21\n"
        "the test's own line\n"
    )
    assert without_cpp_frames(said) == (
        "[W TCPStore.cpp:106] sendBytes failed: Broken pipe\n"
        "[4 C++ frames omitted]\n"
        "the test's own line\n"
    )


def test_the_stop_report_names_a_node_whose_every_rank_went_first() -> None:
    placement = {r: f"node {r // 2} (host n{r // 2 + 1})" for r in range(6)}
    text = stop_report("t.py::test_mid", 6, {2: "", 3: "", 5: "it died: SIGKILL"}, placement)
    assert text.splitlines()[0] == (
        "FAILED t.py::test_mid - the launcher stopped the job: node 1 (host n2) was lost "
        "(ranks 2, 3); rank 5 ended first"
    )
    assert "  rank 5 ended first: it died: SIGKILL" in text
    assert "  ranks 0, 1, 4 were stopped by the launcher" in text


# ---- two torchrun agents as two nodes, either lost mid-test -----------------------------------

TWO_NODES = """
import os, time
from pathlib import Path
import pytest, torch, torch.distributed as dist

MARKS = Path(os.environ["MARKS"])

@pytest.mark.ranks
def test_first(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size

@pytest.mark.ranks(timeout=60)
def test_mid(rank):
    (MARKS / f"in-{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 60  # a bound: the node is lost long before
    while not (MARKS / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t = torch.ones(1)
    dist.all_reduce(t)  # the lost node's ranks never come

@pytest.mark.ranks
def test_after(rank):
    dist.barrier()
"""


def _until_listening(port: int, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _tree(pid: int) -> list[int]:
    """`pid` and its children (an agent and its workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [pid]
    with contextlib.suppress(OSError):
        found += [int(c) for c in children.read_text().split()]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["store", "other"], ids=["rank 0's node", "the other node"])
def test_two_agents_as_two_nodes_either_lost_mid_test(
    pytester: pytest.Pytester, victim: str
) -> None:
    """Two torchrun agents on this machine, each a node of 2 ranks; one node killed (its
    agent and workers) mid-test. Losing rank 0's node, which holds the store, gave
    `INTERNALERROR ... DistNetworkError: Broken pipe` four times with C++ frames and no
    verdict. The surviving node now gives the test's verdict naming the lost node and its
    ranks, writes torchrun's error files, and nothing is left running."""
    pytester.makepyfile(test_nodes=TWO_NODES)
    marks = pytester.path / "marks"
    marks.mkdir()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    env.update({"MARKS": str(marks), "OMP_NUM_THREADS": "1"})
    # The first agent holds the rendezvous store (it binds the port before the second
    # starts) and, its pid the lower, is node 0 (torch sorts the nodes by address and pid):
    # losing the other node never takes the rendezvous with it, which would end the surviving
    # agent and its workers before they say anything (torchrun's own limit).
    agents = []
    for i in range(2):
        agents.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
             "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             "--rdzv-id=two-nodes", f"--log-dir={pytester.path / f'logs-{i}'}", "-m",
             "pytest", "-p", "harness", "-p", "no:cacheprovider", "-rA", "test_nodes.py"],
            cwd=pytester.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        ))  # fmt: skip
        if i == 0:
            _until_listening(port, LAUNCH_BOUND_S)
    everything: list[int] = []
    try:
        deadline = time.monotonic() + LAUNCH_BOUND_S
        while len(list(marks.glob("in-*"))) < 4:
            assert time.monotonic() < deadline, "the ranks never reached test_mid"
            time.sleep(0.1)
        pids = {int(p.name[3:]): int(p.read_text()) for p in marks.glob("in-*")}
        parent = {r: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                  for r, pid in pids.items()}  # fmt: skip
        holds_rank_0 = next(a for a in agents if a.pid == parent[0])
        lost = (
            holds_rank_0 if victim == "store" else next(a for a in agents if a is not holds_rank_0)
        )
        survivor = next(a for a in agents if a is not lost)
        lost_ranks = sorted(r for r in pids if parent[r] == lost.pid)
        everything = [p for agent in agents for p in _tree(agent.pid)]
        (marks / "go").touch()  # the survivors go into the collective
        kill_quietly(_tree(lost.pid))
        out, _ = survivor.communicate(timeout=LAUNCH_BOUND_S)
        lost.communicate(timeout=60)
    finally:
        for agent in agents:
            agent.kill()
        kill_quietly(everything)
    logs = pytester.path / f"logs-{agents.index(survivor)}"
    workers = "".join(p.read_text(errors="replace") for p in sorted(logs.rglob("*.log")))
    said = out + workers
    node = lost_ranks[0] // 2
    phrase = f"ranks {lost_ranks[0]}, {lost_ranks[1]}"
    assert re.search(rf"node {node} \(host [^)]+\) was lost: .*\({phrase}\)", said), said[-8000:]
    assert "FAILED test_nodes.py::test_mid" in said
    assert "INTERNALERROR" not in said and "frame #" not in workers, said[-8000:]
    files = [json.loads(p.read_text()) for p in logs.rglob("error.json")]
    assert files and all(f"node {node} (host" in json.dumps(f) for f in files), files
    assert_all_gone(everything, timeout=60)
