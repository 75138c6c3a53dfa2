"""Coverage inside a warm rank: measured as the pytest process is (see harness/plan/measured.py),
from the rank's first task on, and saved after every task, since a rank never ends in a way
that saves it (``os._exit`` when pytest goes, SIGKILL when it is replaced).

Runs only in ranks; imports coverage only when asked to measure.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from harness.common.protocol import RANK_DATA_SUFFIX, CoverageSetup


class _Measuring:
    coverage: Any = None  # this rank's Coverage, once started
    setup: CoverageSetup | None = None
    pid = 0  # the process it was started in (a forked copy measures nothing of its own)


def start(setup: CoverageSetup | None) -> None:
    """Measure this rank as `setup` says, from now on (once: later tasks carry the same)."""
    if setup is None or (_Measuring.setup == setup and _Measuring.pid == os.getpid()):
        return
    import coverage

    stop()
    suffix = f"{RANK_DATA_SUFFIX}.{socket.gethostname()}.{os.getpid()}.{os.urandom(3).hex()}"
    cov = coverage.Coverage(
        data_file=setup.data_file,
        data_suffix=suffix,
        config_file=setup.config_file or False,
        source=list(setup.source) if setup.source is not None else None,
        source_pkgs=list(setup.source_pkgs) or None,
        include=list(setup.include) or None,
        omit=list(setup.omit) or None,
        branch=setup.branch,
    )
    cov.start()
    _Measuring.coverage, _Measuring.setup, _Measuring.pid = cov, setup, os.getpid()


def resume() -> None:
    """Trace again after the rank put its own trace functions back (it undoes a test's
    sys.settrace, which undid coverage's too)."""
    cov = _Measuring.coverage
    if cov is None or _Measuring.pid != os.getpid():
        return
    with contextlib.suppress(Exception):
        cov.stop()
        cov.start()


def save() -> None:
    """Write what this rank measured so far (the file is rewritten whole each time)."""
    cov = _Measuring.coverage
    if cov is None or _Measuring.pid != os.getpid():
        return
    with contextlib.suppress(Exception):  # a full disk must not fail the test
        cov.save()


def stop() -> None:
    cov = _Measuring.coverage
    if cov is not None and _Measuring.pid == os.getpid():
        with contextlib.suppress(Exception):
            cov.stop()
            cov.save()
    _Measuring.coverage, _Measuring.setup = None, None
