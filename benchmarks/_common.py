"""Shared helpers: robust statistics, machine facts, and timing a pytest run per test."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class Sample:
    """The median of several measurements and their spread (min..max)."""

    median: float
    low: float
    high: float
    n: int

    @staticmethod
    def of(values: list[float]) -> Sample:
        return Sample(statistics.median(values), min(values), max(values), len(values))

    def ms(self) -> str:
        return (
            f"{self.median * 1e3:.1f} ms ({self.low * 1e3:.1f}-{self.high * 1e3:.1f}, n={self.n})"
        )

    def s(self) -> str:
        return f"{self.median:.2f} s ({self.low:.2f}-{self.high:.2f}, n={self.n})"


def machine() -> str:
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.system()} {platform.release()}"
    )


# A conftest that records each test's wall time (setup + call + teardown), its outcome and,
# for a failure, the one-line message pytest shows for it.
TIMING_CONFTEST = """
import json, os, time, pytest

_times, _outcomes, _messages = {}, {}, {}

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.perf_counter()
    yield
    _times[item.nodeid] = time.perf_counter() - start

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _outcomes.setdefault(report.nodeid, report.outcome)
    crash = getattr(report.longrepr, "reprcrash", None)
    if report.failed and crash is not None:
        _messages.setdefault(report.nodeid, crash.message)

def pytest_sessionfinish(session):
    with open(os.environ["BENCH_TIMES"], "w") as f:
        json.dump({"times": _times, "outcomes": _outcomes, "messages": _messages}, f)
"""


def run_pytest(
    test_source: str, args: list[str], timeout: float = 600, conftest: str = ""
) -> dict[str, Any]:
    """Run pytest on one generated test file (`conftest` is added to the timing conftest).

    Returns {"times": {id: s}, "outcomes": {id: outcome}, "messages": {id: failure message}}.
    """
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        folder = Path(tmp)
        (folder / "conftest.py").write_text(TIMING_CONFTEST + textwrap.dedent(conftest))
        (folder / "test_bench.py").write_text(textwrap.dedent(test_source))
        times = folder / "times.json"
        env = {**os.environ, "BENCH_TIMES": str(times), "PYTHONDONTWRITEBYTECODE": "1"}
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(folder)],
            cwd=folder,
            env=env,
            timeout=timeout,
            check=False,
            capture_output=True,
        )
        if not times.exists():
            return {"times": {}, "outcomes": {}, "messages": {}}
        return json.loads(times.read_text())  # type: ignore[no-any-return]


def time_pytest_run(
    test_source: str, args: list[str], timeout: float = 600, conftest: str = ""
) -> dict[str, float]:
    """Each test's wall time in seconds, in run order."""
    return run_pytest(test_source, args, timeout, conftest)["times"]  # type: ignore[no-any-return]


def missed(lines: list[str]) -> bool:
    """Whether a result says a target was missed (a line "- MISSED: ...")."""
    return any(line.startswith("- MISSED") for line in lines)


def print_and_exit(lines: list[str]) -> None:
    """A benchmark run alone: print its lines, and exit non-zero if it missed a target."""
    print("\n".join(lines), flush=True)
    sys.exit(1 if missed(lines) else 0)


def replaced_ranks(output: str) -> str:
    """'N (reason: count, ...)' from the RanksReplacedWarnings in a run's warnings summary."""
    reasons: Counter[str] = Counter()
    tests = 0
    for line in output.splitlines():
        _, found, message = line.partition("RanksReplacedWarning: ")
        if not found:
            continue
        tests += 1
        # Each rank's reason reads "rank N <why> (<details>); the ranks are replaced ...".
        reasons.update(set(re.findall(r"rank \d+ ([^(;]+?)(?: \(|;|$)", message)))
    listed = ", ".join(f"{why}: {n}" for why, n in reasons.most_common())
    return f"{tests} ({listed})" if tests else "none"
