"""The cost of comparing the ranks' collectives (on by default; --rank-no-collective-check).

Two pytest sessions of the same tests, alternated: 60 trivial 4-rank tests on a kept group,
and 20 tests of 200 one-element all_reduces each, with the check on and off. A third figure:
one fingerprint noted in shared memory, against one all_reduce of one element.
Target: the check costs at most a few percent per test.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from benchmarks._common import Sample, print_and_exit, time_pytest_run

TARGET = 1.05
SOURCE = """
import pytest, torch, torch.distributed as dist

@pytest.mark.parametrize("i", range(60))
@pytest.mark.ranks(4)
def test_trivial(i, rank):
    pass

@pytest.mark.parametrize("i", range(20))
@pytest.mark.ranks(4)
def test_collectives(i, rank):
    t = torch.ones(1)
    for _ in range(200):
        dist.all_reduce(t)
"""


def _per_test(times: dict[str, float], kind: str) -> float:
    picked = [t for name, t in times.items() if f"test_{kind}[" in name][3:]  # warm ones
    return Sample.of(picked).median


def _note_cost_us() -> float:
    """One collective's fingerprint noted on a rank's shared board, in this process."""
    import torch

    from harness.rank import kept_group

    with tempfile.TemporaryDirectory() as folder:
        kept_group.share_issued_count(os.path.join(folder, "board"))
        tensors, rounds = [torch.ones(1)], 20000
        start = time.perf_counter()
        for _ in range(rounds):
            kept_group.note_issued("allreduce", (tensors, None))
        return (time.perf_counter() - start) / rounds * 1e6


def main() -> list[str]:
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for _ in range(4):  # alternated, so a noisy minute lands on both
        runs["on"].append(time_pytest_run(SOURCE, ["-p", "harness"]))
        runs["off"].append(time_pytest_run(SOURCE, ["-p", "harness", "--rank-no-collective-check"]))
    lines = [
        "| 4 ranks, median per test | check on | check off | ratio |",
        "|---|---|---|---|",
    ]
    held = True
    for kind, label in (("trivial", "trivial test"), ("collectives", "200 all_reduces")):
        on = statistics.median(_per_test(r, kind) for r in runs["on"])
        off = statistics.median(_per_test(r, kind) for r in runs["off"])
        held &= on / off <= TARGET
        lines.append(f"| {label} | {on * 1e3:.1f} ms | {off * 1e3:.1f} ms | {on / off:.2f}x |")
    per_reduce = statistics.median(_per_test(r, "collectives") for r in runs["off"]) / 200
    lines += [
        "",
        f"One fingerprint noted: {_note_cost_us():.1f} us, against {per_reduce * 1e6:.0f} us per "
        f"one-element all_reduce (with the test around it) at 4 ranks.",
        f"- {'HELD' if held else 'MISSED'}: the check within {TARGET}x per test",
    ]
    return lines


if __name__ == "__main__":
    print_and_exit(main())
