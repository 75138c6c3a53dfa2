"""What the adopters a session asked for (``--rank-adopt``; see adopt/core.py) give the warm layer:
the libraries the fork server imports early, and cleanups for the warm ranks' end by a
signal. Written once the adopters are registered (adopt.register_adopters); read by
warm/preload.py and warm/session.py, which know nothing of any adopter.

Loaded with the plugin; imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

_libraries_key = pytest.StashKey[frozenset[str]]()
_endings_key = pytest.StashKey[list[Callable[[], None]]]()


def give(
    config: pytest.Config, libraries: frozenset[str], endings: list[Callable[[], None]]
) -> None:
    config.stash[_libraries_key] = libraries
    config.stash[_endings_key] = endings


def libraries(config: pytest.Config) -> frozenset[str]:
    """Top-level packages the asked adopters' suites test from a source checkout."""
    return config.stash.get(_libraries_key, frozenset())


def endings(config: pytest.Config) -> list[Callable[[], None]]:
    """The asked adopters' cleanups for the warm ranks' end by a signal."""
    found: list[Callable[[], None]] = config.stash.get(_endings_key, [])
    return list(found)
