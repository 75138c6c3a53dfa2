"""pytest-cov under torchrun, tested directly with fakes for pytest-cov and the session: a
rank other than 0 saves its data and reports nothing, and every rank waits for every rank's
data before rank 0 combines them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness.launched.coverage import hand_to_rank_0

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast


class _Cov:
    def __init__(self) -> None:
        self.did: list[str] = []

    def stop(self) -> None:
        self.did.append("stop")

    def save(self) -> None:
        self.did.append("save")


def _parts(rank: int, measured: bool = True, connected: bool = True) -> tuple[Any, Any, Any]:
    cov = _Cov()
    controller = SimpleNamespace(cov=cov, finish=lambda: cov.did.append("combine"))
    plugin = SimpleNamespace(
        cov_controller=controller if measured else None,
        options=SimpleNamespace(cov_report={"term": None}, cov_fail_under=90.0),
    )
    gathered: list[str] = []
    link = SimpleNamespace(gather=lambda name, value, seconds, follow_exits: gathered.append(name))
    manager = SimpleNamespace(get_plugin=lambda name: plugin if name == "_cov" else None)
    session = SimpleNamespace(config=SimpleNamespace(pluginmanager=manager))
    hand_to_rank_0(link if connected else None, rank, session)  # type: ignore[arg-type]
    return plugin, cov, gathered


def test_a_rank_other_than_0_saves_its_data_reports_nothing_and_waits() -> None:
    plugin, cov, gathered = _parts(rank=2)
    assert cov.did == ["stop", "save"] and gathered == ["coverage-saved"]
    plugin.cov_controller.finish()  # pytest-cov's finish: rank 0 combines, not this rank
    assert cov.did == ["stop", "save"]
    assert plugin.options.cov_report == {} and plugin.options.cov_fail_under is None


def test_rank_0_waits_for_every_ranks_data_then_combines_and_reports() -> None:
    plugin, cov, gathered = _parts(rank=0)
    assert cov.did == [] and gathered == ["coverage-saved"]
    plugin.cov_controller.finish()
    assert cov.did == ["combine"] and plugin.options.cov_fail_under == 90.0


@pytest.mark.parametrize(("measured", "connected"), [(False, True), (True, False)])
def test_without_pytest_cov_or_the_store_nothing_is_done(measured: bool, connected: bool) -> None:
    _, cov, gathered = _parts(rank=1, measured=measured, connected=connected)
    assert cov.did == [] and gathered == []
