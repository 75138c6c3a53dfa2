"""The benchmarks' own contract: a run alone says whether its targets hold by its exit status."""

from __future__ import annotations

import pytest

from benchmarks._common import print_and_exit


def test_a_benchmark_that_missed_a_target_exits_non_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as missed:
        print_and_exit(["## x", "- HOLDS: one", "- MISSED: two (1.71x)"])
    assert missed.value.code == 1
    assert "- MISSED: two (1.71x)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as held:
        print_and_exit(["## x", "- HOLDS: one", "- HELD: two"])
    assert held.value.code == 0
