"""What runs inside a rank for torch's adopted suites: each rank enters the class's own
entry point (``_run`` for ``MultiProcessTestCase``, ``_worker_loop`` for
``MultiProcContinuousTest``) as the base's spawned process would, and the exit statuses the base
uses as signals become what they mean here: a skip, or the exception the rank raised. Runs only
in ranks (adopter.py names these functions as the ranks' targets).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import unittest
from collections.abc import Iterator
from typing import Any

import pytest

from harness.common import endings
from harness.common.outcome import exit_code

endings.skip_frames_of(__file__)  # a rank's traceback starts in the test's code


def error_exit_code() -> int:
    """The exit status MultiProcessTestCase gives a rank whose test raised."""
    from torch.testing._internal.common_distributed import MultiProcessTestCase

    return int(MultiProcessTestCase.TEST_ERROR_EXIT_CODE)


def skip_messages() -> dict[int, str]:
    """torch's skip exit statuses (TEST_SKIPS) and the reason each stands for."""
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


# ---- MultiProcessTestCase: one test, each rank through the class's own entry point ----------


def run_multiprocess_case(
    cls: Any,
    test_name: str,
    file_name: str,
    entry_kwargs: dict[str, Any],
    *,
    rank: int,
) -> None:
    """Call the class's ``_run`` classmethod as the base does in each spawned process.

    The base ends a rank with ``sys.exit``: status 0 is a pass (torch's parent counts it as
    one; DistributedTest ends every rank so), its error status (the exception is the exit's
    context) is raised again with its own traceback, its skip statuses become skips, and any
    other exit stays an exit, which the harness counts as a failure.
    """
    receiving, sending = multiprocessing.Pipe()
    try:
        cls._run(rank, test_name, file_name, sending, **entry_kwargs)
    except SystemExit as exc:
        _translate_exit(exc)
    finally:
        receiving.close()
        sending.close()


def _translate_exit(exc: SystemExit) -> None:
    code = exit_code(exc)
    if code == 0:  # the base's normal end (DistributedTest's _run exits 0): a pass, as for torch
        return
    cause = exc.__context__
    if isinstance(cause, unittest.SkipTest):
        raise pytest.skip.Exception(str(cause) or "skipped") from None
    if code == error_exit_code() and isinstance(cause, Exception):
        _raise_unchained(cause)  # the test's own exception, with its traceback and causes
    reason = skip_messages().get(code)
    if reason is not None:
        raise pytest.skip.Exception(reason) from None
    raise exc


# ---- MultiProcContinuousTest: one test through the class's own worker loop -----------------


class _OneTask:
    """The task queue the class's worker loop reads: this test, then the end."""

    def __init__(self, test_id: str) -> None:
        self._items: list[str | None] = [test_id, None]

    def get(self, *args: Any, **kwargs: Any) -> str | None:
        return self._items.pop(0)


class _Results:
    """The completion queue the worker loop writes to."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        self.items.append(item)


def run_continuous_case(
    cls: Any, test_id: str, rdvz_file: str, world_size: int, *, rank: int
) -> None:
    """Run one test through the class's ``_worker_loop``, as the base's per-rank process does.

    The loop sets the class's group up from `rdvz_file` (its own ``_init_pg``), runs the test
    and reports into a queue: a skip there is a skip, an error is raised again as the original
    exception (the base wraps it in a RuntimeError whose cause it is).
    """
    results = _Results()
    try:
        with _every_rank_set_up_before_the_test(cls):
            cls._worker_loop(rank, world_size, rdvz_file, _OneTask(test_id), results)
    except Exception:
        # A set-up that exited with a skip status made no group, and the loop's end then
        # fails to destroy it: torch's dispatcher has read the skip by then and never looks.
        if not (results.items and isinstance(results.items[0], unittest.SkipTest)):
            raise
    finally:
        # The base keeps the group on the class; while it does, tearing the group down
        # leaves its connections open and peers blocked on this rank wait instead of failing.
        cls.pg = None
    result = results.items[0] if results.items else None
    if isinstance(result, unittest.SkipTest):
        raise pytest.skip.Exception(str(result) or "skipped")
    if isinstance(result, BaseException):
        _raise_unchained(result.__cause__ or result)  # the base's wrapper left out


def _raise_unchained(exc: BaseException) -> None:
    """Raise `exc` again as the test raised it: its own cause and context kept (the report
    shows them), none added by raising it here (the SystemExit it is handled in)."""
    cause, context, suppressed = exc.__cause__, exc.__context__, exc.__suppress_context__
    try:
        raise exc
    finally:
        exc.__cause__, exc.__context__ = cause, context
        exc.__suppress_context__ = suppressed


@contextlib.contextmanager
def _every_rank_set_up_before_the_test(cls: Any) -> Iterator[None]:
    """The class's ``_init_pg``, then a wait until every rank has finished its own.

    The base sets its group up once per class; here each test sets it up and tears it down.
    A rank whose test does no collective would otherwise tear its group down while a slower
    peer is still connecting, and that peer fails in its set-up, blamed on the test.
    """
    own = cls.__dict__.get("_init_pg")
    init_pg = cls._init_pg  # bound to the class, a subclass's override included

    def init_then_wait(klass: Any, rank: int, world_size: int, rdvz_file: str) -> None:
        init_pg(rank, world_size, rdvz_file)
        _wait_for_every_rank(rank, world_size)

    cls._init_pg = classmethod(init_then_wait)
    try:
        yield
    finally:
        if own is None:
            del cls._init_pg
        else:
            cls._init_pg = own


def _wait_for_every_rank(rank: int, world_size: int) -> None:
    """Each rank marks its set-up done in the group's store and waits for the others'.

    Bounded by the store's timeout (the class's group timeout) and by the run's deadline.
    """
    import torch.distributed as dist

    if not dist.is_initialized():  # the class's own set-up made no default group
        return
    store = dist.distributed_c10d._get_default_store()
    keys = [f"rankwise/set_up/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    store.wait(keys)
