"""What a one-test session costs: a 4-rank test against a plain test, both importing torch.

Each session is a fresh `python -m pytest` process on a file of one test: the plain one runs
`torch.ones(2).sum()` in the pytest process; the ranks one all_reduces on 4 ranks (the fork
server's start and preload, 4 forks, the gloo group, the test). Measured: the whole session
(process start to exit, as a user waits for it) and the test's own wall time (set-up and
teardown included). Rounds alternate the two kinds, each in two places: a directory kept
between rounds, as a developer reruns one file (pytest's cache remembers that the last
session started ranks, so the fork server starts as collection starts), and a fresh one, as
a new clone or a CI job runs (the server starts at the first ranks test collected). Target:
the ranks session within 1.5x of the plain one, both ways.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import TIMING_CONFTEST, print_and_exit

ROUNDS = 5
TARGET = 1.5
WORLD = 4
BOUND_S = 600  # a safety net for one session, far above its seconds

SOURCES = {
    "plain": """
import torch


def test_one():
    assert torch.ones(2).sum().item() == 2
""",
    "ranks": f"""
import pytest
import torch
import torch.distributed as dist


@pytest.mark.ranks({WORLD})
def test_one(rank):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == {WORLD}
""",
}


def _session(folder: Path) -> tuple[float, float]:
    """One session in `folder`: its wall time and its test's, in seconds."""
    times = folder / "times.json"
    env = {**os.environ, "BENCH_TIMES": str(times), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "harness", str(folder)],
        cwd=folder,
        env=env,
        timeout=BOUND_S,
        check=False,
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{folder.name}: the session failed:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    (test_time,) = json.loads(times.read_text())["times"].values()
    return took, float(test_time)


def _folder(parent: Path, name: str, source: str) -> Path:
    folder = parent / name
    folder.mkdir()
    (folder / "conftest.py").write_text(TIMING_CONFTEST)
    (folder / "test_first.py").write_text(source)
    return folder


def measure() -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(session, test) times per (kind, "fresh" or "rerun"), round by round."""
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-first-") as tmp:
        kept = {kind: _folder(Path(tmp), kind, source) for kind, source in SOURCES.items()}
        for kind in SOURCES:  # each kept directory's first session: pytest's cache made
            _session(kept[kind])
        for round_ in range(ROUNDS):
            for kind, source in SOURCES.items():  # alternated: a noisy minute hits both
                fresh = _folder(Path(tmp), f"{kind}-{round_}", source)
                results.setdefault((kind, "fresh"), []).append(_session(fresh))
                results.setdefault((kind, "rerun"), []).append(_session(kept[kind]))
    return results


def main() -> list[str]:
    results = measure()

    def median(key: tuple[str, str], which: int) -> float:
        return statistics.median(r[which] for r in results[key])

    lines = [
        "",
        "## A one-test session (`benchmarks/first_test.py`)",
        "",
        f"A session of one test, as a user waits for it (process start to exit), median of "
        f"{ROUNDS} alternating rounds: in a fresh directory (a new clone, as CI runs) and rerun "
        f"in one (pytest's cache remembers that the last session started ranks).",
        "",
        "| session | fresh directory: session | its one test | rerun: session | its one test |",
        "|---|---|---|---|---|",
    ]
    for kind, label in (("plain", "plain test importing torch"), ("ranks", f"{WORLD}-rank test")):
        cells = [
            f"{median((kind, where), 0):.2f} s | {median((kind, where), 1):.3f} s"
            for where in ("fresh", "rerun")
        ]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    for where in ("fresh", "rerun"):
        ratio = median(("ranks", where), 0) / median(("plain", where), 0)
        verdict = "HOLDS" if ratio <= TARGET else "MISSED"
        lines.append(
            f"- {verdict}: {where}, the {WORLD}-rank session within {TARGET}x of the plain one "
            f"({ratio:.2f}x)"
        )
    return lines


if __name__ == "__main__":
    print_and_exit(main())
