"""rankwise in production code (not pytest) across the cluster's nodes: torchrun per node, a
gloo group, `rw.all_reduce` plus a plain `dist.all_reduce` every step, 2 ranks a node, at 2
and 3 nodes. The last node fails mid-loop four ways: one of its ranks raises in its `fn`, the
node is killed, frozen (SIGSTOP), or its link cut. Every surviving rank ends within the peer
watch's bound plus a grace, naming what failed (the raising rank, or the lost node's ranks
and host) on its own stderr and in its torchrun error file."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, Cluster, address

pytestmark = pytest.mark.cluster

WATCH_BOUND_S = 10  # RANKWISE_PEER_TIMEOUT in these runs (60 by default)
GRACE_S = 45  # a slice, a beat, and 6 processes sharing 2 cores
START_BOUND_S = 300

LOOP = """
import os, time
import torch, torch.distributed as dist
import rankwise as rw

dist.init_process_group("gloo")
rank = dist.get_rank()
marks = os.environ["MARKS"]
raising = os.path.join(marks, "raise")
victim = int(os.environ["VICTIM_RANK"])

def value(step):
    if rank == victim and os.path.exists(raising):
        raise ValueError(f"bad batch at step {step}")
    return step

step = 0
while True:
    rw.all_reduce("step", lambda: value(step), sum)
    t = torch.ones(1)
    dist.all_reduce(t)
    step += 1
    if step == 20:
        mark = os.path.join(marks, f"ready-{rank}")
        with open(mark + ".part", "w") as f:  # renamed whole: the test never reads it half-written
            f.write(str(os.getpid()))
        os.replace(mark + ".part", mark)
    time.sleep(0.01)
"""


def _argv(count: int, endpoint: str, log_dir: Path, script: Path) -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run", f"--nnodes={count}", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=production",
        f"--log-dir={log_dir}", "-r", "3", str(script),
    ]  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _said(log_dir: Path, rank: int) -> tuple[str, str]:
    """Rank `rank`'s stderr and its torchrun error file's message (-r 3 under --log-dir)."""
    for directory in log_dir.glob("*/attempt_0/*"):
        stderr = (directory / "stderr.log").read_text(errors="replace")
        if f"[rank{rank}]" in stderr or f"rankwise: rank {rank}" in stderr:
            error = directory / "error.json"
            message = json.loads(error.read_text())["message"]["message"] if error.exists() else ""
            return stderr, message
    return "", ""


def _named(text: str) -> set[int]:
    """The ranks a rankwise message names ("ranks 4, 5 (host n3)", "rank 4 raised")."""
    found = re.findall(r"ranks? ([\d, ]+) (?:\(host|raised)", text)
    return {int(r) for group in found for r in group.replace(" ", "").split(",") if r}


@pytest.mark.parametrize("fault", ["raise", "kill", "freeze", "cut"])
@pytest.mark.parametrize("count", [2, 3], ids=["2 nodes", "3 nodes"])
def test_every_survivor_names_what_failed_in_production_code(
    quiet_after: Cluster, tmp_path: Path, count: int, fault: str
) -> None:
    cluster = quiet_after
    nodes = ("n1", "n2", "n3")[:count]
    victim = nodes[-1]
    first = 2 * (count - 1)  # the victim node's first rank
    script, marks = tmp_path / "loop.py", tmp_path / "marks"
    script.write_text(LOOP)
    marks.mkdir()
    env = {"MARKS": str(marks), "VICTIM_RANK": str(first),
           "RANKWISE_PEER_TIMEOUT": str(WATCH_BOUND_S)}  # fmt: skip
    endpoint = f"{address(nodes[0])}:29613"
    agents = {node: cluster.start(node, _argv(count, endpoint, tmp_path / f"logs-{node}", script),
                                  tmp_path, env) for node in nodes}  # fmt: skip
    try:
        deadline = time.monotonic() + START_BOUND_S
        while len(list(marks.glob("ready-*[0-9]"))) < 2 * count:
            assert time.monotonic() < deadline, "the ranks never got going"
            time.sleep(0.1)
        pids = {int(p.name[6:]): int(p.read_text()) for p in marks.glob("ready-*[0-9]")}
        started = time.monotonic()
        if fault == "raise":
            (marks / "raise").touch()
            lost, survivors = {first}, sorted(r for r in pids if r != first)
        else:
            lost = {first, first + 1}
            survivors = sorted(r for r in pids if r not in lost)
            if fault == "kill":
                cluster.lose(victim)
            elif fault == "freeze":
                for pid in cluster.processes(victim):
                    os.kill(pid, signal.SIGSTOP)
            else:
                cluster.cut(victim)
        while any(_alive(pids[r]) for r in survivors):
            took = time.monotonic() - started
            assert took < WATCH_BOUND_S + GRACE_S, f"survivors still running after {took:.0f} s"
            time.sleep(0.2)
        took = time.monotonic() - started
    finally:
        cluster.mend(victim)
        cluster.lose(victim)  # a frozen or cut node's processes do not end by themselves
        for proc in agents.values():
            try:
                proc.communicate(timeout=120)
            except Exception:
                proc.kill()
                proc.communicate()
    if fault in ("raise", "kill"):
        assert took < GRACE_S, took  # at once: an exchange, or a closed connection
    for rank in survivors:
        node = nodes[rank // 2]
        stderr, error = _said(tmp_path / f"logs-{node}", rank)
        for text in (stderr, error):
            assert text and _named(text) and _named(text) <= lost, (rank, fault, text[-3000:])
        if fault == "raise":
            assert f"rank {first} raised ValueError: bad batch" in error or rank == first, error
        if fault in ("freeze", "cut"):
            assert f"(host {victim})" in error and "silent for" in error, error
