"""One run's task on a warm rank: the test's environment and context, its process group, its
body (through ``body.run_body``, with what a warm rank adds around it: the test's module
loaded, the rank's own fixtures, log capture, stray exceptions), then what the rank keeps or
lets go (the group, or the reasons it must be replaced).

Runs only in ranks; ``worker`` serves tasks and restores the process after each.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.common import endings, environment, hygiene, rank_warnings
from harness.common.faults import Fault, Injector
from harness.common.launch_detect import IN_RANK_WORKER
from harness.common.outcome import Ending, RankOutcome, exit_code
from harness.common.protocol import CURRENT_TEST, FixturePlan, RequestInfo, RunTask, decode_args
from harness.common.pytest_internals import real_xfail
from harness.common.rank_state import RankState
from harness.rank import group, group_release, kept_group, lasting, loader, logs
from harness.rank.body import run_body
from harness.rank.fixtures import RankFixtures

endings.skip_frames_of(__file__)


def run(task: RunTask) -> tuple[RankOutcome, RankState, environment.Snapshot | None]:
    """How the task ended here, what this rank holds after it (its kept group), and the
    environment it started with (None: not set yet). Never raises: the harness's own set-up
    failing on this rank is its outcome too."""
    started = time.monotonic()  # the pytest side's deadline for this run counts from here
    test_env: environment.Snapshot | None = None
    state = RankState()
    kept: str | None = None
    outcome: RankOutcome | None = None
    try:
        test_env = _apply_environment(task)  # mostly already so: going back costs nothing
        _enter_test_context(task)
        unwaited = kept_group.unwaited_functional()
        _xfail_as_pytest_has_it(task.spec.runxfail)
        outcome, before = run_body(task.key, task.rank, task.spec, WarmBody(task), started)
        hygiene.put_back_native_env(before)
        daemons = hygiene.daemons_left(before) if "threads" in task.spec.hygiene else []
        if not outcome.replace_after:
            outcome = outcome.replaced(lasting.why_replaced(daemons, unwaited))
        kept_ok = not (outcome.leftovers or outcome.replace_after)
        if task.keep_group and outcome.ending is Ending.RETURNED and kept_ok:
            kept = kept_group.keep(task.key)
            messages, counts = kept_group.point_to_point(), kept_group.counts()
            state.kept_group, state.point_to_point, state.kept_counts = kept, messages, counts
        return outcome, state, test_env
    except BaseException as exc:  # the harness's own set-up failed on this rank
        outcome = endings.raised(
            task.key, task.rank, exc, note="while setting the rank up for the test"
        ).set_up_tried(1, failed=isinstance(exc, group.SetUpFailed))
        return outcome, state, test_env
    finally:
        if kept is None:
            group.teardown()
        # Groups a spawned or launched run made on its own store stay alive if something
        # holds them (a subgroup in a module's cache), and with them the port it listens on.
        own_store = task.spec.bare or task.launch_port is not None
        torn = group.tore_down_the_tests_own()
        if outcome is not None and (torn or (own_store and group_release.made_alive())):
            state.settles = True


class WarmBody:
    """A test body as a warm rank runs it (see body.Body): its module loaded here, the rank's
    own fixtures made and torn down here, log records and stray exceptions captured here."""

    reraised: tuple[type[BaseException], ...] = ()

    def __init__(self, task: RunTask) -> None:
        self._task = task
        self._fn: Callable[..., Any] | None = None
        self._args: tuple[Any, ...] = ()
        self._kwargs: dict[str, Any] = {}
        self._plan: FixturePlan | None = None
        self._fixtures: RankFixtures | None = None
        self._stray: rank_warnings.StrayExceptions | None = None

    def load(self) -> tuple[Fault, ...]:
        """Load the test's module, then what may refer to its classes: the arguments, the
        faults."""
        task = self._task
        loader.finder.learn(task.target)  # first: those classes may live where only pytest looks
        run = decode_args(task.args_blob)
        multiprocessing.set_start_method(None, force=True)  # the module's import may set it
        self._fn = loader.resolve(task.target, run.instance_state, run.class_state)
        if multiprocessing.get_start_method(allow_none=True) is None and task.start_method:
            multiprocessing.set_start_method(task.start_method)  # a conftest's, say
        self._args, self._kwargs, self._plan = run.args, run.kwargs, run.fixtures
        return task.load_faults()

    @contextlib.contextmanager
    def around(self) -> Any:
        spec = self._task.spec
        with (
            logs.capturing(spec.log_capture),  # the test's module is loaded: its loggers exist
            rank_warnings.stray_exceptions(spec.stray_warnings) as stray,
        ):
            self._stray = stray
            yield

    def call(self, injector: Injector) -> Any:
        try:
            return self._call(injector)
        except BaseException as exc:
            end_if_a_forked_copy(exc)
            raise

    def _call(self, injector: Injector) -> Any:
        task, fn, plan = self._task, self._fn, self._plan
        assert fn is not None, "load() comes first"
        made = self._kwargs if plan is None else {**plan.values, **self._kwargs}  # every value
        info = made.get("request")
        fixtures = RankFixtures(task.rank, info if isinstance(info, RequestInfo) else None)
        self._fixtures = fixtures
        fixtures.bind(fn)
        group_release.test_begins()  # groups made from here on are the test's (fixtures too)
        made.update(_rank_side_values(task, made))
        made.update(fixtures.make(made))
        kwargs = self._kwargs
        if plan is not None:
            fixtures.make_fixtures(plan, made, getattr(fn, "__self__", None), loader.load_module)
            kwargs = {name: made[name] for name in kwargs}
        fixtures.enter_phase("call")
        injector.at_start()
        value = fn(*self._args, **kwargs)
        end_if_a_forked_copy(None)
        return value

    def finish(self) -> None:
        try:
            if self._fixtures is not None:
                self._fixtures.close()  # finalizers and undoing, in the rank: errors fail it
            end_if_a_forked_copy(None)  # a fixture's teardown forked, and its copy came back
        except BaseException as exc:
            end_if_a_forked_copy(exc)
            raise
        # The test's values go now, while stray exceptions are watched: a __del__ that raises
        # as they go is the test's, as in a plain test's teardown (after, it was lost).
        self._let_values_go()
        if self._stray is not None:
            self._stray.warn()  # exceptions in its threads or __del__, as pytest warns of them

    def _let_values_go(self) -> None:
        self._fn, self._args, self._kwargs, self._plan = None, (), {}, None
        self._fixtures = None

    def after_raise(self, outcome: RankOutcome) -> RankOutcome:
        """Peers blocked on this rank fail now instead of at their timeout, and so does a
        fixture's teardown waiting in a collective (it would hang until the deadline, and
        the report would show where ranks waited instead of this error)."""
        self._fn, self._args, self._kwargs, self._plan = None, (), {}, None  # the test's values
        group.teardown()
        if self._fixtures is None:
            return outcome
        try:
            self._fixtures.close()
            end_if_a_forked_copy(None)
        except BaseException as also:  # reported with the body's error, not instead of it
            said = f"{type(also).__name__}: {endings.text_of(also)}"
            del also
            return outcome.noted(f"then, tearing its fixtures down: {said}")
        return outcome

    def after_body(self, outcome: RankOutcome) -> tuple[RankOutcome, bool]:
        task = self._task
        left = (task.launch_port is not None or task.spec.bare) and dist.is_initialized()
        return outcome, left

    def children_before(self) -> set[int]:
        return set()  # a warm rank has none of its own: whatever runs below it is the test's

    def env_before(self, env: dict[str, str]) -> dict[str, str]:
        return env


def _rank_side_values(task: RunTask, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Fill the fixtures only a rank can know, where the test asked for them and the pytest
    process left them to the rank (None: a project's own `device` fixture has a value)."""
    known: dict[str, Callable[[], Any]] = {
        "rank": lambda: task.rank,
        "world_size": lambda: task.spec.world_size,
        "device": lambda: torch.device(task.device),
    }
    return {name: make() for name, make in known.items() if name in kwargs and kwargs[name] is None}


# ---- the test's context -------------------------------------------------------------------

_SET_PER_RUN = (CURRENT_TEST, IN_RANK_WORKER)


def _apply_environment(task: RunTask) -> environment.Snapshot:
    """Give the rank the environment the test sees, as torchrun's children have theirs;
    returns it, for the rank to go back to after the test.

    The last test's is still there, so mostly only PYTEST_CURRENT_TEST changes.
    """
    if task.env is not None:
        environment.restore(environment.encoded(task.env), leave=_SET_PER_RUN)
    if task.current_test is None:
        os.environ.pop(CURRENT_TEST, None)
    else:
        os.environ[CURRENT_TEST] = task.current_test
    if os.environ.get(IN_RANK_WORKER) != "1":
        os.environ[IN_RANK_WORKER] = "1"  # a pytest started in here is no launched rank
    return environment.snapshot()


def _enter_test_context(task: RunTask) -> None:
    if task.sys_path:
        sys.path[:] = task.sys_path
    os.chdir(task.cwd)
    spec = task.spec
    loader.set_assert_verbosity(spec.assert_verbosity)
    if spec.threads is not None:  # restored after the test (state.py)
        torch.set_num_threads(spec.threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device(task.device))
    group.enter(task)


def _no_op_xfail(reason: str = "") -> None:
    pass


_no_op_xfail.Exception = real_xfail.Exception  # type: ignore[attr-defined]


def _xfail_as_pytest_has_it(runxfail: bool) -> None:
    """Under --runxfail pytest makes pytest.xfail() a no-op for the session: so in the rank,
    which serves one session. Left so between runs: a module a run loads binds what it
    finds (`from pytest import xfail`), and a later test of the session calls that."""
    pytest.xfail = _no_op_xfail if runxfail else real_xfail  # type: ignore[assignment]


# ---- a forked copy of the rank --------------------------------------------------------------


class _Own:
    pid = 0  # this rank's own pid (a forked copy of it has another)


def note_own_pid() -> None:
    """Remember this process as the rank (at its start): a fork of it is a copy."""
    _Own.pid = os.getpid()


def end_if_a_forked_copy(error: BaseException | None) -> None:
    """A copy of this rank made by os.fork that returned (or raised) out of the test into
    the harness ends as its own process would, never serving as the rank: it would report
    to the pytest side as the rank, and take later tests."""
    if os.getpid() == _Own.pid:
        return
    code = 0
    if isinstance(error, SystemExit):
        code = exit_code(error)
    elif error is not None:
        traceback.print_exception(error)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
