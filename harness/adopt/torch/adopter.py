"""torch's suites on warm ranks: ``--rank-adopt torch`` (ini ``rank_adopt = torch``), one
instance of the adopter seam (adopt/core.py).

Tests whose class derives from torch's ``MultiProcessTestCase`` or ``MultiProcContinuousTest``
(``torch.testing._internal.common_distributed``) keep their source. Their parent-side
``setUp``/``tearDown`` (and ``setUpClass``) run in the pytest process as unittest runs them;
each rank runs the class's own per-rank entry point (``_run``, or ``_worker_loop`` for the
continuous base) on a warm rank. Only the spawning and the joining change: instead of starting
processes, the parent hands the test to the harness, which judges every rank's end (a rank's
``sys.exit`` fails), reports the root cause first, bounds a hang with every rank's stack, and
leaves no process behind.

A class whose spawning or joining the adapter cannot follow runs as before, and the terminal
summary gets one line saying why. Imports no torch: a class can only derive from these bases
once its test module has imported torch's module.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import tempfile
import types
import unittest
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from harness.adopt import core
from harness.adopt.torch import ranks
from harness.common.errors import SpecError
from harness.common.outcome import Ending, RankOutcome
from harness.common.protocol import RankSpec
from harness.plan.settings import DEFAULT_TIMEOUT_S, session_timeout, settings_of
from harness.pytest_side import verdict

TORCH_BASES = "torch.testing._internal.common_distributed"
# The base's own parts the adapter replaces or relies on: a class that overrides one of the
# replaced ones spawns or joins in a way the adapter cannot follow.
PROCESS_REPLACED = (
    "_spawn_processes",
    "_start_processes",
    "_join_processes",
    "_check_return_codes",
    "join_or_run",
)
PROCESS_NEEDED = (*PROCESS_REPLACED, "_run", "run_test", "TEST_ERROR_EXIT_CODE")
PROCESS_ENTRY = ("rank", "test_name", "file_name", "parent_pipe")
CONTINUOUS_REPLACED = ("_spawn_processes", "_worker_run_main_wait")
CONTINUOUS_NEEDED = (*CONTINUOUS_REPLACED, "_worker_loop", "_run_test_given_id")
CONTINUOUS_ENTRY = ("rank", "world_size", "rdvz_file", "task_queue", "completion_queue")
# What an adopted rank is checked for after the test: the base ends its processes, so a group
# or environment left behind is normal (the worker resets both), but a thread or process that
# keeps running would meet the next test.
ADOPTED_HYGIENE = frozenset({"threads", "processes"})

Kind = Literal["process", "continuous"]


@dataclass
class _Classes:
    """What this adopter knows of the session's classes: each one's kind, and why not."""

    kinds: dict[type, Kind | None] = field(default_factory=dict)
    unadoptable: dict[type, str] = field(default_factory=dict)  # class -> why, once classified
    undo: list[Callable[[], None]] = field(default_factory=list)


_classes_key = pytest.StashKey[_Classes]()


def _classes(config: pytest.Config) -> _Classes:
    return core.session_state(config, _classes_key, _Classes)


class TorchAdopter(core.Adopter):
    """torch's MultiProcessTestCase and MultiProcContinuousTest."""

    name = "torch"

    def claims(self, cls: type) -> bool:
        return classify(cls)[0] is not None

    def collected(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Each adopted test's bound for its ranks (the harness's timer, which reports every
        rank's stack); pytest-timeout's still bounds what runs in this process around them."""
        settings = settings_of(config)
        for item in items:
            if _kind(item) is None:
                continue
            with contextlib.suppress(SpecError):  # a bad timeout marker: the test's error, later
                core.set_timeout(item, session_timeout(settings, item, _torchs_timeout(item)))

    def setting_up(self, item: pytest.Item) -> None:
        """Before the class's setUpClass: a continuous class spawns nothing from now on. A
        class that runs as it is gets its line in the summary (only those whose tests run)."""
        kind = _kind(item)
        cls: Any = getattr(item, "cls", None)
        classes = _classes(item.config)
        why = classes.unadoptable.get(cls) if cls is not None else None
        if why is not None:
            core.note_not_adopted(item.config, f"{cls.__module__}.{cls.__qualname__}", why)
        if kind == "continuous" and "_spawn_processes" not in vars(cls):
            classes.undo.append(_patch_continuous_spawn(cls))

    def calling(self, item: pytest.Item) -> None:
        """Point the test instance's spawning and joining at the harness."""
        kind = _kind(item)
        case = getattr(item, "_testcase", None)  # the TestCase instance pytest made for the test
        if kind == "process" and case is not None:
            _adopt_process_case(self, item, case)
        elif kind == "continuous" and case is not None:
            _adopt_continuous_case(self, item, case)

    def ended(self, config: pytest.Config) -> None:
        classes = config.stash.get(_classes_key, None)
        while classes is not None and classes.undo:
            classes.undo.pop()()


def _torchs_timeout(item: pytest.Item) -> float:
    """torch's own bound for the test (TIMEOUT_OVERRIDE by test name, else TIMEOUT_DEFAULT):
    the default when the session names none of its own, so an adopted suite keeps the time
    its tests were written for (the harness's default where torch has none)."""
    torch_bases = sys.modules.get(TORCH_BASES)
    default = getattr(torch_bases, "TIMEOUT_DEFAULT", None)
    overrides = getattr(torch_bases, "TIMEOUT_OVERRIDE", {})
    bound = overrides.get(item.name, default) if isinstance(overrides, dict) else default
    return float(bound) if isinstance(bound, int | float) and bound > 0 else DEFAULT_TIMEOUT_S


def _kind(item: pytest.Item) -> Kind | None:
    """How `item` is adopted, or None (not such a class, or not honourable)."""
    cls = getattr(item, "cls", None)
    if not isinstance(cls, type):
        return None
    classes = _classes(item.config)
    if cls not in classes.kinds:
        kind, why = classify(cls)
        other = core.claimed_elsewhere(item.config, cls, TorchAdopter.name)
        if other is not None:
            kind, why = None, other
        classes.kinds[cls] = kind if why is None else None
        if why is not None:
            classes.unadoptable[cls] = why
    return classes.kinds[cls]


def classify(cls: type) -> tuple[Kind | None, str | None]:
    """Which of torch's bases `cls` derives from, and why it cannot be adopted (None when it
    can)."""
    if not issubclass(cls, unittest.TestCase):
        return None, None
    bases = sys.modules.get(TORCH_BASES)
    if bases is None:
        return None, None
    process = getattr(bases, "MultiProcessTestCase", None)
    continuous = getattr(bases, "MultiProcContinuousTest", None)
    if isinstance(process, type) and issubclass(cls, process):
        return "process", _unfollowable(cls, process, PROCESS_NEEDED, PROCESS_REPLACED, "_run")
    if isinstance(continuous, type) and issubclass(cls, continuous):
        why = _unfollowable(cls, continuous, CONTINUOUS_NEEDED, CONTINUOUS_REPLACED, "_worker_loop")
        return "continuous", why
    older = getattr(bases, "MultiProcContinousTest", None)  # sic: torch's earlier spelling
    if isinstance(older, type) and issubclass(cls, older):
        return "continuous", (
            "the installed torch's MultiProcContinousTest (each rank runs the whole class "
            "under torchrun via run_rank) is not a base the harness adopts"
        )
    return None, None


def _unfollowable(
    cls: type, base: type, needed: tuple[str, ...], replaced: tuple[str, ...], entry: str
) -> str | None:
    missing = [name for name in needed if not hasattr(base, name)]
    expected = PROCESS_ENTRY if entry == "_run" else CONTINUOUS_ENTRY
    signature = core.parameters_of(getattr(base, entry, None))
    if missing or signature[: len(expected)] != list(expected):
        return (
            f"the installed torch's {base.__name__} is not the one the harness supports "
            f"(missing or changed: {', '.join(missing) or entry}); see README 'Existing suites'"
        )
    for owner in cls.__mro__[: cls.__mro__.index(base)]:
        overridden = [name for name in replaced if name in vars(owner)]
        if overridden:
            return f"{owner.__qualname__} overrides {', '.join(overridden)}"
    return None


@dataclass
class _Spawn:
    requested: str | None = None  # the base's spawning method setUp asked for


def _adopt_process_case(adopter: core.Adopter, item: pytest.Item, case: Any) -> None:
    """setUp's request to spawn is only noted; the join runs the test on warm ranks."""
    spawn = _Spawn()
    for name in ("_spawn_processes", "_fork_processes"):
        if hasattr(case, name):
            setattr(case, name, functools.partial(setattr, spawn, "requested", name))
    case._join_processes = functools.partial(_join_process_case, adopter, item, case, spawn)


def _join_process_case(
    adopter: core.Adopter, item: pytest.Item, case: Any, spawn: _Spawn, fn: Any
) -> None:
    cls = type(case)
    if spawn.requested is None:  # setUp spawned nothing: the base's own join decides
        cls._join_processes(case, fn)
        return
    if fn in getattr(case, "skip_return_code_checks", ()) or fn in getattr(
        case, "special_return_code_checks", {}
    ):
        core.note_not_adopted(
            item.config,
            item.nodeid,
            "expects exit statuses of its own (special/skip_return_code_checks)",
        )
        getattr(cls, spawn.requested)(case)
        cls._join_processes(case, fn)
        return
    name = case._current_test_name
    adopter.run(
        item,
        int(case.world_size),
        ranks.run_multiprocess_case,
        cls,
        name() if callable(name) else name,
        case.file_name,
        _entry_kwargs(cls, case),
        judged_by=judge,
    )


def _entry_kwargs(cls: type, case: Any) -> dict[str, Any]:
    """The keyword arguments the base's _start_processes passes to _run."""
    signature = inspect.signature(cls._run)  # type: ignore[attr-defined]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    if takes_any or "fake_pg" in signature.parameters:
        return {"fake_pg": getattr(case, "fake_pg", False)}
    return {}


# ---- MultiProcContinuousTest ----------------------------------------------------------------


def _patch_continuous_spawn(cls: Any) -> Callable[[], None]:
    """The class's processes become none: each test runs on warm ranks instead."""

    def no_processes(klass: Any, world_size: int) -> None:
        klass.processes, klass.task_queues, klass.completion_queues = [], [], []
        klass._harness_world_size = int(world_size)
        with tempfile.NamedTemporaryFile(delete=False) as f:
            klass.rdvz_file = f.name  # tearDownClass removes it, as after the base's spawn

    cls._spawn_processes = classmethod(no_processes)
    return lambda: delattr(cls, "_spawn_processes")


def _adopt_continuous_case(adopter: core.Adopter, item: pytest.Item, case: Any) -> None:
    original = item.obj  # type: ignore[attr-defined]

    @functools.wraps(original)
    def adopted(self: Any) -> None:
        if getattr(type(self), "_harness_world_size", None) is None:
            # The class spawned nothing (torch's local-tensor bases run each test in this
            # process): run the test here, as torch does.
            original() if inspect.ismethod(original) else original(self)
            return
        _run_continuous_case(adopter, item, self)

    item.obj = types.MethodType(adopted, case)  # type: ignore[attr-defined]


def _run_continuous_case(adopter: core.Adopter, item: pytest.Item, case: Any) -> None:
    cls = type(case)
    world_size = cls._harness_world_size
    with _rendezvous_file() as rdvz:
        run = ranks.run_continuous_case
        adopter.run(item, world_size, run, cls, case.id(), rdvz, world_size, judged_by=judge)


@contextlib.contextmanager
def _rendezvous_file() -> Iterator[str]:
    """A fresh file for one test's FileStore (the base makes one per class)."""
    with tempfile.NamedTemporaryFile(delete=False) as f:
        path = f.name
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


def judge(item: pytest.Item, spec: RankSpec, outcomes: list[RankOutcome]) -> None:
    """Skip when every rank skipped (a skip status included); else pass or fail as the harness."""
    outcomes = [as_skip(o) for o in outcomes]
    if all(o.ending is Ending.SKIPPED for o in outcomes):
        raise unittest.SkipTest(outcomes[0].message)
    verdict.judge(item, spec, outcomes)


def as_skip(outcome: RankOutcome) -> RankOutcome:
    """A rank process that ended with one of torch's skip statuses skipped, with its reason."""
    if outcome.ending is not Ending.HARD_EXIT or outcome.exit_code is None:
        return outcome
    reason = ranks.skip_messages().get(outcome.exit_code)
    return outcome if reason is None else outcome.skipped_instead(reason)
