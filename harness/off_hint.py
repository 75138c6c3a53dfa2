"""What ``-p no:harness`` turned off, said where a test needs it.

Loaded by an entry point of its own beside the harness's, so it still loads when the harness
is blocked. Then, instead of pytest's "fixture 'rank' not found" (or, under
``--strict-markers``, "'ranks' not found in `markers`"), a test that needs the harness fails
saying that the plugin is off and what to do. While the harness is loaded it does nothing.
Imports no torch.
"""

from __future__ import annotations

import pytest

# The harness's markers and fixtures (tests/harness/test_running.py pins them to the plugin's).
MARKERS = ("ranks", "gpu", "fault", "expect", "allow_leftovers")
FIXTURES = (
    "rank", "world_size", "device", "shared_tmp_path", "rank_faults", "run_on_ranks",
    "rank_pool", "launch_env", "fake_world", "threaded_world",
)  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.is_blocked("harness"):
        return
    for name in MARKERS:  # known, so --strict-markers lets the hint below speak
        config.addinivalue_line("markers", f"{name}: the harness's (the plugin is off)")
    config.pluginmanager.register(_Hint(), "harness-off-hint-active")


class _Hint:
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        need = needs_harness(item)
        if need:
            pytest.fail(
                f"{need}, and the harness plugin is off (-p no:harness): drop -p no:harness "
                f"to run it, or deselect such tests (-m 'not ranks', or -k)",
                pytrace=False,
            )


def needs_harness(item: pytest.Item) -> str:
    """Why `item` needs the harness ("" where it does not)."""
    marked = [name for name in MARKERS if item.get_closest_marker(name) is not None]
    if marked:
        return f"{item.nodeid} is marked {marked[0]}"
    used = [name for name in getattr(item, "fixturenames", ()) if name in FIXTURES]
    if used:
        return f"{item.nodeid} uses the harness's fixture '{used[0]}'"
    return ""
