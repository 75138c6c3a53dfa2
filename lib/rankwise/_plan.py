"""How a model is placed over a run's ranks, recorded on the model itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn as nn

from rankwise._launch import is_distributed_run, is_initialized, size

DENSE_PLACEMENTS = ("replicate", "fsdp")
# A plain attribute, not a buffer: copied by deepcopy, kept by fully_shard (which only swaps
# the class) and by torch.compile (which wraps), and never part of state_dict.
_ATTRIBUTE = "_rankwise_distribution_plan"


@dataclass(frozen=True)
class DistributionPlan:
    """How a model is distributed: over `world_size` ranks, experts over `ep_size`, and the rest.

    `dense` places everything but the routed experts: "replicate" gives every rank a whole
    copy, "fsdp" shards it with FSDP2. Every rank calibrates on its own data, so data
    parallelism spans the world, and each expert shard is held by `edp` ranks.
    """

    world_size: int = 1
    ep_size: int = 1
    dense: Literal["replicate", "fsdp"] = "replicate"

    def __post_init__(self) -> None:
        for name in ("world_size", "ep_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DistributionPlan: {name} must be a positive int; got {value!r}")
        if self.world_size % self.ep_size:
            raise ValueError(
                f"DistributionPlan: ep_size {self.ep_size} must divide world_size "
                f"{self.world_size} (each expert shard is replicated world_size / ep_size times)"
            )
        if self.dense not in DENSE_PLACEMENTS:
            raise ValueError(
                f"DistributionPlan: dense must be 'replicate' or 'fsdp'; got {self.dense!r}"
            )

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: how many ranks hold a replica of each expert shard."""
        return self.world_size // self.ep_size

    @property
    def is_expert_parallel(self) -> bool:
        """Whether routed experts are sharded across ranks."""
        return self.ep_size > 1

    @property
    def is_fsdp_dense(self) -> bool:
        """Whether the dense part is FSDP2-sharded rather than replicated."""
        return self.dense == "fsdp"


def _module(what: str, model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{what}: model must be a torch.nn.Module (the model, or a submodule of it); got "
            f"{type(model).__name__}"
        )
    return model


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module a torch.compile wrapper stands for (itself otherwise)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def set_distribution_plan(model: nn.Module, plan: DistributionPlan) -> None:
    """Record that `model` is distributed as `plan`, on it and on every submodule it has now.

    A model is distributed once: if it or any submodule already records a plan (the same
    one included), this raises and changes nothing. In a run of several ranks a plan for
    another number of ranks raises too; before the group exists, or in a run of one, the
    plan is taken as given.
    """
    if not isinstance(plan, DistributionPlan):
        raise TypeError(f"set_distribution_plan: plan must be a DistributionPlan; got {plan!r}")
    model = _unwrapped(_module("set_distribution_plan", model))
    recorded = [(name, m) for name, m in model.named_modules() if _ATTRIBUTE in vars(m)]
    if recorded:
        name, holder = recorded[0]
        raise RuntimeError(
            f"set_distribution_plan: {f'submodule {name!r}' if name else 'the model'} already "
            f"records {vars(holder)[_ATTRIBUTE]!r}; a model is distributed once: record its "
            f"plan where it is distributed, and do not reload or re-distribute it"
        )
    if is_initialized() and size() > 1 and plan.world_size != size():
        raise ValueError(
            f"set_distribution_plan: the plan is for {plan.world_size} rank(s) but this run "
            f"has {size()}; build the plan with world_size={size()}"
        )
    for module in model.modules():
        setattr(module, _ATTRIBUTE, plan)


def distribution_plan(model: nn.Module) -> DistributionPlan:
    """The plan recorded on `model`; a model without one is a single process's.

    Unless it shows otherwise: a model without a plan that is FSDP2-sharded (or holds
    sharded parameters, as a leaf of a sharded model does), or held in a run of several
    ranks, raises instead of being taken for a single process's.
    """
    model = _unwrapped(_module("distribution_plan", model))
    plan = vars(model).get(_ATTRIBUTE)
    if isinstance(plan, DistributionPlan):
        return plan
    why = _why_not_single_process(model)
    if why:
        raise RuntimeError(
            f"distribution_plan: {type(model).__name__} records no plan but {why}; record it "
            f"where the model is distributed: set_distribution_plan(model, DistributionPlan("
            f"world_size=...)). A module added to a model after its plan was recorded has "
            f"none: read the plan off the model it was added to"
        )
    return DistributionPlan()


def _why_not_single_process(model: nn.Module) -> str:
    """Why a model without a plan is not a single process's ("" when nothing shows it is
    not): sharded by FSDP2, its parameters sharded (DTensors: a leaf of a sharded model is
    not wrapped itself), or held in a run of several ranks."""
    from rankwise._fsdp import is_fsdp2_model

    if is_fsdp2_model(model):
        return "is FSDP2-sharded"
    sharded = _dtensor_class()
    if sharded is not None and any(isinstance(p, sharded) for p in model.parameters()):
        return "holds sharded (DTensor) parameters"
    if is_distributed_run():
        return f"is held in a run of {size()} ranks"
    return ""


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: nothing is sharded
        return None
    return DTensor
