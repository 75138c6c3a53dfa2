"""The versions rankwise and its harness are tested on, and the one message for any other.

pyproject.toml declares the same floors (tests/test_packaging.py holds them equal); the
versions lane (`make test-versions`, docs/versions.md) runs the suite on each floor and on
the newest torch. Reads versions from the installed metadata: imports neither torch nor
pytest.
"""

from __future__ import annotations

import re
from importlib import metadata

TORCH_FLOOR = "2.13"
PYTEST_FLOOR = "8.0"


def _release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); '2.15.0.dev20261101' -> (2, 15, 0)."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def too_old(package: str, floor: str, installed: str | None = None) -> str | None:
    """What to say when `package` is older than `floor` (or not installed), else None."""
    if installed is None:
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            return None  # its import says so itself
    if _release(installed) >= _release(floor):
        return None
    return (
        f"{package} {installed} is older than the oldest rankwise is tested with, {floor}: "
        f"pip install '{package}>={floor}' (docs/versions.md lists the versions tested)"
    )


def require_torch() -> None:
    """Raise ImportError, saying what to install, where torch is older than the floor."""
    said = too_old("torch", TORCH_FLOOR)
    if said is not None:
        raise ImportError(f"rankwise: {said}")
