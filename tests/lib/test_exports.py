"""The public surface is exactly the specification's names, sorted, and nothing more."""

from __future__ import annotations

import pytest
import rankwise

SPEC_NAMES = [
    "DistributedProcessGroup",
    "DistributedState",
    "DistributionPlan",
    "ParallelState",
    "all_reduce",
    "backend",
    "barrier",
    "broadcast_from",
    "distributed_run",
    "distribution_plan",
    "fsdp2_wrap",
    "gather_bytes",
    "gather_state_dicts",
    "is_available",
    "is_distributed_launch",
    "is_distributed_run",
    "is_fsdp2_model",
    "is_initialized",
    "is_master",
    "rank",
    "set_distribution_plan",
    "size",
]


@pytest.mark.unit
def test_rankwise_exports_the_spec_names_sorted() -> None:
    assert rankwise.__all__ == sorted(SPEC_NAMES)
    assert all(getattr(rankwise, name).__doc__ for name in rankwise.__all__)
    public = {n for n in vars(rankwise) if not n.startswith("_")}
    # rankwise.testing is an attribute once a tool (the harness) imported it: no API name.
    assert public - {"testing"} == set(SPEC_NAMES) | {"annotations"}


def test_the_tools_module_is_apart_from_the_api() -> None:
    """rankwise.testing (for harnesses: named points, the wire format) is no part of the API:
    the library never imports it, so `import rankwise` and its use leave it unloaded."""
    import subprocess
    import sys

    code = (
        "import sys, rankwise\n"
        "rankwise.all_reduce('x', lambda: 1, sum)\n"
        "rankwise.broadcast_from('y', lambda: {'a': 1})\n"
        "print('rankwise.testing' in sys.modules, sorted(n for n in vars(rankwise) "
        "if not n.startswith('_') and n not in rankwise.__all__))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert found.stdout.strip() == "False ['annotations']"
    from rankwise import testing

    assert testing.__all__ == sorted(testing.__all__)
    assert all(getattr(testing, name).__doc__ for name in testing.__all__ if name != "Observer")
