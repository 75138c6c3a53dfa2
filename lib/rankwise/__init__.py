"""rankwise: torch.distributed utilities that never leave a rank waiting.

The public API is exactly the names below; everything else lives in private modules.
"""

# ruff: noqa: E402  # the torch version is checked before the imports that need it

from __future__ import annotations

__all__ = [
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

from rankwise import _versions

_versions.require_torch()  # before the modules that use what an older torch lacks

from rankwise._collectives import all_reduce, broadcast_from
from rankwise._fsdp import fsdp2_wrap, is_fsdp2_model
from rankwise._gather import gather_bytes, gather_state_dicts
from rankwise._groups import DistributedProcessGroup, ParallelState
from rankwise._launch import (
    backend,
    barrier,
    is_available,
    is_distributed_launch,
    is_distributed_run,
    is_initialized,
    is_master,
    rank,
    size,
)
from rankwise._plan import DistributionPlan, distribution_plan, set_distribution_plan
from rankwise._run import DistributedState, distributed_run


def __getattr__(name: str) -> str:
    """`__version__`: the distribution's, from its installed metadata (pyproject.toml's),
    read when first asked for (a metadata lookup costs tens of ms at every import)."""
    if name != "__version__":
        raise AttributeError(f"module 'rankwise' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rankwise")
    except PackageNotFoundError:  # imported from a source tree nobody installed
        return "0+unknown"
