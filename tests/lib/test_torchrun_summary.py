"""torchrun's own summary names the rank rankwise names.

torchrun's "Root Cause" is the failed worker with the smallest timestamp in its error file
(TORCHELASTIC_ERROR_FILE), else the time torchrun noticed its exit. It named whichever rank
it saw exit first, often a collateral one, with "error_file: <N/A>"; every collateral rank
printed a full traceback. Here each rank's error file is read with torch's own reader
(ProcessFailure, ChildFailedError), on warm ranks; the slow lane runs torchrun itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import rankwise as rw
import torch.distributed as dist
from rankwise._run import ABORT_EXIT_CODE
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from harness import Ending


def _failures(folder: Path, world: int, code: int) -> dict[int, ProcessFailure]:
    return {
        r: ProcessFailure(local_rank=r, pid=0, exitcode=code, error_file=str(folder / f"{r}.json"))
        for r in range(world)
    }


def _torchruns_root(failures: dict[int, ProcessFailure]) -> int:
    return ChildFailedError("job", failures).get_first_failure()[0]


def _own_group_aborting(folder: str, bad: int, full: bool, torchrun: bool = True) -> None:
    """A launched rank in a run that owns its group; rank `bad`'s loader fails."""
    world, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if torchrun:
        os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, f"{me}.json")
    if full:
        os.environ["RANKWISE_COLLATERAL_TRACEBACKS"] = "1"
    del os.environ["WORLD_SIZE"]  # not a launch now: the body owns the group it makes

    def load_batch() -> int:
        if me == bad:
            raise OSError(f"shard {me}: batch 2 is unreadable")
        return 16

    with rw.distributed_run(device="cpu"):
        dist.init_process_group("gloo", init_method="env://", rank=me, world_size=world)
        rw.all_reduce("load_batch", load_batch, min)


@pytest.mark.parametrize("bad", [1, 3])
def test_torchrun_names_the_failing_rank_and_the_others_say_they_were_collateral(
    run_on_ranks: Any, tmp_path: Path, bad: int
) -> None:
    out = run_on_ranks(
        _own_group_aborting, str(tmp_path), bad, False, world_size=4, launch=True, timeout=60
    )
    assert [o.exit_code for o in out.ranks] == [ABORT_EXIT_CODE] * 4, out.report()
    failures = _failures(tmp_path, 4, ABORT_EXIT_CODE)
    assert _torchruns_root(failures) == bad
    root = failures[bad].message
    assert (
        isinstance(root, dict) and root["message"] == f"OSError: shard {bad}: batch 2 is unreadable"
    )
    assert "Traceback" in root["extraInfo"]["py_callstack"]
    assert "load_batch" in root["extraInfo"]["py_callstack"]  # where it failed
    said = f"all_reduce('load_batch'): rank {bad} raised OSError: shard {bad}: batch 2"
    for r in set(range(4)) - {bad}:
        theirs = failures[r].message
        assert isinstance(theirs, dict), theirs
        assert theirs["extraInfo"]["py_callstack"].startswith(f"collateral: {said}")
        assert failures[r].timestamp > failures[bad].timestamp
        assert "Traceback" not in out[r].output  # one line, not a traceback
        assert (
            f"rank {r} of 4 aborting the run (exit status {ABORT_EXIT_CODE}): collateral: {said}"
            in out[r].output
        )
        assert "RANKWISE_COLLATERAL_TRACEBACKS=1" in out[r].output
    assert "Traceback" in out[bad].output and "OSError: shard" in out[bad].output


def test_collateral_ranks_print_their_traceback_when_asked(
    run_on_ranks: Any, tmp_path: Path
) -> None:
    out = run_on_ranks(
        _own_group_aborting, str(tmp_path), 1, True, world_size=2, launch=True, timeout=60
    )
    assert out[0].ending is Ending.HARD_EXIT and out[0].exit_code == ABORT_EXIT_CODE
    assert "Traceback" in out[0].output
    assert "RuntimeError: all_reduce('load_batch'): rank 1 raised OSError" in out[0].output
    assert _torchruns_root(_failures(tmp_path, 2, ABORT_EXIT_CODE)) == 1


def _body_raises_alone(folder: str) -> None:
    """Rank 1's body raises outside any collective; rank 0 finishes its block."""
    world, me = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    os.environ["TORCHELASTIC_ERROR_FILE"] = os.path.join(folder, f"{me}.json")
    del os.environ["WORLD_SIZE"]
    with rw.distributed_run(device="cpu"):
        dist.init_process_group("gloo", init_method="env://", rank=me, world_size=world)
        if me == 1:
            raise KeyError("no such layer: 'lm_head'")


def test_a_body_raising_outside_a_collective_writes_its_own_entry(
    run_on_ranks: Any, tmp_path: Path
) -> None:
    run_on_ranks(_body_raises_alone, str(tmp_path), world_size=2, launch=True, timeout=60)
    entry = json.loads((tmp_path / "1.json").read_text())["message"]
    assert entry["message"] == "KeyError: \"no such layer: 'lm_head'\""
    assert "Traceback" in entry["extraInfo"]["py_callstack"]


def test_nothing_is_written_without_torchruns_error_file(run_on_ranks: Any, tmp_path: Path) -> None:
    """Outside torchrun (no TORCHELASTIC_ERROR_FILE) no file is written; the collateral rank
    still prints one line and the failing rank its traceback."""
    out = run_on_ranks(
        _own_group_aborting, str(tmp_path), 1, False, False, world_size=2, launch=True, timeout=60
    )
    assert [o.exit_code for o in out.ranks] == [ABORT_EXIT_CODE] * 2
    assert list(tmp_path.iterdir()) == []
    assert "Traceback" not in out[0].output and "collateral: all_reduce(" in out[0].output
    assert "Traceback" in out[1].output


# ---- torchrun itself (slow lane) ------------------------------------------------------------

CPU_JOB = """
import torch.distributed as dist
import rankwise as rw

dist.init_process_group("gloo")  # the caller's group: a CPU launch, as the demo runs


def load_batch():
    if rw.rank() == 1:
        raise OSError("shard 1: batch 2 is unreadable")
    return 16


rw.all_reduce("load_batch", load_batch, min)
"""


def _torchrun(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(script))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", *args, str(job)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def root_cause_section(stderr: str) -> str:
    """torchrun's summary from "Root Cause" to its closing rule."""
    assert "Root Cause (first observed failure):" in stderr, stderr[-4000:]
    return stderr.split("Root Cause (first observed failure):", 1)[1].split("=====", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_torchruns_summary_names_the_rank_whose_fn_failed(tmp_path: Path, world: int) -> None:
    result = _torchrun(tmp_path, CPU_JOB, "--nproc-per-node", str(world))
    assert result.returncode != 0
    root = root_cause_section(result.stderr)
    assert "rank      : 1 (local_rank: 1)" in root, result.stderr[-6000:]
    assert "OSError: shard 1: batch 2 is unreadable" in root
    assert "error_file: <N/A>" not in root
    failures = result.stderr.split("Failures:", 1)[1].split("Root Cause", 1)[0]
    assert (
        failures.count("collateral: all_reduce('load_batch'): rank 1 raised OSError") == world - 1
    )
    # Collateral ranks print one line each; the traceback is rank 1's alone.
    said = "collateral: all_reduce('load_batch'): rank 1 raised OSError: shard 1"
    assert result.stderr.count(said) >= 2 * (world - 1)  # its line, and its summary entry
    printed = result.stderr.split("Failures:", 1)[0]
    assert printed.count("RuntimeError: all_reduce('load_batch')") == 0
