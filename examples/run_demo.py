"""`make demo`: the main job end to end on this machine's CPUs.

1. A 4-rank calibration under torchrun (gloo): progress bar on rank 0, then a summary.
2. The example's own multi-rank tests on the harness (pytest -p harness --ranks 4).
3. What was produced.

`DEMO_FAIL=1 make demo` shows the failure path instead: rank 1's data loader fails, and every
rank stops at once naming the cause, where a plain torch.distributed job would sit in its
next collective until the process group timed out (30 minutes by default).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "calibration"
OUT = EXAMPLE / "out"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]


def banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def calibrate(fail_rank: int | None = None) -> tuple[int, float]:
    settings = OUT / "settings.json"
    settings.write_text(json.dumps({"batches_per_rank": 24, "batch": 4, "seq_len": 32, "seed": 0}))
    command = [
        *TORCHRUN,
        str(EXAMPLE / "calibrate.py"),
        "--settings",
        str(settings),
        "--out",
        str(OUT / "calibration.pt"),
    ]
    if fail_rank is not None:
        command += ["--fail-rank", str(fail_rank)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    code = subprocess.call(command, cwd=ROOT, env=env)
    return code, time.perf_counter() - started


def failure_demo() -> int:
    banner("failure demo: rank 1's data loader fails at its third batch")
    code, seconds = calibrate(fail_rank=1)
    print(
        f"\nthe job stopped after {seconds:.1f} s with exit status {code}: every rank raised in "
        f"all_reduce('load_batch') naming rank 1's OSError (see the tracebacks above). A plain "
        f"torch.distributed loop would leave ranks 0, 2 and 3 waiting in their next collective "
        f"until the process group's timeout (30 minutes by default)."
    )
    return 0 if code != 0 else 1  # the demo succeeds when the failure was caught


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    if os.environ.get("DEMO_FAIL"):
        return failure_demo()
    banner("1/3 calibrating a tiny Llama on 4 ranks (torchrun, gloo, CPU)")
    code, seconds = calibrate()
    if code != 0:
        print(f"calibration failed with exit status {code}", file=sys.stderr)
        return code
    print(f"(4-rank calibration took {seconds:.1f} s including start-up)")
    banner("2/3 the example's multi-rank tests on the harness")
    tests = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "harness",
        "--ranks",
        "4",
        "-v",
        "-p",
        "no:cacheprovider",
        str(EXAMPLE),
        str(ROOT / "examples" / "quickstart"),
    ]
    code = subprocess.call(tests, cwd=ROOT)
    if code != 0:
        return code
    banner("3/3 produced")
    import torch

    result = torch.load(OUT / "calibration.pt", weights_only=True)
    print(
        f"{OUT / 'calibration.pt'}: {len(result['amax'])} per-layer activation maxima, "
        f"{len(result['ranks'])} ranks x {result['ranks'][0]['batches']} batches each"
    )
    print("try DEMO_FAIL=1 make demo for the failure path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
