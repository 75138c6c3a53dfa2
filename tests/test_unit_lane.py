"""`make unit-fast` runs the tests marked `unit`: logic tested in this process, with fakes. A
test so marked that starts a process fails, naming itself, so the lane stays what it says."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

REFUSED = r"::test_a_unit_test_that_starts_a_process_fails_saying_so is marked unit"


@pytest.mark.unit
def test_a_unit_test_that_starts_a_process_fails_saying_so() -> None:
    with pytest.raises(AssertionError, match=REFUSED):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    with pytest.raises(AssertionError, match=REFUSED):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(AssertionError, match=REFUSED):
        os.fork()


def test_a_test_not_marked_unit_may_start_one() -> None:
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0
