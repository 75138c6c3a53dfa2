"""Labelled collectives that never leave a rank waiting: all_reduce and broadcast_from.

Both are thin public functions over one private core, which the gathers and the group
wrapper use too. Each rank runs `fn` itself and joins the exchange whatever happened. The
first exchange of every labelled collective is the same one: a fixed-size header from every
rank carrying its collective's kind and label, its status (ok, error, exit), the sizes that
follow, and a small value itself when it fits. So every rank learns in that one exchange
whether any rank failed or is in another collective, and raises together instead of waiting
in a collective a peer never reaches. Only when something is wrong does a second exchange
carry the words (each rank's call and error) for the message.

One concept, hence its length: the core's header exchange and the failure semantics every
labelled collective shares (who raises what, naming whom), with the two collectives written
directly on it and the argument checks that must fail inside the exchange, never before it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import operator
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, NoReturn, TypeVar

import torch.distributed as dist

from rankwise import _error_file, _fake, _points, _transport, _watch, _wire
from rankwise._launch import is_initialized, launch_world_size, rank, size

_V = TypeVar("_V")
_R = TypeVar("_R")

# Each kind's code in the header; any fixed distinct integers do.
_KINDS = {
    "all_reduce": 1,
    "broadcast_from": 2,
    "gather_bytes": 3,
    "gather_state_dicts": 4,
    "get_dist_syncd_obj": 5,
}
_STATUSES = ("ok", "error", "exit")
_FIELDS = 7  # kind, key, status, length, root, chunk, code: int64 each
# The fields packed and unpacked in plain Python: cheaper than building tensors for 56 bytes.
_LAYOUT = struct.Struct(f"<{_FIELDS}q")
# The header's size. A value that fits in the rest rides in the header itself, so a small
# all_reduce or broadcast_from moves in the header exchange alone. Every rank receives every
# rank's header, so in a large group the header shrinks (a larger value takes a second
# exchange): each rank's share of the exchange stays near 128 KiB up to 512 ranks.
HEADER_BYTES = 4096  # also the size of the words exchanged when something is wrong
SMALLEST_HEADER = 256
_EXCHANGE_BYTES = 128 * 1024


def header_bytes(members: int) -> int:
    """The header's size in a group of `members` ranks (the same on every member)."""
    return max(SMALLEST_HEADER, min(HEADER_BYTES, _EXCHANGE_BYTES // max(1, members)))


def all_reduce(label: str, fn: Callable[[], _V], combine: Callable[[list[_V]], _V]) -> _V:
    """Run `fn` on every rank and return `combine` of all their values, in rank order.

    Every rank gets the same result. `combine` receives copies loaded from the bytes each rank
    sent (tensors on the CPU); in a single process it receives `fn()`'s value as it is. If
    `fn` fails on any rank, or its value cannot travel (it must load with weights_only), every
    rank raises: a rank whose own `fn` raised re-raises its error, the others raise a
    RuntimeError naming the first failing rank; if the only failures are SystemExits, each
    rank exits with its own code, or the first one's. The same `label` must be used on every
    rank; ranks out of step raise. A label that is not a str raises TypeError on its rank and
    makes every other rank raise too, instead of waiting for it. `combine` runs on each rank
    after the exchange, on its own: one that raises on some ranks only raises there alone.
    """
    call, refused = _call_of("all_reduce", label)
    if single_process(call.text):
        if refused is not None:
            raise refused
        return combine([fn()])
    if _fake.on_fake_world():  # no peer waits there: its own bad label raised at once
        raise refused or _fake.not_simulated(call.text, rank(), None, "the values")
    if refused is not None:  # in the exchange all the same, so the peers raise too
        fn = _raising(refused)
    return combine(gather_values(call, fn, None))


def broadcast_from(label: str, fn: Callable[[], _V], src: int = 0) -> _V:
    """Run `fn` on rank `src` only and return its value on every rank.

    For a value ranks could disagree on if each computed it (environment, files, GPU). Every
    rank, `src` included, gets a copy loaded from the bytes sent (tensors on the CPU); in a
    single process `fn()`'s value comes back as it is. If `fn` fails on `src`, or its value
    cannot travel, every rank raises instead of waiting: `src` its own error, the others a
    SystemExit with its code if it exited, else a RuntimeError naming it. A receiving rank
    whose label differs from `src`'s raises; `src` returns its value (the spec's contract).
    Ranks in another collective, or naming another `src`, raise on every rank; so do the
    others when one rank passes a `src` or label it cannot use (that rank its own error).
    """
    call, bad_label = _call_of("broadcast_from", label)
    src = as_rank(src)
    solo = single_process(call.text)
    refused = bad_label or _src_error(call, src, 1 if solo else size())
    if solo:
        if refused is not None:
            raise refused
        return fn()
    with _points.point(call.kind, call.label, hold_errors=True) as held:
        if refused is not None:  # joins all the same: every peer raises too, none waits
            entry, error, payload = run_fn(call, _raising(refused))
        elif rank() == src:
            entry, error, payload = run_fn(call, fn, held)
        else:
            entry, error, payload = Entry(), None, b""
        if _fake.on_fake_world():
            return _on_fake_world(call, error, payload, src)  # type: ignore[no-any-return]
        headers = exchange(call, entry._replace(root=as_header_int(src)), None, payload)
        if any(kind != _KINDS[call.kind] for kind in headers.kinds):  # before any failure:
            leave_out_of_step(headers, error)  # a peer in another collective has left it
        _raise_for_refusals(headers, error, src)
        _raise_for_source(headers, error, src)
        data = headers.inline[headers.members.index(src)]
        if data is None:  # too large for src's header
            sent = payload if rank() == src else None
            with peers_answering(call):
                data = _transport.broadcast_known(sent, headers.of(src).length, src)
    _raise_for_receiver(headers, src)
    held.raise_if_any()  # a fault injected on a receiver: after the value moved, alone
    return load(data, f"{call.text}: src rank {src}'s value")  # type: ignore[no-any-return]


def _on_fake_world(call: Call, error: BaseException | None, payload: bytes, src: int) -> Any:
    """broadcast_from where no data moves: `src` gets its own value back as every rank
    does (a copy loaded from its bytes); another rank cannot know it."""
    if error is not None:
        raise error
    if rank() != src:
        raise _fake.not_simulated(call.text, rank(), None, f"the value of src rank {src}, one")
    return load(payload, f"{call.text}: src rank {src}'s value")


# ---- the core ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """A labelled collective as ranks must agree on it, and how messages name it."""

    kind: str
    label: str
    text: str = ""  # how messages name this rank's call; kind('label') by default

    def __post_init__(self) -> None:
        if not self.text:
            object.__setattr__(self, "text", f"{self.kind}({_shown_label(self.label)})")

    @functools.cached_property
    def key(self) -> int:
        """A digest of kind and label, the same in every process (unlike hash())."""
        text = f"{self.kind}\0{self.label}".encode("utf-8", "surrogatepass")  # any str at all
        digest = hashlib.blake2b(text, digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)


class Entry(NamedTuple):
    """One rank's fixed-size header: what it contributes to the first exchange (a tuple:
    every rank builds one per member at every exchange, so it must be cheap to make)."""

    status: str = "ok"
    length: int = 0  # the bytes this rank sends next
    root: int = -1  # src or dst, for collectives that have one
    chunk: int = 0  # gather_bytes' chunk_bytes
    code: int = 0  # the exit code when status is "exit"
    error: str = ""  # "ValueError: bad batch"; travels only in the second exchange


@dataclass(frozen=True)
class Headers:
    """Every member's header from the first exchange, in group order."""

    call: Call
    members: list[int]  # global ranks, in group order
    kinds: list[int]
    keys: list[int]
    entries: list[Entry]
    texts: list[str]  # each rank's call text; filled only when something is wrong
    inline: list[bytes | None]  # each rank's payload, where it fit in the header
    alike: bool = False  # every field but the length the same on every member, status ok

    def of(self, global_rank: int) -> Entry:
        return self.entries[self.members.index(global_rank)]

    @property
    def in_step(self) -> bool:
        return all(key == self.call.key for key in self.keys)

    @property
    def agreed(self) -> bool:
        """In step, no failure, and the same root and chunk size everywhere."""
        if self.alike:  # found while parsing: the common case, read once
            return self.keys[0] == self.call.key
        first = self.entries[0]
        return self.in_step and all(
            e.status == "ok" and (e.root, e.chunk) == (first.root, first.chunk)
            for e in self.entries
        )


def exchange(call: Call, mine: Entry, group: Any, payload: bytes = b"") -> Headers:
    """All-gather every rank's header; when any rank failed or is out of step, its words too.

    `payload` rides along when it fits. Every rank sees the same headers, so every rank
    takes the second exchange or none does.
    """
    members = _members(group)
    size = header_bytes(len(members))
    with peers_answering(call):
        raw = _transport.all_gather_block(_header(call, mine, payload, size), group)
    headers = _parse(call, members, raw)
    if headers.agreed:
        return headers
    with peers_answering(call):
        said = _exchange_words(call.text, mine.error, group)
    entries = [e._replace(error=w["error"]) for e, w in zip(headers.entries, said, strict=True)]
    return replace(headers, entries=entries, texts=[w["call"] for w in said])


@contextlib.contextmanager
def peers_answering(call: Call) -> Iterator[None]:
    """Name the call when moving bytes with the peers fails: the backend's own error (gloo's
    "Connection closed by peer", a timeout) says neither which collective nor what to do.
    Every rank is leaving: an enclosing collective's fn lets it through."""
    try:
        yield
    except _watch.PeersLost as exc:  # silent past the watch's bound
        text = f"{call.text} on rank {rank()}: {exc}; it never finished"
        raise _peers_lost(text, exc.lost, in_flight=True) from None
    except _transport.LinkError as exc:  # the backend's failure; a local error stays as it is
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        watch = _watch.current()
        named = watch.explain_link_failure(str(exc)) if watch is not None else None
        if named is not None:
            words, lost = named
            text = f"{call.text} on rank {rank()}: moving data with its peers failed: {words}"
            raise _peers_lost(f"{text} ({reason})", lost, in_flight=False) from exc
        raise _peers_lost(
            f"{call.text} on rank {rank()}: moving data with its peers failed ({reason}): "
            f"a peer died, hung or never reached this collective; see that rank's own "
            f"error or output",
            (),
            in_flight=False,
        ) from exc


def _peers_lost(message: str, lost: tuple[int, ...], in_flight: bool) -> BaseException:
    """The error every survivor raises for peers that died or went silent: it names them
    (and its origin is the one rank, where one was lost), torchrun's error file says so,
    and the process can end without waiting on the lost peers at exit."""
    error = RuntimeError(message)
    error._rankwise_lost = lost  # type: ignore[attr-defined]  # for the watch, as it ends
    watch = _watch.current()
    if watch is not None:
        watch.leaving()  # so that a later survivor does not name this rank among the lost
    _error_file.note_peers_lost(error, in_flight)
    left = _leaving(error)
    return _from(lost[0], left) if len(lost) == 1 else left


def _exchange_words(text: str, error: str, group: Any) -> list[dict[str, str]]:
    """Every rank's call text and error, for the message: one more fixed-size exchange."""
    block = bytearray(HEADER_BYTES)
    words = _words(text, error)
    block[: len(words)] = words
    raw = _transport.all_gather_block(block, group)
    rows = [raw[i : i + HEADER_BYTES] for i in range(0, len(raw), HEADER_BYTES)]
    return [json.loads(row.rstrip(b"\0")) for row in rows]


def _words(text: str, error: str) -> bytes:
    """JSON of the call and the error, shortened until it fits in a header: the error first,
    then the call (a label of wide characters can fill a header on its own)."""
    call = text[:400]
    while True:
        said = {"call": call, "error": error}
        try:
            words = json.dumps(said, ensure_ascii=False).encode()
        except UnicodeEncodeError:  # a lone surrogate (a file name that is not UTF-8): escaped
            words = json.dumps(said).encode()
        if len(words) <= HEADER_BYTES:
            return words
        if len(error) > 16:
            error = error[: len(error) // 2] + "..."
        else:  # both end short enough: a few dozen characters always fit
            call = call[: len(call) // 2] + "..."


def _header(call: Call, mine: Entry, payload: bytes, size: int) -> bytearray:
    """This rank's header of `size` bytes: the fields, then the payload when it fits,
    zero-padded."""
    block = bytearray(size)
    fields = (_KINDS[call.kind], call.key, _STATUSES.index(mine.status), mine.length)
    _LAYOUT.pack_into(block, 0, *fields, mine.root, mine.chunk, mine.code)
    if payload and _fits(mine, size):
        block[_LAYOUT.size : _LAYOUT.size + len(payload)] = payload
    return block


def _parse(call: Call, members: list[int], raw: bytes) -> Headers:
    """Every member's header from the gathered bytes, in group order."""
    size = len(raw) // len(members)
    fields = list(_row(size).iter_unpack(raw))  # one C call for every member's fields
    kinds, keys = [f[0] for f in fields], [f[1] for f in fields]
    first = fields[0]
    if first[2] == 0 and all(f[:3] == first[:3] and f[4:] == first[4:] for f in fields):
        # The common case: every member ok, in the same call, with the same arguments.
        capacity = size - _LAYOUT.size
        entries = [Entry("ok", f[3], first[4], first[5], first[6]) for f in fields]
        inline: list[bytes | None] = [
            raw[start : start + f[3]] if f[3] <= capacity else None
            for start, f in zip(range(_LAYOUT.size, len(raw), size), fields, strict=True)
        ]
        return Headers(call, members, kinds, keys, entries, [], inline, True)
    entries = [Entry(_STATUSES[s], n, r, c, x) for _, _, s, n, r, c, x in fields]
    inline = [
        raw[start : start + e.length] if _fits(e, size) else None
        for start, e in zip(range(_LAYOUT.size, len(raw), size), entries, strict=True)
    ]
    return Headers(call, members, kinds, keys, entries, [], inline)


@functools.lru_cache(maxsize=16)
def _row(size: int) -> struct.Struct:
    """One member's header as struct reads it: the fields, then the rest skipped."""
    return struct.Struct(f"<{_FIELDS}q{size - _LAYOUT.size}x")


def _fits(entry: Entry, header_size: int) -> bool:
    return entry.status == "ok" and entry.length <= header_size - _LAYOUT.size


def out_of_step(headers: Headers) -> RuntimeError:
    """The error every rank raises when ranks are in different labelled collectives."""
    where = "; ".join(
        f"rank {m} in {t}" + (f", which raised {e.error}" if e.status == "error" else "")
        for m, t, e in zip(headers.members, headers.texts, headers.entries, strict=True)
    )
    error = RuntimeError(
        f"{headers.call.text} on rank {rank()}: ranks out of step ({where}); every rank must "
        f"reach the same labelled collectives in the same order"
    )
    # Raised inside an enclosing collective's fn, it leaves that collective without its
    # exchange: the peers it would wait for raised at the exchange that found it (run_fn).
    error._rankwise_out_of_step = True  # type: ignore[attr-defined]
    return error


def raise_if_disagreeing(headers: Headers, name: str, values: list[int]) -> None:
    """Raise on every rank when members passed different values of an argument `name`; the
    one rank that differs from all the others, if there is one, is the origin."""
    if len(set(values)) < 2:
        return
    each = ", ".join(f"rank {m}: {v}" for m, v in zip(headers.members, values, strict=True))
    odd = odd_one(headers.members, values)
    blame = f"; rank {odd} differs from every other rank" if odd is not None else ""
    error = ValueError(
        f"{headers.call.text} on rank {rank()}: ranks disagree on {name} ({each}){blame}; "
        f"every rank must pass the same {name}"
    )
    raise _from(odd, error) if odd is not None else error


def odd_one(members: list[int], values: list[Any]) -> int | None:
    """The member whose value differs while every other member's is the same (at least
    three members: of two, neither is the odd one); None otherwise."""
    if len(members) < 3:
        return None
    counts: dict[Any, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    if len(counts) != 2 or 1 not in counts.values():
        return None
    return members[[counts[v] for v in values].index(1)]


def _from(origin: int, error: BaseException) -> BaseException:
    """`error`, marked with the rank whose failure it is.

    Every error a labelled collective raises because a rank failed carries ``origin_rank``
    (a global rank): on the failing rank its own error, marked with its own number; on the
    others the RuntimeError (or SystemExit) naming it. A test runner can then name the
    origin even when another rank's error was reported first.
    """
    if getattr(error, "origin_rank", None) is None:  # set where it first failed: kept
        with contextlib.suppress(AttributeError, TypeError):  # one that takes no attributes
            error.origin_rank = origin  # type: ignore[attr-defined]
    if _error_file.is_collateral(error, rank()):
        _error_file.note_collateral(error)  # one line, not a traceback, if it ends the process
    return error


def _leaving(error: BaseException) -> BaseException:
    """`error`, marked so that an enclosing collective's fn lets it through at once, as its
    peers leave: joining the enclosing exchange alone would wait for them until the timeout."""
    with contextlib.suppress(AttributeError, TypeError):
        error._rankwise_out_of_step = True  # type: ignore[attr-defined]
    return error


def leave_out_of_step(headers: Headers, error: BaseException | None) -> NoReturn:
    """Ranks are in different collectives: every rank leaves, and any enclosing one too. A
    rank whose own fn failed (or that refused its arguments) raises its own error; the
    others a RuntimeError naming every rank's call, marked with the first failing rank."""
    if error is not None and not isinstance(error, SystemExit):
        raise _from(rank(), _leaving(error))
    entries = zip(headers.members, headers.entries, strict=True)
    failed = [m for m, e in entries if e.status == "error"]
    origin = failed[0] if failed else odd_one(headers.members, headers.keys)
    raise _from(origin, out_of_step(headers)) if origin is not None else out_of_step(headers)


def raise_for_failures(
    headers: Headers, error: BaseException | None, failed_as: str = "raised"
) -> None:
    """Raise on every rank if any rank failed or is out of step (see all_reduce for who
    raises what); `failed_as` words the others' message: "rank 2 raised ValueError: ..."."""
    if headers.alike and headers.keys[0] == headers.call.key:
        return  # every member ok, in this call
    if not headers.in_step:
        leave_out_of_step(headers, error)
    failed = [
        (m, e) for m, e in zip(headers.members, headers.entries, strict=True) if e.status == "error"
    ]
    if failed:
        first, entry = failed[0]
        if error is not None and not isinstance(error, SystemExit):
            raise _from(rank(), error)  # this rank failed itself: its own error
        text = f"{headers.call.text}: rank {first} {failed_as} {entry.error}"
        raise _from(first, RuntimeError(text))
    exits = [
        (m, e) for m, e in zip(headers.members, headers.entries, strict=True) if e.status == "exit"
    ]
    if exits:
        if error is not None:
            raise _from(rank(), error)
        first, entry = exits[0]
        raise _from(first, SystemExit(entry.code))


def gather_values(call: Call, fn: Callable[[], Any], group: Any) -> list[Any]:
    """Run `fn` here, then every member's value, loaded, in group order (all_reduce's core)."""
    with _points.point(call.kind, call.label, hold_errors=True) as held:
        entry, error, payload = run_fn(call, fn, held)
        headers = exchange(call, entry, group, payload)
        raise_for_failures(headers, error)
        blobs = [b for b in headers.inline if b is not None]
        if len(blobs) < len(headers.entries):  # a value too large for its header
            sizes = [e.length for e in headers.entries]
            with peers_answering(call):
                blobs = _transport.all_gather_known(payload, sizes, group)
    try:  # each member's words are made only for a value that fails to load
        return _wire.decode_many(blobs)
    except Exception:
        return [
            load(blob, f"{call.text}: rank {member}'s value")
            for member, blob in zip(headers.members, blobs, strict=True)
        ]


def run_fn(
    call: Call, fn: Callable[[], object], held: _points.Held | None = None
) -> tuple[Entry, BaseException | None, bytes]:
    """Run `fn` and encode what happened; whatever it was, the caller still joins.

    An error an observer raised entering the point (`held`) counts as `fn`'s own.
    """
    try:
        if held is not None:
            held.raise_if_any()
        payload = _wire.encode(fn(), f"{call.text} on rank {rank()}")
    except BaseException as exc:
        if getattr(exc, "_rankwise_out_of_step", False):
            raise  # a collective inside fn found ranks out of step: every rank is leaving
        if isinstance(exc, SystemExit):
            return Entry("exit", code=exit_code(exc)), exc, b""
        if not _error_file.is_collateral(exc, rank()):  # before the exchange tells the peers
            _error_file.note_own_failure(exc)
        return Entry("error", error=describe(exc)), exc, b""
    return Entry(length=len(payload)), None, payload


def describe(exc: BaseException) -> str:
    """ "ValueError: bad batch": the text a failure travels as, whatever its __str__ does."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except BaseException as broken:  # its __str__ raised, even an exit: it still travels
        return f"{type(exc).__name__} (its message could not be read: {type(broken).__name__})"


def load(data: bytes, what: str) -> Any:
    """Decode bytes another rank sent; a refused payload names who sent it, never runs."""
    try:
        return _wire.decode(data)
    except json.JSONDecodeError as exc:  # the plain-value form: no torch.load involved
        raise RuntimeError(
            f"{what} is not valid JSON ({exc}): it was damaged on the way or not sent by "
            f"rankwise; nothing in it was run"
        ) from None
    except Exception as exc:
        raise RuntimeError(
            f"{what} does not load with torch.load(weights_only=True) "
            f"({_wire.refusal(exc)}); it was refused and nothing in it was run"
        ) from None


def single_process(text: str, group: Any = None) -> bool:
    """True for a process on its own (or a group of one); raises for a launched rank alone."""
    if is_initialized():
        return size(group) == 1
    world = launch_world_size()
    if world > 1:
        raise RuntimeError(
            f"{text}: this process is one of {world} launched ranks (WORLD_SIZE={world}) but "
            f"no process group is set up; call it inside distributed_run(), or after "
            f"torch.distributed.init_process_group()"
        )
    return True


def _members(group: Any) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


LABEL_SHOWN_MAX = 120  # a label whose repr is longer is shown cut (see _shown_label)


def _shown_label(label: str) -> str:
    """`label` as messages name it: its repr, or for a long one (a model's module names,
    say) its head and tail, its length and a digest of it, which tells apart two labels
    that differ only in the middle."""
    shown = repr(label)
    if len(shown) <= LABEL_SHOWN_MAX:
        return shown
    digest = hashlib.blake2b(label.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{shown[:80]}...{shown[-30:]} ({len(label)} characters, #{digest})"


def shown(value: object) -> str:
    """`value`'s repr for a message, whatever its repr does (even raise an exit), cut short
    when long: an argument is named before the exchange, where nothing may escape."""
    try:
        text = repr(value)
    except BaseException:
        text = f"<a {type(value).__name__} whose repr raised>"
    if len(text) > LABEL_SHOWN_MAX:
        text = f"{text[:80]}...{text[-30:]} (a repr of {len(text)} characters)"
    return text


def _call_of(kind: str, label: object) -> tuple[Call, TypeError | None]:
    """The call `kind(label)`, and the error for a label that is not a str (the call is then
    named by the label's repr, and still joins the exchange so its peers raise too)."""
    if isinstance(label, str):  # a subclass as the str it is: its own repr may not work
        return Call(kind, str.__str__(label)), None
    shown_label = shown(label)
    error = TypeError(f"{kind}: label must be a str naming the collective; got {shown_label}")
    return Call(kind, shown_label, f"{kind}({shown_label})"), error


def as_index(value: object) -> int | None:
    """`value` as an int if it is integer-like (an int, numpy's or torch's integer scalars;
    not a bool, a float or a tensor of several elements); None otherwise."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except BaseException:  # even an exit from a __index__: refused on its rank, never escaped
        return None


def _src_error(call: Call, src: object, world: int) -> Exception | None:
    index = as_index(src)
    if index is None:
        return TypeError(f"{call.text}: src must be an int rank; got {shown(src)}")
    if not 0 <= index < world:
        return ValueError(
            f"{call.text}: src={src} is not a rank of this run of {world}; use 0..{world - 1}"
        )
    return None


def as_rank(value: _R) -> _R | int:
    """An integer-like rank (numpy's int64, say) as the int it stands for; anything else as
    it is, for the argument check to refuse by its own repr."""
    index = as_index(value)
    return value if index is None else index


def _raising(error: BaseException) -> Callable[[], Any]:
    """A stand-in for `fn` that raises a rank's own argument error inside the exchange."""

    def refuse() -> Any:
        raise error

    return refuse


def as_header_int(value: object) -> int:
    """An argument (src, dst, chunk_bytes) as the header carries it: -1 for one that is no
    int or does not fit in an int64 (each is refused on its rank before it is compared)."""
    fits = isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    return int(value) if fits else -1  # type: ignore[call-overload]


def _raise_for_refusals(headers: Headers, error: BaseException | None, src: object) -> None:
    """Every rank raises when a rank refused its own arguments (a label or src it cannot
    use): that rank its own error, the others a RuntimeError naming it. src's failure in
    `fn` is _raise_for_source's."""
    refused = [
        (m, e)
        for m, e in zip(headers.members, headers.entries, strict=True)
        if e.status == "error" and (m != src or e.root != src)
    ]
    if not refused:
        return
    if error is not None and rank() in [m for m, _ in refused]:
        raise _from(rank(), error)
    first, entry = refused[0]
    words = f"{headers.texts[headers.members.index(first)]} on rank {first} raised {entry.error}"
    raise _from(first, RuntimeError(f"{headers.call.text}: {words}"))


def exit_code(exc: SystemExit) -> int:
    """The code a header carries (int64): 1, as for a message, for one it cannot hold."""
    if exc.code is None:
        return 0
    fits = isinstance(exc.code, int) and -(2**63) <= exc.code < 2**63
    return exc.code if fits else 1  # type: ignore[return-value]


def _raise_for_source(headers: Headers, error: BaseException | None, src: int) -> None:
    """Before the value moves: every rank raises for another src, or a failed src."""
    raise_if_disagreeing(headers, "src", [e.root for e in headers.entries])
    source = headers.of(src)
    if source.status == "exit":
        raise _from(src, error if error is not None else SystemExit(source.code))
    if source.status == "error":
        if error is not None:
            raise _from(src, error)
        text = f"{headers.call.text}: src rank {src} raised {source.error}"
        raise _from(src, RuntimeError(text))


def _raise_for_receiver(headers: Headers, src: int) -> None:
    """After the value moved: a receiver whose label differs from src's raises, alone."""
    at = headers.members.index(src)
    if headers.keys[at] != headers.call.key:
        raise RuntimeError(
            f"{headers.call.text} on rank {rank()}: ranks out of step: src rank {src} is in "
            f"{headers.texts[at]}; every rank must reach the same labelled collectives in order"
        )
