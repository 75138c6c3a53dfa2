"""The cost of the ranks' private store (a file in the 0700 work directory) against the
TCPStore on a loopback port it replaced, per fresh gloo group: the only set-up that waits
on the store (a kept group reads nothing from it).

Each round starts `world` spawned ranks that set up and destroy 30 groups through one store
kind, then the other, alternating, so both see the same machine. Target: within 1.25x.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks._common import print_and_exit

GROUPS = 30
ROUNDS = 3
TARGET = 1.25


def _store(kind: str, where: str) -> Any:
    import torch.distributed as dist

    from harness.rank.private_store import PrivateStore

    if kind == "private":
        return PrivateStore(where, timedelta(seconds=60))
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", int(where), is_master=False, wait_for_workers=False
    )


def _rank(kind: str, where: str, prefix: str, rank: int, world: int, took: Any) -> None:
    import torch
    import torch.distributed as dist

    store = _store(kind, where)
    start = time.perf_counter()
    for i in range(GROUPS):
        scoped = dist.PrefixStore(f"{prefix}/{i}", store)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=scoped, rank=rank, world_size=world)
        dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()
    if rank == 0:
        took.value = (time.perf_counter() - start) / GROUPS


def _per_group(kind: str, where: str, prefix: str, world: int) -> float:
    context = mp.get_context("spawn")
    took = context.Value("d", 0.0)
    ranks = [
        context.Process(target=_rank, args=(kind, where, prefix, r, world, took))
        for r in range(world)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(300)
    return float(took.value)


def main() -> list[str]:
    from harness.common import loopback

    server = loopback.store()
    lines = [
        "| per fresh gloo group (set-up, one all_reduce, destroy), median | private file | "
        "TCPStore | ratio |",
        "|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for world in (2, 4):
            times: dict[str, list[float]] = {"private": [], "tcp": []}
            for round_ in range(ROUNDS):
                for kind in ("private", "tcp"):
                    where = str(Path(folder) / "store") if kind == "private" else str(server.port)
                    prefix = f"{kind}/{world}/{round_}"
                    times[kind].append(_per_group(kind, where, prefix, world))
            private, tcp = (statistics.median(times[k]) for k in ("private", "tcp"))
            lines.append(
                f"| {world} ranks | {private * 1e3:.1f} ms | {tcp * 1e3:.1f} ms | "
                f"{private / tcp:.2f}x |"
            )
    return lines


if __name__ == "__main__":
    print_and_exit(main())
