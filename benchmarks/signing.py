"""The cost of signing the harness's store keys with the session's secret, per trivial test.

Two pytest sessions of the same 60 trivial 4-rank tests, side by side, kept group and fresh
group: as the harness runs them (signed), and with the secret turned off in the pytest
process by the benchmark's own conftest (unsigned: the keys as they were). Only a fresh
group's set-up writes signed keys (one per rank); a kept group writes none. Target: within a
few percent (the medians' ratio at most 1.05, on a machine where the noise allows it).
"""

from __future__ import annotations

import hashlib
import hmac
import statistics
import time

from benchmarks._common import Sample, print_and_exit, time_pytest_run

TESTS = 60
SOURCE = f"""
import pytest

@pytest.mark.parametrize("i", range({TESTS}))
@pytest.mark.ranks(4)
def test_kept(i, rank):
    pass

@pytest.mark.parametrize("i", range({TESTS}))
@pytest.mark.ranks(4, fresh_group=True)
def test_fresh(i, rank):
    pass
"""
UNSIGNED = """
import harness.common.signing
harness.common.signing.new_secret = lambda: None  # the benchmark's peer: no secret, no signatures
"""
TARGET = 1.05


def _per_test(times: dict[str, float], kind: str) -> Sample:
    picked = [t for name, t in times.items() if f"test_{kind}[" in name][5:]  # warm ones
    return Sample.of(picked)


def _hmac_cost_us() -> float:
    secret, rounds = b"k" * 32, 20000
    start = time.perf_counter()
    for i in range(rounds):
        mac = hmac.new(secret, b"run7//setup/1\0" + str(i).encode(), hashlib.sha256).hexdigest()
        hmac.compare_digest(mac, mac)
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> list[str]:
    runs = {"signed": [], "unsigned": []}  # type: dict[str, list[dict[str, float]]]
    for _ in range(2):  # alternated, so a noisy minute lands on both
        runs["signed"].append(time_pytest_run(SOURCE, ["-p", "harness"]))
        runs["unsigned"].append(time_pytest_run(SOURCE, ["-p", "harness"], conftest=UNSIGNED))
    lines = [
        "",
        "## Harness: signing the store keys (4 ranks, trivial tests, medians)",
        "",
        "| group | signed | unsigned | ratio |",
        "|---|---|---|---|",
    ]
    held = True
    for kind in ("kept", "fresh"):
        signed = statistics.median(_per_test(r, kind).median for r in runs["signed"])
        unsigned = statistics.median(_per_test(r, kind).median for r in runs["unsigned"])
        ratio = signed / unsigned
        held &= ratio <= TARGET
        lines.append(f"| {kind} | {signed * 1e3:.1f} ms | {unsigned * 1e3:.1f} ms | {ratio:.2f}x |")
    lines += [
        "",
        f"One signature and its check: {_hmac_cost_us():.1f} us (a fresh group's set-up makes "
        f"one per rank).",
        f"- {'HELD' if held else 'MISSED'}: signed within {TARGET}x unsigned per trivial test",
    ]
    return lines


if __name__ == "__main__":
    print_and_exit(main())
