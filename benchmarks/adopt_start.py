"""Where an adopted session's start goes: DeepSpeed's own tests from a checkout, adopted
(--rank-adopt deepspeed), against the same file as it is, each one whole pytest session.

``python -m benchmarks.adopt_start --deepspeed-src DIR --python PY [--files F ...]``: DIR a
DeepSpeed checkout, PY a Python with its requirements and rankwise (``make .venv-deepspeed
DEEPSPEED_SRC=DIR``); by default its comm tests (unit/comm/test_dist.py, as the issue that
asked for this measured). In order:

- the file as it is, once (DeepSpeed's JIT ops built before anything is timed);
- adopted, the first session after an install: pytest's cache empty (the benchmark gives
  the sessions a cache directory of their own) and, run as root, the page cache dropped;
- adopted, the next sessions (the cache as the first left it, the page cache warm).

Each adopted session prints its breakdown, read from a timing plugin and from the harness
(harness.warm.session.start_timeline): Python and pytest's start, the conftests, the
collection, the fork server (its own imports, then each list it is handed), the wait for
its preload, the ranks' start, the first test (its group set up), the other tests, and the
process's end; and the server's slowest imports. Targets: the whole file at least 20x
faster adopted, cold and warm; the first session within 1.5x of the next.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import OUT
from benchmarks.adopt_deepspeed import (
    ADOPTED,
    AS_IS,
    NOT_ON_THIS_CPU,
    SESSION_TIMEOUT_S,
    buffers_left_removed,
    warm_extensions,
)

FILES = ("unit/comm/test_dist.py",)
NEXT_SESSIONS = 3
TARGET = 20.0
FIRST_WITHIN = 1.5

# Loaded with -p before the harness: stamps (seconds since the process started) at pytest's
# milestones, the harness's start timeline and slowest preloads, written at exit.
START_PLUGIN = """
import atexit, json, os, time
import pytest

def _since_start():
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return up - ticks / os.sysconf("SC_CLK_TCK")

_ZERO = time.time() - _since_start()  # when this process started, as time.time() says
_marks = {"plugins": time.time() - _ZERO}
_found = {"marks": _marks, "server": {}, "slowest": [], "tests": []}

def _mark(name):
    _marks.setdefault(name, time.time() - _ZERO)

def _write():
    _mark("exit")
    with open(os.environ["BENCH_START"], "w") as f:
        json.dump(_found, f)

atexit.register(_write)

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    _mark("configure")

@pytest.hookimpl(tryfirst=True)
def pytest_collection(session):
    _mark("collection")

def pytest_collection_finish(session):
    _mark("collected")

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time() - _ZERO
    yield
    _found["tests"].append((item.nodeid, start, time.time() - _ZERO))

@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    _mark("finished")
    from harness.warm import session as warm

    timeline = warm.start_timeline(session.config)
    _found["server"] = {name: at - _ZERO for name, at in timeline.items()}
    _found["slowest"] = warm.slowest_preloads(session.config)
"""


@dataclass(frozen=True)
class Run:
    """One pytest session: its wall time, its verdicts, and what the start plugin found."""

    seconds: float
    outcomes: dict[str, int]
    found: dict[str, Any]
    output: str


def run(python: str, tests: Path, args: list[str], cache: Path | None, cold: bool) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp, buffers_left_removed():
        folder = Path(tmp)
        (folder / "bench_start.py").write_text(START_PLUGIN)
        stamps = folder / "start.json"
        env = dict(os.environ)
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("LOCAL_SIZE", "2")
        env.setdefault("TORCH_EXTENSIONS_DIR", str(OUT / "torch_extensions"))
        env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
        env["BENCH_START"] = str(stamps)
        where = ["-o", f"cache_dir={cache}"] if cache else ["-p", "no:cacheprovider"]
        command = [python, "-m", "pytest", "-p", "bench_start", "-q", *where, *args]
        if cold:
            drop_page_cache()
        start = time.perf_counter()
        done = subprocess.run(
            command, cwd=tests, env=env, capture_output=True, text=True, timeout=SESSION_TIMEOUT_S
        )
        seconds = time.perf_counter() - start
        found = json.loads(stamps.read_text()) if stamps.exists() else {}
        return Run(seconds, counts(done.stdout), found, done.stdout + done.stderr)


def drop_page_cache() -> bool:
    """Empty the kernel's page cache (root only): the next session reads every file from
    disk, as the first after an install or a reboot does."""
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def counts(output: str) -> dict[str, int]:
    """pytest's summary line as counts ("22 passed, 1 skipped" -> {...}); colours removed
    (DeepSpeed's conftest turns them on)."""
    found: dict[str, int] = {}
    last = re.sub(r"\x1b\[[0-9;]*m", "", output).strip().splitlines()[-1:]
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", " ".join(last)):
        found[word.rstrip("s")] = int(number)
    return found


def breakdown(run: Run) -> list[tuple[str, float]]:
    """The session's start and run, part by part (seconds; the parts add up to the whole)."""
    marks, server = run.found.get("marks", {}), run.found.get("server", {})
    tests = sorted(run.found.get("tests", []), key=lambda t: t[1])
    if not marks or not tests:
        return []
    collected, configured = marks.get("collected", 0.0), marks.get("configure", 0.0)
    ready = server.get("ranks-ready", tests[0][1])
    asked = server.get("ranks-asked", ready)
    waited = max(0.0, min(server.get("modules-done", asked), ready) - max(collected, asked))
    first = next((t for t in tests if t[2] >= ready), tests[0])  # the first on ranks
    others = sum(t[2] - t[1] for t in tests if t is not first)
    parts = [
        ("Python and pytest, plugins loaded", marks.get("plugins", 0.0)),
        ("conftests (torch)", configured - marks.get("plugins", 0.0)),
        ("collection (the tests' imports)", collected - configured),
        ("wait for the fork server's preload", waited),
        ("ranks start (forks)", max(0.0, ready - asked - waited)),
        ("first test on ranks, its group set up", first[2] - max(first[1], ready)),
        ("the other tests", others),
        ("session end and process exit", run.seconds - tests[-1][2]),
    ]
    counted = sum(seconds for _, seconds in parts)
    parts.append(("the rest (between tests, pytest's own)", run.seconds - counted))
    return parts


def server_lines(run: Run) -> list[str]:
    """The fork server's own timeline, in the same seconds since the process started."""
    server = run.found.get("server", {})
    order = ("launched", "started", "early-handed", "early-done", "modules-handed")
    shown = [f"{name} {server[name]:.2f} s" for name in (*order, "modules-done") if name in server]
    slowest = ", ".join(
        f"{name} {seconds:.2f} s" for name, seconds in run.found.get("slowest", [])[:5]
    )
    return [
        f"  - fork server: {'; '.join(shown) or 'none'}",
        f"  - its slowest imports: {slowest or 'none'}",
    ]


def table(runs: list[tuple[str, Run]]) -> list[str]:
    names = [name for name, _ in breakdown(runs[0][1])] or ["(no breakdown)"]
    head = "| part | " + " | ".join(label for label, _ in runs) + " |"
    lines = [head, "|---|" + "---|" * len(runs)]
    columns = [dict(breakdown(r)) for _, r in runs]
    for name in names:
        cells = " | ".join(f"{c.get(name, 0.0):.2f} s" for c in columns)
        lines.append(f"| {name} | {cells} |")
    wholes = " | ".join(f"**{r.seconds:.2f} s**" for _, r in runs)
    lines.append(f"| whole session | {wholes} |")
    return lines


@contextlib.contextmanager
def cache_directory() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-start-cache-") as tmp:
        yield Path(tmp) / "cache"


def measure(python: str, src: Path, files: list[str]) -> list[str]:
    tests = src / "tests"
    warm_extensions(python, tests)
    selection = [*NOT_ON_THIS_CPU, *files]
    as_is = run(python, tests, [*AS_IS, *selection], None, cold=False)
    with cache_directory() as cache:
        first = run(python, tests, [*ADOPTED, *selection], cache, cold=True)
        cold_dropped = os.geteuid() == 0
        nexts = [
            run(python, tests, [*ADOPTED, *selection], cache, cold=False)
            for _ in range(NEXT_SESSIONS)
        ]
    median_next = sorted(nexts, key=lambda r: r.seconds)[len(nexts) // 2]
    cold_ratio, warm_ratio = as_is.seconds / first.seconds, as_is.seconds / median_next.seconds
    within = first.seconds / median_next.seconds
    same = all(r.outcomes == as_is.outcomes for r in (first, *nexts))
    cold_what = "page cache dropped" if cold_dropped else "page cache kept (not root)"
    return [
        f"## An adopted session's start: DeepSpeed's {', '.join(files)}, one session each",
        "",
        f"As it is: {as_is.seconds:.1f} s ({_said(as_is.outcomes)}). Adopted: the first "
        f"session after an install ({cold_what}, pytest's cache empty), then "
        f"{NEXT_SESSIONS} more (the median shown).",
        "",
        *table([("first (cold)", first), ("next (median)", median_next)]),
        "",
        "First session:",
        *server_lines(first),
        "Next session:",
        *server_lines(median_next),
        "",
        f"- {'HOLDS' if same else 'MISSED'}: the same verdicts as it is "
        f"({'; '.join(_said(r.outcomes) for r in (first, *nexts))})",
        f"- {'HOLDS' if cold_ratio >= TARGET else 'MISSED'}: at least {TARGET:.0f}x the file as it "
        f"is, first session ({cold_ratio:.1f}x)",
        f"- {'HOLDS' if warm_ratio >= TARGET else 'MISSED'}: at least {TARGET:.0f}x, next "
        f"sessions ({warm_ratio:.1f}x; spread {min(r.seconds for r in nexts):.2f}-"
        f"{max(r.seconds for r in nexts):.2f} s)",
        f"- {'HOLDS' if within <= FIRST_WITHIN else 'MISSED'}: the first session within "
        f"{FIRST_WITHIN}x of the next ({within:.2f}x)",
        "",
    ]


def _said(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{n} {word}" for word, n in sorted(outcomes.items())) or "no verdicts"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed-src", required=True, help="a DeepSpeed checkout")
    parser.add_argument("--python", default=sys.executable, help="its venv's Python")
    parser.add_argument("--files", nargs="*", default=list(FILES), help="below its tests/")
    args = parser.parse_args()
    src = Path(args.deepspeed_src).resolve()
    if not (src / "tests" / "unit" / "common.py").is_file():
        raise SystemExit(f"{src} has no tests/unit/common.py: give a DeepSpeed checkout")
    python = os.path.abspath(args.python)  # a venv's link, not resolved
    lines = measure(python, src, args.files)
    print("\n".join(lines))
    return 0 if not any(line.startswith("- MISSED") for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
