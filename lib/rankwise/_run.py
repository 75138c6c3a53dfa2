"""A run's process group, owned for a block: set up, yielded as state, torn down or aborted."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from rankwise import _error_file, _points, _transport, _watch
from rankwise._launch import (
    is_initialized,
    launch_rank,
    launch_world_size,
    rank,
    size,
)

# The exit status of a rank that leaves through abort(): distinct from a crash (a signal) and
# from an ordinary failure (1), so launchers' logs and the harness can tell it apart.
ABORT_EXIT_CODE = 70


@dataclass(frozen=True)
class DistributedState:
    """Where this process stands in its run: rank, size of the run, and its compute device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that writes the run's outputs."""
        return self.rank == 0


class _LiveState(DistributedState):
    """The state distributed_run yields: inside the block its rank and size are read from the
    live group each time, so they follow a group the body sets up; when the block ends they
    keep the values they had then (the run's), so that after a run that destroyed its group
    `state.is_main` is still true on rank 0 alone. Its hash is its device's, which never
    changes, so it stays findable in a set or dict while its rank and size move."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("rank", "world_size"):
            ended = object.__getattribute__(self, "__dict__").get("_ended")
            if ended is not None:
                return ended[0] if name == "rank" else ended[1]
            return rank() if name == "rank" else size()
        return super().__getattribute__(name)

    def end(self) -> None:
        """Keep the rank and size read now, for after the block."""
        object.__setattr__(self, "_ended", (self.rank, self.world_size))

    def _fields(self) -> tuple[int, int, torch.device]:
        return self.rank, self.world_size, self.device

    def __eq__(self, other: object) -> bool:  # equal to a DistributedState of the same values
        if not isinstance(other, DistributedState):
            return NotImplemented
        return self._fields() == (other.rank, other.world_size, other.device)

    def __hash__(self) -> int:
        return hash(self.device)

    def __repr__(self) -> str:
        rank_now, size_now, device = self._fields()
        return f"DistributedState(rank={rank_now}, world_size={size_now}, device={device!r})"


@contextlib.contextmanager
def distributed_run(
    timeout: timedelta | None = None, device: torch.device | str = "cuda"
) -> Iterator[DistributedState]:
    """Own this run's process group for the block and yield this process's state.

    On a distributed launch (WORLD_SIZE > 1): bind this rank's CUDA device (LOCAL_RANK) and,
    unless the caller already set a group up, set up an NCCL group with `timeout`; any device
    but CUDA is refused. Without a launch nothing is set up and the state is on `device`.
    Inside the block rank and size come from the live group; after it the state keeps the
    values they had when the block ended. On exit the group this run set up (or the body set
    up, also in place of the caller's) is destroyed; the group that was there when the run
    began is the caller's and is left alone.
    If the body raises in a run of several ranks on a group the run owns, the rank leaves
    through `abort()` instead: destroying the group would wait on peers stuck elsewhere. A
    `SystemExit` is not an error and tears down normally (every rank must exit together).
    """
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"distributed_run: timeout must be a datetime.timedelta or None; got {timeout!r}"
        )
    requested = _parse_device(device)
    callers_group = dist.group.WORLD if is_initialized() else None
    state_device = _prepare_launch(requested, timeout) if _is_launch() else requested
    if state_device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"distributed_run: device {str(device)!r} asks for CUDA, but CUDA is not available "
            f"here (torch.cuda.is_available() is False); pass device='cpu' or run on a GPU machine"
        )
    if callers_group is not None and timeout is not None and size() > 1:
        warnings.warn(
            f"distributed_run: timeout={timeout} is ignored: the caller set the process group "
            f"up ({size()} ranks) before the run, and a group's timeout is fixed when it is "
            f"created; pass the timeout to init_process_group instead",
            RuntimeWarning,
            stacklevel=3,
        )
    state = _LiveState(rank=rank(), world_size=size(), device=state_device)
    _watch.current()  # on a launch, this rank's heartbeat starts with the run
    try:
        _points.passed("distributed_run", "enter")  # a fault injected here acts as the body's
        yield state
        _points.passed("distributed_run", "exit")
    except SystemExit as exc:
        state.end()
        _teardown(callers_group, wait=True, exiting=exc)
        raise
    except BaseException as exc:
        state.end()
        if _owned(callers_group) and size() > 1:
            abort()  # writes this rank's entry for torchrun's summary itself
        _error_file.leaving(exc, rank())  # torchrun's summary names the rank that failed
        _teardown(callers_group, wait=False)
        raise
    state.end()
    _teardown(callers_group, wait=True)


def _owned(callers_group: Any) -> bool:
    """Whether a live group is the run's to tear down: any but the one the caller had set up
    when the run began (a body may destroy that one and set up its own)."""
    return is_initialized() and dist.group.WORLD is not callers_group


def _is_launch() -> bool:
    return launch_world_size() > 1


def _parse_device(device: torch.device | str) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"distributed_run: device must be a torch.device or a string such as 'cuda' or "
            f"'cpu'; got {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(
            f"distributed_run: unknown device {device!r} ({exc}); use 'cuda', 'cuda:N' or 'cpu'"
        ) from None


def _prepare_launch(requested: torch.device, timeout: timedelta | None) -> torch.device:
    """Bind this rank's GPU and set the launch's NCCL group up unless the caller did."""
    world = launch_world_size()
    if requested.type != "cuda":
        raise ValueError(
            f"distributed_run: this process was launched as one of {world} ranks "
            f"(WORLD_SIZE={world}), which compute on CUDA, one GPU each; device "
            f"{str(requested)!r} is refused. Leave device at 'cuda', or run without a launcher "
            f"for a single CPU process"
        )
    local = launch_rank("LOCAL_RANK")
    if requested.index is not None and requested.index != local:
        raise ValueError(
            f"distributed_run: device {str(requested)!r} is refused: this rank's GPU is "
            f"cuda:{local} (LOCAL_RANK={local}), one GPU per rank. Pass 'cuda' (or "
            f"'cuda:{local}') and the run binds it"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"distributed_run: launched as one of {world} ranks, but CUDA is not available on "
            f"this machine (torch.cuda.is_available() is False); run on a machine with GPUs"
        )
    count = torch.cuda.device_count()
    if local >= count:
        raise RuntimeError(
            f"distributed_run: LOCAL_RANK={local} but this machine has {count} GPU(s); launch "
            f"at most {count} ranks per node"
        )
    cuda = torch.device("cuda", local)
    torch.cuda.set_device(cuda)
    if not is_initialized():
        dist.init_process_group(backend="nccl", device_id=cuda, timeout=timeout)
    return cuda


def _teardown(callers_group: Any, wait: bool, exiting: SystemExit | None = None) -> None:
    """Destroy the group the run owns; on a normal exit, once every rank has got here.

    Destroying does not wait on gloo, so without the barrier a rank would leave while its
    peers still work. The barrier is bounded by the group's own timeout (the run's, for the
    launch's group). `exiting`: the SystemExit the body raised, which stays the rank's own.
    """
    if not _owned(callers_group):
        return
    if wait and size() > 1:
        _wait_for_every_rank(exiting)
    if is_initialized():  # a failed wait destroyed it already
        dist.destroy_process_group()


def _wait_for_every_rank(exiting: SystemExit | None) -> None:
    """A barrier whose failure says what it means: a peer left the run without finishing,
    or, for a rank exiting, that its peers did not exit with it."""
    where = f"rank {rank()} of {size()}"
    try:
        _transport.settle(dist.barrier(async_op=True))  # through the peer watch on a launch
    except _watch.PeersLost as exc:  # the group cannot be destroyed: it would wait for them
        error = RuntimeError(
            f"distributed_run: {where} finished its run, but waiting for every rank at the "
            f"run's end found {exc}; the process must end"
        )
        if len(exc.lost) == 1:
            error.origin_rank = exc.lost[0]  # type: ignore[attr-defined]
        error._rankwise_lost = exc.lost  # type: ignore[attr-defined]
        watch = _watch.current()
        if watch is not None:
            watch.leaving()
        _error_file.note_peers_lost(error, in_flight=True)
        raise error from None
    except RuntimeError as exc:
        dist.destroy_process_group()
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if exiting is not None:  # its exit goes on, with its code: only say why it waited
            print(
                f"rankwise: distributed_run: {where} exited alone (SystemExit({exiting.code!r}))"
                f" and waited for its peers at the run's end until that failed ({reason}): an "
                f"exit must be every rank's (raise it inside all_reduce() or broadcast_from() "
                f"so that it is), or raise an error instead",
                file=sys.stderr,
                flush=True,
            )
            return
        raise RuntimeError(
            f"distributed_run: {where} finished its run, but waiting for every rank at the "
            f"run's end failed ({reason}): a peer left without finishing (it aborted, "
            f"crashed or exited alone); see that rank's own error"
        ) from exc


def abort() -> NoReturn:
    """Leave the run now: print the error being handled, then end the process.

    Used instead of tearing a group down when peers may be blocked in a collective this rank
    never reaches: the launcher (torchrun) sees the exit status and tears the whole job down.
    """
    this_rank = rank()
    description = f"rank {this_rank} of {size()}"
    error = sys.exc_info()[1]
    if error is not None:
        _error_file.write_for(error, this_rank)
    header = f"rankwise: {description} aborting the run (exit status {ABORT_EXIT_CODE})"
    if error is None:
        print(header, file=sys.stderr)
    elif _error_file.is_collateral(error, this_rank) and not _error_file.full_tracebacks():
        print(_error_file.one_line(error, header), file=sys.stderr)  # the root prints its own
    else:
        print(f"{header}:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    watch = _watch.current()
    if watch is not None and error is not None and hasattr(error, "_rankwise_peers_lost"):
        watch.spoken(tuple(getattr(error, "_rankwise_lost", ())))  # let the others say it too
    os._exit(ABORT_EXIT_CODE)
