"""pytest-cov under torchrun: every launched pytest process measures itself, and each would
combine every data file beside its own into one `.coverage` at once (an INTERNALERROR, a
corrupt data file, or a report of one rank's lines). Here the ranks other than 0 save their
own data and report nothing; rank 0 combines every rank's, once all have saved, and reports
for the job (its `--cov-fail-under` too).

Used only in a launched session.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.launched.link import Link
from harness.launched.session import AGREE_S


def hand_to_rank_0(link: Link | None, rank: int, session: pytest.Session) -> None:
    """After the tests, before pytest-cov finishes: this rank's data saved, and every rank
    waits until every rank's is (rank 0 then combines them all). `link`: None where the
    session never connected to the launch's store."""
    plugin: Any = session.config.pluginmanager.get_plugin("_cov")
    controller = getattr(plugin, "cov_controller", None)
    if controller is None or link is None:
        return
    if rank != 0:
        controller.cov.stop()
        controller.cov.save()  # a parallel data file of its own, beside rank 0's
        controller.finish = lambda: None  # rank 0 combines
        plugin.options.cov_report = {}  # and reports: a rank's own lines are part of it
        plugin.options.cov_fail_under = None
    link.gather("coverage-saved", "1", AGREE_S, follow_exits=False)
