"""A whole suite on the harness: tests/lib as it is, and with -n 2 (pytest-xdist)."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks._common import ROOT, print_and_exit


def run_suite(*extra: str) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not gpu",
            *extra,
            "tests/lib",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "no output"
    return time.perf_counter() - start, summary


def main() -> list[str]:
    serial, serial_summary = run_suite()
    parallel, parallel_summary = run_suite("-n", "2")
    return [
        "## Harness: a whole suite (tests/lib, CPU lane)",
        "",
        "| run | wall time | pytest's summary |",
        "|---|---|---|",
        f"| as it is | {serial:.1f} s | {serial_summary} |",
        f"| with -n 2 | {parallel:.1f} s | {parallel_summary} |",
        "",
        f"- -n 2 is {serial / parallel:.2f}x the speed on this 2-core machine",
        "",
    ]


if __name__ == "__main__":
    print_and_exit(main())
