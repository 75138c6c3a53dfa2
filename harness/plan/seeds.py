"""The ranks' random seeds: one session seed, and each test's seed from it by one rule.

Before each test (and each run_on_ranks, spawn or rank_pool run) every rank seeds Python's
``random``, torch (CPU and CUDA) and numpy (when it is imported) with::

    session seed + crc32(the test's node id) + rank        # same_seed=True: without + rank

so rank 0 draws what a plain test draws under pytest-randomly with the same session seed,
the other ranks draw numbers of their own, and a failure that depends on them comes back
with the same session seed. The session seed is pytest-randomly's (``--randomly-seed``)
when it runs, else ``--rank-seed`` (ini ``rank_seed``), else one drawn at random; the header
and every failure report say which, and how to get it again. Under pytest-xdist the workers
take the controller's; under torchrun every rank takes rank 0's.

Imports no torch.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class SessionSeed:
    """The session's seed and where it came from: "pytest-randomly", "--rank-seed" (or the
    ini key), or "drawn"."""

    value: int
    source: str

    def how_to_repeat(self) -> str:
        """The option that gives the same seed again."""
        if self.source == "pytest-randomly":
            return f"-p randomly --randomly-seed={self.value}"
        return f"--rank-seed {self.value}"

    def header(self) -> str:
        return (
            f"harness: ranks seeded from {self.value} ({self.source}): seed + crc32(node id) "
            f"+ rank per test; {self.how_to_repeat()} repeats it"
        )

    def report_line(self) -> str:
        return f"ranks seeded from {self.value} ({self.source}; {self.how_to_repeat()} repeats it)"


WORKER_KEY = "harness_rank_seed"  # what an xdist worker is handed in its workerinput


def resolve(config: pytest.Config, given: int | None) -> SessionSeed:
    """The session's seed: the controller's for an xdist worker, pytest-randomly's when it
    runs, `given` (--rank-seed), else one drawn now."""
    worker = getattr(config, "workerinput", None)
    if isinstance(worker, dict) and isinstance(worker.get(WORKER_KEY), list):
        value, source = worker[WORKER_KEY]
        return SessionSeed(int(value), str(source))
    randomly = _randomly_seed(config)
    if randomly is not None:
        return SessionSeed(randomly, "pytest-randomly")
    if given is not None:
        return SessionSeed(given, "--rank-seed")
    return SessionSeed(int.from_bytes(os.urandom(4), "little"), "drawn")


def _randomly_seed(config: pytest.Config) -> int | None:
    """pytest-randomly's resolved seed, where it runs in this session."""
    if not config.pluginmanager.has_plugin("randomly"):
        return None
    value = getattr(config.option, "randomly_seed", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def for_test(session: SessionSeed, nodeid: str) -> int:
    """A test's seed (rank 0's), as pytest-randomly derives a plain test's."""
    return session.value + zlib.crc32(nodeid.encode())


class XdistHooks:
    """Hands each xdist worker the controller's seed, so every worker seeds alike."""

    def __init__(self, seed: SessionSeed) -> None:
        self._seed = seed

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput[WORKER_KEY] = [self._seed.value, self._seed.source]
