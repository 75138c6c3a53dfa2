"""The library against torch's object collectives, side by side, on 4 gloo ranks.

- gather_bytes vs torch.distributed.gather_object of the same bytes: time and peak memory of
  the receiving rank (RSS growth), each method in a fresh world so the peaks do not mix.
- all_reduce / broadcast_from vs all_gather_object / broadcast_object_list: latency on a
  small value, until every rank holds it.
- Time for every rank to raise when one rank's fn fails (ours), against how long a plain
  all_gather_object waits when a rank never joins (theirs: the group timeout, set short).
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import start_processes

from benchmarks._common import Sample, print_and_exit

WORLD = 4
MIB = 1024 * 1024


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _world(rank: int, store_path: str, job: str, arg: Any, results: Any) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60 if job != "plain_wait" else 3),
    )
    if job == "plain_wait":
        value = JOBS[job](rank, arg)
        if rank == 0:
            results.put(value)
        # The timed-out group cannot be torn down cleanly (gloo may abort in its destructors
        # at exit): leave at once, the measurement is already queued.
        os._exit(0)
    try:
        value = JOBS[job](rank, arg)
        if rank == 0:
            results.put(value)
    finally:
        dist.destroy_process_group()


def _gather(rank: int, args: tuple[Any, ...]) -> tuple[list[float], int]:
    import rankwise as rw

    method, size, *chunk = args
    data = bytes([rank % 256]) * size
    baseline = _rss_bytes()
    times = []
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        if method == "gather_bytes":
            out: Any = rw.gather_bytes(data, dst=0, chunk_bytes=chunk[0] if chunk else 256 * MIB)
        else:
            out = [None] * WORLD if rank == 0 else None
            dist.gather_object(data, out, dst=0)
        times.append(time.perf_counter() - start)
        if rank == 0:
            assert out is not None and len(out[3]) == size
        del out
    return times, _peak_rss_bytes() - baseline


def _gather_times(rank: int, size: int) -> tuple[list[float], list[float]]:
    """gather_bytes and gather_object alternating in one world (time only; memory peaks
    need a world each), so the machine's load falls on both alike."""
    import rankwise as rw

    data = bytes([rank % 256]) * size
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(15):
        for which in (0, 1):
            dist.barrier()
            start = time.perf_counter()
            if which == 0:
                rw.gather_bytes(data, dst=0)
            else:
                dist.gather_object(data, [None] * WORLD if rank == 0 else None, dst=0)
            times[which].append(time.perf_counter() - start)
    return times[0][3:], times[1][3:]


def _latency(rank: int, methods: tuple[str, str]) -> tuple[list[float], list[float]]:
    """Both methods in one world, alternating call by call, so load on the machine (noisy
    here) falls on both alike; the first 10 of 210 rounds are warm-up. Each call is timed until
    every rank holds the value (the call, then a barrier that both pay): a broadcast's source
    alone returns once its bytes are sent, which would time the sending only."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(210):
        for which, method in enumerate(methods):
            dist.barrier()
            start = time.perf_counter()
            _small_collective(method, rank, i)
            dist.barrier()
            times[which].append(time.perf_counter() - start)
    return times[0][10:], times[1][10:]


def _small_collective(method: str, rank: int, i: int) -> None:
    import rankwise as rw

    if method == "all_reduce":
        rw.all_reduce("bench", lambda: {"step": i, "rank": rank}, lambda xs: xs[0])
    elif method == "all_gather_object":
        out: list[Any] = [None] * WORLD
        dist.all_gather_object(out, {"step": i, "rank": rank})
    elif method == "broadcast_from":
        rw.broadcast_from("bench", lambda: {"step": i})
    else:
        box: list[Any] = [{"step": i}]
        dist.broadcast_object_list(box, src=0)


def _total(values: list[float]) -> float:
    return sum(values)


def _fail_fast(rank: int, _: Any) -> float:
    import rankwise as rw

    dist.barrier()
    start = time.perf_counter()
    with contextlib.suppress(ZeroDivisionError, RuntimeError):
        rw.all_reduce("step", lambda: 1 / (rank - 1), _total)  # rank 1 divides by zero
    return time.perf_counter() - start


def _plain_wait(rank: int, _: Any) -> float:
    """Rank 1 never joins; the others wait in all_gather_object until the group times out."""
    dist.barrier()
    start = time.perf_counter()
    if rank != 1:
        try:
            out: list[Any] = [None] * WORLD
            dist.all_gather_object(out, rank)
        except Exception:
            pass
    else:
        time.sleep(5)
    return time.perf_counter() - start


JOBS: dict[str, Callable[[int, Any], Any]] = {
    "gather": _gather,
    "gather_times": _gather_times,
    "latency": _latency,
    "fail_fast": _fail_fast,
    "plain_wait": _plain_wait,
}


def run_world(job: str, arg: Any = None) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        start_processes(  # type: ignore[no-untyped-call]
            _world,
            args=(os.path.join(tmp, "store"), job, arg, results),
            nprocs=WORLD,
            start_method="spawn",
            join=True,
        )
        return results.get()


def chunk_section() -> list[str]:
    """gather_bytes of 64 MiB per rank with smaller and smaller chunks: the peak follows."""
    lines = ["", "## Library: gather_bytes memory against chunk_bytes (64 MiB per rank)", ""]
    lines += ["| chunk_bytes | time | peak RSS growth on dst |", "|---|---|---|"]
    for chunk in (4, 16, 64):
        times, peak = run_world("gather", ("gather_bytes", 64 * MIB, chunk * MIB))
        lines.append(f"| {chunk} MiB | {Sample.of(times).ms()} | {peak / MIB:.0f} MiB |")
    return [
        *lines,
        "",
        "The receiving rank must hold the 4 x 64 MiB it gathers; on gloo each chunk lands "
        "straight in those buffers, so the chunk size changes little here; on NCCL it bounds "
        "the device buffers (ranks x chunk).",
    ]


def main(sizes_mib: tuple[int, ...] = (1, 16, 64, 256)) -> tuple[list[str], list[Any]]:
    lines = ["## Library: gather_bytes vs gather_object (4 ranks, gloo, receiving rank)", ""]
    lines += [
        "| per rank | gather_bytes time | gather_object time | time ratio | "
        "gather_bytes peak RSS growth | gather_object peak RSS growth |",
        "|---|---|---|---|---|---|",
    ]
    holds = []
    rows: list[Any] = []
    for size in sizes_mib:
        ours_t, ours_mem = run_world("gather", ("gather_bytes", size * MIB))
        theirs_t, theirs_mem = run_world("gather", ("gather_object", size * MIB))
        a, b = Sample.of(ours_t), Sample.of(theirs_t)
        rows.append((size, a, b, ours_mem / MIB, theirs_mem / MIB))
        lines.append(
            f"| {size} MiB | {a.ms()} | {b.ms()} | {b.median / a.median:.2f}x | "
            f"{ours_mem / MIB:.0f} MiB | {theirs_mem / MIB:.0f} MiB |"
        )
        if size == 64:
            holds.append(
                (
                    "gather_bytes at least as fast as gather_object at 64 MiB",
                    a.median <= b.median * 1.05,
                    f"{a.median * 1e3:.0f} vs {b.median * 1e3:.0f} ms",
                )
            )
            holds.append(
                (
                    "gather_bytes lower peak memory at 64 MiB",
                    ours_mem < theirs_mem,
                    f"{ours_mem / MIB:.0f} vs {theirs_mem / MIB:.0f} MiB",
                )
            )
    ours_t, theirs_t = run_world("gather_times", MIB)
    a, b = Sample.of(ours_t), Sample.of(theirs_t)
    lines += [
        "",
        f"Side by side in one world at 1 MiB per rank: gather_bytes {a.ms()}, gather_object "
        f"{b.ms()} ({b.median / a.median:.2f}x the speed).",
    ]
    holds.append(
        (
            "gather_bytes at least as fast as gather_object at 1 MiB",
            a.median <= b.median * 1.05,
            f"{a.median * 1e3:.1f} vs {b.median * 1e3:.1f} ms",
        )
    )
    lines += chunk_section()
    lines += [
        "",
        "## Library: labelled collectives vs torch's object collectives (small value)",
        "",
    ]
    lines += ["| ours | median | theirs | median | ratio |", "|---|---|---|---|---|"]
    for ours_name, theirs_name in (
        ("all_reduce", "all_gather_object"),
        ("broadcast_from", "broadcast_object_list"),
    ):
        ours, theirs = run_world("latency", (ours_name, theirs_name))
        a, b = Sample.of(ours), Sample.of(theirs)
        ratio = a.median / b.median
        lines.append(f"| {ours_name} | {a.ms()} | {theirs_name} | {b.ms()} | {ratio:.2f}x |")
        holds.append((f"{ours_name} within 1.1x of {theirs_name}", ratio <= 1.1, f"{ratio:.2f}x"))
    fast = run_world("fail_fast")
    slow = run_world("plain_wait")
    lines += [
        "",
        "## Library: one rank's fn fails",
        "",
        f"- rankwise all_reduce: every rank raised after **{fast * 1e3:.1f} ms** (rank 0's view)",
        f"- plain all_gather_object with a rank that never joins: rank 0 waited "
        f"**{slow:.2f} s**, its group timeout (set to 3 s here; the default is 30 min)",
        "",
        "Targets:",
    ]
    lines += [f"- {'HOLDS' if ok else 'MISSED'}: {name} ({detail})" for name, ok, detail in holds]
    return [*lines, ""], rows


if __name__ == "__main__":
    sizes = tuple(int(a) for a in sys.argv[1:]) or (1, 16, 64, 256)
    print_and_exit(main(sizes)[0])
