"""The launched ranks' meeting place: the launch's store, with waits that know their peers.

Every exchange is "publish mine, wait for every rank's" under one key. A wait gives up on a
peer early, with the reason, when the peer shows no sign of life (its heartbeat stopped) or
has moved past the test being exchanged (it will never publish); otherwise it waits for its
bound, and a few seconds at most once the launcher is stopping the job.

The store itself can go: its node lost, or cut off. An operation that fails for that (the
connection closed or reset, or no answer within STORE_ANSWER_S: see store_calls.py) marks
the store `lost` with torch's first line; from then on nothing waits on it: a write is
dropped, a read finds nothing, and a gather finds every other rank absent for that reason,
so the session reaches its verdicts and its end on what this rank alone knows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch.distributed as dist

from harness.common import listening, reaper, signing
from harness.common.launch_detect import Launch
from harness.launched import store_calls
from harness.launched.gathered import Gathered
from harness.launched.store_calls import StoreCalls

_T = TypeVar("_T")

HEARTBEAT_S = 1.0  # how often each rank says it is alive
SILENT_AFTER_S = 15.0  # a heartbeat unchanged this long: the rank is gone (see _silent)
QUIET_AFTER_S = 2.5 * HEARTBEAT_S  # unchanged this long when a wait ends: gone, most likely
STOPPING_WAIT_S = 3.0  # the longest wait once the launcher is stopping the job
# How long one store operation may go unanswered before the store counts as lost. Through a
# cut link no error arrives until TCP gives up (about 15 minutes), and torch's client timeout
# does not bound a blocked operation: store_calls.py cuts the connection under one this late.
# A safety net: the store answers in microseconds, even under load.
STORE_ANSWER_S = 30.0
_FIRST_POLL_S = 0.0005  # ranks usually arrive together: poll fast first, then slow down
_LAST_POLL_S = 0.05
# Each pause this much longer than the last: the last rank is seen at most half a pause late
# (doubling let an exchange wait up to twice as long as its last rank took to come).
_POLL_GROWTH = 1.5
# An exchange's wait for its peers' keys, in the store, a slice at a time (between slices it
# looks at why peers are missing): torch answers the wait as the last key is set. A slice that
# ends unanswered costs about half a millisecond (torch's exception, held back: quiet_cpp), so
# slices grow to a quarter second: fifteen ranks waiting for one computing for a minute take
# 0.2% of a core each, not the 1% that 50 ms slices would. The first slice lasts until the
# first look at missing peers: shorter ones only ended unanswered more often as the world grew
# (on an oversubscribed machine sixteen ranks take tens of milliseconds to reach an exchange).
_FIRST_LOOK_S = 0.1  # a wait this long first notes the missing peers' heartbeats
_FIRST_SLICE_S = _FIRST_LOOK_S
_LAST_SLICE_S = 0.25
_ABSENTEES_EVERY_S = 1.0  # how often a long wait looks at why peers are missing
_TORCH_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"  # a frame's file, in there


class Peers:
    """This rank's client of the launch's store, under a prefix of this attempt of the job."""

    def __init__(self, launch: Launch, timeout_s: float, secret: bytes | None = None) -> None:
        hosts = launch.rank == 0 and not launch.agent_store  # srun, mpirun: rank 0 hosts it
        if not hosts:
            _await_listening(launch.master_addr, launch.master_port, timeout_s)
        sockets = store_calls.socket_descriptors()
        base = dist.TCPStore(  # type: ignore[attr-defined]
            launch.master_addr,
            launch.master_port,
            world_size=launch.world_size,
            is_master=hosts,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            multi_tenant=hosts,  # a test's env:// group on rank 0 reuses it, as torchrun's
        )
        new = store_calls.socket_descriptors() - sockets
        self._calls = StoreCalls(store_calls.connection_to(launch.master_port, new))
        # A restart after a membership change keeps TORCHELASTIC_RESTART_COUNT: count the
        # arrivals instead, so a new attempt never reads the last one's keys.
        # With a secret every key's name carries a tag only its holders can compute.
        self.secret = secret
        _claim(base, launch, signing.key(secret, f"harness/{launch.run_key.rpartition('/')[0]}"))
        run = signing.key(secret, f"harness/{launch.run_key}")
        arrival = base.add(f"{run}/arrivals", 1) - 1
        base.set_timeout(timedelta(seconds=STORE_ANSWER_S))  # one answer, not a whole wait
        self.prefix = f"{run}/{arrival // launch.world_size}"
        self._base = base
        self.store: Any = dist.PrefixStore(self.prefix, base)  # type: ignore[attr-defined]
        self.lost = ""  # why the launch's store stopped answering, once it did
        self.lost_at = 0.0  # when (time.monotonic())
        self.nonce = secrets.token_hex(16)  # this rank's part of the job's own prefix
        self.refused: list[str] = []  # keys whose value failed the signature check
        self.rank, self.world_size = launch.rank, launch.world_size
        self.stopping = False  # set when the launcher's SIGTERM came
        self.position: Callable[[], int] = lambda: 0  # where this rank is (see at/<rank>)
        self.name_of: Callable[[int], str] = str  # that place, in words
        self._tick = threading.Event()  # never set: a bounded pause between polls
        self._to_drop: list[str] = []  # keys every rank has read, deleted by flush_drops
        self._drops_lock = threading.Lock()
        self._beats: dict[int, tuple[bytes, float]] = {}  # last heartbeat seen, and when
        # A peer on another machine, silent this long, is gone (or hung, which the test's
        # bound would end anyway): the longest a test may take, at least SILENT_AFTER_S.
        self.silent_elsewhere_s = SILENT_AFTER_S

    def follow(
        self, position: Callable[[], int], name_of: Callable[[int], str], silent_s: float
    ) -> None:
        """Where this rank is, as a stage and in words (a peer past it has moved on), and how
        long a peer elsewhere may be silent before it counts as gone (the tests' bound: one
        holding its GIL looks silent)."""
        self.position, self.name_of = position, name_of
        self.allow_silence(silent_s)

    def allow_silence(self, seconds: float) -> None:
        """A peer elsewhere may be silent `seconds` (a longer test's bound) before it is gone."""
        self.silent_elsewhere_s = max(self.silent_elsewhere_s, seconds)

    def note_stopping(self) -> None:
        """The launcher is stopping the job: waits end after a few seconds from here."""
        self.stopping = True

    def freshen(self, nonces: list[bytes]) -> None:
        """Go on under a prefix made from every rank's random word (`nonces`, in rank order,
        this rank's own as it made it): a value recorded from an earlier job with the same
        run id and secret is never read in this one, and ranks that were shown different
        words (a replayed one) do not see each other's keys at all."""
        words = [n.decode(errors="replace") for n in nonces]
        words[self.rank] = self.nonce
        job = hashlib.sha256(" ".join(words).encode()).hexdigest()[:32]
        self.prefix = f"{self.prefix}/{job}"
        self.store = dist.PrefixStore(self.prefix, self._base)  # type: ignore[attr-defined]
        self.beat()  # at once under the new prefix: a peer may look for it before the next

    def put(self, key: str, value: bytes | str) -> None:
        blob = signing.sign(self.secret, self._where(key), value)
        self._answered(lambda: self.store.set(self._name(key), blob), None)

    def put_many(self, items: Sequence[tuple[str, bytes | str]]) -> None:
        """Set each (key, value) in one operation, in order: no peer sees a later one set
        while an earlier one is not."""
        names = [self._name(key) for key, _ in items]
        blobs = [signing.sign(self.secret, self._where(key), value) for key, value in items]
        self._answered(lambda: self.store.multi_set(names, blobs), None)

    def has(self, key: str) -> bool:
        return self._checked([self._name(key)])

    def _checked(self, names: list[str]) -> bool:
        """Whether every key in `names` is set (False once the store is lost)."""
        return self._answered(lambda: bool(self.store.check(names)), False)

    def read(self, key: str) -> bytes | None:
        """The value under `key`; None if absent, or if its signature does not hold (then it
        is noted in `refused`, to be reported, and never believed)."""
        if not self.has(key):
            return None
        blob = self._answered(lambda: bytes(self.store.get(self._name(key))), None)
        return None if blob is None else self._verified(key, blob)

    def _verified(self, key: str, blob: bytes) -> bytes | None:
        """`blob`'s value if its signature for `key` holds; else None, noted in `refused`."""
        value = signing.verify(self.secret, self._where(key), blob)
        if value is None and key not in self.refused:
            self.refused.append(key)
        return value

    def drop(self, keys: list[str]) -> None:
        """Delete these keys soon, off the caller's way: the heartbeat's thread does it
        (flush_drops), so a test's exchanges do not wait on its last test's deletes."""
        with self._drops_lock:
            self._to_drop += keys

    def flush_drops(self) -> None:
        """Delete the keys dropped since the last flush, each a store call bounded as any."""
        with self._drops_lock:
            keys, self._to_drop = self._to_drop, []
        for key in keys:
            with contextlib.suppress(Exception):
                self._answered(functools.partial(self.store.delete_key, self._name(key)), None)

    def _answered(self, operation: Callable[[], _T], undone: _T) -> _T:
        """`operation`'s result; `undone` once the store is lost, or when the operation
        fails because the store is gone (see store_gone), or gets no answer within
        STORE_ANSWER_S: either marks it lost."""
        if self.lost:
            return undone
        answered, result = self._calls.run(operation, STORE_ANSWER_S)
        if not answered:
            self._mark_lost(
                f"no answer within {STORE_ANSWER_S:g} s: the link to its node, or the node, is down"
            )
            return undone
        if not isinstance(result, BaseException):
            return cast(_T, result)
        if not store_gone(result):
            raise result
        self._mark_lost(first_line(result))
        return undone

    def _mark_lost(self, why: str) -> None:
        if not self.lost:
            self.lost, self.lost_at = why, time.monotonic()

    def _name(self, key: str) -> str:
        return signing.key(self.secret, key)

    def _where(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def beat(self) -> None:
        """Say this rank is alive, whether its main thread is inside torch.distributed, and
        where its process runs (a thread calls it every HEARTBEAT_S)."""
        waiting = "c10d" if main_thread_in_torch_distributed() else "-"
        self.put(f"beat/{self.rank}", f"{time.monotonic()} {waiting} {_PROCESS}")

    def say_place(self) -> None:
        """Say where this rank's process runs (machine, pid namespace, pid)."""
        self.put(f"place/{self.rank}", _PROCESS)

    def pid_here(self, rank: int) -> int | None:
        """`rank`'s pid, if its process runs on this machine and in this pid namespace."""
        return _pid_here((self.read(f"place/{rank}") or b"").decode(errors="replace"))

    def in_torch_distributed(self, rank: int) -> bool:
        """Whether `rank`'s main thread was inside torch.distributed at its last heartbeat
        (most likely blocked in a collective)."""
        return _beat_fields(self.read(f"beat/{rank}"))[1] == "c10d"

    def live_below(self, rank: int, within_s: float) -> bool:
        """Whether a rank below `rank` shows a sign of life within `within_s`: its process
        runs (one on this machine), or its heartbeat moves. False once the store is lost."""
        lower = range(rank)
        first = {r: self.read(f"beat/{r}") for r in lower}
        for r in lower:
            pid = _pid_here(_beat_fields(first[r])[2])
            if pid is not None and reaper.alive(pid):
                return True
        for _ in self.polls(within_s):
            if any(first[r] is not None and self.read(f"beat/{r}") != first[r] for r in lower):
                return True
        return False

    def last_sign_of_life(self, rank: int) -> float:
        """When this rank first saw `rank`'s last heartbeat (time.monotonic()); now if never."""
        seen = self._beats.get(rank)
        return time.monotonic() if seen is None else seen[1]

    def still_in_this_test(self, rank: int) -> bool:
        """Whether `rank` is alive and has not moved past this rank's place."""
        return not self._silent(rank) and self._at(rank) <= self.position()

    def gather(
        self,
        name: str,
        value: bytes | str | None,
        seconds: float,
        skip: set[int],
        first: Sequence[tuple[str, bytes | str]] = (),
    ) -> Gathered:
        """Every rank's value under `name` (None where absent) and why each absent one is.

        `value` None keeps what this rank published there already; ranks in `skip` (known
        to be gone) are not waited for; `first`, keys set just before `value`, in the same
        operation (a round trip less for each).
        """
        puts = [*first, *([(f"{name}/{self.rank}", value)] if value is not None else [])]
        if len(puts) == 1:
            self.put(*puts[0])
        elif puts:
            self.put_many(puts)
        keys = [f"{name}/{r}" for r in range(self.world_size)]
        awaited = {r for r in range(self.world_size) if r not in skip and r != self.rank}
        absent = self._await(keys, awaited, seconds)
        if self.lost:
            gone = f"the launch's store stopped answering ({self.lost})"
            return Gathered([None] * self.world_size, {r: gone for r in awaited | skip})
        own = {self.rank} if value is not None and self.rank not in skip else set()
        sure = {r for r in awaited if r not in absent} | own
        values = self._read_many(keys, sure)
        for r in range(self.world_size):  # the rest, rare: a late key, this rank's kept one
            if r not in sure and r not in skip:
                values[r] = self.read(keys[r])
        reasons = {r: absent.get(r, "gone before") for r, v in enumerate(values) if v is None}
        return Gathered(values, reasons)

    def _read_many(self, keys: list[str], ranks: set[int]) -> list[bytes | None]:
        """The values under the keys of `ranks`, known to be set, in one round trip: a
        gather's cost per rank stays the same whatever the world's size. None for every
        other rank, and for a value whose signature fails."""
        order = sorted(ranks)
        names = [self._name(keys[r]) for r in order]
        values: list[bytes | None] = [None] * self.world_size
        if not names:
            return values
        blobs = self._answered(lambda: [bytes(b) for b in self.store.multi_get(names)], None)
        for r, blob in zip(order, blobs or [], strict=False):
            values[r] = self._verified(keys[r], blob)
        return values

    def polls(self, seconds: float) -> Iterator[float]:
        """Yields the seconds waited so far, pausing between yields (briefly at first, as
        ranks usually arrive together, longer later); stops after `seconds`, or a few once the
        launcher is stopping the job. The caller leaves the loop when what it awaits is there."""
        for waited, pause in self._slices(seconds, _FIRST_POLL_S, _LAST_POLL_S):
            yield waited
            if pause:
                self._tick.wait(pause)

    def wait_for(self, key: str, seconds: float) -> bytes | None:
        """The value at `key` once some rank sets it; None if it is not set within `seconds`."""
        for _ in self.polls(seconds):
            if self.has(key):
                return self.read(key)
        return None

    def _slices(
        self, seconds: float, first_s: float = _FIRST_SLICE_S, last_s: float = _LAST_SLICE_S
    ) -> Iterator[tuple[float, float]]:
        """(seconds waited so far, how long to wait next; 0 at the end), each wait longer than
        the last from `first_s` to `last_s`: `polls` pauses for it, an exchange waits that
        long in the store, which ends its wait as what it awaits arrives."""
        start = time.monotonic()
        slice_s = first_s
        while True:
            waited = time.monotonic() - start
            if waited >= seconds or (self.stopping and waited >= STOPPING_WAIT_S) or self.lost:
                yield waited, 0.0
                return
            yield waited, min(slice_s, seconds - waited)
            slice_s = min(slice_s * _POLL_GROWTH, last_s)

    def _arrived(self, names: list[str], within_s: float) -> bool:
        """Whether every key in `names` is set within `within_s` (0: now): a wait in the store,
        which answers as the last one is set (a poll would see it up to a pause later). False
        once the store is lost."""

        def wait() -> bool:
            try:
                self.store.wait(names, timedelta(seconds=within_s))
            except Exception as exc:
                if _wait_timed_out(exc):
                    return False
                raise
            return True

        return self._answered(wait, False) if within_s > 0 else self._checked(names)

    def _await(self, keys: list[str], awaited: set[int], seconds: float) -> dict[int, str]:
        given_up: dict[int, str] = {}
        start = looked = time.monotonic()
        noted = False
        for waited, slice_s in self._slices(seconds):
            waiting = [r for r in awaited if r not in given_up]
            if not waiting or self._arrived([self._name(keys[r]) for r in waiting], slice_s):
                return given_up
            if waited >= _FIRST_LOOK_S and not noted:
                # Not a quick arrival: each late peer's heartbeat as now, so one that never
                # changes from here on counts as quiet. Quick waits (nearly every wait) never
                # read a heartbeat, and a gather's cost does not grow with the world.
                noted = True
                for r in waiting:
                    self._silent(r)
            elif time.monotonic() - looked >= _ABSENTEES_EVERY_S:
                looked = time.monotonic()
                given_up |= self._absentees(keys, waiting)
        waited = time.monotonic() - start
        missing = [r for r in awaited if r not in given_up and not self.has(keys[r])]
        return given_up | {r: self._late(r, waited) for r in missing}

    def _absentees(self, keys: list[str], ranks: list[int]) -> dict[int, str]:
        """Peers not worth waiting for: silent ones, and ones already past this exchange.

        A rank publishes before it moves on, so its place is read first and its key after:
        a rank seen past this point whose key is still missing will never publish it.
        """
        found = {}
        for r in ranks:
            at = self._at(r)
            if self.has(keys[r]):
                continue
            if at > self.position():
                found[r] = f"it had moved on to {self.name_of(at)} (ranks out of step)"
            elif self.has(f"died/{r}"):
                found[r] = "it died (a rank beside it said so)"
            elif self._silent(r):
                quiet = time.monotonic() - self._beats[r][1]
                found[r] = f"no sign of life for {quiet:.3g} s: {self._why_silent(r)}"
        return found

    def _silent(self, rank: int) -> bool:
        """Whether `rank` is gone. A heartbeat is a thread's, which cannot run while the main
        thread holds the GIL in one long call (a regex, json.loads): a peer on this machine
        is gone once it missed a few beats and its process has ended; one elsewhere, once
        silent for `silent_elsewhere_s` (at least SILENT_AFTER_S)."""
        beat = self.read(f"beat/{rank}") or b""
        seen = self._beats.get(rank)
        now = time.monotonic()
        if seen is None or seen[0] != beat:
            self._beats[rank] = (beat, now)
            return False
        quiet = now - seen[1]
        pid = _pid_here(_beat_fields(beat)[2])
        if pid is not None:  # asked directly, once a few beats are missed
            return quiet > QUIET_AFTER_S and not reaper.alive(pid)
        return quiet > max(SILENT_AFTER_S, self.silent_elsewhere_s)

    def _why_silent(self, rank: int) -> str:
        """Why a silent peer is silent, as far as this rank can tell."""
        if _pid_here(_beat_fields(self._beats[rank][0])[2]) is not None:
            return "its process ended"  # on this machine: asked directly
        return "its process ended, or its node or the link to it went down"

    def _at(self, rank: int) -> int:
        found = self.read(f"at/{rank}")
        try:
            return int(found) if found else -1
        except ValueError:  # not the harness's word: where the rank is, unknown
            return -1

    def _late(self, rank: int, waited: float) -> str:
        at = self._at(rank)
        where = "before the first test" if at < 0 else f"at {self.name_of(at)}"
        self._silent(rank)
        quiet = time.monotonic() - self._beats[rank][1]
        pid = _pid_here(_beat_fields(self._beats[rank][0])[2])
        if pid is not None and not reaper.alive(pid):  # on this machine: known, not guessed
            return f"no sign of life for {quiet:.3g} s: its process ended (it was {where})"
        if quiet >= QUIET_AFTER_S and pid is not None:
            return (
                f"it did not answer within {waited:.3g} s (it was {where}); its process runs "
                f"but gave no sign of life for {quiet:.3g} s: its main thread may hold the "
                f"GIL in one long call"
            )
        if quiet >= QUIET_AFTER_S:  # beats missed in a short wait: gone, most likely
            return (
                f"it gave no sign of life for {quiet:.3g} s (it was {where}): its process has "
                f"likely ended (the launcher's summary gives its exit status)"
            )
        return f"it did not answer within {waited:.3g} s (it was {where})"


class ForeignStore(Exception):
    """The launch's store is another job's (two jobs were given the same port)."""


OWNER_KEY = "rankwise/store-owner"


def _claim(base: Any, launch: Launch, job: str) -> None:
    """The first job to reach a store owns it; another job that reaches it (its launch block
    gave the same port) stops before its tests, where it would fail when the owner ends."""
    owner = bytes(base.compare_set(OWNER_KEY, "", job))
    if owner != job.encode():
        raise ForeignStore(
            f"the launch's store at {launch.master_addr}:{launch.master_port} is another "
            f"job's (another run id reached it first): two jobs were given the same port on "
            f"a node they share. This job stops before its tests and the other goes on; give "
            f"each job its own port (docs/clusters.md derives it from SLURM_JOB_ID)"
        )


def store_is_here(launch: Launch) -> bool:
    """Whether this process's node holds the launch's store: the socket listening on its
    port (in this network namespace) is this process's (rank 0 under srun or mpirun) or its
    launcher's (torchrun's agent). Read from /proc; False where that cannot tell."""
    inodes = _listening_inodes(launch.master_port)
    if not inodes:
        return False
    for pid in ("self", str(os.getppid())):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        return True
    return False


def _listening_inodes(port: int) -> set[str]:
    """The sockets listening on TCP `port` here, as /proc names them ("socket:[inode]")."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.add(f"socket:[{inode}]")
    return found


class StoreUnreachable(Exception):
    """No connection to the launch's store could be made within the bound."""


def _await_listening(host: str, port: int, bound_s: float) -> None:
    """Wait, bounded, until the launch's store takes a connection (a plain socket's tries
    say nothing on the terminal). Raises StoreUnreachable at the bound."""
    failed = listening.await_listening(
        host, port, bound_s, first_pause_s=_FIRST_POLL_S, last_pause_s=_LAST_POLL_S,
        try_at_least_s=0.5,
    )  # fmt: skip
    if failed is not None:
        raise StoreUnreachable(f"no connection to {host}:{port} ({failed})") from None


def store_gone(exc: BaseException) -> bool:
    """Whether a store operation failed because the store is gone: its connection closed,
    reset or refused, no answer within its timeout, or none to be had at all."""
    if isinstance(exc, StoreUnreachable):
        return True
    name = type(exc).__name__
    if name == "DistNetworkError":
        return True
    return name == "DistStoreError" and "timeout" in str(exc).lower()


def _wait_timed_out(exc: BaseException) -> bool:
    """Whether a store's wait ended at its timeout with the store answering (torch raises
    DistStoreError then; a store gone raises DistNetworkError)."""
    return type(exc).__name__ == "DistStoreError" and "timeout" in str(exc).lower()


def first_line(exc: BaseException) -> str:
    """torch's error in one line: its first, without the C++ frames c10 appends."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _process_place() -> str:
    """This process as peers on the same machine and pid namespace can find it."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}/{os.getpid()}"


_PROCESS = _process_place()
_HERE = _PROCESS.rsplit("/", 1)[0]  # this machine and pid namespace


def _beat_fields(beat: bytes | None) -> tuple[str, str, str]:
    """A heartbeat's time, whether it was in torch.distributed, and its process's place."""
    time_, waiting, place, *_ = [*(beat or b"").decode(errors="replace").split(" "), "", "", ""]
    return time_, waiting, place


def _pid_here(place: str) -> int | None:
    """The pid of a process at `place`, if it is on this machine and in this pid namespace."""
    where, _, pid = place.rpartition("/")
    fits = pid.isascii() and pid.isdigit() and len(pid) < 10
    return int(pid) if where == _HERE and fits else None


def main_thread_in_torch_distributed() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if _TORCH_DISTRIBUTED in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False
