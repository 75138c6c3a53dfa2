"""Places in torch's own modules that keep a test's process groups alive after it.

A rank whose torn-down group is still referenced ends after the test (its sockets would
stay open under a peer waiting on it) and is replaced. Two kinds of references held groups
after every FSDP2 and DTensor test (found by a probe, each confirmed by leaving it out):

- DTensor's caches keep the DeviceMesh (whose `_pg_registry` holds the groups): the
  redistribute planner cache, the transform-info cache and the C++ sharding-propagation
  cache. DeviceMesh compares equal without its groups, so the first mesh of each shape a
  process caches stays for good.
- Functions whose default argument is `group.WORLD`, evaluated when their module is first
  imported (torch.distributed.nn.functional, reached from torch.distributed.fsdp and
  torch._dynamo): imported while a group is up, they hold that group for the process's life.
  None means the default group to them, as it does when imported with no group up.

`release` empties the caches and resets those defaults after the test's groups are
destroyed; about 0.3 ms. Runs inside ranks.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

_MODULES_WITH_WORLD_DEFAULTS = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
)


def let_go() -> None:
    """Drop what torch's modules still hold of destroyed process groups (only modules the
    process has imported are looked at)."""
    _clear_dtensor_caches()
    for name in _MODULES_WITH_WORLD_DEFAULTS:
        module = sys.modules.get(name)
        if module is not None:
            _reset_group_defaults(module)


def _clear_dtensor_caches() -> None:
    modules = sys.modules
    api = modules.get("torch.distributed.tensor._api")
    if api is not None:
        with contextlib.suppress(Exception):  # another torch: its caches are its own
            propagator = api.DTensor._op_dispatcher.sharding_propagator
            propagator.propagate_op_sharding.cache_clear()  # this thread's
            propagator._propagate_tensor_meta_cached.cache_clear()
        with contextlib.suppress(Exception):
            torch._C._clear_DTensor_sharding_propagator_cache()
    redistribute = modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None:
        with contextlib.suppress(Exception):
            redistribute.clear_redistribute_planner_cache()
        with contextlib.suppress(Exception):
            redistribute._gen_transform_infos.cache_clear()
    collective_utils = modules.get("torch.distributed.tensor._collective_utils")
    if collective_utils is not None:
        with contextlib.suppress(Exception):
            collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def _reset_group_defaults(module: types.ModuleType) -> None:
    """A process group as a default argument of `module`'s functions (and its own classes'
    methods) becomes None."""
    group_type: Any = dist.ProcessGroup
    for value in list(vars(module).values()):
        if isinstance(value, types.FunctionType):
            functions = [value]
        elif isinstance(value, type) and value.__module__ == module.__name__:
            functions = [f for f in vars(value).values() if isinstance(f, types.FunctionType)]
        else:
            continue
        for function in functions:
            defaults = function.__defaults__
            if defaults and any(isinstance(d, group_type) for d in defaults):
                function.__defaults__ = tuple(
                    None if isinstance(d, group_type) else d for d in defaults
                )
            keywords = function.__kwdefaults__
            if keywords and any(isinstance(d, group_type) for d in keywords.values()):
                function.__kwdefaults__ = {
                    k: None if isinstance(d, group_type) else d for k, d in keywords.items()
                }
