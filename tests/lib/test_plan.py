"""DistributionPlan and its recording: every rule of the spec, on 4 ranks and at 4096 (fake)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import rankwise as rw
import torch
import torch.nn as nn
from rankwise import DistributionPlan

# ---- the plan value -------------------------------------------------------------------------


def test_defaults_and_derived_properties() -> None:
    plan = DistributionPlan()
    assert (plan.world_size, plan.ep_size, plan.dense) == (1, 1, "replicate")
    assert (plan.edp, plan.is_expert_parallel, plan.is_fsdp_dense) == (1, False, False)
    plan = DistributionPlan(world_size=8, ep_size=4, dense="fsdp")
    assert (plan.edp, plan.is_expert_parallel, plan.is_fsdp_dense) == (2, True, True)


def test_a_plan_is_frozen() -> None:
    with pytest.raises(AttributeError):
        DistributionPlan().world_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be a positive int; got 0"),
        ({"ep_size": -1}, "ep_size must be a positive int; got -1"),
        ({"world_size": 2.0}, "world_size must be a positive int; got 2.0"),
        ({"world_size": 6, "ep_size": 4}, "ep_size 4 must divide world_size 6"),
        ({"dense": "tp"}, "dense must be 'replicate' or 'fsdp'; got 'tp'"),
    ],
)
def test_invalid_plans_say_what_is_allowed(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DistributionPlan(**kwargs)


# ---- recording, single process ---------------------------------------------------------


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))


def test_recorded_on_the_model_and_every_submodule() -> None:
    model = _model()
    plan = DistributionPlan(world_size=4, dense="fsdp")
    rw.set_distribution_plan(model, plan)  # no group yet: not checked against a run
    assert all(rw.distribution_plan(m) is plan for m in model.modules())


def test_recording_again_raises_and_changes_nothing() -> None:
    model = _model()
    first = DistributionPlan(world_size=2)
    rw.set_distribution_plan(model, first)
    for again in (first, DistributionPlan(world_size=4)):
        with pytest.raises(RuntimeError, match="the model already records DistributionPlan"):
            rw.set_distribution_plan(model, again)
    assert all(rw.distribution_plan(m) is first for m in model.modules())


def test_a_submodule_that_records_a_plan_blocks_the_model() -> None:
    model = _model()
    rw.set_distribution_plan(model[1], DistributionPlan(world_size=2))
    with pytest.raises(RuntimeError, match="submodule '1' already records"):
        rw.set_distribution_plan(model, DistributionPlan(world_size=2))
    assert rw.distribution_plan(model) == DistributionPlan()  # the model itself still has none
    assert "_rankwise_distribution_plan" not in vars(model[0])


def test_a_model_without_a_plan_is_a_single_processs() -> None:
    assert rw.distribution_plan(_model()) == DistributionPlan()


def test_a_plan_survives_deepcopy_and_compile_and_stays_out_of_state_dict() -> None:
    model = _model()
    plan = DistributionPlan(world_size=2, ep_size=2)
    rw.set_distribution_plan(model, plan)
    assert rw.distribution_plan(copy.deepcopy(model)) == plan
    assert rw.distribution_plan(copy.deepcopy(model)[1][0]) == plan
    assert rw.distribution_plan(torch.compile(model)) == plan
    assert all("plan" not in key for key in model.state_dict())
    assert set(model.state_dict()) == set(_model().state_dict())


def test_a_plan_must_be_a_plan() -> None:
    with pytest.raises(TypeError, match="plan must be a DistributionPlan"):
        rw.set_distribution_plan(_model(), {"world_size": 2})  # type: ignore[arg-type]


# ---- in a run of several ranks ---------------------------------------------------------


@pytest.mark.ranks(4)
def test_in_a_run_of_4_a_plan_for_another_size_raises_and_records_nothing(rank: int) -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"the plan is for 2 rank\(s\) but this run has 4"):
        rw.set_distribution_plan(model, DistributionPlan(world_size=2))
    with pytest.raises(RuntimeError, match="records no plan but is held in a run of 4 ranks"):
        rw.distribution_plan(model)  # nothing was recorded
    rw.set_distribution_plan(model, DistributionPlan(world_size=4, ep_size=2))
    assert rw.distribution_plan(model[1][0]).edp == 2


@pytest.mark.ranks(4)
def test_a_module_added_after_the_plan_has_none(rank: int) -> None:
    model = _model()
    rw.set_distribution_plan(model, DistributionPlan(world_size=4))
    model.add_module("head", nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="read the plan off the model it was added to"):
        rw.distribution_plan(model.head)
    assert rw.distribution_plan(model).world_size == 4


@pytest.mark.ranks(2, timeout=120)
def test_a_sharded_model_without_a_plan_raises_and_one_with_a_plan_keeps_it(rank: int) -> None:
    from tests.lib.tiny_models import build

    unplanned = build("llama")
    rw.fsdp2_wrap(unplanned)
    with pytest.raises(RuntimeError, match="records no plan but is FSDP2-sharded"):
        rw.distribution_plan(unplanned)
    planned = build("llama")
    plan = DistributionPlan(world_size=2, dense="fsdp")
    rw.set_distribution_plan(planned, plan)
    rw.fsdp2_wrap(planned)  # fully_shard swaps classes: the plan stays
    assert rw.distribution_plan(planned) == plan
    assert rw.distribution_plan(planned.model.layers[0]) == plan


@pytest.mark.ranks(1)
def test_a_leaf_of_a_sharded_model_without_a_plan_raises_in_a_run_of_one(rank: int) -> None:
    # Not wrapped itself, but its parameters are the sharded model's DTensors: no single
    # process's module, whatever the run's size.
    from torch.distributed.fsdp import fully_shard

    unplanned = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))
    fully_shard(unplanned[0])
    fully_shard(unplanned)
    leaf = unplanned[0][0]
    assert not rw.is_fsdp2_model(leaf)
    with pytest.raises(RuntimeError, match="records no plan but holds sharded"):
        rw.distribution_plan(leaf)


def _single_rank_run_takes_any_plan() -> int:
    model = _model()
    rw.set_distribution_plan(model, DistributionPlan(world_size=8))  # a rank can stand for 8
    return rw.distribution_plan(model).world_size


def test_a_run_of_one_does_not_check(run_on_ranks: Any) -> None:
    assert run_on_ranks(_single_rank_run_takes_any_plan, world_size=1).values == [8]


# ---- at scale, in one process -----------------------------------------------------------


def test_plan_rules_at_4096_ranks(fake_world: Any) -> None:
    fake_world(4096, rank=17)
    model = _model()
    with pytest.raises(ValueError, match="this run has 4096"):
        rw.set_distribution_plan(model, DistributionPlan(world_size=4095))
    with pytest.raises(RuntimeError, match="held in a run of 4096 ranks"):
        rw.distribution_plan(model)
    plan = DistributionPlan(world_size=4096, ep_size=64, dense="fsdp")
    rw.set_distribution_plan(model, plan)
    assert rw.distribution_plan(model[1]).edp == 64
    with pytest.raises(RuntimeError, match="already records"):
        rw.set_distribution_plan(model, plan)
