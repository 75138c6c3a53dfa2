"""``harness.spawn``: the drop-in for ``torch.multiprocessing.spawn`` on warm ranks.

``harness.spawn(fn, args, nprocs)`` runs ``fn(i, *args)`` on warm ranks with no group set up
(``fn`` sets its own, as under spawn), bounded by the harness's timeout, and raises torch's own
exception types (subclasses carrying the harness's report), root cause first. The other
common launcher, a hand-written pool of processes, has its drop-in in pool.py.

Runs from the pytest process of the current session (any test, marked or not). This module
is also a pytest plugin: it follows the session and the running test, and waits at a test's
teardown for the join=False runs its body never joined. Imports no torch until a run raises
torch's exception types.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness import seam
from harness.adopt import ranks
from harness.common import rank_warnings
from harness.common.errors import SpecError, invalid
from harness.common.outcome import Ending, RankOutcome, signal_name
from harness.common.protocol import RankSpec, Target, encode_args
from harness.common.report_text import failure_text
from harness.common.root_cause import root_cause
from harness.plan import packing, seeds
from harness.plan.settings import settings_of, timeout_for

# What a spawned or pooled rank is checked for afterwards: threads and processes that would
# meet the next run. A group or environment left behind is reset by the worker, as process
# exit resets them under spawn.
RUN_HYGIENE = frozenset({"threads", "processes"})

_configs: list[pytest.Config] = []
_items: list[pytest.Item] = []
_calling: list[pytest.Item] = []  # the tests whose body is running (not a fixture)
_started: list[tuple[SpawnContext, pytest.Item]] = []  # join=False runs, by test body
# join=False runs started outside a test body (a fixture's), with where they started: the
# fixture's to join, and checked at the session's end in case it never does.
_outside_body: list[tuple[SpawnContext, pytest.Config, str]] = []
_lost_key = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    _configs.append(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config in _configs:
        _configs.remove(config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    _items.append(item)
    try:
        return (yield)
    finally:
        _items.remove(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _calling.append(item)
    try:
        return (yield)
    except BaseException:
        item.stash[_body_raised_key] = True
        raise
    finally:
        _calling.remove(item)


_body_raised_key = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """After the test's teardown (even one that raised), wait for the join=False runs its body
    started and never joined (the next test would queue behind them on the same ranks and be
    blamed); one that failed is this test's error. A run a fixture started is the fixture's:
    it may be joined at its teardown."""
    try:
        return (yield)
    finally:
        mine = [context for context, owner in _started if owner is item]
        _started[:] = [(context, owner) for context, owner in _started if owner is not item]
        body_raised = item.stash.get(_body_raised_key, False)
        __tracebackhide__ = True  # the error is the run's report, not the harness's frames
        failures, skipped = _unjoined_failures(mine, body_raised)
        if failures:  # raised outside any handler: chained only to a teardown's own error
            raise _not_joined(failures)
        if skipped is not None:  # a run skipped on every rank, and none failed
            raise skipped


def _where_started(config: pytest.Config) -> str:
    item = next((i for i in reversed(_items) if i.config is config), None)
    return f"started while setting up or tearing down {item.nodeid}" if item else "started"


@pytest.hookimpl(tryfirst=True)  # before the pools close under the runs
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Runs a fixture started and never joined: wait for them (one still going is ended at
    once: nothing will join it now) and fail the session for any that failed."""
    mine = [(c, where) for c, config, where in _outside_body if config is session.config]
    _outside_body[:] = [entry for entry in _outside_body if entry[1] is not session.config]
    lost = []
    for context, where in mine:
        context.cut_if_running("the session ended", after_s=0.0)
        with contextlib.suppress(pytest.skip.Exception):
            failure = context.unjoined_failure()
            if failure is not None:
                lost.append(f"-- {where} --\n{failure}")
    if lost:
        session.config.stash[_lost_key] = "\n\n".join(lost)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lost = terminalreporter.config.stash.get(_lost_key, None)
    if lost:
        terminalreporter.write_sep(
            "=",
            "harness.spawn(join=False) runs started outside a test body and never joined, "
            "which failed (join each in the fixture that starts it, at its teardown)",
            red=True,
        )
        terminalreporter.write_line(lost)


UNJOINED_POLL_S = 0.02  # how often teardown looks for the next of several runs to end


def _unjoined_failures(
    contexts: list[SpawnContext], body_raised: bool
) -> tuple[list[Exception], BaseException | None]:
    """Wait for each run never joined, as they end (not in the order they started), and
    return their failures, and the first skip (a run skipped on every rank) if any. Once
    the test has failed (its body raised, or one of these failed), nobody will join the
    rest: those still going are ended after the grace."""
    pending = [context for context in contexts if not context.joined]
    failures: list[Exception] = []
    skipped: BaseException | None = None
    failing = body_raised
    while pending:
        if failing:
            for context in pending:
                context.cut_if_running("the test that started it failed")
        ended = [context for context in pending if not context.running]
        if not ended:
            pending[0].wait(UNJOINED_POLL_S)
            continue
        for context in ended:
            pending.remove(context)
            try:
                failure = context.unjoined_failure()
            except pytest.skip.Exception as skip:  # no failure, but the others still count
                skipped = skipped or skip
                continue
            if failure is not None:
                failures.append(failure)
                failing = True
    return failures, skipped


def _not_joined(failures: list[Exception]) -> SpawnNotJoined:
    """The teardown error for runs never joined that failed: each run's report, in full."""
    if len(failures) == 1:
        return SpawnNotJoined(
            f"a harness.spawn(join=False) run this test started was never joined, and it "
            f"failed (join its context to meet the failure where it happens):\n{failures[0]}"
        )
    reports = "".join(
        f"\n\n-- run {n} of {len(failures)} to fail --\n{failure}"
        for n, failure in enumerate(failures, 1)
    )
    return SpawnNotJoined(
        f"{len(failures)} harness.spawn(join=False) runs this test started were never joined, "
        f"and they failed (join each context to meet its failure where it happens):{reports}"
    )


def _session(caller: str) -> tuple[pytest.Config, pytest.Item | None]:
    if not _configs:
        raise RuntimeError(
            f"{caller} runs ranks from a pytest session with the harness loaded, and none is "
            f"running in this process (inside a rank, call torch.multiprocessing.spawn or the "
            f"function itself; outside pytest, use torch.multiprocessing.spawn)"
        )
    config = _configs[-1]
    item = _items[-1] if _items and _items[-1].config is config else None
    return config, item


def target_of(fn: Callable[..., Any], caller: str) -> Target | Callable[..., Any]:
    """How each rank finds `fn`: by name, or (a method bound to an instance) the method
    itself, pickled with its instance as torch's spawn pickles it."""
    if inspect.ismethod(fn) and not isinstance(fn.__self__, type):
        try:
            pickle.dumps(fn)
        except Exception as exc:
            raise ValueError(
                f"{caller}: the instance of the bound method {fn.__qualname__} cannot travel "
                f"to the ranks ({type(exc).__name__}: {exc}); make the instance pickle, or "
                f"pass a module-level function"
            ) from exc
        return fn
    try:
        return packing.function_target(fn)
    except SpecError:
        raise ValueError(
            f"{caller} needs a function defined at the top level of a module (each rank finds "
            f"it by name, as spawn pickles it by name), not {fn!r}; move it to module level"
        ) from None


def encoded_args(caller: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """The run's arguments pickled for the ranks; a ValueError saying what to pass instead."""
    try:
        return encode_args(args, kwargs)
    except Exception as exc:
        raise ValueError(
            f"{caller}: the arguments cannot reach the warm ranks ({type(exc).__name__}: "
            f"{exc}); pass values that pickle: a multiprocessing queue, pipe or event only "
            f"passes to processes being created, so use a file or a torch.distributed store"
        ) from exc


# ---- harness.spawn ----------------------------------------------------------------------------


def spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    timeout: float | None = None,
) -> SpawnContext | None:
    """Run ``fn(i, *args)`` for ``i`` in ``range(nprocs)`` on warm ranks, like torch's spawn.

    No process group is set up: ``fn`` sets its own (MASTER_ADDR/MASTER_PORT, a FileStore...).
    Every rank must return: an exception raises a ``ProcessRaisedException`` subclass, and an
    exit (``sys.exit`` included, even with 0), a signal or a hang past ``timeout`` (the
    harness's precedence, 60 s by default) raises a ``ProcessExitedException`` subclass; the
    message opens with the root-cause rank, as torch's does, followed by the harness's report.
    ``daemon`` and ``start_method`` are accepted for compatibility: ranks are warm
    processes of the harness's start method. With ``join=False`` the run goes on in the
    background and the returned context's ``join()`` waits for it.
    """
    config, item = _session("harness.spawn")
    settings = settings_of(config)
    spec = RankSpec(
        world_size=nprocs_value(nprocs),
        timeout_s=timeout_for(settings, timeout, "harness.spawn(timeout=...)", item),
        backend=settings.backend,
        start_method=settings.start_method,
        bare=True,
        hygiene=RUN_HYGIENE,
        warning_filters=rank_warnings.filters_for(config, item),
        stray_warnings=settings.stray_warnings,
        runxfail=settings.runxfail,
        seed=seeds.for_test(settings.seed, item.nodeid if item is not None else ""),
    )
    blob = encoded_args(
        "harness.spawn", (target_of(fn, "harness.spawn"), tuple(args)), {"rank": None}
    )
    target = packing.function_target(ranks.run_spawned)
    own = seam.own_ranks_of(config)
    context = SpawnContext(
        lambda started, cut: after_import(
            config,
            spec,
            fn,
            lambda: own.run_target(spec, target, blob, started, cut),
        ),
        spec.timeout_s,
        own.failure_grace_s(),
    )
    if not join:
        body = next((i for i in reversed(_calling) if i.config is config), None)
        if body is not None:
            _started.append((context, body))
        else:
            _outside_body.append((context, config, _where_started(config)))
        return context
    context.join()
    return None


def after_import(
    config: pytest.Config,
    spec: RankSpec,
    fn: Callable[..., Any],
    run: Callable[[], list[RankOutcome]],
) -> list[RankOutcome]:
    """`run`, once `fn`'s module is imported on the ranks in a phase of its own, bounded by
    --rank-import-timeout (a big library's import is no part of the run's own bound); the
    import's outcomes instead when it failed or ran past that bound."""
    failed = seam.own_ranks_of(config).import_ahead(None, spec, _module_target(fn))
    return failed or run()


def _module_target(fn: Callable[..., Any]) -> Target:
    """The module `fn` comes from, as a target a rank imports (a bound method's class's)."""
    instance = getattr(fn, "__self__", None)
    owner = type(instance) if inspect.ismethod(fn) and not isinstance(instance, type) else fn
    return packing.function_target(owner)


def nprocs_value(value: Any, origin: str = "harness.spawn(nprocs=...)") -> int:
    """An int >= 1, strictly (as torch's spawn wants it); ValueError naming `origin`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(invalid("process count", value, origin, "use an int >= 1"))
    return value


# A run of the ranks: told whom to tell the rank processes as it starts, and the handle that
# may end it early.
Runner = Callable[[Callable[[list[int]], None], seam.Cut], list[RankOutcome]]


class SpawnContext:
    """A started :func:`spawn` run, joined like torch's ``ProcessContext``."""

    def __init__(self, run: Runner, start_bound_s: float, failure_grace_s: float) -> None:
        self.outcomes: list[RankOutcome] = []
        self._error: BaseException | None = None
        self._joined = False  # a join() saw the run's end (and raised its failure, if any)
        self._cut = seam.Cut()  # the harness ends it after the grace once its test failed
        self._pids: list[int] = []
        self._started = threading.Event()  # the ranks are chosen (or the run ended before)
        self._start_bound_s = start_bound_s
        self._failure_grace_s = failure_grace_s
        self._thread = threading.Thread(target=self._run, args=(run,), name="harness-spawn")
        self._thread.start()

    def _run(self, run: Runner) -> None:
        try:
            self.outcomes = run(self._starting, self._cut)
        except BaseException as exc:  # handed to join(), in the caller's thread
            self._error = exc
        finally:
            self._started.set()

    def _starting(self, pids: list[int]) -> None:
        self._pids = pids
        self._started.set()

    def pids(self) -> list[int]:
        """The rank processes running ``fn``, in rank order, as soon as the run has them (a
        test may signal one); those that ran it once the run has ended."""
        if self.outcomes:
            return [o.pid for o in self.outcomes]
        # Starting ranks takes seconds at most (a cold session's first): bounded by the run's.
        self._started.wait(self._start_bound_s)
        return [o.pid for o in self.outcomes] or list(self._pids)

    def join(self, timeout: float | None = None) -> bool:
        """True when every rank returned; False while the run goes on; raises for a failure."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._joined = True
        if self._error is not None:
            raise self._error
        rank_warnings.reemit(self.outcomes)
        raise_for(self.outcomes)
        return True

    @property
    def joined(self) -> bool:
        """Whether a join() has seen the run's end."""
        return self._joined

    @property
    def running(self) -> bool:
        """Whether the run goes on."""
        return self._thread.is_alive()

    def wait(self, timeout: float) -> None:
        """Wait at most `timeout` seconds for the run to end (raises nothing)."""
        self._thread.join(timeout)

    def cut_if_running(self, why: str, after_s: float | None = None) -> None:
        """End the run, if it still goes on, `after_s` from now (by default the grace peers of
        a failure get): nobody will join it (or talk to a server it is) now."""
        if self._cut.at is not None or self._joined or not self._thread.is_alive():
            return
        self._cut.after(self._failure_grace_s if after_s is None else after_s, why)

    def unjoined_failure(self) -> Exception | None:
        """For a context never joined: wait for its run (bounded by the run's timeout, or by
        the grace once cut) and return its failure, if any. A run that ended only because
        it was cut has none of its own: the test's failure is the report."""
        if self._joined:
            return None
        try:
            self.join()
            return None
        except Exception as exc:
            failure = exc
        if self._cut.at is not None and _only_cut_short(self.outcomes):
            return None
        return failure


def _only_cut_short(outcomes: list[RankOutcome]) -> bool:
    """Whether a run ended only because the harness cut it short: every rank returned or
    was still running (none raised, exited or died on its own)."""
    endings = {o.ending for o in outcomes}
    return Ending.HUNG in endings and endings <= {Ending.HUNG, Ending.RETURNED}


class SpawnNotJoined(AssertionError):
    """A harness.spawn(join=False) run the test never joined failed."""


def raise_for(outcomes: list[RankOutcome]) -> None:
    """Raise torch's exception type for the root-cause rank, with the whole report after it."""
    report = failure_text(outcomes)
    if report is None:
        _raise_for_leftovers(outcomes)
        return
    if all(o.ending is Ending.SKIPPED for o in outcomes):
        raise pytest.skip.Exception(outcomes[0].message, _use_item_location=True)
    culprit = root_cause(outcomes) or next(o for o in outcomes if not o.ok)
    raise _exception_for(culprit, report, outcomes)


def _raise_for_leftovers(outcomes: list[RankOutcome]) -> None:
    """A process that left a thread running would never have ended under torch's spawn (its
    join waits): the leftovers fail the call, naming the rank."""
    from harness.adopt.spawn_errors import RankRaised
    from harness.pytest_side.runner import leftovers_text

    text = leftovers_text(outcomes)
    if text is not None:
        culprit = next(o for o in outcomes if o.leftovers)
        error = RankRaised(text, culprit.rank, culprit.pid)
        error.report, error.outcomes = text, outcomes
        raise error


def _exception_for(culprit: RankOutcome, report: str, outcomes: list[RankOutcome]) -> Exception:
    from harness.adopt.spawn_errors import RankExited, RankRaised

    index, pid = culprit.rank, culprit.pid
    error: RankRaised | RankExited
    if culprit.ending is Ending.RAISED:
        message = f"\n\n-- Process {index:d} terminated with the following error:\n"
        error = RankRaised(f"{message}{culprit.traceback}\n{report}", index, pid)
    elif culprit.ending is Ending.SIGNALLED:
        name = signal_name(culprit.signal)
        first = f"process {index:d} terminated with signal {name}"
        error = RankExited(f"{first}\n{report}", index, pid, -(culprit.signal or 0), name)
    elif culprit.ending is Ending.RETURNED:  # the root cause: it left its peers waiting
        first = f"process {index:d} returned while its peers still waited on it (exit code 0)"
        error = RankExited(f"{first}\n{report}", index, pid, 0)
    elif culprit.ending is Ending.HUNG:
        first = f"process {index:d} did not end in time and was killed (SIGKILL)"
        error = RankExited(f"{first}\n{report}", index, pid, -9, "SIGKILL")
    else:  # exited: sys.exit, os._exit, or a skip on some ranks only
        code = culprit.exit_code if culprit.exit_code is not None else 1
        first = f"process {index:d} terminated with exit code {code:d}"
        error = RankExited(f"{first}\n{report}", index, pid, code)
    error.report, error.outcomes = report, outcomes
    return error
