"""An existing MultiProcessTestCase suite, as it is and adopted (--rank-adopt torch), in one run.

The suite (2 ranks, gloo, a FileStore group at ``self.file_name`` as torch's own suites do)
mixes passes, skips by torch's exit statuses, ``self.skipTest`` and ``unittest.skip``, and two
tests that pass under torch only because torch checks rank 0's exit status alone. Both runs
must give the same verdicts except those false greens, which the adoption turns red.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks._common import run_pytest

PASSING = 24
WORLD_SIZE = 2
TARGET_RATIO = 20.0

_HEADER = """
import os, sys, unittest
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase, TEST_SKIPS


class Suite(MultiProcessTestCase):
    @property
    def world_size(self):
        return {world_size}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass

    def join_group(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
"""

_PASS = """
    def test_all_reduce_{i:02d}(self):
        self.join_group()
        t = torch.full((4,), float(self.rank + {i}))
        dist.all_reduce(t)
        self.assertEqual(t[0].item(), sum(r + {i} for r in range(self.world_size)))
"""

_SKIPS = """
    def test_skip_no_gpus(self):
        sys.exit(TEST_SKIPS["multi-gpu-2"].exit_code)

    def test_skip_no_cuda(self):
        sys.exit(TEST_SKIPS["no_cuda"].exit_code)

    def test_skip_small_world(self):
        sys.exit(TEST_SKIPS["small_worldsize"].exit_code)

    def test_skip_test_here(self):
        self.skipTest("not on this machine")

    def test_skip_test_reason(self):
        self.skipTest("needs a feature")

    @unittest.skip("decorated")
    def test_skip_decorated(self):
        pass
"""

# Green under torch (only rank 0's exit status is read), red under the harness.
FALSE_GREENS = {
    "test_false_green_exit": "rank 1 calls sys.exit(3)",
    "test_false_green_hard_exit": "rank 1 ends with os._exit(0) before the collective",
}
_FALSE_GREENS = """
    def test_false_green_exit(self):
        if self.rank == 1:
            sys.exit(3)

    def test_false_green_hard_exit(self):
        if self.rank == 1:
            os._exit(0)
"""


def suite_source() -> str:
    body = "".join(_PASS.format(i=i) for i in range(PASSING))
    return _HEADER.format(world_size=WORLD_SIZE) + body + _SKIPS + _FALSE_GREENS


def measure() -> tuple[dict[str, Any], dict[str, Any]]:
    source = suite_source()
    as_is = run_pytest(source, ["-p", "harness"])
    adopted = run_pytest(source, ["-p", "harness", "--rank-adopt", "torch"])
    return as_is, adopted


def _short(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1]


def main() -> list[str]:
    as_is, adopted = measure()
    before, after = as_is["outcomes"], adopted["outcomes"]
    changed = sorted(_short(n) for n in before if before[n] != after.get(n))
    expected = sorted(FALSE_GREENS)
    total_before, total_after = sum(as_is["times"].values()), sum(adopted["times"].values())
    ratio = total_before / total_after if total_after else 0.0
    median_before = statistics.median(as_is["times"].values())
    median_after = statistics.median(adopted["times"].values())
    counts = {o: list(after.values()).count(o) for o in ("passed", "failed", "skipped")}
    lines = [
        f"## Existing suites: {len(before)} MultiProcessTestCase tests, as is and adopted",
        "",
        f"{PASSING} passing tests, 6 skips, 2 false greens; world size {WORLD_SIZE}, gloo.",
        "",
        "| run | all tests | median test | verdicts |",
        "|---|---|---|---|",
        f"| torch, as is | {total_before:.1f} s | {median_before * 1e3:.0f} ms "
        f"| {_counts(before)} |",
        f"| --rank-adopt torch | {total_after:.1f} s | {median_after * 1e3:.0f} ms "
        f"| {_counts(after)} |",
        "",
        f"- verdicts that differ: {', '.join(changed) or 'none'}",
        *(f"  - {name}: {why}" for name, why in FALSE_GREENS.items()),
        f"- {'HOLDS' if changed == expected else 'MISSED'}: the same verdicts except the "
        f"false greens, which turn red",
        f"- {'HOLDS' if ratio >= TARGET_RATIO else 'MISSED'}: at least {TARGET_RATIO:.0f}x "
        f"faster over the whole suite ({ratio:.0f}x; per median test "
        f"{median_before / median_after:.0f}x)",
        f"- adopted: {counts}",
        "",
    ]
    return lines


# torch's own DistributedTest, wrapped as PyTorch's test/distributed/test_distributed_spawn.py
# wraps it (the suite ships in torch's wheel), restricted to a selection of its tests.
DISTRIBUTED_SELECTION = (
    "all_reduce_sum", "all_reduce_max", "all_reduce_sum_async", "all_reduce_sum_complex",
    "broadcast", "broadcast_full_group", "barrier", "barrier_full_group", "reduce_sum",
    "reduce_sum_twice", "all_gather", "all_gather_complex", "all_gather_full_group",
    "all_reduce_sum_cuda",  # skipped on CPU, as it is and adopted
)  # fmt: skip
DISTRIBUTED_TARGET = 10.0
DISTRIBUTED_SOURCE = """
import os
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")

from torch.testing._internal.distributed.distributed_test import (
    DistributedTest, TestDistBackend,
)


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
"""
# The selection, in a conftest: the class's setUp refers to test methods by name.
DISTRIBUTED_CONFTEST = """
SELECTED = {selected!r}


def pytest_collection_modifyitems(config, items):
    items[:] = [item for item in items if item.name.removeprefix("test_") in SELECTED]
"""


def distributed_test() -> list[str]:
    """torch's DistributedTest selection, whole file, as it is and adopted."""
    conftest = DISTRIBUTED_CONFTEST.format(selected=set(DISTRIBUTED_SELECTION))
    runs = {}
    for name, args in (
        ("as_is", ["-p", "no:harness"]),
        ("adopted", ["-p", "harness", "--rank-adopt", "torch"]),
    ):
        start = time.perf_counter()
        found = run_pytest(DISTRIBUTED_SOURCE, [*args, "-W", "ignore"], conftest=conftest)
        runs[name] = (time.perf_counter() - start, found)
    (wall_before, before), (wall_after, after) = runs["as_is"], runs["adopted"]
    same = before["outcomes"] == after["outcomes"] and len(before["outcomes"]) == len(
        DISTRIBUTED_SELECTION
    )
    ratio = wall_before / wall_after if wall_after else 0.0
    median_before = statistics.median(before["times"].values()) if before["times"] else 0.0
    median_after = statistics.median(after["times"].values()) if after["times"] else 0.0
    return [
        f"## torch's DistributedTest ({len(DISTRIBUTED_SELECTION)} tests, 2 ranks, gloo), "
        f"whole file",
        "",
        "| run | whole file (pytest's start included) | median test | verdicts |",
        "|---|---|---|---|",
        f"| as it is | {wall_before:.1f} s | {median_before * 1e3:.0f} ms | "
        f"{_counts(before['outcomes'])} |",
        f"| --rank-adopt torch | {wall_after:.1f} s | {median_after * 1e3:.0f} ms | "
        f"{_counts(after['outcomes'])} |",
        "",
        f"- {'HOLDS' if same else 'MISSED'}: the same verdicts",
        f"- {'HOLDS' if ratio >= DISTRIBUTED_TARGET else 'MISSED'}: at least "
        f"{DISTRIBUTED_TARGET:.0f}x faster over the whole file ({ratio:.1f}x)",
        "",
    ]


def _counts(outcomes: dict[str, str]) -> str:
    values = list(outcomes.values())
    return ", ".join(f"{values.count(o)} {o}" for o in ("passed", "failed", "skipped"))


if __name__ == "__main__":
    print("\n".join(main() + distributed_test()))
