"""What the peer watch costs a production loop: rankwise's all_reduce at 4 ranks under
torchrun, with the watch (its heartbeat thread, and each collective waited in slices) and
without it (RANKWISE_PEER_TIMEOUT=0), alternating rounds in the same run.

Target: the labelled all_reduce within 1.05x with the watch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._common import ROOT, Sample, print_and_exit

RANKS = 4
STEPS = 300
ROUNDS = 5
TARGET = 1.05

LOOP = """
import json, os, time
import torch, torch.distributed as dist
import rankwise as rw

dist.init_process_group("gloo")
rank = dist.get_rank()
for _ in range(20):  # warm up (the watch starts at the first labelled collective)
    rw.all_reduce("warm", lambda: rank, sum)
times = []
for step in range(int(os.environ["STEPS"])):
    start = time.perf_counter()
    rw.all_reduce("step", lambda: step, sum)
    times.append(time.perf_counter() - start)
if rank == 0:
    times.sort()
    with open(os.environ["OUT"], "w") as f:
        json.dump(times[len(times) // 2], f)
dist.destroy_process_group()
"""


def _median_step(watch: bool, folder: Path) -> float:
    script, out = folder / "loop.py", folder / "out.json"
    script.write_text(LOOP)
    env = {**os.environ, "STEPS": str(STEPS), "OUT": str(out), "OMP_NUM_THREADS": "1"}
    env["RANKWISE_PEER_TIMEOUT"] = "60" if watch else "0"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={RANKS}", str(script)],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return float(json.loads(out.read_text()))


def main() -> list[str]:
    with tempfile.TemporaryDirectory(prefix="bench-watch-") as tmp:
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ROUNDS):
            for watch in (False, True):
                runs[watch].append(_median_step(watch, Path(tmp)))
    on, off = Sample.of(runs[True]), Sample.of(runs[False])
    ratio = on.median / off.median
    return [
        "",
        f"## The peer watch's cost: rw.all_reduce at {RANKS} ranks under torchrun",
        "",
        "| | median step (median of rounds) |",
        "|---|---|",
        f"| watch off (RANKWISE_PEER_TIMEOUT=0) | {off.ms()} |",
        f"| watch on (the default, 60 s) | {on.ms()} |",
        "",
        f"- {'HELD' if ratio <= TARGET else 'MISSED'}: with the watch within {TARGET}x "
        f"({ratio:.3f}x)",
    ]


if __name__ == "__main__":
    print_and_exit(main())
