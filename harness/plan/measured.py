"""Coverage in ranks: when coverage measures the pytest process (pytest-cov, or
``coverage run -m pytest``), every rank measures too, with the same settings, and the lines
the ranks ran count in the session's report as a plain test's would.

Each rank starts measuring at its first task and saves its data after every task (a rank
ends by ``os._exit``, or is killed, without saving on its own) into a file in the session's
private work directory (``coverage/data.harness-rank.<host>.<pid>.<n>``), where no
neighbour's ``coverage erase`` or ``combine`` in the same directory can reach it. Once the
tests have run, this process folds those files into the data of the Coverage measuring it
(pytest-cov's, or ``coverage run``'s), before that one saves: the report counts the ranks'
lines with no ``coverage combine`` step, and nothing of the ranks is left in the cwd.

Imports coverage only where it is already imported (this process is measured).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from harness.common.protocol import RANK_DATA_SUFFIX, CoverageSetup

RANK_DATA_FILE = "data"  # the ranks' data files: data.<RANK_DATA_SUFFIX>.<host>.<pid>.<n>


def current() -> Any:
    """The Coverage measuring this process, or None."""
    coverage = sys.modules.get("coverage")
    if coverage is None:
        return None
    return coverage.Coverage.current()


def setup_for_ranks(directory: Path) -> CoverageSetup | None:
    """How the ranks measure, copied from the Coverage measuring this process, their data
    going to `directory` (None: this process is not measured, and neither are the ranks)."""
    cov = current()
    if cov is None:
        return None
    config = cov.config
    directory.mkdir(mode=0o700, exist_ok=True)
    return CoverageSetup(
        data_file=str(directory / RANK_DATA_FILE),
        config_file=config.config_file or None,
        source=tuple(config.source or ()) or None,
        source_pkgs=tuple(config.source_pkgs or ()),
        include=tuple(config.run_include or ()),
        omit=tuple(config.run_omit or ()),
        branch=bool(config.branch),
    )


def fold_ranks_data(directory: Path) -> None:
    """Fold the ranks' data files in `directory` into the data of the Coverage measuring
    this process, which saves them with its own (pytest-cov as it finishes, `coverage run`
    as the process ends), and remove them."""
    cov = current()
    found = sorted(str(p) for p in directory.glob(f"{RANK_DATA_FILE}.{RANK_DATA_SUFFIX}.*"))
    if cov is None or not found:
        return
    with contextlib.suppress(Exception):  # never the session's failure
        cov.combine(data_paths=found, keep=False)
