"""What a test leaves behind in a rank: a process group, non-daemon threads, changed env,
processes still running (which the worker kills whatever the test allows); and daemon
threads, which are no finding but get the ranks replaced.

The worker snapshots before the body and compares after; the pytest side reports findings
as a test error naming the rank. A test that means to leave something opts out with
``@pytest.mark.allow_leftovers("group", "threads", "env", "processes")`` (no arguments: all).
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

from harness.common import environment
from harness.common.errors import SpecError, invalid

CHECKS = ("group", "threads", "env", "processes")
# Not a check a test can opt out of: the rank's state after the test could not be restored.
UNDONE = "undone"
# Variables libraries set for themselves on first use (torch's compile caches, Intel OpenMP's
# KMP_* switches set when an MKL-linked package is imported): the test did not change them.
LIBRARY_MANAGED = ("TORCHINDUCTOR_", "TRITON_", "KMP_")


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[int]  # threading's threads, and every thread running Python
    env: dict[str, str]
    native_env: dict[bytes, bytes]  # the C library's (os.putenv, native code)
    # threading's threads themselves: an ident is reused by the next thread started once its
    # thread has ended, so a thread the test started may hold the ident of one before it.
    objects: frozenset[threading.Thread] = frozenset()


# A non-daemon thread the body started may run on until the test's own bound before it
# counts as left running (a process's exit would wait for it: a flush, a last log line):
# one merely slow (a busy machine) is never flagged; only one that never ends waits it out.
# Where no bound is given, this long.
THREAD_END_WAIT_S = 5.0
# What is kept of the test's bound for the rank to report after that wait.
REPORT_MARGIN_S = 1.0
# The harness's own threads' names start so, and rankwise's peer watch (a thread of the
# group's life, ended with it): never the test's.
HARNESS_THREADS = ("harness-", "rankwise-peer-watch")


def before_test() -> Snapshot:
    listed = threading.enumerate()
    idents = {t.ident or 0 for t in listed} | sys._current_frames().keys()
    return Snapshot(
        frozenset(idents), environment.variables(), environment.native(), frozenset(listed)
    )


def findings(
    before: Snapshot,
    checks: frozenset[str],
    group_left: bool,
    processes: dict[int, str] | None = None,
    raw_threads: list[str] | None = None,
    threads_until: float | None = None,
) -> dict[str, str]:
    """Each leftover, by check: a sentence saying what it is and what to do.

    `processes` are the ones the test left running (pid -> command line); already killed.
    `raw_threads` are the functions of the threads the test started with
    _thread.start_new_thread that still run (or are about to). `threads_until` (monotonic):
    until when its non-daemon threads may run on: the test's bound, less REPORT_MARGIN_S.
    """
    found: dict[str, str] = {}
    if "processes" in checks and processes:
        listed = "; ".join(f"pid {pid}: {line[:200]}" for pid, line in sorted(processes.items()))
        found["processes"] = (
            f"left processes running (the harness killed them): {listed}; "
            f"end the processes the test starts (wait for them, or terminate them)"
        )
    if "group" in checks and group_left:
        found["group"] = (
            "left the process group it set up initialised: call "
            "torch.distributed.destroy_process_group() (or use rankwise.distributed_run)"
        )
    if "threads" in checks:
        started = [t for t in _started_since(before) if not t.daemon]
        waited_from = time.monotonic()
        deadline = waited_from + THREAD_END_WAIT_S if threads_until is None else threads_until
        for thread in started:
            thread.join(max(0.0, deadline - time.monotonic()))
        names = [t.name for t in started if t.is_alive()]
        waited = time.monotonic() - waited_from
        said = (
            [
                f"left non-daemon threads running: {', '.join(sorted(names))} (still running "
                f"{waited:.1f} s after the test, at its bound); join them"
            ]
            if names
            else []
        )
        raw = _raw_threads_left(before, raw_threads or [])
        if raw:
            said.append(raw)
        if said:
            found["threads"] = "; ".join(said)
    if "env" in checks and environment.replaced():
        found["env"] = (
            "replaced os.environ itself (the harness put the real one back); set variables "
            "in os.environ, or use the monkeypatch fixture, which undoes itself"
        )
    now = environment.variables() if "env" in checks else before.env
    if now != before.env:
        changed = sorted(
            k
            for k in before.env.keys() | now.keys()
            if before.env.get(k) != now.get(k) and not k.startswith(LIBRARY_MANAGED)
        )
        if changed:
            found["env"] = (
                f"changed environment variables {', '.join(changed)}; restore them, or use "
                f"the monkeypatch fixture, which undoes itself"
            )
    natively = (
        environment.changed_natively(before.native_env, LIBRARY_MANAGED)
        if ("env" in checks)
        else []
    )
    if natively:
        earlier = found.get("env", "")
        found["env"] = (earlier + "; " if earlier else "") + (
            f"changed environment variables {', '.join(natively)} outside os.environ "
            f"(os.putenv, or native code): child processes inherit them (the harness put "
            f"them back); set them in os.environ, or use the monkeypatch fixture"
        )
    return found


def put_back_native_env(before: Snapshot) -> None:
    """The C library's environment as it was before the test, where os.environ does not
    say otherwise (that part is restored with os.environ)."""
    environment.restore_native(before.native_env, LIBRARY_MANAGED)


def _raw_threads_left(before: Snapshot, tracked: list[str]) -> str:
    """Threads running Python that threading does not list and that the test started:
    `tracked` (started with _thread.start_new_thread, running or about to), and any other
    seen running Python (started by native code). They cannot be joined, and one blocked in
    a collective joins the next test's. Each named by the function it runs."""
    listed = {t.ident for t in threading.enumerate()}
    places = set(tracked)
    for ident, frame in sys._current_frames().items():
        if ident in listed or ident in before.threads:
            continue
        while frame.f_back is not None:  # the function the thread was started with
            frame = frame.f_back
        code = frame.f_code
        name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+
        places.add(f"{name} ({code.co_filename}:{code.co_firstlineno})")
    if not places:
        return ""
    return (
        f"left a thread running that threading does not list (started with _thread, or by "
        f"native code): {', '.join(sorted(places))}; end it before the test returns (the "
        f"ranks are replaced for the next test)"
    )


def daemons_left(before: Snapshot) -> list[str]:
    """The daemon threads the test started that still run. Not a finding (libraries keep
    such threads), but such a thread may act in a later test (a watchdog that exits the
    process, a poller calling collectives): the ranks are replaced instead of reused."""
    return sorted(t.name for t in _started_since(before) if t.daemon)


def _started_since(before: Snapshot) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.is_alive() and t not in before.objects and not t.name.startswith(HARNESS_THREADS)
    ]


def parse_allowed(args: tuple[object, ...], origin: str) -> frozenset[str]:
    """The checks a test opts out of; unknown names are an error naming `origin`."""
    names = set(args) if args else set(CHECKS)
    unknown = names - set(CHECKS)
    if unknown:
        fix = f"choose from {', '.join(CHECKS)}"
        raise SpecError(invalid("leftover kind(s)", sorted(map(str, unknown)), origin, fix))
    return frozenset(str(n) for n in names)
