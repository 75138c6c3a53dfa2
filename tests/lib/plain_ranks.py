"""Ranks as plain processes, outside the harness: nobody frees a peer left waiting.

`run(scenario, world_size, directory)` starts one spawned process per rank, each with a
gloo group whose timeout is far past the bound here, runs `SCENARIOS[scenario]` on it and
reports how each rank ended; each stays alive until every rank has said so. A rank that
has not said by the bound is reported as "waiting" and killed: in the harness it would have
been freed as collateral, here it would wait until the group's timeout (30 minutes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

# A safety net far above the seconds these take (a spawn and a torch import per rank):
# only a rank that really waits for a peer reaches it.
BOUND_S = 240.0
GROUP_TIMEOUT = timedelta(minutes=30)


class _Interrupting:
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise KeyboardInterrupt


class _ExitingText(Exception):
    def __str__(self) -> str:
        raise KeyboardInterrupt


class _ExitingRepr:
    def __repr__(self) -> str:
        raise KeyboardInterrupt

    def __index__(self) -> int:
        raise SystemExit(3)


def _dst_past_int64(rank: int) -> Any:
    import rankwise as rw

    return rw.gather_bytes(b"x", dst=2**63 if rank == 1 else 0)


def _chunk_past_int64(rank: int) -> Any:
    import rankwise as rw

    return rw.gather_bytes(b"x", dst=0, chunk_bytes=2**63 if rank == 1 else 8)


def _interrupted_encode(rank: int) -> Any:
    import rankwise as rw
    import torch

    state = {"w": _Interrupting() if rank == 1 else torch.ones(2)}
    return len(list(rw.gather_state_dicts(state, dst=0)))


def _error_text_interrupts(rank: int) -> Any:
    import rankwise as rw

    def fn() -> int:
        if rank == 1:
            raise _ExitingText()
        return 1

    return rw.all_reduce("x", fn, sum)


def _repr_exits(rank: int) -> Any:
    import rankwise as rw

    return rw.broadcast_from("x", lambda: 1, src=_ExitingRepr() if rank == 1 else 0)


SCENARIOS: dict[str, Callable[[int], Any]] = {
    "dst_past_int64": _dst_past_int64,
    "chunk_past_int64": _chunk_past_int64,
    "interrupted_encode": _interrupted_encode,
    "error_text_interrupts": _error_text_interrupts,
    "repr_exits": _repr_exits,
}


def _rank_main(
    scenario: str, rank: int, world_size: int, directory: str, reports: Any, done: Any
) -> None:
    import torch.distributed as dist

    store = f"file://{os.path.join(directory, 'store')}"
    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    try:
        SCENARIOS[scenario](rank)
        said: dict[str, Any] = {"rank": rank, "ending": "returned"}
    except BaseException as exc:  # what the rank's own caller would see
        said = {"rank": rank, "ending": "raised", "type": type(exc).__name__}
    reports.put(json.dumps(said))
    # Alive until every rank has said how it ended, as a program that goes on after its
    # error would be: a rank that exited here would free its waiting peers itself.
    done.wait(BOUND_S)
    os._exit(0)  # no teardown: a destroy would wait on a peer that is still waiting


def run(scenario: str, world_size: int, directory: Path) -> list[dict[str, Any]]:
    """How each rank ended: {"ending": "returned" | "raised" | "waiting", "type": ...}."""
    context = multiprocessing.get_context("spawn")
    reports, done = context.Queue(), context.Event()
    ranks = [
        context.Process(
            target=_rank_main, args=(scenario, r, world_size, str(directory), reports, done)
        )
        for r in range(world_size)
    ]
    for process in ranks:
        process.start()
    ended: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + BOUND_S
    try:
        while len(ended) < world_size:
            said = json.loads(reports.get(timeout=max(0.0, deadline - time.monotonic())))
            ended[said["rank"]] = said
    except queue.Empty:  # the ranks that have not said by the bound still wait
        pass
    finally:
        done.set()
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
    return [ended.get(r, {"ending": "waiting"}) for r in range(world_size)]
