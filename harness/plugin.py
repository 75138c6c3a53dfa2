"""The pytest side: options, markers, fixtures, and running marked tests on ranks.

Imports no torch and does not start a process until a test needs ranks: ``harness.pool`` is
loaded then. Everything here is a pytest hook or fixture; the work lives in ``pool``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness import expect as expectations
from harness import faults as fault_specs
from harness import hygiene
from harness.expect import Expected
from harness.faults import Fault
from harness.outcome import Ending, RankOutcome, diagnose, render_report, summary_line
from harness.protocol import Target

if TYPE_CHECKING:
    from harness.pool import Pools

DEFAULT_RANKS = 2
DEFAULT_TIMEOUT_S = 60.0
START_METHODS = ("forkserver", "spawn", "fork")
BACKENDS = ("gloo", "nccl")
WORLD_PARAM = "_harness_world_size"
# Fixtures each rank makes for itself: only a rank knows them, or (monkeypatch) their undo
# must run in the rank. The pytest process sends a placeholder.
RANK_SIDE = ("rank", "device", "monkeypatch")

_pools_key = pytest.StashKey["Pools"]()
_spec_key = pytest.StashKey["RankSpec"]()
_leftovers_key = pytest.StashKey[str]()


# ---- options and markers -------------------------------------------------------------------

_OPTIONS: list[tuple[str, str, str]] = [
    ("ranks", f"world size for @pytest.mark.ranks without sizes (default {DEFAULT_RANKS})", "N"),
    ("rank_timeout", f"seconds a multi-rank test may run (default {DEFAULT_TIMEOUT_S:g})", "S"),
    ("rank_start_method", "how rank processes start: forkserver (default), spawn, fork", "M"),
    ("rank_backend", "process group backend for rank tests: gloo (default) or nccl", "B"),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "run tests on real torch.distributed ranks")
    for name, help_text, metavar in _OPTIONS:
        group.addoption(
            f"--{name.replace('_', '-')}", dest=name, default=None, metavar=metavar, help=help_text
        )
        parser.addini(name, help_text, default=None)


MARKERS = (
    "ranks(*sizes, timeout=None, launch=False, backend=None): run the test body on every rank "
    "of a world of each size (default --ranks); launch=True gives torchrun's environment and no "
    "process group; timeout in seconds overrides --rank-timeout",
    "gpu: needs CUDA GPUs (one per rank); skipped where there are too few",
    "fault(rank=1, kind='raise', at='start', nth=1, exc=None, code=1, signal='SIGKILL', "
    "seconds=1.0): inject a fault on a rank of a ranks test (repeatable; or Fault objects)",
    "expect(...): how each rank must end: expect(returns()), expect(rank=1, does=raises(E), "
    "others=returns()) or expect({rank: outcome}); see harness.expect",
    "allow_leftovers(*kinds): let the test leave 'group', 'threads' or 'env' behind in its "
    "ranks (no arguments: all three)",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    _validate_options(config)


def _setting(config: pytest.Config, name: str) -> tuple[Any, str] | None:
    """An option's value and where it came from: the command line first, then the ini file."""
    value = config.getoption(name, None)
    if value is not None:
        return value, f"--{name.replace('_', '-')}"
    value = config.getini(name)
    if value not in (None, ""):
        return value, f"ini option {name!r}"
    return None


def _validate_options(config: pytest.Config) -> None:
    for name in ("ranks", "rank_timeout", "rank_start_method", "rank_backend"):
        _option(config, name)


def _option(config: pytest.Config, name: str) -> Any:
    found = _setting(config, name)
    if name == "ranks":
        return DEFAULT_RANKS if found is None else _positive_int(found[0], found[1])
    if name == "rank_timeout":
        return None if found is None else _positive_seconds(found[0], found[1])
    choices = START_METHODS if name == "rank_start_method" else BACKENDS
    if found is None:
        return choices[0]
    value, origin = found
    if value not in choices:
        raise pytest.UsageError(f"invalid {origin} {value!r}: choose one of {', '.join(choices)}")
    return value


def _positive_int(value: Any, origin: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(value, bool) or str(number) != str(value).strip():
        raise pytest.UsageError(f"invalid world size {value!r} from {origin}: expected an int >= 1")
    return number


def _positive_seconds(value: Any, origin: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if not seconds > 0 or isinstance(value, bool):
        raise pytest.UsageError(f"invalid timeout {value!r} from {origin}: expected seconds > 0")
    return seconds


# ---- collection ----------------------------------------------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("ranks")
    if marker is None or not marker.args:
        return
    origin = f"@pytest.mark.ranks on {metafunc.definition.nodeid}"
    try:
        sizes = [_positive_int(size, origin) for size in marker.args]
    except pytest.UsageError as exc:
        raise ValueError(str(exc)) from None
    metafunc.fixturenames.append(WORLD_PARAM)
    metafunc.parametrize(WORLD_PARAM, sizes, ids=[f"ranks={n}" for n in sizes])


@dataclass(frozen=True)
class RankSpec:
    """How one marked test runs: its world, its bound, its mode."""

    world_size: int
    timeout_s: float
    backend: str
    start_method: str
    launch: bool
    faults: tuple[Fault, ...] = ()
    expected: tuple[Expected, ...] = ()  # one per rank; empty: every rank must return
    hygiene: frozenset[str] = frozenset(hygiene.CHECKS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("ranks")
        if marker is None or not isinstance(item, pytest.Function):
            continue
        spec = _spec_for(item, marker)
        item.stash[_spec_key] = spec
        if item.get_closest_marker("timeout") is not None or getattr(config, "_env_timeout", None):
            # One timer only: ours, which kills the ranks and reports their stacks.
            item.add_marker(pytest.mark.timeout(0), append=False)


def _spec_for(item: pytest.Function, marker: pytest.Mark) -> RankSpec:
    config = item.config
    origin = f"@pytest.mark.ranks on {item.nodeid}"
    unknown = set(marker.kwargs) - {"timeout", "launch", "backend"}
    if unknown:
        raise pytest.UsageError(
            f"{origin}: unknown option(s) {sorted(unknown)}; use timeout=, launch= or backend="
        )
    callspec = getattr(item, "callspec", None)
    if callspec is not None and WORLD_PARAM in callspec.params:
        world_size = int(callspec.params[WORLD_PARAM])
    else:
        world_size = _option(config, "ranks")
    backend = marker.kwargs.get("backend") or _option(config, "rank_backend")
    if backend not in BACKENDS:
        raise pytest.UsageError(f"{origin}: invalid backend {backend!r}; use gloo or nccl")
    try:
        faults = _marked_faults(item, world_size)
        expected = _marked_expectations(item, world_size)
        allowed = _allowed_leftovers(item)
    except (fault_specs.FaultError, expectations.ExpectationError, ValueError) as exc:
        raise pytest.UsageError(str(exc)) from None
    return RankSpec(
        world_size=world_size,
        timeout_s=_timeout_for(item, marker),
        backend=backend,
        start_method=_option(config, "rank_start_method"),
        launch=bool(marker.kwargs.get("launch", False)),
        faults=faults,
        expected=expected,
        hygiene=frozenset(hygiene.CHECKS) - allowed,
    )


def _marked_faults(item: pytest.Function, world_size: int) -> tuple[Fault, ...]:
    origin = f"the fault marker on {item.nodeid}"
    found: list[Fault] = []
    for mark in item.iter_markers("fault"):
        try:
            found += fault_specs.from_marker(mark.args, mark.kwargs)
        except (TypeError, fault_specs.FaultError) as exc:
            raise fault_specs.FaultError(f"{exc}, in {origin}") from None
    return tuple(fault_specs.validate(f, world_size, origin) for f in found)


def _marked_expectations(item: pytest.Function, world_size: int) -> tuple[Expected, ...]:
    mark = item.get_closest_marker("expect")
    if mark is None:
        return ()
    origin = f"the expect marker on {item.nodeid}"
    return tuple(expectations.from_marker(mark.args, mark.kwargs, world_size, origin))


def _allowed_leftovers(item: pytest.Function) -> frozenset[str]:
    mark = item.get_closest_marker("allow_leftovers")
    if mark is None:
        return frozenset()
    return hygiene.parse_allowed(mark.args, f"the allow_leftovers marker on {item.nodeid}")


def _timeout_for(item: pytest.Function, marker: pytest.Mark) -> float:
    """The ranks marker, then pytest-timeout's marker, --rank-timeout, pytest-timeout's option."""
    if marker.kwargs.get("timeout") is not None:
        return _positive_seconds(marker.kwargs["timeout"], f"the ranks marker on {item.nodeid}")
    timeout_marker = item.get_closest_marker("timeout")
    if timeout_marker is not None:
        value = timeout_marker.kwargs.get("timeout", (timeout_marker.args or [None])[0])
        if value is not None:
            return _positive_seconds(value, f"the timeout marker on {item.nodeid}")
    configured = _option(item.config, "rank_timeout")
    if configured is not None:
        return float(configured)
    env_timeout = getattr(item.config, "_env_timeout", None)
    if env_timeout:
        return float(env_timeout)
    return DEFAULT_TIMEOUT_S


def pytest_runtest_setup(item: pytest.Item) -> None:
    spec = item.stash.get(_spec_key, None)
    needs_gpu = item.get_closest_marker("gpu") is not None or (
        spec is not None and spec.backend == "nccl"
    )
    if needs_gpu:
        needed = spec.world_size if spec is not None else 1
        _skip_without_gpus(needed)


def _skip_without_gpus(needed: int) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < needed:
        # Reported at the test's own location, not this line.
        raise pytest.skip.Exception(
            f"needs {needed} CUDA GPU(s), this machine has {have}", _use_item_location=True
        )


# ---- fixtures ------------------------------------------------------------------------------


class _OnlyInRanks:
    """What a rank-side fixture is in the pytest process: a placeholder the rank replaces."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: set inside each rank>"


def _rank_spec(request: pytest.FixtureRequest, name: str) -> RankSpec:
    spec = request.node.stash.get(_spec_key, None)
    if spec is None:
        raise pytest.UsageError(
            f"fixture {name!r} exists only in a test marked @pytest.mark.ranks; "
            f"mark {request.node.nodeid} or use run_on_ranks"
        )
    return spec  # type: ignore[no-any-return]


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> Any:
    """This rank's index in the test's world (0 .. world_size-1)."""
    _rank_spec(request, "rank")
    return _OnlyInRanks("rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """The number of ranks the test runs on."""
    return _rank_spec(request, "world_size").world_size


@pytest.fixture
def device(request: pytest.FixtureRequest) -> Any:
    """This rank's torch.device: cpu with gloo, cuda:<rank> with nccl."""
    _rank_spec(request, "device")
    return _OnlyInRanks("device")


@pytest.fixture
def shared_tmp_path(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A temporary directory every rank of the test sees (the same path on all of them)."""
    spec = _rank_spec(request, "shared_tmp_path")
    return tmp_path_factory.mktemp(f"shared-ranks{spec.world_size}")


@pytest.fixture
def rank_faults() -> list[Fault]:
    """Faults for the ranks of a ranks test; override it (or parametrize it) to inject some."""
    return []


def _pools(config: pytest.Config) -> Pools:
    if _pools_key not in config.stash:
        from harness.pool import Pools

        config.stash[_pools_key] = Pools()
    return config.stash[_pools_key]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Close every pool and make sure no rank process outlived the session."""
    pools = session.config.stash.get(_pools_key, None)
    if pools is None:
        return
    left = pools.close()
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"harness: rank processes still alive at session end: {left}"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    pools = config.stash.get(_pools_key, None)
    if pools is not None:
        pools.close()  # idempotent; covers an interrupted session


# ---- running a marked test on its ranks -----------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.stash.get(_spec_key, None)
    if spec is None:
        return None
    target = _test_target(pyfuncitem)
    args_blob = _sendable_funcargs(pyfuncitem)
    extra = pyfuncitem._request.getfixturevalue("rank_faults")
    if extra:
        origin = f"the rank_faults fixture of {pyfuncitem.nodeid}"
        try:
            more = tuple(fault_specs.validate(f, spec.world_size, origin) for f in extra)
        except fault_specs.FaultError as exc:
            pytest.fail(str(exc), pytrace=False)
        spec = RankSpec(**{**spec.__dict__, "faults": spec.faults + more})
    outcomes = _run(pyfuncitem.config, spec, target, args_blob)
    _record_leftovers(pyfuncitem, outcomes)
    _judge(pyfuncitem.nodeid, spec, outcomes)
    return True


def _record_leftovers(item: pytest.Item, outcomes: list[RankOutcome]) -> None:
    lines = [f"rank {o.rank} {finding}" for o in outcomes for finding in o.leftovers.values()]
    if lines:
        hint = "(a test that means it: @pytest.mark.allow_leftovers('group', 'threads', 'env'))"
        item.stash[_leftovers_key] = "\n".join(["hygiene: " + lines[0], *lines[1:], hint])


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test that left things behind in a rank errors at teardown, naming the rank."""
    text = item.stash.get(_leftovers_key, None)
    if text is not None:
        raise RankLeftovers(text)


class RankLeftovers(Exception):
    """A rank test left a process group, threads or environment changes behind."""


def _test_target(item: pytest.Function) -> Target:
    module = item.module
    assert module is not None
    qualname = item.originalname
    if item.cls is not None:
        qualname = f"{item.cls.__qualname__}.{item.originalname}"
    return Target(module.__name__, getattr(module, "__file__", None), qualname)


def _sendable_funcargs(item: pytest.Function) -> bytes:
    """The test's arguments resolved here, pickled for the trip to the ranks.

    A value that cannot travel fails the test naming its fixture; each value is pickled on
    its own only then, to find it.
    """
    kwargs = {
        name: None if name in RANK_SIDE else item.funcargs[name]  # the rank fills RANK_SIDE
        for name in item._fixtureinfo.argnames
    }
    try:
        return pickle.dumps(((), kwargs))
    except Exception:
        _fail_naming_the_fixture(item, kwargs)
        raise  # no single value is to blame: the error as pickle gave it


def _fail_naming_the_fixture(item: pytest.Function, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            pytest.fail(
                f"fixture {name!r} of {item.nodeid} cannot be sent to the ranks "
                f"({type(exc).__name__}: {exc}); make its value picklable, or build it "
                f"inside the test body",
                pytrace=False,
            )


def _run(
    config: pytest.Config,
    spec: RankSpec,
    target: Target,
    args_blob: bytes,
) -> list[RankOutcome]:
    """Run `target` with the pickled (args, kwargs) on every rank of `spec`'s pool."""
    from harness.pool import PoolKey, RunRequest

    key = PoolKey(spec.world_size, spec.backend, spec.start_method)
    request = RunRequest(
        target=target,
        args_blob=args_blob,
        timeout_s=spec.timeout_s,
        launch=spec.launch,
        device_for_rank=_device_for(spec.backend),
        faults=spec.faults,
        hygiene=spec.hygiene,
    )
    return _pools(config).run(key, request)


def _device_for(backend: str) -> Callable[[int], str]:
    if backend == "nccl":
        return lambda r: f"cuda:{r}"
    return lambda r: "cpu"


def _judge(nodeid: str, spec: RankSpec, outcomes: list[RankOutcome]) -> None:
    """Pass only if every rank ended as expected; otherwise fail with the root cause first."""
    if all(o.ending is Ending.SKIPPED for o in outcomes):
        pytest.skip(outcomes[0].message)
    text = failure_text(outcomes, spec.expected)
    if text is not None:
        pytest.fail(
            f"{text.splitlines()[0]}  [{spec.world_size} ranks, {nodeid}]\n"
            + "\n".join(text.splitlines()[1:]),
            pytrace=False,
        )


def failure_text(outcomes: list[RankOutcome], expected: tuple[Expected, ...] = ()) -> str | None:
    """The report for outcomes that differ from `expected` (default: all return), or None."""
    if expected:
        failed = expectations.mismatches(expected, outcomes)
        if not failed:
            return None
        diagnosis = diagnose(outcomes, failed)
        header = f"expected outcomes not met on {_plural(failed)}"
        body = render_report(outcomes, diagnosis, expectations.table(expected, outcomes))
        return f"{header}\n\n{body}"
    failed = [o.rank for o in outcomes if not o.ok]
    if not failed:
        return None
    diagnosis = diagnose(outcomes, failed)
    return render_report(outcomes, diagnosis, summary_line(outcomes, diagnosis))


def _plural(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# ---- running any function on ranks, from the pytest process ---------------------------------


@dataclass
class WorldOutcome:
    """Every rank's outcome of one `run_on_ranks` call, in rank order."""

    ranks: list[RankOutcome]

    def __getitem__(self, rank: int) -> RankOutcome:
        return self.ranks[rank]

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[RankOutcome]:
        return iter(self.ranks)

    @property
    def values(self) -> list[Any]:
        """Each rank's return value; raises if any rank did not return."""
        bad = [o for o in self.ranks if not o.ok]
        if bad:
            raise AssertionError(self.report())
        return [o.value for o in self.ranks]

    @property
    def endings(self) -> list[Ending]:
        return [o.ending for o in self.ranks]

    def report(self) -> str:
        return failure_text(self.ranks) or "every rank returned"

    def expect(self, *args: Any, **kwargs: Any) -> None:
        """Assert how each rank ended, in the expect marker's forms; the table on a mismatch."""
        wanted = expectations.from_marker(args, kwargs, len(self.ranks), "WorldOutcome.expect")
        text = failure_text(self.ranks, tuple(wanted))
        if text is not None:
            raise AssertionError(text)


class RankRunner:
    """Runs a module-level function on every rank of a world and returns every outcome."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config

    def __call__(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int | None = None,
        timeout: float | None = None,
        launch: bool = False,
        backend: str | None = None,
        faults: list[Fault] | tuple[Fault, ...] = (),
        **kwargs: Any,
    ) -> WorldOutcome:
        target = _function_target(fn)
        chosen_backend = backend or _option(self._config, "rank_backend")
        if chosen_backend not in BACKENDS:
            raise ValueError(f"run_on_ranks: invalid backend {chosen_backend!r}; use gloo or nccl")
        try:
            size = _positive_int(
                world_size if world_size is not None else _option(self._config, "ranks"),
                "run_on_ranks(world_size=...)",
            )
            seconds = _positive_seconds(
                timeout
                if timeout is not None
                else _option(self._config, "rank_timeout") or DEFAULT_TIMEOUT_S,
                "run_on_ranks(timeout=...)",
            )
        except pytest.UsageError as exc:  # a bad argument, not a bad command line
            raise ValueError(str(exc)) from None
        if chosen_backend == "nccl":
            _skip_without_gpus(size)
        spec = RankSpec(
            world_size=size,
            timeout_s=seconds,
            backend=chosen_backend,
            start_method=_option(self._config, "rank_start_method"),
            launch=launch,
            faults=tuple(fault_specs.validate(f, size, "run_on_ranks(faults=...)") for f in faults),
        )
        return WorldOutcome(_run(self._config, spec, target, pickle.dumps((args, kwargs))))


def _function_target(fn: Callable[..., Any]) -> Target:
    qualname = getattr(fn, "__qualname__", "")
    module_name = getattr(fn, "__module__", None)
    if not module_name or not qualname or "<" in qualname:
        raise ValueError(
            f"run_on_ranks needs a module-level function (found by name in each rank), "
            f"not {fn!r}; move it to the top level of a module"
        )
    import sys

    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    # A test module (assertion-rewritten here) is loaded the same way in the ranks.
    is_test_file = (file is not None and Path(file).name.startswith(("test_", "conftest"))) or (
        file is not None and Path(file).stem.endswith("_test")
    )
    return Target(module_name, file if is_test_file else None, qualname)


@pytest.fixture
def run_on_ranks(request: pytest.FixtureRequest) -> RankRunner:
    """Call ``run_on_ranks(fn, *args, world_size=N, timeout=S, launch=False, **kwargs)``.

    Runs ``fn`` on every rank (with a fresh process group, or torchrun's environment and
    none when ``launch=True``) and returns a :class:`WorldOutcome` with every rank's ending,
    value, exception, exit code or signal. It never raises for what a rank did.
    """
    return RankRunner(request.config)
