"""Starting 4 ranks for a test module that imports transformers: each rank importing it
(--rank-preload none) against the fork server having imported it once (auto, the default),
beside the bare start (a module that imports only torch), in one run.

Three tests per session: the first (the session's fork server and 4 fresh ranks), one whose
rank 1 dies (the ranks are replaced) and the next (4 replacement ranks). Rounds alternate
the three kinds, so each sees the same machine. Target: with the preload, starting 4 ranks
within 1.5x of the bare start; the first test pays the session's one import (reported).
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from benchmarks._common import print_and_exit, run_pytest

ROUNDS = 3
TARGET = 1.5
WORLD = 4

_IMPORTS = {
    "bare": "import torch",
    "transformers": "import torch\nfrom transformers import LlamaConfig, LlamaForCausalLM",
}
_TESTS = """
import os
import pytest
{imports}


@pytest.mark.ranks({world})
def test_first(rank):
    pass


@pytest.mark.ranks({world})
def test_rank_1_dies(rank):
    if rank == 1:
        os._exit(3)


@pytest.mark.ranks({world})
def test_replaced(rank):
    pass
"""
KINDS = (("bare", "auto"), ("transformers", "none"), ("transformers", "auto"))
EXPECTED = {"test_first": "passed", "test_rank_1_dies": "failed", "test_replaced": "passed"}


def _name(nodeid: str) -> str:
    return nodeid.rsplit("::", 1)[-1].split("[")[0]


def _one(imports: str, preload: str) -> dict[str, float]:
    source = _TESTS.format(imports=_IMPORTS[imports], world=WORLD)
    found = run_pytest(source, ["-p", "harness", "--rank-preload", preload])
    outcomes = {_name(k): v for k, v in found["outcomes"].items()}
    if outcomes != EXPECTED:
        sys.exit(f"{imports}/{preload}: unexpected outcomes {outcomes} {found['messages']}")
    times = {_name(k): v for k, v in found["times"].items()}
    return {"first": times["test_first"], "replaced": times["test_replaced"]}


def measure() -> dict[tuple[str, str], dict[str, list[float]]]:
    results: dict[tuple[str, str], dict[str, list[float]]] = {
        kind: {"first": [], "replaced": []} for kind in KINDS
    }
    for _ in range(ROUNDS):
        for kind in KINDS:
            for phase, took in _one(*kind).items():
                results[kind][phase].append(took)
    return results


def main() -> list[str]:
    results = measure()
    median: dict[Any, float] = {
        (kind, phase): statistics.median(values)
        for kind, phases in results.items()
        for phase, values in phases.items()
    }
    lines = [
        f"{WORLD} ranks, median of {ROUNDS} alternating rounds; a test's wall time, pytest's "
        f"set-up and teardown included.",
        "",
        "| test module imports | --rank-preload | first test (fork server + 4 ranks) "
        "| test after a rank died (4 new ranks) |",
        "|---|---|---|---|",
    ]
    for kind in KINDS:
        first, replaced = median[kind, "first"], median[kind, "replaced"]
        lines.append(f"| {kind[0]} | {kind[1]} | {first:.2f} s | {replaced:.2f} s |")
    bare, auto, none = ("bare", "auto"), ("transformers", "auto"), ("transformers", "none")
    ratio = median[auto, "replaced"] / median[bare, "replaced"]
    before = median[none, "replaced"] / median[bare, "replaced"]
    first = median[auto, "first"] / median[bare, "first"]
    first_before = median[none, "first"] / median[bare, "first"]
    lines += [
        f"- {'HOLDS' if ratio <= TARGET else 'MISSED'}: starting 4 ranks for the module that "
        f"imports transformers within {TARGET}x of the bare start ({ratio:.2f}x; "
        f"{before:.2f}x with each rank importing it)",
        f"- the first test also pays the session's one import of transformers, in the fork "
        f"server: {first:.2f}x the bare first test ({first_before:.2f}x with each rank "
        f"importing it)",
    ]
    return lines


if __name__ == "__main__":
    print_and_exit(main())
