"""`make bench`: every benchmark in one go; writes benchmarks/results.md (and plots)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks import collectives, harness_overhead
from benchmarks._common import machine

RESULTS = Path(__file__).resolve().parent / "results.md"


def main() -> int:
    started = time.perf_counter()
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}. Produced by `make bench` on {time.strftime('%Y-%m-%d')}; each "
        "figure is a median with its spread (min-max) over the runs shown, and each ratio "
        "compares two runners measured side by side in the same run.",
        "",
    ]
    for section in (harness_overhead.main, collectives.main):
        lines += section()
        print("\n".join(lines[-3:]), flush=True)
    lines.append(f"Total benchmark time: {time.perf_counter() - started:.0f} s")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {RESULTS}")
    return 1 if any(line.startswith("- MISSED") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
