"""The declared versions: pyproject.toml's floors are rankwise's, and a torch or pytest below
them stops rankwise's import and the harness's session with one message saying what to
install (never a raw torch error or a "hung" report). The versions lane (make
test-versions) runs the suite on each floor and on the newest torch."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from rankwise import _versions

from harness.pytest_side import versions as harness_versions

pytestmark = pytest.mark.unit  # logic in this process, with fakes: make unit-fast

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_floors_rankwise_checks() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    torch = re.search(r'"torch>=([\d.]+)"', text)
    pytest_floor = re.search(r'pytest = \["pytest>=([\d.]+)"\]', text)
    assert torch and _versions._release(torch.group(1)) == _versions._release(_versions.TORCH_FLOOR)
    assert pytest_floor
    assert _versions._release(pytest_floor.group(1)) == _versions._release(_versions.PYTEST_FLOOR)


@pytest.mark.parametrize(
    ("installed", "said"),
    [("2.5.1", True), ("2.5.1+cu124", True), (_versions.TORCH_FLOOR, False),
     ("2.15.0+cu132", False), ("2.16.0.dev20270101", False)],
)  # fmt: skip
def test_a_torch_below_the_floor_is_named_with_what_to_install(installed: str, said: bool) -> None:
    found = _versions.too_old("torch", _versions.TORCH_FLOOR, installed)
    if said:
        assert found == (
            f"torch {installed} is older than the oldest rankwise is tested with, "
            f"{_versions.TORCH_FLOOR}: pip install 'torch>={_versions.TORCH_FLOOR}' "
            f"(docs/versions.md lists the versions tested)"
        )
    else:
        assert found is None


@pytest.mark.parametrize("package", ["torch", "pytest"])
def test_the_harness_stops_a_session_on_a_version_below_the_floor(
    monkeypatch: pytest.MonkeyPatch, package: str
) -> None:
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "1.0" if name == package else real(name))
    with pytest.raises(pytest.UsageError, match=rf"harness: {package} 1\.0 is older than"):
        harness_versions.check()


def test_the_installed_versions_pass_the_check() -> None:
    harness_versions.check()
    _versions.require_torch()
