"""The hooks the harness adds to pytest's: a project registers its own test base's adopter.

Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from harness.adopt.core import Adopter


@pytest.hookspec
def pytest_harness_adopters(config: pytest.Config) -> list[Adopter]:  # type: ignore[empty-body]
    """The adopters of a project's own multi-rank test bases (``harness.Adopter``
    instances), each adopted when ``--rank-adopt`` names it: from a conftest (an initial one,
    at the root or among the command line's paths) or a plugin."""
