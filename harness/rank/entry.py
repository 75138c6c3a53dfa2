"""A rank process's entry point: the worker, imported without torch's NumPy warning.

A rank (spawned, or the fork server that forks the ranks) imports torch as it imports the
worker, before any test code: torch's "Failed to initialize NumPy" would be printed once per
rank into a report, while the pytest process already shows it once where the tests import
torch (common/torch_import_warnings.py).
"""

from __future__ import annotations

from typing import Any

from harness.common.protocol import RankFiles
from harness.common.torch_import_warnings import without_numpy_notice

with without_numpy_notice():
    from harness.rank import worker


def main(conn: Any, files: RankFiles) -> None:
    """Serve as a rank (worker.main)."""
    worker.main(conn, files)
