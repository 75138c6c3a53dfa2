"""`make bench`: every benchmark in one go; writes benchmarks/results.md and the plots."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from benchmarks import (
    adopt,
    cluster,
    collectives,
    compute,
    coverage_cost,
    first_test,
    harness_overhead,
    peer_watch,
    plots,
    preload,
    private_store,
    signing,
    simulation,
    suite,
    wire,
)
from benchmarks._common import machine, missed

RESULTS = Path(__file__).resolve().parent / "results.md"


def main() -> int:
    started = time.perf_counter()
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}. Produced by `make bench` on {time.strftime('%Y-%m-%d')}. Each "
        "figure is a median with its spread (min-max) over the runs shown; each ratio compares "
        "two runners measured side by side in the same run.",
        "",
        "![per-test overhead against world size](overhead.png)",
        "",
        "![gather_bytes against gather_object](gather.png)",
        "",
    ]
    print("measuring the harness against its peers...", flush=True)
    section, overheads = harness_overhead.main()
    lines += section
    plots.overhead_plot(overheads)
    _write(lines)  # each section is saved as it completes
    print("measuring a whole suite...", flush=True)
    lines += suite.main()
    _write(lines)
    print("measuring compute-heavy ranks...", flush=True)
    lines += compute.main()
    _write(lines)
    print("measuring an existing suite, as it is and adopted...", flush=True)
    lines += adopt.main()
    print("measuring torch's DistributedTest, as it is and adopted...", flush=True)
    lines += adopt.distributed_test()
    print("measuring torch's RPC suites and DDP under dist autograd, as is and adopted...")
    lines += adopt.rpc_suite() + adopt.ddp_under_dist_autograd()
    _write(lines)
    print("measuring the library against torch's object collectives...", flush=True)
    section, rows = collectives.main()
    lines += section
    plots.gather_plot(rows)
    _write(lines)
    print("measuring the sender's cost of a value that travels...", flush=True)
    lines += wire.main()
    _write(lines)
    print("measuring the cost of signing the store keys...", flush=True)
    lines += signing.main()
    print("measuring the ranks' private store against a TCPStore...", flush=True)
    lines += ["", "## The ranks' private store", "", *private_store.main()]
    print("measuring coverage in ranks against coverage in plain tests...", flush=True)
    lines += coverage_cost.main()
    _write(lines)
    print("measuring a one-test session, with ranks and plain...", flush=True)
    lines += first_test.main()
    _write(lines)
    print("measuring launched ranks (torchrun, one agent per node) against warm ranks...")
    lines += cluster.main()
    _write(lines)
    print("measuring the peer watch's cost per collective...", flush=True)
    lines += peer_watch.main()
    _write(lines)
    print("measuring simulated worlds against torch's tools...", flush=True)
    lines += simulation.main()
    _write(lines)
    print("measuring rank starts with the tests' imports preloaded...", flush=True)
    lines += ["", "## Ranks started with the tests' imports loaded", "", *preload.main()]
    lines.append(f"Total benchmark time: {time.perf_counter() - started:.0f} s")
    _write(lines)
    print("\n".join(lines))
    print(f"\nwrote {RESULTS}")
    return 1 if missed(lines) else 0


def _write(lines: list[str]) -> None:
    RESULTS.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
