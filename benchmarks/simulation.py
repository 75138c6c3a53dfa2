"""Simulated worlds in one process against torch's own tools, at 8, 64, 256 and 4096 ranks.

- Thread-ranks: the harness's threaded_world (its own process group) against torch's
  "threaded" backend as MultiThreadedTestCase uses it: a whole world (start every thread,
  set up its group, one all_reduce, end), and the time of one collective (the slowest rank's,
  from a barrier; median over repeats), for torch's all_reduce and rankwise's labelled one.
  Target: rankwise's all_reduce within 4x a plain all_reduce at 128 thread-ranks.
- Fake worlds: the harness's fake_world (torchrun's environment, a 2-D mesh) against torch's
  FakeStore with the fake backend alone, per rank set up and torn down.

Each measurement runs in a fresh interpreter: a threaded world leaves torch's globals behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

from benchmarks._common import ROOT, Sample, print_and_exit

SIZES = (8, 64, 256, 4096)
PER_OP_SIZES = (8, 64, 128, 256)  # one collective: 4096 thread-ranks take seconds each
REPEATS = 7
RATIO_TARGET = 4.0  # rankwise's all_reduce against torch's, at 128 thread-ranks
TARGET_SIZE = 128

_PRELUDE = """
import json, sys, threading, time
import torch, torch.distributed as dist
import rankwise as rw
# Both runners imported before anything is timed.
from torch.testing._internal.distributed import multi_threaded_pg as mt
from harness.simulation.threaded_world import run_threaded

def torch_threaded(fn, n):
    mt._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store, out = dist.HashStore(), [None] * n
    def main(rank):
        dist.init_process_group("threaded", rank=rank, world_size=n, store=store)
        out[rank] = fn(rank)
        dist.destroy_process_group()
    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads: t.start()
    for t in threads: t.join()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)
    mt._uninstall_threaded_pg()
    return out

def harness_threaded(fn, n):
    return run_threaded(fn, n, 600.0)

def one_all_reduce(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def timed(op, repeats):
    def body(rank):
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            op(rank)
            times.append(time.perf_counter() - start)
        return times
    return body
"""


def _run(code: str, timeout: float = 900) -> Any:
    """Run `code` (after the prelude) in a fresh interpreter; it prints one JSON line."""
    script = _PRELUDE + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark step failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _whole_world(runner: str, n: int) -> float:
    return float(
        _run(
            f"""
            start = time.perf_counter()
            values = {runner}(one_all_reduce, {n})
            assert values == [float({n})] * {n}
            print(json.dumps(time.perf_counter() - start))
            """
        )
    )


def _per_op(runner: str, op: str, n: int) -> Sample:
    """The slowest rank's time for one `op`, per repeat (the first left out)."""
    per_rank = _run(
        f"""
        ops = {{
            "all_reduce": lambda rank: dist.all_reduce(torch.ones(1)),
            "rw.all_reduce": lambda rank: rw.all_reduce("n", lambda: rank, sum),
        }}
        print(json.dumps({runner}(timed(ops[{op!r}], {REPEATS + 1}), {n})))
        """
    )
    slowest = [max(rank[i] for rank in per_rank) for i in range(1, REPEATS + 1)]
    return Sample.of(slowest)


def _fake_world_start(n: int, harness: bool) -> Sample:
    """Setting up (and tearing down) one rank's fake world of n ranks, per rank swept."""
    side = int(n**0.5)
    mesh = (side, n // side)
    code = f"""
        import os
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from harness.simulation import fake_world as fake
        times = []
        for rank in range(0, {n}, max(1, {n} // 16)):
            start = time.perf_counter()
            if {harness}:
                shape = fake.shape_of({n}, None, {mesh}, ("dp", "tp"), {{}})
                fake.start(shape, rank, {{}}, "cpu")
                fake.stop()
            else:
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size={n})
                dist.destroy_process_group()
            times.append(time.perf_counter() - start)
        print(json.dumps(times))
        """
    return Sample.of(_run(code))


def main() -> list[str]:
    lines = [
        "",
        "## Simulated worlds: thread-ranks and fake worlds against torch's tools",
        "",
        "A whole thread-rank world: start, set up the group, one all_reduce, end (median of "
        "3 fresh interpreters; 1 at 4096):",
        "",
        "| thread-ranks | torch's threaded backend | harness threaded_world | torch / harness |",
        "|---|---|---|---|",
    ]
    for n in SIZES:
        rounds = 1 if n > 256 else 3  # 4096 thread-ranks take torch's backend a minute
        theirs = Sample.of([_whole_world("torch_threaded", n) for _ in range(rounds)])
        ours = Sample.of([_whole_world("harness_threaded", n) for _ in range(rounds)])
        lines.append(f"| {n} | {theirs.s()} | {ours.s()} | {theirs.median / ours.median:.1f}x |")
    lines += [
        "",
        f"One collective (the slowest rank's time from a barrier; median of {REPEATS}):",
        "",
        "| thread-ranks | torch's backend: all_reduce | harness: all_reduce | "
        "harness: rw.all_reduce | rw / plain (harness) |",
        "|---|---|---|---|---|",
    ]
    ratio_at_target = float("inf")
    for n in PER_OP_SIZES:
        torch_op = _per_op("torch_threaded", "all_reduce", n)
        plain = _per_op("harness_threaded", "all_reduce", n)
        labelled = _per_op("harness_threaded", "rw.all_reduce", n)
        ratio = labelled.median / plain.median
        if n == TARGET_SIZE:
            ratio_at_target = ratio
        lines.append(f"| {n} | {torch_op.ms()} | {plain.ms()} | {labelled.ms()} | {ratio:.2f}x |")
    lines += [
        "",
        "A fake world per rank swept (set up and torn down; 16 ranks of each size):",
        "",
        "| ranks | torch's FakeStore + fake backend | harness fake_world (env, 2-D mesh) |",
        "|---|---|---|",
    ]
    for n in SIZES:
        lines.append(
            f"| {n} | {_fake_world_start(n, False).ms()} | {_fake_world_start(n, True).ms()} |"
        )
    held = ratio_at_target <= RATIO_TARGET
    lines += [
        "",
        f"- {'HELD' if held else 'MISSED'}: rw.all_reduce within {RATIO_TARGET:g}x a plain "
        f"all_reduce at {TARGET_SIZE} thread-ranks ({ratio_at_target:.2f}x)",
    ]
    return lines


if __name__ == "__main__":
    print_and_exit(main())
