"""What a test leaves behind in a rank: a process group, non-daemon threads, changed env,
processes still running (which the worker kills whatever the test allows).

The worker snapshots before the body and compares after; the pytest side reports findings
as a test error naming the rank. A test that means to leave something opts out with
``@pytest.mark.allow_leftovers("group", "threads", "env", "processes")`` (no arguments: all).
"""

from __future__ import annotations

import threading
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


def snapshot() -> Snapshot:
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
        names = [
            t.name
            for t in threading.enumerate()
            if t.is_alive() and not t.daemon and (t.ident or 0) not in before.threads
        ]
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


def parse_allowed(args: tuple[object, ...], origin: str) -> frozenset[str]:
    """The checks a test opts out of; unknown names are an error naming `origin`."""
    names = set(args) if args else set(CHECKS)
    unknown = names - set(CHECKS)
    if unknown:
        fix = f"choose from {', '.join(CHECKS)}"
        raise SpecError(invalid("leftover kind(s)", sorted(map(str, unknown)), origin, fix))
    return frozenset(str(n) for n in names)
