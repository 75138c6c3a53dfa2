"""fsdp2_wrap on tiny HF models, gloo/CPU: same logits and same step as the unsharded model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import rankwise as rw
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from tests.lib.tiny_models import ARCHITECTURES, build, tokens

# fp32 models: the sharded forward and step are the same computation, up to summation order.

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits.float().pow(2).mean()


def _check_same_logits_and_step(model: nn.Module, reference: nn.Module, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    # Optimizers first: after a forward FSDP2 registers the root's unsharded tensors for a
    # while, and an optimizer built then would step copies that resharding throws away.
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    ids = tokens()  # the same batch on every rank: the averaged gradient is the reference's
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=rtol, atol=atol
        )
    for m, optimizer in zip((model, reference), optimizers, strict=True):
        _loss(m, ids).backward()
        optimizer.step()
    ours = dict(model.named_parameters())
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(
            _full(ours[name]),
            expected.detach(),
            rtol=rtol,
            atol=atol,
            msg=lambda m, n=name: f"{n}: {m}",
        )


@pytest.mark.ranks(2, 4, timeout=120)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_wrapped_model_matches_the_unsharded_one(arch: str, rank: int) -> None:
    model = build(arch)
    reference = copy.deepcopy(model)
    dtype = next(model.parameters()).dtype if arch != "moe" else torch.bfloat16
    layers = rw.fsdp2_wrap(model)
    assert layers and all(isinstance(layer, FSDPModule) for layer in layers)
    assert isinstance(model, FSDPModule) and rw.is_fsdp2_model(model)
    assert "Decoder" in type(layers[0]).__name__ or type(layers[0]).__name__.endswith("GPT2Block")
    _check_same_logits_and_step(model, reference, dtype)


@pytest.mark.ranks(2, timeout=120)
def test_moe_router_weights_stay_fp32_and_replicated(rank: int) -> None:
    model = build("moe")
    routers = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert routers and all(n.endswith("mlp.gate.weight") for n in routers)
    rw.fsdp2_wrap(model)
    for name, param in model.named_parameters():
        if name in routers:
            assert not isinstance(param, DTensor) and param.dtype == torch.float32, name
            assert param.device.type == "cpu"  # the shards' compute device here
        else:
            assert isinstance(param, DTensor), name


@pytest.mark.ranks(2, timeout=120)
def test_shard_root_false_leaves_the_root_replicated(rank: int) -> None:
    model = build("llama")
    reference = copy.deepcopy(model)
    layers = rw.fsdp2_wrap(model, shard_root=False)
    assert not isinstance(model, FSDPModule) and all(isinstance(x, FSDPModule) for x in layers)
    assert not isinstance(model.model.embed_tokens.weight, DTensor)
    assert rw.is_fsdp2_model(model)
    _check_same_logits_and_step(model, reference, torch.float32)


@pytest.mark.ranks(2, timeout=120)
def test_bf16_mixed_precision_policy(rank: int) -> None:
    model = build("llama")
    reference = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rw.fsdp2_wrap(model, mp_policy=policy)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # sharded params stay fp32
    ids = tokens()
    with torch.no_grad():
        got, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert got.dtype == torch.bfloat16  # computed in bf16
    torch.testing.assert_close(got.float(), expected, rtol=5e-2, atol=5e-2)


@pytest.mark.ranks(2, timeout=120)
@pytest.mark.parametrize("build_kind", ["CPU build", "CUDA build without a GPU"])
def test_cpu_offload_without_an_accelerator_changes_nothing(rank: int, build_kind: str) -> None:
    """A CUDA build on a machine without a GPU (what `pip install torch` gives a CPU runner)
    names "cuda" as its accelerator, unavailable: offloading pinned memory for it raised
    "Found no NVIDIA driver". Its answer is played here on the CPU build; the versions lane
    runs this test on PyPI's CUDA build itself."""
    real = torch.accelerator.current_accelerator
    if build_kind != "CPU build":
        torch.accelerator.current_accelerator = lambda check_available=False: (  # type: ignore[assignment]
            None if check_available else torch.device("cuda")
        )
    try:
        model = build("moe")
        reference = copy.deepcopy(model)
        rw.fsdp2_wrap(model, cpu_offload=True)
    finally:
        torch.accelerator.current_accelerator = real  # type: ignore[assignment]
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert sharded and all(p.to_local().device.type == "cpu" for p in sharded)
    _check_same_logits_and_step(model, reference, torch.bfloat16)


@pytest.mark.ranks(2, timeout=120)
def test_config_architectures_are_kept(rank: int) -> None:
    model = build("qwen2")
    model.config.architectures = ["Qwen2ForCausalLM"]
    rw.fsdp2_wrap(model)
    assert model.config.architectures == ["Qwen2ForCausalLM"]


@pytest.mark.ranks(2)
def test_wrapping_twice_is_refused(rank: int) -> None:
    model = build("llama")
    rw.fsdp2_wrap(model)
    with pytest.raises(RuntimeError, match="already FSDP2-sharded"):
        rw.fsdp2_wrap(model)


def test_a_model_it_cannot_read_says_what_it_looked_for() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"cannot find the decoder layers of Sequential.*model\.layers.*transformer\.h",
    ):
        rw.fsdp2_wrap(nn.Sequential(nn.Linear(2, 2)))


def test_layers_are_found_by_attribute_path_without_metadata() -> None:
    from rankwise._fsdp import decoder_layers

    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.Module()
            self.transformer.h = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    bare = Bare()
    assert decoder_layers(bare) == list(bare.transformer.h)


def test_off_dtype_params_are_chosen_by_element_count() -> None:
    from rankwise._fsdp import off_dtype_params

    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(2, 2).to(torch.float64))
    assert off_dtype_params(model) == list(model[1].parameters())
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(100, 100).to(torch.float64))
    assert off_dtype_params(model) == list(model[0].parameters())


def test_is_fsdp2_model_on_a_plain_model() -> None:
    assert not rw.is_fsdp2_model(build("gpt2"))


@pytest.mark.gpu
@pytest.mark.ranks(1, 2, backend="nccl", timeout=180)
@pytest.mark.parametrize("arch", ["llama", "moe"])
def test_wrap_on_nccl_with_cuda(arch: str, rank: int, device: Any) -> None:
    model = build(arch).to(device)
    reference = copy.deepcopy(model)
    rw.fsdp2_wrap(model)
    ids = tokens().to(device)
    rtol, atol = TOLERANCE[torch.bfloat16 if arch == "moe" else torch.float32]
    with torch.no_grad():
        got, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
    assert dist.get_backend() == "nccl"


@pytest.mark.gpu
@pytest.mark.ranks(1, 2, backend="nccl", timeout=180)
def test_cpu_offload_on_cuda_keeps_off_dtype_params_on_the_gpu(rank: int, device: Any) -> None:
    model = build("moe").to(device)
    reference = copy.deepcopy(model)
    rw.fsdp2_wrap(model, cpu_offload=True)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            assert param.to_local().device.type == "cpu", name  # offloaded shards
        else:
            assert param.device == device and param.dtype == torch.float32, name  # router
    ids = tokens().to(device)
    with torch.no_grad():
        got, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


# ---- the upstream caller's flow: build on meta, wrap, materialise, load ------------------------


@pytest.mark.ranks(2, 4, timeout=120)
def test_a_meta_model_of_mixed_dtypes_is_wrapped_then_loaded(rank: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    reference = build("moe")
    with torch.device("meta"):
        model = build("moe")
    rw.fsdp2_wrap(model)  # the fp32 router stays out of the shards, and on meta for now
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    set_model_state_dict(
        model, reference.state_dict(), options=StateDictOptions(full_state_dict=True)
    )
    for name, buffer in reference.named_buffers():  # non-persistent buffers (rotary tables)
        model.get_buffer(name).copy_(buffer)
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=2e-2, atol=2e-2
        )


@pytest.mark.ranks(2, timeout=120)
def test_the_root_is_sharded_again_after_a_forward(rank: int) -> None:
    model = build("llama")
    rw.fsdp2_wrap(model)
    with torch.no_grad():
        model(input_ids=tokens())
    root = [model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight]
    assert all(isinstance(p, DTensor) for p in root)  # sharded, not left whole after forward


# ---- what it refuses --------------------------------------------------------------------------


def _non_causal(kind: str) -> nn.Module:
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    if kind == "t5":
        config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2)
        return T5ForConditionalGeneration(config)
    bert = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32,
    )  # fmt: skip
    return BertModel(bert) if kind == "bert" else BertForMaskedLM(bert)


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("t5", "encoder-decoder"),
        ("bert", "not one stack of blocks"),
        ("bertmlm", "not one stack of blocks"),
    ],
)
def test_a_model_that_is_no_causal_lm_is_refused(kind: str, why: str) -> None:
    """T5's encoder blocks were taken for decoder layers, BertModel's embeddings for one, and
    BertForMaskedLM then failed inside torch with a shared-parameter error."""
    model = _non_causal(kind)
    with pytest.raises(RuntimeError, match=r"fsdp2_wrap: cannot find the decoder layers of") as no:
        rw.fsdp2_wrap(model)
    assert why in str(no.value), str(no.value)
    assert not rw.is_fsdp2_model(model)


def test_an_encoders_one_stack_of_blocks_is_refused() -> None:
    from rankwise._fsdp import decoder_layers

    model = _non_causal("bert")
    model._no_split_modules = ["BertLayer"]  # only the blocks named: still an encoder's
    with pytest.raises(RuntimeError, match=r"encoder\.layer.*an encoder's"):
        decoder_layers(model)


def test_without_a_process_group_it_says_it_needs_one() -> None:
    """torch's own words were "env:// ... RANK expected"."""
    with pytest.raises(RuntimeError, match=r"fsdp2_wrap: .*needs a process group") as no:
        rw.fsdp2_wrap(build("llama"))
    assert "distributed_run" in str(no.value)


@pytest.mark.ranks(2, timeout=120)
def test_off_dtype_params_go_to_the_shards_device_on_a_machine_with_cuda(
    rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They went to cuda:current_device() whenever CUDA existed, not where the shards are, so
    a gloo/CPU mesh on a GPU machine failed at the first forward."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, CPU mesh
    model = build("moe")
    rw.fsdp2_wrap(model)
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            assert param.device.type == "cpu", name
