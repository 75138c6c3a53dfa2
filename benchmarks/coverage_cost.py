"""What coverage costs a ranks test, beside what it costs a plain test.

The same session of 60 trivial 2-rank tests and 60 trivial plain tests, each calling a
function of a measured module, run without coverage and under `pytest --cov`, alternating.
Reports the median per test of each kind both ways and the ratios: a ranks test's cost of
coverage (every rank traces, and saves its data after each test) against a plain test's.
"""

from __future__ import annotations

from benchmarks._common import Sample, print_and_exit, run_pytest

TESTS = 60
MEASURED = """
def work(x):
    total = 0
    for i in range(100):
        total += i * x
    return total
"""
SOURCE = f"""
import sys, pytest
sys.path.insert(0, __import__("os").path.dirname(__file__))
import measured_bench


@pytest.mark.parametrize("i", range({TESTS}))
@pytest.mark.ranks(2)
def test_ranks(i, rank):
    assert measured_bench.work(rank) >= 0


@pytest.mark.parametrize("i", range({TESTS}))
def test_plain(i):
    assert measured_bench.work(1) >= 0
"""
CONFTEST = f"""
import os
from pathlib import Path
Path(os.path.dirname(__file__), "measured_bench.py").write_text({MEASURED!r})
"""


def _per_test(runs: list[dict[str, float]], kind: str) -> Sample:
    picked = []
    for times in runs:  # each run's warm tests (its first ones start the ranks)
        picked += [t for name, t in times.items() if f"test_{kind}[" in name][5:]
    return Sample.of(picked)


def main() -> list[str]:
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "cov": []}
    for _ in range(2):  # alternated, so a noisy minute lands on both
        runs["plain"].append(run_pytest(SOURCE, ["-p", "harness"], conftest=CONFTEST)["times"])
        runs["cov"].append(
            run_pytest(
                SOURCE,
                ["-p", "harness", "--cov=measured_bench", "--cov-report="],
                conftest=CONFTEST,
            )["times"]
        )
    lines = [
        "",
        "## Coverage in ranks (`benchmarks/coverage_cost.py`)",
        "",
        "| per test | without coverage | `--cov` | ratio |",
        "|---|---|---|---|",
    ]
    for kind in ("ranks", "plain"):
        bare, measured = _per_test(runs["plain"], kind), _per_test(runs["cov"], kind)
        ratio = measured.median / bare.median if bare.median else float("nan")
        lines.append(f"| {kind} test | {bare.ms()} | {measured.ms()} | {ratio:.2f}x |")
    return lines


if __name__ == "__main__":
    print_and_exit(main())
