"""Production code under torchrun (not pytest) losing a node: two torchrun agents on this
machine as two nodes of 2 ranks, a gloo group, `rw.all_reduce` plus a plain `dist.all_reduce`
every step. One node is frozen (SIGSTOP) or killed mid-loop, rank 0's or the other: every
surviving rank ends within the watch's bound plus a grace, naming the lost ranks on its
stderr and in torchrun's error file. And a rank that is only slow is never called lost."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.conftest import assert_all_gone, kill_quietly

BOUND_S = 5  # RANKWISE_PEER_TIMEOUT in these runs (60 by default)
GRACE_S = 30  # a slice, a beat, and two busy cores
START_BOUND_S = 240  # two agents starting 4 workers that import torch, on 2 cores

LOOP = """
import os, time
import torch, torch.distributed as dist
import rankwise as rw

dist.init_process_group("gloo")
rank = dist.get_rank()
step = 0
while True:
    rw.all_reduce("step", lambda: step, sum)
    t = torch.ones(1)
    dist.all_reduce(t)
    step += 1
    if step == 20:
        mark = os.path.join(os.environ["MARKS"], f"ready-{rank}")
        with open(mark + ".part", "w") as f:  # renamed whole: the test never reads it half-written
            f.write(str(os.getpid()))
        os.replace(mark + ".part", mark)
    time.sleep(0.01)
"""

# The same loop through the other labelled collectives: each waits through the watch.
OPS = {
    "gather_bytes": "rw.gather_bytes(bytes([rank]) * 64, dst=0, chunk_bytes=16)",
    "gather_state_dicts": 'list(rw.gather_state_dicts({"step": step}, dst=0))',
    "broadcast_from": 'rw.broadcast_from("cfg", lambda: torch.arange(2000.0), src=0)',
}

# The surviving node's first rank waits on its second alone (a plain recv); the second waits on
# the other node (their subgroup): only it hears the other node go. The test names the waiter.
WAITER = """
import os, time
import torch, torch.distributed as dist
import rankwise as rw

dist.init_process_group("gloo")
rank = dist.get_rank()
without = {0: dist.new_group([1, 2, 3]), 2: dist.new_group([0, 1, 3])}
for step in range(20):
    rw.all_reduce("step", lambda: step, sum)
mark = os.path.join(os.environ["MARKS"], f"ready-{rank}")
with open(mark + ".part", "w") as f:  # renamed whole: the test never reads it half-written
    f.write(str(os.getpid()))
os.replace(mark + ".part", mark)
plan = os.path.join(os.environ["MARKS"], "waiter")
while not os.path.exists(plan):
    time.sleep(0.05)
waiter = int(open(plan).read())
if rank == waiter:
    open(os.path.join(os.environ["MARKS"], "waiting"), "w").close()
    dist.recv(torch.ones(1), src=waiter + 1)  # it never sends
while True:
    dist.all_reduce(torch.ones(1), group=without[waiter])
    time.sleep(0.01)
"""

SLOW = """
import os, time
import torch.distributed as dist
import rankwise as rw

dist.init_process_group("gloo")
rank = dist.get_rank()
assert rw.all_reduce("start", lambda: rank, sum) == 1
if rank == 1:
    deadline = time.monotonic() + 4 * float(os.environ["RANKWISE_PEER_TIMEOUT"])
    while time.monotonic() < deadline:  # a long computation holding the GIL, in Python
        sum(range(1000))
assert rw.all_reduce("after", lambda: rank, sum) == 1
print(f"rank {rank} done", flush=True)
"""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _agents(
    tmp: Path, script: Path, nodes: int, per_node: int, bound: float = BOUND_S, port: int = 0
) -> list[subprocess.Popen[str]]:
    port = port or _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    env.update({"MARKS": str(tmp), "OMP_NUM_THREADS": "1", "RANKWISE_PEER_TIMEOUT": str(bound)})
    return [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
             f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=watch",
             f"--log-dir={tmp / f'logs-{i}'}", "-r", "3", str(script)],
            cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )
        for i in range(nodes)
    ]  # fmt: skip


def _script(tmp: Path, text: str) -> Path:
    script = tmp / "loop.py"
    script.write_text(text)
    return script


def _ready(tmp: Path, agents: list[subprocess.Popen[str]]) -> dict[int, int]:
    """Wait (bounded) until all 4 ranks are looping; each rank's pid."""
    deadline = time.monotonic() + START_BOUND_S
    while len(list(tmp.glob("ready-*[0-9]"))) < 4:
        assert time.monotonic() < deadline, "the ranks never got going"
        assert all(a.poll() is None for a in agents), "an agent ended before the fault"
        time.sleep(0.1)
    return {int(p.name[6:]): int(p.read_text()) for p in tmp.glob("ready-*[0-9]")}


def _until(path: Path) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.05)


def _listening_on(port: int) -> set[int]:
    """The socket inodes listening on TCP `port` (IPv4 or IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
                found.add(int(fields[9]))
    return found


def _rendezvous_host(agents: list[subprocess.Popen[str]], port: int) -> int:
    """The agent that holds the rendezvous store (whichever bound `port` first, here where
    both agents share an address): its loss ends the other agent and its workers silently,
    a torchrun limit (docs/library.md), so a test of survivors loses the other node."""
    inodes = _listening_on(port)
    for agent in agents:
        for fd in Path(f"/proc/{agent.pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                    return agent.pid
    raise AssertionError(f"no agent listens on the rendezvous port {port}")


def _end(agents: list[subprocess.Popen[str]], pids: list[int]) -> None:
    """Kill whatever is left (a frozen node's agent and workers too) and reap the agents."""
    for agent in agents:
        with contextlib.suppress(OSError):
            os.killpg(agent.pid, signal.SIGKILL)
    kill_quietly(pids)
    for agent in agents:
        agent.wait(timeout=60)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _said(logs: Path, rank: int) -> tuple[str, str]:
    """A worker's stderr and its error file's message (torchrun's per-rank log dirs)."""
    stderr = error = ""
    for directory in logs.glob("*/attempt_0/*"):
        log = (directory / "stderr.log").read_text(errors="replace")
        if f"[rank{rank}]" in log or f"rank {rank}:" in log:
            stderr = log
            if (directory / "error.json").exists():
                error = json.loads((directory / "error.json").read_text())["message"]["message"]
    return stderr, error


def _said_on_a_node(tmp: Path, rank: int) -> tuple[str, str]:
    """`_said` from whichever of the two agents' log dirs holds `rank`'s."""
    logs = (_said(tmp / f"logs-{i}", rank) for i in range(2))
    return next((said for said in logs if said[0]), ("", ""))


def _lose(pids: list[int], fault: str, survivors: list[int], bound_s: float) -> None:
    """Freeze (SIGSTOP) or kill `pids`, then wait until every survivor's process has ended,
    failing once `bound_s` has passed."""
    started = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
    while any(_alive(pid) for pid in survivors):
        took = time.monotonic() - started
        assert took < bound_s, f"survivors {survivors} still running {bound_s:g} s after the fault"
        time.sleep(0.2)


def _named(text: str) -> set[int]:
    """The ranks a rankwise message names as lost ("ranks 2, 3 (host ...)")."""
    found = re.findall(r"ranks? ([\d, ]+) \((?:host|rank 0's node)", text)
    found += re.findall(r"rank 0's node \(host [^,]+, ranks ([\d, ]+)\)", text)
    return {int(r) for group in found for r in group.replace(" ", "").split(",") if r}


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["freeze", "kill"])
@pytest.mark.parametrize("victim", ["other", "rank0"], ids=["the other node", "rank 0's node"])
def test_every_survivor_names_the_lost_node_within_the_bound(
    tmp_path: Path, fault: str, victim: str
) -> None:
    agents = _agents(tmp_path, _script(tmp_path, LOOP), nodes=2, per_node=2)
    everything: list[int] = []
    try:
        pids = _ready(tmp_path, agents)
        node_of = {r: _parent(pid) for r, pid in pids.items()}
        lost_agent = (
            node_of[0] if victim == "rank0" else next(a.pid for a in agents if a.pid != node_of[0])
        )
        lost = sorted(r for r in pids if node_of[r] == lost_agent)
        survivors = sorted(r for r in pids if r not in lost)
        everything = [a.pid for a in agents] + list(pids.values())
        lost_pids = [lost_agent] + [pids[r] for r in lost]
        _lose(lost_pids, fault, [pids[r] for r in survivors], BOUND_S + GRACE_S)
    finally:
        _end(agents, everything)
    for rank in survivors:
        stderr, error = _said_on_a_node(tmp_path, rank)
        for text in (stderr, error):
            named = _named(text)
            assert named and named <= set(lost), (rank, lost, text[-3000:], stderr[-3000:])
        if fault == "freeze" and victim == "other":
            assert "silent for" in error, error
    assert_all_gone(everything, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("op", sorted(OPS))
def test_a_frozen_node_is_named_from_every_labelled_collective(tmp_path: Path, op: str) -> None:
    """The gathers (point to point on gloo) and a broadcast too large for its header wait
    through the watch as all_reduce does: the frozen node is named within the bound."""
    loop = LOOP.replace('rw.all_reduce("step", lambda: step, sum)', OPS[op])
    agents = _agents(tmp_path, _script(tmp_path, loop), nodes=2, per_node=2)
    everything: list[int] = []
    try:
        pids = _ready(tmp_path, agents)
        node_of = {r: _parent(pid) for r, pid in pids.items()}
        frozen = next(a.pid for a in agents if a.pid != node_of[0])
        everything = [a.pid for a in agents] + list(pids.values())
        survivors = [r for r in pids if node_of[r] != frozen]
        lost_pids = [frozen] + [pid for r, pid in pids.items() if node_of[r] == frozen]
        _lose(lost_pids, "freeze", [pids[r] for r in survivors], BOUND_S + GRACE_S)
    finally:
        _end(agents, everything)
    for rank in survivors:
        stderr, error = _said_on_a_node(tmp_path, rank)
        for text in (stderr, error):
            assert _named(text) == {2, 3}, (rank, op, text[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["freeze", "kill"])
def test_a_survivor_waiting_on_a_live_survivor_is_told_the_loss(tmp_path: Path, fault: str) -> None:
    """A survivor waits on another survivor alone, which finds the other node lost and ends:
    torchrun then ends the waiter at once. The waiter names the lost ranks before that (told
    through the store), not ended unheard while it waits out the bound itself. A bound of
    20 s: the finder waits for the others to speak for a beat and 5 s, not for the bound."""
    bound, port = 20, _port()
    agents = _agents(tmp_path, _script(tmp_path, WAITER), 2, 2, bound=bound, port=port)
    everything: list[int] = []
    try:
        pids = _ready(tmp_path, agents)
        node_of = {r: _parent(pid) for r, pid in pids.items()}
        kept = _rendezvous_host(agents, port)
        survivors = sorted(r for r in pids if node_of[r] == kept)
        lost = sorted(r for r in pids if node_of[r] != kept)
        (tmp_path / "waiter").write_text(str(survivors[0]))
        everything = [a.pid for a in agents] + list(pids.values())
        _until(tmp_path / "waiting")  # written just before its recv (reached or not, the same)
        lost_pids = [node_of[lost[0]]] + [pids[r] for r in lost]
        _lose(lost_pids, fault, [pids[r] for r in survivors], bound + GRACE_S)
    finally:
        _end(agents, everything)
    for rank in survivors:
        stderr, error = _said_on_a_node(tmp_path, rank)
        for text in (stderr, error):
            assert _named(text) == set(lost), (rank, fault, text[-3000:], stderr[-3000:])
    waiter = _said_on_a_node(tmp_path, survivors[0])[0]
    if fault == "kill" and 0 not in lost:  # it found no closed connection itself: told
        assert f"(as rank {survivors[1]} found)" in waiter, waiter[-3000:]
    assert_all_gone(everything, timeout=60)


@pytest.mark.slow
def test_a_rank_that_is_only_slow_is_never_lost(tmp_path: Path) -> None:
    """Rank 1 computes for 4x the bound (in Python, holding the GIL) between two labelled
    collectives while rank 0 waits in the second: its watch thread keeps counting."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW)
    (agent,) = _agents(tmp_path, script, nodes=1, per_node=2)
    try:
        assert agent.wait(timeout=START_BOUND_S + 4 * BOUND_S) == 0
    finally:
        _end([agent], [])
    out = "".join(p.read_text() for p in (tmp_path / "logs-0").rglob("stdout.log"))
    assert "rank 0 done" in out and "rank 1 done" in out
