"""Honesty on a fake world: torch's "fake" backend moves no data.

On a fake process group (one process standing for one rank of a large world, as test
suites use to check plans and shapes at scale), a collective's output holds this rank's own
data where every other rank's should be. A labelled collective that returned that would
return a plausible, wrong value (an all_reduce of 7 over 8 "ranks" giving 56). So each one
asks here first: it computes what this rank would really see where that is known from this
rank alone (the source of a broadcast, a rank that only sends its part of a gather), and
otherwise raises :class:`NotSimulatedError`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class NotSimulatedError(RuntimeError):
    """A collective whose result depends on other ranks' data, called on a fake world."""


def on_fake_world(group: Any = None) -> bool:
    """Whether `group` (default: the world) runs on torch's "fake" backend."""
    return str(dist.get_backend(group)).lower() == "fake"


def not_simulated(text: str, rank: int, group: Any, what: str) -> NotSimulatedError:
    """The error for a call whose result needs `what` (the other ranks' values, say)."""
    others = dist.get_world_size(group) - 1
    return NotSimulatedError(
        f"{text} on rank {rank}: not simulated on a fake world: its result needs {what} of "
        f"the other {others} rank{'s' if others != 1 else ''}, which a fake process group "
        f"never moves (torch's 'fake' backend would hand back this rank's own data in their "
        f"place, a plausible but wrong result). Test it on thread-ranks (the harness's "
        f"threaded_world) or on real ranks, or give the call's result to the code under test"
    )
