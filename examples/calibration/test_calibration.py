"""The calibration example's tests, written only with the harness's documented surface.

Run: pytest -p harness --ranks 4 examples/calibration
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from calibrate import calibrate_single_process, cpu_run, run_calibration, shard_loader

from harness import exits, killed, raises

SETTINGS = {"batches_per_rank": 4, "batch": 2, "seq_len": 8, "seed": 3, "vocab": 256}


@pytest.fixture
def settings_file(shared_tmp_path: Path) -> Path:
    path = shared_tmp_path / "settings.json"
    path.write_text(json.dumps(SETTINGS))
    return path


@pytest.mark.ranks(2, 4, timeout=120)
def test_ranks_give_the_same_maxima_as_one_process(
    rank: int, world_size: int, settings_file: Path, shared_tmp_path: Path
) -> None:
    out = shared_tmp_path / "calibration.pt"
    with cpu_run() as state:
        combined = run_calibration(state, settings_file, out, progress=False)
    expected = calibrate_single_process(SETTINGS, world_size)
    assert combined.keys() == expected.keys() and len(combined) == 4 * 7 + 1
    for name, value in expected.items():
        torch.testing.assert_close(combined[name], value, rtol=1e-5, atol=1e-6, msg=name)
    if rank == 0:
        saved = torch.load(out, weights_only=True)
        assert [entry["rank"] for entry in saved["ranks"]] == list(range(world_size))
        assert all(entry["batches"] == SETTINGS["batches_per_rank"] for entry in saved["ranks"])


def _loader_failing_on_rank_1(settings: dict[str, Any], rank: int, world: int) -> Any:
    for step, batch in enumerate(shard_loader(settings, rank, world)):
        if rank == 1 and step == 1:
            raise OSError("shard 1 is unreadable")
        yield batch


@pytest.mark.ranks(4, timeout=120)
@pytest.mark.expect(
    rank=1,
    does=raises(OSError, match="shard 1 is unreadable"),
    others=raises(RuntimeError, match=r"all_reduce\('load_batch'\): rank 1 raised OSError"),
)
def test_a_failing_loader_stops_every_rank_with_the_cause(
    settings_file: Path, shared_tmp_path: Path
) -> None:
    with cpu_run() as state:
        run_calibration(
            state, settings_file, shared_tmp_path / "c.pt", _loader_failing_on_rank_1, False
        )


def _loader_exiting_on_rank_2(settings: dict[str, Any], rank: int, world: int) -> Any:
    for step, batch in enumerate(shard_loader(settings, rank, world)):
        if rank == 2 and step == 2:
            sys.exit(3)
        yield batch


@pytest.mark.ranks(4, timeout=120)
@pytest.mark.expect(exits(3))  # the exit happens inside all_reduce: every rank exits with it
def test_a_system_exit_on_one_rank_exits_every_rank(
    settings_file: Path, shared_tmp_path: Path
) -> None:
    with cpu_run() as state:
        run_calibration(
            state, settings_file, shared_tmp_path / "c.pt", _loader_exiting_on_rank_2, False
        )


@pytest.mark.ranks(4, timeout=120)
@pytest.mark.fault(rank=2, kind="signal", signal="SIGKILL", at="all_reduce:load_batch", nth=3)
@pytest.mark.expect(
    {
        0: raises(RuntimeError),
        1: raises(RuntimeError),
        2: killed(signal.SIGKILL),
        3: raises(RuntimeError),
    }
)
def test_a_rank_killed_mid_run(settings_file: Path, shared_tmp_path: Path) -> None:
    with cpu_run() as state:
        run_calibration(state, settings_file, shared_tmp_path / "c.pt", progress=False)
