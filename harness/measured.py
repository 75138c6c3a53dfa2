"""Coverage in ranks: when coverage measures the pytest process (pytest-cov, or
``coverage run -m pytest``), every rank measures too, with the same settings, and the lines
the ranks ran count in the session's report as a plain test's would.

Each rank starts measuring at its first task and saves its data after every task (a rank
ends by ``os._exit``, or is killed, without saving on its own) into a file beside the
session's data file (``.coverage.harness-rank.<host>.<pid>.<n>``): pytest-cov combines the
files beside its own as it finishes; under ``coverage run`` this process combines the
ranks' files into its own data at the session's end (``coverage report`` then counts them
without a ``coverage combine``).

Imports coverage only where it is already imported (this process is measured).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from typing import Any

from harness.common.protocol import RANK_DATA_SUFFIX, CoverageSetup


def current() -> Any:
    """The Coverage measuring this process, or None."""
    coverage = sys.modules.get("coverage")
    if coverage is None:
        return None
    return coverage.Coverage.current()


def setup_for_ranks() -> CoverageSetup | None:
    """How the ranks measure, copied from the Coverage measuring this process (None: this
    process is not measured, and neither are the ranks)."""
    cov = current()
    if cov is None:
        return None
    config = cov.config
    return CoverageSetup(
        data_file=os.path.abspath(config.data_file),
        config_file=config.config_file or None,
        source=tuple(config.source or ()) or None,
        source_pkgs=tuple(config.source_pkgs or ()),
        include=tuple(config.run_include or ()),
        omit=tuple(config.run_omit or ()),
        branch=bool(config.branch),
    )


def combine_ranks_data() -> None:
    """Fold the ranks' data files into the data of the Coverage measuring this process
    (`coverage run`: it saves them with its own as the process ends); nothing where none
    measures now (pytest-cov stopped its own after combining the files beside it)."""
    cov = current()
    if cov is None:
        return
    pattern = f"{os.path.abspath(cov.config.data_file)}.{RANK_DATA_SUFFIX}.*"
    found = glob.glob(pattern)
    if found:
        with contextlib.suppress(Exception):  # never the session's failure
            cov.combine(data_paths=found, keep=False)
