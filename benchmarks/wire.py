"""The sender's cost of a value that travels: rankwise's encode (torch.save, then a check that
it loads with weights_only) against torch.save alone of the same state, to bytes in memory.

Each measurement runs in a fresh spawned process, so peaks do not mix: peak RSS growth while
producing the bytes, and the time it takes. The check loads onto the meta device, so it reads
the pickle and builds no second copy of the tensors; target: peak within 1.2x torch.save's.
"""

from __future__ import annotations

import io
import os
import resource
import time
from typing import Any

import torch.multiprocessing as mp

from benchmarks._common import Sample, print_and_exit

MIB = 1024 * 1024
RUNS = 3
PEAK_TARGET = 1.2


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(method: str, size_mib: int, results: Any) -> None:
    import torch
    from rankwise import testing as wire

    per_tensor = size_mib * MIB // 8 // 4  # 8 float32 tensors: a state dict's shape
    state = {f"layer{i}.weight": torch.randn(per_tensor) for i in range(8)}
    before = _rss_bytes()
    started = time.perf_counter()
    if method == "encode":
        data = wire.encode(state, "benchmark")
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
    took = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results.put((took, max(0, peak - before), len(data)))


def _once(method: str, size_mib: int) -> tuple[float, int, int]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    process = ctx.Process(target=_measure, args=(method, size_mib, results))
    process.start()
    process.join()
    return results.get()  # type: ignore[no-any-return]


def main(size_mib: int = 256) -> list[str]:
    rows = {m: [_once(m, size_mib) for _ in range(RUNS)] for m in ("encode", "torch.save")}
    times = {m: Sample.of([r[0] for r in rows[m]]) for m in rows}
    peaks = {m: min(r[1] for r in rows[m]) / MIB for m in rows}  # the least noisy of the runs
    ratio = peaks["encode"] / peaks["torch.save"]
    held = ratio <= PEAK_TARGET
    return [
        "",
        f"## Library: the sender's cost of a {size_mib} MiB state (encode vs torch.save)",
        "",
        "| method | time | peak RSS growth (least of the runs) |",
        "|---|---|---|",
        f"| rankwise encode (save + weights_only check) | {times['encode'].s()} | "
        f"{peaks['encode']:.0f} MiB |",
        f"| torch.save to bytes | {times['torch.save'].s()} | {peaks['torch.save']:.0f} MiB |",
        "",
        f"- {'HELD' if held else 'MISSED'}: encode's peak within {PEAK_TARGET}x torch.save's "
        f"({ratio:.2f}x; time {times['encode'].median / times['torch.save'].median:.2f}x)",
    ]


if __name__ == "__main__":
    print_and_exit(main())
