"""The peer watch: a silent peer (frozen, cut off, its node gone) is named within a bound.

gloo waits for a peer that never answers for the group's whole timeout (30 minutes by
default), and then says only "timed out". On a launch (torchrun, or wherever the launch's
store is the default group's) each rank's watch thread adds one to its counter in that store
every few seconds: a rank that is alive, however slow (a long computation, a long data
load), keeps counting; a frozen process, a node cut off or gone, stops. Nothing is read while
collectives finish: a labelled collective waits in slices of a few seconds, and only once one
passes does the watch read the peers' counters (in its own thread, so a store that stops
answering never blocks the wait). A peer whose counter has not moved for ``bound`` seconds
(``RANKWISE_PEER_TIMEOUT``, 60 by default; ``0`` turns the watch off) is silent: the wait
raises :class:`PeersLost` naming it, its host and for how long. A rank stuck in a plain
``torch.distributed`` collective on a silent peer cannot be woken; the watch writes its
error file, says why on stderr and ends it (as NCCL's watchdog ends a rank whose collective
timed out). Each rank also publishes where it runs (host, addresses, pid), so that gloo's
"Connection closed by peer [10.0.0.3]:2782" after a node dies becomes the ranks and host.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rankwise import _error_file

BOUND_ENV = "RANKWISE_PEER_TIMEOUT"
DEFAULT_BOUND_S = 60.0
_KEYS = "rankwise/watch/"
_FOUND = f"{_KEYS}found"  # the first survivor's words for the lost peers, for the others
_THREAD = "rankwise-peer-watch"
_SLICE_S = 2.0  # how long a labelled collective waits before it asks the watch
_TIMED_OUT = "Operation timed out"  # gloo's word for a wait's own timeout (not a failure)
# Where a plain collective waits: a main thread stuck there on a silent peer is ended.
_TORCH_COLLECTIVES = ("distributed_c10d.py", "_functional_collectives.py")


class PeersLost(RuntimeError):
    """Peers went silent (or died) while this rank waited for them in a collective."""

    def __init__(self, message: str, lost: tuple[int, ...]) -> None:
        super().__init__(message)
        self.lost = lost
        if len(lost) == 1:
            self.origin_rank = lost[0]


def bound_s() -> float | None:
    """The silence after which a peer is lost, in seconds; None when the watch is off."""
    raw = os.environ.get(BOUND_ENV, "").strip()
    if not raw:
        return DEFAULT_BOUND_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"{BOUND_ENV}={raw!r} is not a number of seconds: set it to how long a peer may "
            f"stay silent before it is called lost ({DEFAULT_BOUND_S:g} by default; 0 turns "
            f"the watch off)"
        ) from None
    return value if value > 0 else None


@dataclass
class Where:
    """Where a rank runs, as it published it."""

    rank: int
    host: str
    pid: int
    boot: str
    addresses: tuple[str, ...]


@dataclass
class Watch:
    """This process's watch over the default group's ranks."""

    store: Any
    rank: int
    world: int
    bound: float
    beat: float
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank: (count, since)
    where: dict[int, Where] = field(default_factory=dict)
    waiting: int = 0  # labelled waits in progress on the main thread
    store_ok_at: float = field(default_factory=time.monotonic)  # its last answer
    store_gone: bool = False  # the store's end of the connection closed (not only silent)
    lost: tuple[int, ...] = ()
    found: str = ""  # this rank's words for the lost peers, once it found them
    told: tuple[str, tuple[int, ...]] = ("", ())  # another survivor's words, and its lost
    stuck: tuple[int, float] = (0, 0.0)  # the main thread's torch frame, and since when
    clock: Any = time.monotonic  # a test's own clock, where one is given
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    # ---- the thread -------------------------------------------------------------------------

    def run(self) -> None:
        """Each beat: count, and read the peers while this rank waits in a collective, on a
        thread of its own (a store frozen or cut off never answers, and this thread must
        still end a rank stuck on it); end with the group (destroyed, or another set up in
        its place)."""
        talking: threading.Thread | None = None
        while not self.stop.wait(self.beat) and _decided_for() is dist.group.WORLD:
            if talking is None or not talking.is_alive():  # else the store still owes an answer
                talking = threading.Thread(target=self._talk, name=f"{_THREAD}-store", daemon=True)
                talking.start()
                talking.join(self.beat / 2)
            self._end_if_stuck_in_torch()

    def _talk(self) -> None:
        try:
            self.store.add(f"{_KEYS}beat/{self.rank}", 1)
        except Exception as exc:  # a silent store: the wait says so once it has been too long
            if isinstance(exc, dist.DistNetworkError) or any(w in str(exc) for w in _LINK_WORDS):
                self.store_gone = True  # its end of the connection closed: its node is gone
            return
        self.store_ok_at = self.clock()  # a call stuck on a cut link never gets here
        if self.waiting or _main_torch_frame() is not None:
            self._read_peers()

    def _read_peers(self) -> None:
        try:
            counts = self._counts()
        except Exception:
            return
        now = self.clock()
        silent = []
        with self.lock:
            for peer, count in counts.items():
                before = self.seen.get(peer)
                if before is None or before[0] != count:
                    self.seen[peer] = (count, now)
                elif now - before[1] >= self.bound:
                    silent.append(peer)
        # a rank that left (ended its run, or found its own peers lost) is not silent
        left = tuple(r for r in silent if self._marked("left", r))
        if not self.told[0]:
            self._read_told(counts)
        with self.lock:
            self.lost = tuple(r for r in silent if r not in left) or self.told[1]
        if len(self.where) < self.world:
            self._read_where()  # on this thread, ahead of any failure the main thread words

    def _read_told(self, counts: dict[int, int]) -> None:
        """Another survivor's words for peers it found lost, where one published them: a rank
        waiting on a live survivor (not on the lost peers themselves) hears nothing from
        gloo, and would otherwise wait out the bound while torchrun ends it unheard. The
        words hold while the peers they name have not counted since (not a record left by
        an earlier group whose ranks were replaced)."""
        with contextlib.suppress(Exception):
            if self.store.check([_FOUND]):
                said = json.loads(bytes(self.store.get(_FOUND)))
                lost = tuple(int(r) for r in said["lost"])
                then = {int(r): int(c) for r, c in said["counts"].items()}
                still = all(counts.get(r) == c for r, c in then.items())
                if int(said["rank"]) != self.rank and lost and still:
                    self.told = (f"{said['words']} (as rank {int(said['rank'])} found)", lost)

    def account(self) -> str:
        """This rank's words for the peers it holds lost: another survivor's, where they
        came from it, else how long they have been silent."""
        told, lost = self.told
        words = told if told and self.lost == lost else self.describe(self.lost)
        self.found = self.found or words
        return words

    def _marked(self, what: str, peer: int) -> bool:
        """Whether `peer` put its mark `what` ("left", "spoke") in the store."""
        try:
            return bool(self.store.check([f"{_KEYS}{what}/{peer}"]))
        except Exception:
            return False

    def _mark(self, what: str) -> bool:
        """Put this rank's mark `what` in the store; False if the store did not take it
        within a second (it may be the thing that is gone)."""
        key = f"{_KEYS}{what}/{self.rank}"
        return _bounded(lambda: self.store.set(key, "1") or True, 1.0) is not None

    def spoken(self, lost: tuple[int, ...]) -> None:
        """This rank has said that `lost` were lost, and is ending: say so in the store, then
        wait (a beat and a few seconds at most) until the other survivors have said it too.
        torchrun ends a node's other workers as soon as one exits: without this wait a
        survivor a moment slower to find the loss would be ended before it could name it.
        The words are published too, for a survivor that could not find the loss itself."""
        if lost and self.found and not self.told[0]:
            counts = _bounded(self._counts, 1.0) or {}
            said = json.dumps({
                "rank": self.rank, "lost": list(lost), "words": self.found,
                "counts": {str(r): c for r, c in counts.items() if r in lost},
            })  # fmt: skip
            _bounded(lambda: self.store.set(_FOUND, said), 1.0)
        if not self._mark("spoke"):
            # The store is gone: nobody can say anything through it. The other survivors
            # watch the same silence and reach the same end within a beat: give them it.
            time.sleep(min(self.bound, 1.5 * self.beat + 1.0))
            return
        others = [r for r in range(self.world) if r != self.rank and r not in lost]
        deadline = time.monotonic() + min(self.bound, self.beat + 5.0)
        while others and time.monotonic() < deadline:
            left = _bounded(functools.partial(self._yet_to_speak, others), 1.0)
            if left is None:
                return
            others = left
            if others:
                time.sleep(0.2)

    def _yet_to_speak(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if not self._marked("spoke", r)]

    def leaving(self) -> None:
        """Say in the store that this rank is leaving (its run ended, or it found peers
        lost), so that peers neither wait for it as silent nor name it as lost."""
        self._mark("left")

    def _counts(self) -> dict[int, int]:
        """Each peer's count, for the peers whose watch has started: one that has not (still
        on its way to its first labelled collective, however slowly) is not judged. Nothing
        here waits for a key (a missing key would block a get for the store's timeout)."""
        keys = {r: f"{_KEYS}beat/{r}" for r in range(self.world) if r != self.rank}
        if self.store.check(list(keys.values())):
            values = self.store.multi_get(list(keys.values()))
            return {r: int(bytes(v)) for r, v in zip(keys, values, strict=True)}
        return {r: int(bytes(self.store.get(k))) for r, k in keys.items() if self.store.check([k])}

    def _end_if_stuck_in_torch(self) -> None:
        """A main thread in a plain collective on a silent peer cannot be woken: end it, once
        it has stayed in the same call for the bound (not a quick get_rank() by chance)."""
        frame = _main_torch_frame()
        now = self.clock()
        if frame is None or self.waiting or id(frame) != self.stuck[0]:
            self.stuck = (id(frame) if frame is not None else 0, now)
            return
        # told by a survivor, or the store's connection closed, the loss is known: a beat in
        # the same call is not a passing one
        needed = self.beat if self.told[0] or self.store_gone else self.bound
        quiet = now - self.store_ok_at
        if now - self.stuck[1] < needed:
            return
        if self.lost:
            lost, words = self.lost, self.account()
        elif self.store_gone or quiet >= self.bound + self.beat:  # rank 0's node: no counts
            words, lost = self.store_words()
        else:
            return
        message = (
            f"rank {self.rank}: waiting in a torch.distributed collective for "
            f"{words}, which cannot finish; ending this rank (exit status 1) "
            f"as a collective on a silent peer never returns"
        )
        self.leaving()
        _error_file.write_entry(
            message=f"PeersLost: {message}",
            callstack=message,
            timestamp=int(time.time()) - _error_file.EARLIER_S,
        )
        print(f"rankwise: {message}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        self.spoken(lost)
        os._exit(1)

    # ---- what the main thread asks -------------------------------------------------------

    def store_words(self) -> tuple[str, tuple[int, ...]]:
        """The words for the launch's store gone (its connection closed) or silent past the
        bound, and the ranks on its node."""
        if self.store_gone:
            words, lost = _store_node("closed its connections (its node died or went down)")
        else:
            quiet = self.clock() - self.store_ok_at
            words, lost = _store_node(f"has not answered for {quiet:.0f} s")
            words = f"{words}: frozen, cut off or gone (the bound is {self.bound:g} s, {BOUND_ENV})"
        self.found = self.found or words
        return words, lost

    def describe(self, ranks: tuple[int, ...]) -> str:
        """'rank 2 (host n2) silent for 61 s (...)' or 'ranks 4, 5 (host n3) silent ...'."""
        now = self.clock()
        with self.lock:
            silent = max((now - self.seen[r][1] for r in ranks if r in self.seen), default=0.0)
        return (
            f"{_named(ranks, self._where())} silent for {silent:.0f} s (no heartbeat: frozen, "
            f"cut off, or its node gone; the bound is {self.bound:g} s, {BOUND_ENV})"
        )

    def _where(self) -> dict[int, Where]:
        """The whereabouts each rank published, as far as the store answers within a bound
        (the main thread asks this as it raises: a cut link must not hold it there)."""
        if len(self.where) < self.world:
            _bounded(self._read_where, 2.0)
        return dict(self.where)

    def _read_where(self) -> None:
        """Read the whereabouts not read yet (never waiting for a key: check, then get)."""
        for r in range(self.world):
            key = f"{_KEYS}where/{r}"
            if r in self.where:
                continue
            with contextlib.suppress(Exception):
                if not self.store.check([key]):
                    continue
                said = json.loads(bytes(self.store.get(key)))
                self.where[r] = Where(
                    r, str(said["host"]), int(said["pid"]), str(said["boot"]),
                    tuple(said["addresses"]),
                )  # fmt: skip

    def explain_link_failure(self, words: str) -> tuple[str, tuple[int, ...]] | None:
        """gloo's words for a peer that went away ("Connection closed by peer [10.0.0.3]:
        2782"), as the ranks and host it was, and what happened to them where that can be
        told; None when nothing names them."""
        where = self._where()
        with self.lock:
            silent = self.lost
        if silent:  # known silent already: they are why the link failed
            return self.account(), silent
        if len(where) <= 1 and _bounded(lambda: self.store.check([f"{_KEYS}beat/0"]), 2.0) is None:
            return _store_node("is gone too: it died or went down")  # nothing else answers
        address = _address_in(words)
        left = _bounded(lambda: {r for r in where if self._marked("left", r)}, 2.0) or set()
        candidates = [w for w in where.values() if w.rank != self.rank and w.rank not in left]
        if address is not None:
            candidates = [w for w in candidates if address in w.addresses] or candidates
        boot = where[self.rank].boot if self.rank in where else ""
        time.sleep(0.3)  # a node killed as a whole: let each of its processes' ends land
        for state, said in (("died", "died (process gone)"), ("frozen", "frozen (stopped)")):
            ranks = tuple(w.rank for w in candidates if _state(w, boot) == state)
            if ranks:
                self.found = self.found or f"{_named(ranks, where)} {said}"
                return f"{_named(ranks, where)} {said}", ranks
        if address is not None and candidates and len(candidates) < len(where) - 1:
            ranks = tuple(w.rank for w in candidates)
            words = f"{_named(ranks, where)} closed the connection (died, or its node went down)"
            self.found = self.found or words
            return words, ranks
        return None


def _store_node(what: str) -> tuple[str, tuple[int, ...]]:
    """The launch's store `what` ("has not answered for 61 s"), and the ranks on the node
    that holds it: torchrun's agent store is on the node of ranks 0..LOCAL_WORLD_SIZE-1."""
    address = os.environ.get("MASTER_ADDR", "?")
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    ranks = tuple(range(local))
    who = f"rank 0's node (host {address}, ranks {', '.join(map(str, ranks))})"
    return f"the launch's store on {who} {what}", ranks


def _bounded(call: Any, timeout: float) -> Any:
    """`call()`'s result, or None if it has not returned within `timeout` (it runs on in a
    daemon thread: a store call on a cut link returns only when TCP gives up)."""
    box: list[Any] = []

    def called() -> None:
        with contextlib.suppress(Exception):  # a store gone: no traceback from this thread
            box.append(call())

    thread = threading.Thread(target=called, name=f"{_THREAD}-call", daemon=True)
    thread.start()
    thread.join(timeout)
    return box[0] if box else None


def _named(ranks: tuple[int, ...], where: dict[int, Where]) -> str:
    hosts = sorted({where[r].host for r in ranks if r in where})
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{who} ({'host ' + ', '.join(hosts) if hosts else 'host unknown'})"


_ADDRESS = re.compile(r"\[((?:\d{1,3}\.){3}\d{1,3}|[0-9a-fA-F]*:[0-9a-fA-F:.]+)\]:\d+")


def _address_in(words: str) -> str | None:
    """The peer's address in gloo's words ("... by peer [10.0.0.3]:2782", or an IPv6 one;
    not the "[.../pair.cc:553]" its message starts with)."""
    found = _ADDRESS.search(words)
    return found.group(1).removeprefix("::ffff:") if found else None


def _state(where: Where, my_boot: str) -> str | None:
    """On this very machine (the same boot): "died" for a rank whose process is gone (or a
    zombie), "frozen" for one stopped (SIGSTOP); None elsewhere, or running."""
    if not where.boot or where.boot != my_boot:
        return None
    try:
        with open(f"/proc/{where.pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "died"
    return {"Z": "died", "X": "died", "T": "frozen", "t": "frozen"}.get(state)


def _main_torch_frame() -> Any:
    """The main thread's outermost frame inside torch.distributed's collectives, or None."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    found = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(_TORCH_COLLECTIVES) and "torch" in name:
            found = frame
        frame = frame.f_back
    return found


# ---- the one watch of this process ----------------------------------------------------------

_watch: Watch | None = None
# The default group whether to watch was decided for, weakly: holding a destroyed group
# would keep its resources alive (and a harness checks that nothing does).
_started_for: Any = None


def _decided_for() -> Any:
    return _started_for() if _started_for is not None else None


def current() -> Watch | None:
    """The watch over this process's default group, started on first use where it applies:
    a launched multi-rank gloo group with a store, and a bound that is not 0."""
    global _watch, _started_for
    if not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _decided_for() is world:  # decided for this group already (a watch, or none)
        return _watch
    if _watch is not None:  # a new default group: the old watch's counts mean nothing now
        _watch.stop.set()
        _watch = None
    _started_for = weakref.ref(world)
    bound = bound_s()
    if bound is None or not _applies():
        return None  # read once per group: each labelled collective pays one comparison
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    _watch = _start(store, dist.get_rank(), dist.get_world_size(), bound)
    return _watch


def _applies() -> bool:
    if dist.get_world_size() < 2 or "gloo" not in str(dist.get_backend()).lower():
        return False
    launched = "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get(BOUND_ENV, "").strip()
    return bool(launched)


def _start(store: Any, rank: int, world: int, bound: float) -> Watch:
    beat = min(10.0, max(0.2, bound / 10))
    watch = Watch(store, rank, world, bound, beat)
    with contextlib.suppress(Exception):
        store.set(f"{_KEYS}where/{rank}", json.dumps(_here()))
        store.add(f"{_KEYS}beat/{rank}", 1)
    threading.Thread(target=watch.run, name=_THREAD, daemon=True).start()
    atexit.register(_at_exit, watch)
    _name_lost_peers_on_exit(watch)
    _error_file.spoken = lambda error: watch.spoken(tuple(getattr(error, "_rankwise_lost", ())))
    return watch


# gloo's words when a peer's link fails (a plain torch.distributed collective's error).
_LINK_WORDS = ("Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe")


def _name_lost_peers_on_exit(watch: Watch) -> None:
    """A plain torch.distributed collective that fails on a lost peer ends the process with
    gloo's words: say which ranks and host they were, on stderr and in the error file."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        words = str(error)
        plain = not hasattr(error, "_rankwise_peers_lost")  # rankwise's own said it already
        named = None
        if plain and any(w in words for w in _LINK_WORDS):
            with contextlib.suppress(Exception):
                named = watch.explain_link_failure(words)
            what = named[0] if named is not None else "a peer died or went away"
            said = f"rank {watch.rank}: a torch.distributed collective failed: {what}"
            _error_file.write_entry(
                message=f"{type(error).__name__}: {said} ({words.splitlines()[0]})",
                callstack=words,
                timestamp=int(time.time()) - _error_file.EARLIER_S,
            )
        previous(kind, error, tb)
        if named is not None:
            print(f"rankwise: {said}", file=sys.stderr, flush=True)
        if plain and any(w in words for w in _LINK_WORDS):
            watch.leaving()
            watch.spoken(named[1] if named is not None else ())

    sys.excepthook = hook


def _at_exit(watch: Watch) -> None:
    watch.stop.set()
    if dist.is_initialized() and _decided_for() is dist.group.WORLD:
        watch.leaving()  # an ordinary end: not silent, not lost


def _here() -> dict[str, Any]:
    addresses = {"127.0.0.1"}
    with contextlib.suppress(OSError):
        addresses.update(socket.gethostbyname_ex(socket.gethostname())[2])
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            addresses.add(s.getsockname()[0])
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as file:
        boot = file.read().strip()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "boot": boot,
        "addresses": sorted(addresses),
    }


# ---- waiting ---------------------------------------------------------------------------------


def wait(work: Any) -> None:
    """Wait for an async collective's `work`: at once where no watch runs; else in slices,
    raising PeersLost once a peer has been silent past the bound."""
    watch = current()
    if watch is None:
        work.wait()
        return
    with _waiting(watch):
        while True:
            try:
                if work.wait(timeout=timedelta(seconds=_SLICE_S)) is not False:
                    return
            except RuntimeError as exc:
                if _TIMED_OUT not in str(exc):
                    raise  # the collective failed: the caller words it
            if watch.lost:
                raise PeersLost(watch.account(), watch.lost)
            if watch.store_gone or watch.clock() - watch.store_ok_at >= watch.bound + watch.beat:
                raise PeersLost(*watch.store_words())


@contextlib.contextmanager
def _waiting(watch: Watch) -> Iterator[None]:
    watch.waiting += 1
    try:
        yield
    finally:
        watch.waiting -= 1
