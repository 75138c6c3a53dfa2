"""The messages between the pytest process and its ranks, all in one place.

Every message is a :class:`Message`: a :class:`Kind` and the one payload type that kind
carries, so no event name is a bare string scattered over files. Imports no torch: the
pytest side loads this module at collection time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from harness.faults import Fault
from harness.outcome import RankOutcome


class Kind(enum.Enum):
    READY = "ready"  # worker -> pytest, once, when the rank can take work
    RUN = "run"  # pytest -> worker: run one test (or function) on this rank
    RESULT = "result"  # worker -> pytest: how the rank ended that run


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Target:
    """A module-level function, or a method of a test class, found by name in a rank."""

    module: str
    file: str | None  # loaded with assertion rewriting when given
    qualname: str


@dataclass(frozen=True)
class RunTask:
    key: str  # unique per run; the result carries it back so a late one is never misfiled
    rank: int
    world_size: int
    backend: str
    device: str
    timeout_s: float
    store_host: str
    store_port: int
    store_prefix: str
    launch_port: int | None  # launch mode: torchrun's env, rendezvous on this store
    launch_attempt: int
    target: Target
    args_blob: bytes  # pickled (args, kwargs), loaded after the target's module
    sys_path: list[str] = field(default_factory=list)
    cwd: str = "."
    env: dict[str, str] = field(default_factory=dict)  # the pytest process's, at run time
    faults: tuple[Fault, ...] = ()  # this rank's
    hygiene: frozenset[str] = frozenset()  # the leftover checks to make after the body


PAYLOAD_TYPES: dict[Kind, type] = {
    Kind.READY: Ready,
    Kind.RUN: RunTask,
    Kind.RESULT: RankOutcome,
}


@dataclass(frozen=True)
class Message:
    kind: Kind
    payload: Any

    def __post_init__(self) -> None:
        expected = PAYLOAD_TYPES[self.kind]
        assert isinstance(self.payload, expected), (self.kind, type(self.payload))
