"""The whole contract between the pytest process and its ranks, in one place.

- Messages: a :class:`Kind` and the one payload type that kind carries, so no event name is
  a bare string scattered over files.
- What one run is (:class:`RankSpec`, :class:`RunTask`) and the device a rank uses.
- The files a rank writes (:class:`RankFiles`) and the encoding of the where-buffer.
- The signal that makes a rank dump its stacks, the fixtures a rank makes for itself, and
  the encoding of a run's arguments.

Imports no torch: the pytest side loads this module at collection time.
"""

from __future__ import annotations

import enum
import pickle
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from harness.common.expect import Expected
from harness.common.faults import Fault
from harness.common.hygiene import CHECKS
from harness.common.rank_state import RankResult

Backend = Literal["gloo", "nccl"]
StartMethod = Literal["forkserver", "spawn", "fork"]
BACKENDS: tuple[Backend, ...] = ("gloo", "nccl")
START_METHODS: tuple[StartMethod, ...] = ("forkserver", "spawn", "fork")

# faulthandler dumps every thread's stack on this signal, even inside a C++ collective.
DUMP_STACKS_SIGNAL = signal.SIGUSR1
# Fixtures each rank makes for itself: only a rank knows them, or their effect (capture,
# patches, finalizers) must happen in the rank. The pytest process sends None in their
# place, except a base the rank builds from: tmp_path and tmpdir (the test's directory, as
# a str), request (a RequestInfo), caplog (the level to capture from, or None).
RANK_SIDE_FIXTURES = (
    "rank",
    "device",
    "monkeypatch",
    "capsys",
    "capsysbinary",
    "capfd",
    "capfdbinary",
    "caplog",
    "recwarn",
    "request",
    "tmp_path",
    "tmpdir",
)
WHERE_SIZE = 512  # bytes of the shared where-buffer: the labelled collectives a rank is in
OUTPUT_LIMIT = 64 * 1024  # the tail of a rank's stream (or captured log) a report keeps
# pytest names the test and phase it is in here; it travels apart from the environment.
CURRENT_TEST = "PYTEST_CURRENT_TEST"
# The variable naming the fork server's preload directory (in the session's work directory)
# while the pytest process starts the server (rank/forkserver_preload.py reads it).
SERVER_DIR = "_HARNESS_PRELOAD_DIR"
# The pid of the pytest process starting the fork server, read (and dropped) by the server.
SERVER_PARENT = "_HARNESS_PRELOAD_PARENT"
# The harness's own tests set this to make rank 1's first N group set-ups fail.
SIMULATED_SET_UP_FAILURES = "_HARNESS_TEST_SETUP_FAILURES"


class Kind(enum.Enum):
    READY = "ready"  # worker -> pytest, once, when the rank can take work
    RUN = "run"  # pytest -> worker: run one test (or function) on this rank
    RESULT = "result"  # worker -> pytest: how the rank ended that run
    DROP_GROUP = "drop_group"  # pytest -> worker: tear the group kept after that run down
    # worker -> pytest, after a RESULT that was not a return and after each DROP_GROUP:
    # whether the rank stays to serve, or ends (a torn-down group it cannot drop)
    SETTLED = "settled"


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Target:
    """A module-level function, or a method of a test class, found by name in a rank."""

    module: str
    file: str | None  # loaded with assertion rewriting when given
    qualname: str
    # Modules the pytest process loaded from files under names a rank cannot import (pytest's
    # importlib import mode, conftests): (name, file); and their packages: (name, paths).
    modules: tuple[tuple[str, str], ...] = ()
    packages: tuple[tuple[str, tuple[str, ...]], ...] = ()
    unwrap: str = ""  # "hypothesis": call the named test's inner function (an example of it)


@dataclass(frozen=True)
class WarningFilters:
    """The warning filters pytest would apply to the test, for the ranks to apply."""

    config: tuple[str, ...] = ()  # the ini's filterwarnings
    cmdline: tuple[str, ...] = ()  # -W options
    marks: tuple[str, ...] = ()  # the test's filterwarnings markers, closest last
    python_warnoptions: bool = False  # python -W was given: pytest then adds no defaults


@dataclass(frozen=True)
class LogCapture:
    """How pytest captures a test's log records for its report (log_level, log_format, ...),
    for the ranks to capture theirs the same way."""

    level: int | None  # None: the loggers' own levels decide, as in pytest
    fmt: str
    datefmt: str | None
    auto_indent: Any  # pytest's log_auto_indent, as given


@dataclass(frozen=True)
class RequestInfo:
    """What a test's ``request`` can tell a rank: a snapshot taken in the pytest process."""

    name: str
    nodeid: str
    keywords: tuple[str, ...]
    markers: tuple[tuple[str, tuple[Any, ...], dict[str, Any]], ...]  # closest first
    fixturenames: tuple[str, ...]
    options: dict[str, Any]  # those that pickle
    ini: dict[str, Any]  # those that pickle
    has_param: bool = False
    param: Any = None
    flags: dict[str, str] = field(default_factory=dict)  # "--big" -> its option's dest
    path: str = ""  # the test's file


def device_for(backend: Backend, rank: int) -> str:
    """The device a rank of `backend` uses: its own GPU with NCCL, the CPU with gloo."""
    return f"cuda:{rank}" if backend == "nccl" else "cpu"


@dataclass(frozen=True)
class CoverageSetup:
    """How a rank measures coverage: as the Coverage measuring the pytest process does."""

    data_file: str  # absolute, in the session's work directory: the ranks' data files' stem
    config_file: str | None  # the one the pytest process read (None: none)
    source: tuple[str, ...] | None
    source_pkgs: tuple[str, ...] = ()
    include: tuple[str, ...] = ()
    omit: tuple[str, ...] = ()
    branch: bool = False


# A rank's coverage data file is <data_file>.<RANK_DATA_SUFFIX>.<host>.<pid>.<n>.
RANK_DATA_SUFFIX = "harness-rank"


@dataclass(frozen=True)
class RankSpec:
    """How one test (or run_on_ranks call) runs: its world, its bound, its mode, its checks."""

    world_size: int
    timeout_s: float
    backend: Backend = "gloo"
    start_method: StartMethod = "forkserver"
    launch: bool = False  # torchrun's environment and no process group
    bare: bool = False  # no group and no torchrun environment: the target sets its own
    faults: tuple[Fault, ...] = ()
    expected: tuple[Expected, ...] = ()  # one per rank; empty: every rank must return
    hygiene: frozenset[str] = frozenset(CHECKS)  # the leftover checks to make after the body
    warning_filters: WarningFilters = WarningFilters()
    threads: int | None = None  # torch intra-op threads per rank; None: torch's own
    fresh_group: bool = False  # never run on a group kept from an earlier test
    # Compare the ranks' collectives on the harness's group (collective_match.py).
    collective_check: bool = True
    assert_verbosity: int = 0  # pytest's -v for the diffs of the body's failed asserts
    log_capture: LogCapture | None = None  # None: the rank's records go where logging sends them
    show_locals: int | None = None  # --showlocals: longest repr of a local (0: whole); None: off
    # Stray exceptions ("thread", "unraisable") turned into warnings, as pytest's plugins for
    # them do when loaded; one whose plugin is off is printed, as Python prints it.
    stray_warnings: frozenset[str] = frozenset({"thread", "unraisable"})
    runxfail: bool = False  # --runxfail: pytest.xfail() does nothing, as in the pytest process
    # Whether the target's return value travels back whole (run_on_ranks, spawn, rank_pool);
    # a ranks test's needs only its repr, for pytest's warning.
    keep_value: bool = True
    # Each rank seeds random, torch and numpy with seed + rank (seed alone: same_seed) before
    # the body; None: from os.urandom (see plan/seeds.py).
    seed: int | None = None
    same_seed: bool = False

    @property
    def keeps_group(self) -> bool:
        """Whether a clean run may leave its group for the next test (gloo, a harness group)."""
        return self.backend == "gloo" and not (self.fresh_group or self.launch or self.bare)

    def faults_on(self, rank: int, faults: tuple[Fault, ...] | None = None) -> tuple[Fault, ...]:
        """The faults (this spec's, or `faults` given for it) that apply to `rank`."""
        every = self.faults if faults is None else faults
        return tuple(f for f in every if rank in f.ranks(self.world_size))


_FAULTS = "_faults_blob"  # where a rank's task holds the spec's faults, still pickled
# The fields that stay the same from run to run of a test file (spec, target, paths, the
# environment less PYTEST_CURRENT_TEST): pickled apart, so a rank unpickles them only when
# they change (~0.1 ms of a rank's CPU per test).
_STABLE_FIELDS = (
    "spec",
    "target",
    "store_path",
    "keep_group",
    "sys_path",
    "cwd",
    "env",
    "coverage",
)


class _Common:
    """The fields a run's tasks have in common, pickled when the first of them is: those
    that rarely change between runs, and the rest."""

    def __init__(self) -> None:
        self._pickled: tuple[bytes, bytes] | None = None

    def pickled(self, task: RunTask) -> tuple[bytes, bytes]:
        if self._pickled is None:
            fields = {k: v for k, v in vars(task).items() if k not in ("rank", "_common")}
            stable = {name: fields.pop(name) for name in _STABLE_FIELDS}
            # The faults go per run, loaded once the test's module is (see load_faults), and
            # are never shared between runs: an exception instance gathers each run's traceback.
            stable["spec"] = replace(task.spec, faults=())
            fields[_FAULTS] = _dumps(task.spec.faults)
            self._pickled = (_dumps(stable), _dumps(fields))
        return self._pickled


def _dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True)
class RunTask:
    """One rank's share of one run, as sent to it."""

    key: str  # unique per run; the result carries it back so a late one is never misfiled
    rank: int
    spec: RankSpec
    target: Target
    args_blob: bytes  # encode_args((args, kwargs)), loaded after the target's module
    store_path: str  # the session's private store (a file in its 0700 work directory)
    store_prefix: str
    launch_port: int | None = None  # launch mode: torchrun's env, rendezvous on this store
    attempt: int = 0  # launch mode: torchrun's restart count, distinct per run
    setup_attempt: int = 1  # the set-up is retried (fresh store prefix) when it fails
    reuse_group: str | None = None  # run on the group kept under this id (every rank has it)
    keep_group: bool = False  # the rank may keep its group after a clean run (kept_group)
    sys_path: list[str] = field(default_factory=list)
    cwd: str = "."
    env: dict[str, str] | None = None  # the pytest process's at run time; None: leave the rank's
    current_test: str | None = None  # its PYTEST_CURRENT_TEST, apart: it changes every run
    # The pytest process's default start method as the test sees it there (None: not set).
    start_method: str | None = None
    # The session's secret for the keys the ranks write in the pytest process's store (see
    # signing.py): it travels over the rank's private pipe only.
    secret: bytes | None = None
    coverage: CoverageSetup | None = None  # the rank measures coverage so (see plan/measured.py)
    # What it has in common with the other ranks' tasks of its run, pickled once for them all.
    _common: _Common = field(default_factory=_Common, init=False, compare=False, repr=False)

    @property
    def device(self) -> str:
        return device_for(self.spec.backend, self.rank)

    def load_faults(self) -> tuple[Fault, ...]:
        """This rank's faults. In a rank they arrive pickled apart from the spec: call this
        once the test's module is loaded, as their exceptions may be its classes."""
        blob = self.__dict__.get(_FAULTS)
        return self.spec.faults_on(self.rank, None if blob is None else pickle.loads(blob))

    def for_ranks(self, world_size: int) -> list[RunTask]:
        """This task for every rank of the run; pickling them all pickles what they share
        once (~40 us for a run's environment, spec and paths, per rank otherwise)."""
        tasks = []
        for rank in range(world_size):
            task = object.__new__(RunTask)
            task.__dict__.update(self.__dict__, rank=rank)  # _common included: shared
            tasks.append(task)
        return tasks

    def __reduce__(self) -> tuple[Any, ...]:
        return (_task_of_rank, (*self._common.pickled(self), self.rank))


# In a rank: the stable fields last received, as bytes and as loaded. Their values are
# shared by the tasks that use them, and nothing mutates them.
_last_stable: tuple[bytes, dict[str, Any]] = (b"", {})


def _task_of_rank(stable: bytes, per_run: bytes, rank: int) -> RunTask:
    global _last_stable
    if stable != _last_stable[0]:
        _last_stable = (stable, pickle.loads(stable))
    task = object.__new__(RunTask)
    task.__dict__.update(_last_stable[1], **pickle.loads(per_run), rank=rank, _common=_Common())
    return task


@dataclass(frozen=True)
class DropGroup:
    key: str  # the run whose kept group to drop (a later run's group is never dropped)


@dataclass(frozen=True)
class Settled:
    key: str  # the run it follows
    leaving: bool  # the rank ends now: the pool must replace it before the next run


PAYLOAD_TYPES: dict[Kind, type] = {
    Kind.READY: Ready,
    Kind.RUN: RunTask,
    Kind.RESULT: RankResult,
    Kind.DROP_GROUP: DropGroup,
    Kind.SETTLED: Settled,
}


@dataclass(frozen=True)
class Message:
    kind: Kind
    payload: Any

    def __post_init__(self) -> None:
        expected = PAYLOAD_TYPES[self.kind]
        assert isinstance(self.payload, expected), (self.kind, type(self.payload))


@dataclass(frozen=True)
class RankFiles:
    """The files one rank writes and the pytest process reads, even after the rank died."""

    stdout: Path  # fd 1 of the rank
    stderr: Path  # fd 2 of the rank
    stacks: Path  # faulthandler's dump on DUMP_STACKS_SIGNAL
    where: Path  # the where-buffer (WHERE_SIZE bytes, memory-mapped by the rank)
    log: Path  # the log records the rank captured during the run (RankSpec.log_capture)
    issued: Path  # ISSUED_SIZE bytes, memory-mapped: operations issued on its group this test
    crash: Path  # faulthandler's stack of a fatal signal (SIGSEGV, SIGABRT, ...) in this run

    @classmethod
    def in_dir(cls, directory: Path, rank: int) -> RankFiles:
        return cls(
            directory / f"rank{rank}.out",
            directory / f"rank{rank}.err",
            directory / f"rank{rank}.stacks",
            directory / f"rank{rank}.where",
            directory / f"rank{rank}.log",
            directory / f"rank{rank}.issued",
            directory / f"rank{rank}.crash",
        )


def encode_where(collectives: list[str]) -> bytes:
    """The where-buffer's content: the nested labelled collectives, outermost first."""
    text = " > ".join(collectives).encode()[: WHERE_SIZE - 1]
    return text.ljust(WHERE_SIZE, b"\0")


def decode_where(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


# A rank's operations board, shared memory the pytest side reads while the rank runs: the
# count of operations it issued on the harness's group in the current test, the count of
# collectives among them, and the last COLLECTIVES_KEPT collectives' fingerprints (ring).
COUNT_SIZE = 8  # each count: an unsigned 64-bit integer, little-endian
FINGERPRINT_SIZE = 96  # "all_reduce [2] float32", NUL-padded
COLLECTIVES_KEPT = 32
ISSUED_SIZE = 2 * COUNT_SIZE + COLLECTIVES_KEPT * FINGERPRINT_SIZE


def decode_counts(raw: bytes) -> tuple[int, int]:
    """The operations a rank issued on its group in the current test, and how many of them
    were collectives (0s where the board is not written yet)."""
    raw = raw[: 2 * COUNT_SIZE].ljust(2 * COUNT_SIZE, b"\0")
    return int.from_bytes(raw[:COUNT_SIZE], "little"), int.from_bytes(raw[COUNT_SIZE:], "little")


def decode_collectives(raw: bytes) -> tuple[int, dict[int, str]]:
    """How many collectives a rank called on its group in the current test, and the
    fingerprints of the last ones it kept, by their index (0 for its first)."""
    raw = raw.ljust(ISSUED_SIZE, b"\0")
    count = decode_counts(raw)[1]
    kept = {}
    for index in range(max(0, count - COLLECTIVES_KEPT), count):
        at = 2 * COUNT_SIZE + (index % COLLECTIVES_KEPT) * FINGERPRINT_SIZE
        kept[index] = raw[at : at + FINGERPRINT_SIZE].split(b"\0", 1)[0].decode(errors="replace")
    return count, kept


@dataclass(frozen=True)
class FixtureRecipe:
    """A fixture a rank makes by calling its function, because it uses a fixture only a rank
    has (its rank, device, tmp_path, monkeypatch, ...), directly or through another one."""

    key: str  # its name; "name#1" for a definition an override of it requests, and so on
    module: str  # where a rank finds its function: the module and the qualified name there
    qualname: str
    args: tuple[tuple[str, str], ...]  # (parameter, key of the value it is called with)
    has_param: bool = False  # a parametrized fixture: request.param is this
    param: Any = None
    file: str | None = None  # the module's file: two conftests can share a module name

    @property
    def name(self) -> str:
        return self.key.partition("#")[0]


@dataclass(frozen=True)
class FixturePlan:
    """The fixtures a rank makes itself, in order (a fixture after those it uses), and the
    values they use that the test's own arguments do not hold, by key."""

    recipes: tuple[FixtureRecipe, ...]
    values: dict[str, Any]


@dataclass(frozen=True)
class RunArgs:
    """What a run's target is called with, loaded in the rank."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    instance_state: dict[str, Any] | None  # a test class instance's attributes
    fixtures: FixturePlan | None  # fixtures the rank makes before the call
    class_state: dict[str, Any] | None  # what setup_class set on the test's class


def encode_args(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    instance_state: dict[str, Any] | None = None,
    fixtures: FixturePlan | None = None,
    class_state: dict[str, Any] | None = None,
) -> bytes:
    """A run's arguments, for the trip to the ranks; a test class's and its instance's
    attributes and the fixtures the ranks make too. One pickle: a value the test and a
    fixture share stays one object."""
    return pickle.dumps((args, kwargs, instance_state, fixtures, class_state))


def decode_args(blob: bytes) -> RunArgs:
    args, kwargs, state, fixtures, class_state = pickle.loads(blob)
    return RunArgs(tuple(args), dict(kwargs), state, fixtures, class_state)
