"""A process group for thread-ranks: collectives and point-to-point between threads.

Written for ``threaded_world`` instead of torch's "threaded" test backend, which has no
send/recv (so rankwise's gathers cannot run), lets mismatched collectives return values,
makes rank 0 do every collective's work, and copies all_to_all element slice by slice.
Here each collective is a meeting of the group's thread-ranks keyed by the group's name and
its sequence number there: the last to arrive checks that every rank called the same
collective (op, root, reduction, sizes), does the work with whole-tensor copies, and wakes
the others. A mismatch raises CollectiveMismatch on every rank of the meeting. When the world
is aborted (a thread-rank failed, or the call's timeout passed) every waiting rank raises
PeerFailed. Sends are buffered (a copy is posted); receives complete when their message
arrives.
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

# A Work that completes with a future (what c10d wants back from a Python group); untyped.
_c10d: Any = torch._C._distributed_c10d
_create_work_from_future: Any = _c10d._create_work_from_future

BACKEND = "rankwise_threads"


class PeerFailed(RuntimeError):
    """A thread-rank was woken from a collective or a receive because the world ended."""


class CollectiveMismatch(RuntimeError):
    """The ranks of a group met in different collectives (or with different arguments)."""


class Meeting:
    """One collective of one group: each rank's data and call, until the last arrives."""

    def __init__(self, size: int, lock: threading.Lock) -> None:
        self.data: list[Any] = [None] * size
        self.calls: list[tuple[Any, ...] | None] = [None] * size
        self.arrived = 0
        self.done = False
        self.error: str | None = None
        self.odd: int | None = None  # the one rank whose call differs from all others'
        self.cond = threading.Condition(lock)


class ThreadWorld:
    """What the thread-ranks of one threaded_world call share."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.meetings: dict[tuple[str, int], Meeting] = {}
        self.mail: dict[tuple[str, int, int, int], deque[torch.Tensor]] = {}
        self.receives: dict[tuple[str, int, int, int], deque[tuple[list[Any], Future[Any]]]] = {}
        self.ended: str | None = None  # why the world was aborted

    def abort(self, why: str) -> None:
        """Wake every thread-rank waiting in a collective or a receive: each raises
        PeerFailed saying `why`."""
        with self.lock:
            if self.ended is None:
                self.ended = why
            for meeting in self.meetings.values():
                meeting.cond.notify_all()
            pending = [fut for queue in self.receives.values() for _, fut in queue]
            self.receives.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(PeerFailed(f"threaded_world: {why}"))


_world: ThreadWorld | None = None  # the world thread-ranks made now join


def install(world: ThreadWorld | None) -> None:
    """Make `world` the one new groups belong to (None when no call runs)."""
    global _world
    _world = world
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def _create(options: Any, backend_options: Any) -> ThreadGroup:
    if _world is None:
        raise RuntimeError(f"the {BACKEND!r} backend works only inside threaded_world")
    members = list(options.global_ranks_in_group) or list(range(options.group_size))
    return ThreadGroup(_world, options.group_rank, members, str(options.group_id))


def _done(result: Any) -> Any:
    fut: Future[Any] = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _shape(tensors: Any) -> tuple[Any, ...]:
    return tuple((t.dtype, t.numel()) for t in tensors)


_REDUCE: dict[Any, Callable[[torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.SUM: lambda s: s.sum(0),
    dist.ReduceOp.AVG: lambda s: s.sum(0) / s.shape[0],
    dist.ReduceOp.PRODUCT: lambda s: s.prod(0),
    dist.ReduceOp.MIN: lambda s: s.amin(0),
    dist.ReduceOp.MAX: lambda s: s.amax(0),
}


def _reducer(opts: Any) -> tuple[Any, Callable[[list[torch.Tensor]], torch.Tensor]]:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for known, fn in _REDUCE.items():
        if op == known:
            return str(known), functools.partial(_reduced, fn)
    raise NotImplementedError(f"threaded_world: reduction {op} is not simulated")


def _reduced(fn: Callable[[torch.Tensor], torch.Tensor], tensors: list[torch.Tensor]) -> Any:
    return fn(torch.stack(tensors)).to(tensors[0].dtype)


# torch's ProcessGroup, untyped: its stubs overload each collective with the public API's
# signatures, which the methods c10d calls on a Python group do not share.
_ProcessGroup: Any = dist.ProcessGroup


class ThreadGroup(_ProcessGroup):  # type: ignore[misc]
    """One thread-rank's view of one group."""

    def __init__(self, world: ThreadWorld, rank: int, members: list[int], name: str) -> None:
        super().__init__(rank, len(members))
        self._world = world
        self._rank = rank
        self._size = len(members)
        self._members = members  # global ranks, in group order
        self._name = name
        self._sequence = 0

    def size(self) -> int:
        return self._size

    @property
    def group_name(self) -> str:  # c10d names a Python group only through this property
        return self._name

    @property
    def pg_name(self) -> str:
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"ThreadGroup({self._name!r}, rank {self._rank} of {self._size})"

    # ---- the meeting ----------------------------------------------------------------------

    def _meet(self, call: tuple[Any, ...], data: Any, work: Callable[[list[Any]], None]) -> Any:
        """Join this group's next collective; the last rank to arrive does `work`."""
        world = self._world
        self._sequence += 1
        key = (self._name, self._sequence)
        with world.lock:
            meeting = world.meetings.get(key)
            if meeting is None:
                meeting = world.meetings[key] = Meeting(self._size, world.lock)
            meeting.data[self._rank] = data
            meeting.calls[self._rank] = call
            meeting.arrived += 1
            if meeting.arrived == self._size:
                self._finish(meeting, work)
                del world.meetings[key]
            while not meeting.done:
                if world.ended is not None:
                    raise PeerFailed(
                        f"threaded_world: rank {self._rank} of group {self._name!r} left "
                        f"{call[0]} (collective #{self._sequence}) unfinished: {world.ended}"
                    )
                meeting.cond.wait()
        if meeting.error is not None:
            mismatch = CollectiveMismatch(meeting.error)
            mismatch.origin_rank = meeting.odd  # type: ignore[attr-defined]
            raise mismatch
        return _done(data)

    def _finish(self, meeting: Meeting, work: Callable[[list[Any]], None]) -> None:
        calls = meeting.calls
        if any(c != calls[0] for c in calls):
            each = "; ".join(
                f"rank {m}: {_said(c)}" for m, c in zip(self._members, calls, strict=True)
            )
            meeting.odd = _odd_one(self._members, calls)
            meeting.error = (
                f"threaded_world: ranks out of step in collective #{self._sequence} of group "
                f"{self._name!r} ({each}); every rank must call the same collectives, with "
                f"the same root, reduction and sizes, in the same order"
            )
        else:
            try:
                with torch.no_grad():
                    work(meeting.data)
            except Exception as exc:
                meeting.error = f"threaded_world: {_said(calls[0])} failed: {exc}"
        meeting.done = True
        meeting.cond.notify_all()

    # ---- collectives ----------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        name, reduce = _reducer(opts)

        def work(data: list[Any]) -> None:
            for i in range(len(data[0])):
                result = reduce([each[i] for each in data])
                for each in data:
                    each[i].detach().copy_(result)

        return self._meet(("all_reduce", name, _shape(tensors)), tensors, work)

    allreduce_coalesced = allreduce

    def barrier(self, opts: Any = None) -> Any:
        return self._meet(("barrier",), None, lambda data: None)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        root = opts.rootRank

        def work(data: list[Any]) -> None:
            for r, each in enumerate(data):
                if r != root:
                    for out, src in zip(each, data[root], strict=True):
                        out.detach().copy_(src)

        return self._meet(("broadcast", root, _shape(tensors)), tensors, work)

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        name, reduce = _reducer(opts)
        root = opts.rootRank

        def work(data: list[Any]) -> None:
            for i in range(len(data[0])):
                data[root][i].detach().copy_(reduce([each[i] for each in data]))

        return self._meet(("reduce", root, name, _shape(tensors)), tensors, work)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        def work(data: list[Any]) -> None:
            for outs, _ in data:
                for slot, (_, ins) in zip(outs[0], data, strict=True):
                    slot.detach().copy_(ins[0])

        return self._meet(("all_gather", _shape(inputs)), (outputs, inputs), work)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        def work(data: list[Any]) -> None:
            whole = torch.cat([ins.reshape(-1) for _, ins in data])
            for out, _ in data:
                out.detach().view(-1).copy_(whole)

        call = ("all_gather_into_tensor", _shape([input]))
        return self._meet(call, (output, input), work)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        works = [self.allgather([o], [i]) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1] if works else _done(None)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return works[-1] if works else _done(None)

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        root = opts.rootRank

        def work(data: list[Any]) -> None:
            for slot, (_, ins) in zip(data[root][0][0], data, strict=True):
                slot.detach().copy_(ins[0])

        return self._meet(("gather", root, _shape(inputs)), (outputs, inputs), work)

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        root = opts.rootRank

        def work(data: list[Any]) -> None:
            for (outs, _), piece in zip(data, data[root][1][0], strict=True):
                outs[0].detach().copy_(piece)

        return self._meet(("scatter", root, _shape(outputs)), (outputs, inputs), work)

    def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        name, reduce = _reducer(opts)

        def work(data: list[Any]) -> None:
            for r, (outs, _) in enumerate(data):
                outs[0].detach().copy_(reduce([ins[0][r] for _, ins in data]))

        return self._meet(("reduce_scatter", name, _shape(outputs)), (outputs, inputs), work)

    def reduce_scatter_single(self, output: Any, input: Any, opts: Any = None) -> Any:
        name, reduce = _reducer(opts)

        def work(data: list[Any]) -> None:
            parts = [ins.reshape(self._size, -1) for _, ins in data]
            reduced = reduce(parts)
            for r, (out, _) in enumerate(data):
                out.detach().view(-1).copy_(reduced[r])

        call = ("reduce_scatter_tensor", name, _shape([output]))
        return self._meet(call, (output, input), work)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        works = [
            self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return works[-1] if works else _done(None)

    def all_to_all_single(
        self, output: Any, input: Any, output_splits: Any, input_splits: Any, opts: Any = None
    ) -> Any:
        size = self._size

        def work(data: list[Any]) -> None:
            if any(o or i for _, _, o, i in data):
                _all_to_all_split(data)
                return
            parts = torch.stack([ins.reshape(size, -1) for _, ins, _, _ in data])
            for r, (out, _, _, _) in enumerate(data):
                out.detach().view(size, -1).copy_(parts[:, r])

        call = ("all_to_all_single", input.dtype)
        return self._meet(call, (output, input, output_splits, input_splits), work)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        def work(data: list[Any]) -> None:
            for r, (outs, _) in enumerate(data):
                for slot, (_, ins) in zip(outs, data, strict=True):
                    slot.detach().copy_(ins[r])

        return self._meet(("all_to_all",), (outputs, inputs), work)

    # ---- point to point -------------------------------------------------------------------

    def send(self, tensors: Any, dst: int, tag: int = 0) -> Any:
        world = self._world
        box = (self._name, self._rank, dst, tag)
        with world.lock:
            if world.ended is not None:
                raise PeerFailed(f"threaded_world: send to rank {dst} after {world.ended}")
            world.mail.setdefault(box, deque()).extend(t.detach().clone() for t in tensors)
            ready = self._matched(box)
        for tensors_in, fut in ready:
            fut.set_result(tensors_in)
        return _done(tensors)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> Any:
        world = self._world
        box = (self._name, src, self._rank, tag)
        fut: Future[Any] = Future()
        with world.lock:
            if world.ended is not None:
                raise PeerFailed(f"threaded_world: receive from rank {src} after {world.ended}")
            world.receives.setdefault(box, deque()).append((tensors, fut))
            ready = self._matched(box)
        for tensors_in, done in ready:
            done.set_result(tensors_in)
        return _create_work_from_future(fut)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        raise NotImplementedError("threaded_world: a receive from any source is not simulated")

    def _matched(self, box: tuple[str, int, int, int]) -> list[tuple[Any, Future[Any]]]:
        """Pair posted messages with waiting receives, in order (under the world's lock)."""
        mail = self._world.mail.get(box)
        waiting = self._world.receives.get(box)
        ready = []
        while mail and waiting:
            tensors, fut = waiting.popleft()
            for out in tensors:
                out.detach().copy_(mail.popleft().view_as(out))
            ready.append((tensors, fut))
        return ready


def _all_to_all_split(data: list[Any]) -> None:
    """all_to_all_single with uneven splits: slice by slice."""
    size = len(data)

    def bounds(total: int, splits: Any) -> list[int]:
        sizes = list(splits) if splits else [total // size] * size
        edges = [0]
        for n in sizes:
            edges.append(edges[-1] + int(n))
        return edges

    for dst, (out, _, out_splits, _) in enumerate(data):
        out_edges = bounds(out.shape[0], out_splits)
        for src, (_, ins, _, in_splits) in enumerate(data):
            in_edges = bounds(ins.shape[0], in_splits)
            piece = ins[in_edges[dst] : in_edges[dst + 1]]
            out[out_edges[src] : out_edges[src + 1]].detach().copy_(piece)


def _odd_one(members: list[int], calls: list[Any]) -> int | None:
    """The member whose call differs while all the others agree (of three or more)."""
    if len(members) < 3:
        return None
    counts = {c: calls.count(c) for c in set(calls)}
    if len(counts) != 2 or 1 not in counts.values():
        return None
    return members[[counts[c] for c in calls].index(1)]


def _said(call: tuple[Any, ...] | None) -> str:
    """A meeting's call as a message names it: ``all_reduce(SUM, float32[4])``."""
    if call is None:
        return "nothing"
    return f"{call[0]}({', '.join(_shown(arg) for arg in call[1:])})"


def _shown(arg: Any) -> str:
    if isinstance(arg, tuple):  # the tensors' (dtype, numel) pairs
        return ", ".join(f"{str(dtype).removeprefix('torch.')}[{n}]" for dtype, n in arg)
    if isinstance(arg, int):
        return f"root {arg}"
    return str(arg).removeprefix("RedOpType.").removeprefix("torch.")
