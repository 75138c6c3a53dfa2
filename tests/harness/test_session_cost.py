"""What a session costs the pytest process around its tests: its end."""

from __future__ import annotations

import pytest

# Registered before the plugin's (at import of the test module), so run after it at exit.
SAYS_AT_EXIT = """
import atexit, gc, sys

atexit.register(lambda: sys.stderr.write(f"FROZEN AT EXIT {gc.get_freeze_count() > 0}\\n"))
"""


@pytest.mark.parametrize("imports", ["torch", "json"])
def test_a_session_that_imported_torch_skips_the_final_collection(
    pytester: pytest.Pytester, imports: str
) -> None:
    """Python's last garbage collection at exit walks every object torch made (about 0.8 s
    of the second a session with torch and DeepSpeed took to end): the harness freezes them
    first, where torch was imported. Objects are still freed; what a cycle holds is left to
    the process's end, as Python allows."""
    pytester.makepyfile(f"import {imports}\n{SAYS_AT_EXIT}\n\ndef test_plain():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "harness")
    result.assert_outcomes(passed=1)
    assert f"FROZEN AT EXIT {imports == 'torch'}" in result.stderr.str()
