"""Per-test overhead of a trivial multi-rank test: the harness against torch's test bases.

Each figure is the median wall time per test (setup, call and teardown) after the first test
of a run (which starts the pool), measured side by side in one run.
"""

from __future__ import annotations

import time

from benchmarks._common import Sample, time_pytest_run

OURS = """
import pytest, torch, torch.distributed as dist

@pytest.mark.ranks({world})
@pytest.mark.parametrize("i", range({count}))
def test_trivial(i):
    t = torch.ones(1)
    dist.all_reduce(t)
"""

# torch's MultiProcessTestCase: spawns a fresh process per rank for every test.
MULTI_PROCESS = """
import torch, torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase

class Trivial(MultiProcessTestCase):
    world_size = {world}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _trivial(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        t = torch.ones(1)
        dist.all_reduce(t)
        dist.destroy_process_group()

{methods}
"""


def _multi_process_source(world: int, count: int) -> str:
    methods = "\n".join(
        f"    def test_trivial_{i}(self):\n        self._trivial()\n" for i in range(count)
    )
    return MULTI_PROCESS.format(world=world, methods=methods)


def after_warmup(times: dict[str, float]) -> list[float]:
    values = list(times.values())
    return values[1:] if len(values) > 1 else values


def ours(world: int, count: int = 40) -> tuple[Sample, float]:
    """(per-test sample, first test including the pool start) for the harness."""
    times = time_pytest_run(OURS.format(world=world, count=count), ["-p", "harness"])
    first = next(iter(times.values()))
    return Sample.of(after_warmup(times)), first


def multi_process_test_case(world: int, count: int = 4) -> Sample:
    times = time_pytest_run(_multi_process_source(world, count), ["-p", "no:harness"])
    return Sample.of(list(times.values()))


def pool_start(world: int = 4, repeats: int = 3) -> Sample:
    """Starting a fresh pool of `world` warm ranks (the forkserver already running)."""
    from harness.pool import PoolKey, Pools

    pools = Pools()
    key = PoolKey(world, "gloo", "forkserver")
    samples = []
    try:
        pools.get(key).close()  # the forkserver's own start (torch import) is paid once here
        for _ in range(repeats):
            start = time.perf_counter()
            pool = pools.get(key)
            samples.append(time.perf_counter() - start)
            pool.close()
    finally:
        pools.close()
    return Sample.of(samples)


def main() -> list[str]:
    lines = ["## Harness: per-test overhead of a trivial 4-rank test", ""]
    mine, first = ours(4)
    theirs = multi_process_test_case(4)
    ratio = theirs.median / mine.median
    start = pool_start(4)
    lines += [
        "| runner | per test (median, spread) |",
        "|---|---|",
        f"| harness (warm forkserver ranks) | {mine.ms()} |",
        f"| torch MultiProcessTestCase (spawn per test) | {theirs.ms()} |",
        "",
        f"- ratio: MultiProcessTestCase / harness = **{ratio:.0f}x**",
        f"- pool start for 4 ranks (forkserver running): {start.ms()}; first test of the "
        f"session including forkserver start with torch import: {first:.2f} s",
        "",
        "Targets:",
        f"- {'HOLDS' if mine.median < 0.060 else 'MISSED'}: harness median under 60 ms "
        f"({mine.median * 1e3:.1f} ms)",
        f"- {'HOLDS' if ratio >= 40 else 'MISSED'}: at least 40x faster than "
        f"MultiProcessTestCase ({ratio:.0f}x)",
        f"- {'HOLDS' if start.median < 2.0 else 'MISSED'}: pool start for 4 ranks under 2 s "
        f"({start.median:.2f} s)",
        "",
    ]
    return lines


if __name__ == "__main__":
    print("\n".join(main()))
