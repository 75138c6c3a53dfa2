"""The harness and pytest-timeout, on one test: pytest-timeout's timer paused while the
harness bounds a body on the ranks with its own, and its bound on a test's fixtures read
(under a launch the harness enforces it where pytest-timeout's signal cannot act).

Loaded with the plugin; imports no torch (nor pytest-timeout: asked through pytest).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


def pytest_timeout_of_fixtures(item: pytest.Item) -> float | None:
    """pytest-timeout's bound for `item`'s set-up and for its teardown (each is timed with
    the whole of it); None when pytest-timeout is not loaded, off, or times the call only."""
    timing = item.config.pluginmanager.get_plugin("timeout")
    settings_of_item = getattr(timing, "_get_item_settings", None)
    if settings_of_item is None:
        return None
    settings = settings_of_item(item)
    if not settings.timeout or settings.func_only:
        return None
    return float(settings.timeout)


@contextlib.contextmanager
def pytest_timeout_paused(item: pytest.Item) -> Iterator[None]:
    """pytest-timeout's timer off while the harness runs the body under its own bound, and
    set afresh for the teardown after it (pytest-timeout times the whole protocol)."""
    hooks = item.config.pluginmanager.hook
    timing = item.config.pluginmanager.get_plugin("timeout")
    settings_of_item = getattr(timing, "_get_item_settings", None)
    if settings_of_item is None:  # pytest-timeout not loaded (or another version of it)
        yield
        return
    settings = settings_of_item(item)
    if not settings.timeout:
        yield
        return
    hooks.pytest_timeout_cancel_timer(item=item)
    try:
        yield
    finally:
        if not settings.func_only:
            hooks.pytest_timeout_set_timer(item=item, settings=settings)
