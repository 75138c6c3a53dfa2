"""The torch and pytest versions the harness runs on: older ones stop the session at once,
saying what to install, instead of failing tests with raw torch errors or "hung" reports.

The floors and the message are rankwise's (lib/rankwise/_versions.py), read from its file
without importing the rankwise package (whose import loads torch). Imports no torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def _rankwise_versions() -> ModuleType | None:
    found = importlib.util.find_spec("rankwise")  # finds the package, runs nothing of it
    places = list(found.submodule_search_locations or []) if found is not None else []
    if not places:
        return None
    spec = importlib.util.spec_from_file_location(
        "rankwise_versions_for_harness", Path(places[0]) / "_versions.py"
    )
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check() -> None:
    """A usage error naming the version and the fix, where torch or pytest is too old."""
    versions = _rankwise_versions()
    if versions is None:
        return
    for package, floor in (("torch", versions.TORCH_FLOOR), ("pytest", versions.PYTEST_FLOOR)):
        said = versions.too_old(package, floor)
        if said is not None:
            raise pytest.UsageError(f"harness: {said}")
