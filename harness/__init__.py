"""harness: a pytest plugin that runs tests on real torch.distributed ranks.

Load it with ``pytest -p harness`` (or let the ``pytest11`` entry point load it). Mark a test
``@pytest.mark.ranks`` to run its body on every rank, or ask for the ``run_on_ranks`` fixture
to run a function on the ranks and inspect every rank's outcome from the pytest process.

Importing this package does not import torch; the ranks start when a test first needs them.
"""

from __future__ import annotations

from harness.outcome import Ending, RankOutcome
from harness.plugin import RankRunner, WorldOutcome

__all__ = ["Ending", "RankOutcome", "RankRunner", "WorldOutcome"]

# pytest registers harness.plugin (hooks and fixtures) when it registers this module.
pytest_plugins = ["harness.plugin"]
