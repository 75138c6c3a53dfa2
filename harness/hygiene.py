"""What a test leaves behind in a rank: a process group, non-daemon threads, changed env,
processes still running (which the worker kills whatever the test allows); and daemon
threads, which are no finding but get the ranks replaced.

The worker snapshots before the body and compares after; the pytest side reports findings
as a test error naming the rank. A test that means to leave something opts out with
``@pytest.mark.allow_leftovers("group", "threads", "env", "processes")`` (no arguments: all).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from harness import environment
from harness.errors import SpecError, invalid

CHECKS = ("group", "threads", "env", "processes")
# Not a check a test can opt out of: the rank's state after the test could not be restored.
UNDONE = "undone"
# Variables libraries set for themselves on first use (torch's compile caches, Intel OpenMP's
# KMP_* switches set when an MKL-linked package is imported): the test did not change them.
LIBRARY_MANAGED = ("TORCHINDUCTOR_", "TRITON_", "KMP_")


@dataclass(frozen=True)
class Snapshot:
    threads: frozenset[int]
    env: dict[str, str]


# A non-daemon thread the body started may take this long to end before it counts as left
# running (a process's exit would wait for it: a flush, a last log line).
THREAD_END_WAIT_S = 1.0
HARNESS_THREADS = "harness-"  # the harness's own threads' names start so: never the test's


def before_test() -> Snapshot:
    return Snapshot(frozenset(t.ident or 0 for t in threading.enumerate()), environment.variables())


def findings(
    before: Snapshot,
    checks: frozenset[str],
    group_left: bool,
    processes: dict[int, str] | None = None,
) -> dict[str, str]:
    """Each leftover, by check: a sentence saying what it is and what to do.

    `processes` are the ones the test left running (pid -> command line); already killed.
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
        deadline = time.monotonic() + THREAD_END_WAIT_S
        for thread in started:
            thread.join(max(0.0, deadline - time.monotonic()))
        names = [t.name for t in started if t.is_alive()]
        if names:
            found["threads"] = (
                f"left non-daemon threads running: {', '.join(sorted(names))}; join them"
            )
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
    return found


def daemons_left(before: Snapshot) -> list[str]:
    """The daemon threads the test started that still run. Not a finding (libraries keep
    such threads), but such a thread may act in a later test (a watchdog that exits the
    process, a poller calling collectives): the ranks are replaced instead of reused."""
    return sorted(t.name for t in _started_since(before) if t.daemon)


def _started_since(before: Snapshot) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.is_alive()
        and (t.ident or 0) not in before.threads
        and not t.name.startswith(HARNESS_THREADS)
    ]


def parse_allowed(args: tuple[object, ...], origin: str) -> frozenset[str]:
    """The checks a test opts out of; unknown names are an error naming `origin`."""
    names = set(args) if args else set(CHECKS)
    unknown = names - set(CHECKS)
    if unknown:
        fix = f"choose from {', '.join(CHECKS)}"
        raise SpecError(invalid("leftover kind(s)", sorted(map(str, unknown)), origin, fix))
    return frozenset(str(n) for n in names)
