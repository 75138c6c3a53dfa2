"""Compute-heavy ranks: does each rank get its share of the cores?

The same work on 4 ranks (60 steps of a 384x384 matmul each, a few hundred ms) under the
harness (default threads: cores // world size), under the harness with torch's default of
every core per rank (what it did before), under torchrun (OMP_NUM_THREADS=1) and as a
MultiProcessTestCase. Each figure is the slowest rank's compute time, median over runs.
Run: python -m benchmarks.compute
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from benchmarks._common import ROOT, Sample, print_and_exit

WORLD = 4
RUNS = 5
WORK = """
import os, time, torch

def work(out_dir, rank):
    torch.manual_seed(rank)
    a = torch.randn(384, 384)
    start = time.perf_counter()
    for _ in range(60):
        a = (a @ a).clamp_(-1, 1)
    elapsed = time.perf_counter() - start
    with open(os.path.join(out_dir, f"rank{rank}-{time.time_ns()}"), "w") as f:
        f.write(str(elapsed))
"""
HARNESS_TEST = (
    WORK
    + """
import pytest

@pytest.mark.ranks({world})
@pytest.mark.parametrize("i", range({runs}))
def test_work(rank, i):
    work(os.environ["BENCH_OUT"], rank)
"""
)
TORCHRUN_SCRIPT = (
    WORK
    + """
import torch.distributed as dist
dist.init_process_group("gloo")
work(os.environ["BENCH_OUT"], dist.get_rank())
dist.destroy_process_group()
"""
)
MPTC_TEST = (
    WORK
    + """
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

class TestWork(MultiProcessTestCase):
    @property
    def world_size(self):
        return {world}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

"""
    + "".join(
        f"    def test_work_{i}(self):\n        work(os.environ['BENCH_OUT'], self.rank)\n\n"
        for i in range(RUNS)
    )
)


def _per_run(out_dir: Path) -> list[float]:
    """The slowest rank of each run (files are written in run order, WORLD per run)."""
    files = sorted(out_dir.iterdir(), key=lambda p: int(p.name.split("-")[1]))
    times = [float(p.read_text()) for p in files]
    return [max(times[i : i + WORLD]) for i in range(0, len(times), WORLD)]


def _measure(argv: list[str], source: str, name: str, extra_env: dict[str, str]) -> Sample:
    with tempfile.TemporaryDirectory() as tmp:
        directory, out = Path(tmp), Path(tmp) / "out"
        out.mkdir()
        (directory / name).write_text(textwrap.dedent(source))
        env = {**os.environ, "BENCH_OUT": str(out), **extra_env}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "lib"), str(ROOT)])
        subprocess.run(argv, cwd=directory, env=env, check=True, capture_output=True, timeout=900)
        return Sample.of(_per_run(out))


def _without_omp() -> dict[str, str]:
    return {"OMP_NUM_THREADS": ""}


def main() -> list[str]:
    py = sys.executable
    harness_test = HARNESS_TEST.replace("{world}", str(WORLD)).replace("{runs}", str(RUNS))
    pytest_args = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_work.py"]
    cores = os.cpu_count() or 1
    results = {
        "harness (cores // world size threads per rank)": _measure(
            [*pytest_args, "-p", "harness"], harness_test, "test_work.py", _without_omp()
        ),
        "harness, every core per rank (torch's default; before)": _measure(
            [*pytest_args, "-p", "harness", "--rank-threads", str(cores)],
            harness_test,
            "test_work.py",
            _without_omp(),
        ),
    }
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    runs = []
    for _ in range(RUNS):
        runs.append(
            _measure([*torchrun, "work.py"], TORCHRUN_SCRIPT, "work.py", {"OMP_NUM_THREADS": "1"})
        )
    results["torchrun, OMP_NUM_THREADS=1"] = Sample.of([r.median for r in runs])
    results["MultiProcessTestCase"] = _measure(
        [*pytest_args, "-p", "no:harness"],
        MPTC_TEST.replace("{world}", str(WORLD)),
        "test_work.py",
        {},
    )
    ours = results["harness (cores // world size threads per rank)"].median
    peer = results["torchrun, OMP_NUM_THREADS=1"].median
    lines = [
        f"## Compute-heavy ranks ({WORLD} ranks, slowest rank's compute time per run)",
        "",
        "| runner | compute time |",
        "|---|---|",
        *[f"| {name} | {sample.ms()} |" for name, sample in results.items()],
        "",
        f"Harness / torchrun: {ours / peer:.2f}x (target <= 1.2x).",
        "",
    ]
    return lines


if __name__ == "__main__":
    print_and_exit(main())
