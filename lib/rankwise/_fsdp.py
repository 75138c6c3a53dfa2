"""FSDP2 for Hugging Face causal LMs: find the decoder layers, shard each, then the root."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

# Where decoder stacks live when a model carries no metadata (Llama-likes, VLM language
# models, GPT-2, OPT/BART-style decoders, GPT-NeoX), tried in this order.
_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
    "layers",
    "transformer.h",
    "h",
    "model.decoder.layers",
    "decoder.layers",
    "gpt_neox.layers",
)


def is_fsdp2_model(model: nn.Module) -> bool:
    """Whether `model` or any of its submodules was sharded with FSDP2's fully_shard."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: by its own metadata first, else by known attribute paths.

    Only a causal LM's decoder stack counts: an encoder-decoder model, blocks that are not
    the members of one ModuleList (BERT's embeddings beside its layers, T5's two stacks), or
    one stack that is an encoder's, are refused as a layout it cannot read.
    """
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise _unreadable(model, "it is an encoder-decoder model (config.is_encoder_decoder)")
    named = _by_no_split_modules(model)
    if named:
        _check_one_decoder_stack(model, named)
        return named
    for path in _LAYER_PATHS:
        found = _get_path(model, path)
        if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0:
            return list(found)
    raise _unreadable(
        model,
        f"it has no _no_split_modules naming a submodule class, and none of the attribute "
        f"paths {', '.join(_LAYER_PATHS)} is a non-empty ModuleList",
    )


def _unreadable(model: nn.Module, why: str) -> RuntimeError:
    return RuntimeError(
        f"fsdp2_wrap: cannot find the decoder layers of {type(model).__name__}: {why}. It "
        f"shards a Hugging Face causal LM's decoder stack; shard other models with "
        f"torch.distributed.fsdp.fully_shard directly"
    )


def _check_one_decoder_stack(model: nn.Module, layers: list[nn.Module]) -> None:
    """The layers must be the members of one ModuleList (or Sequential) that is no encoder's."""
    stacks = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.Sequential))
        and any(child is layer for child in module.children() for layer in layers)
    }
    names = sorted({type(layer).__name__ for layer in layers})
    members = {id(child) for stack in stacks.values() for child in stack.children()}
    if len(stacks) != 1 or not all(id(layer) in members for layer in layers):
        raise _unreadable(
            model,
            f"the blocks its _no_split_modules name ({', '.join(names)}) are not one stack of "
            f"blocks ({', '.join(stacks) or 'none in a ModuleList'})",
        )
    (path,) = stacks
    if any("encoder" in part.lower() for part in path.split(".")):
        raise _unreadable(model, f"its one stack of blocks ({path}) is an encoder's")


def _by_no_split_modules(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        return []
    matches = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    decoders = [m for m in matches if "Decoder" in type(m).__name__]
    chosen = decoders or matches  # a VLM also names its vision blocks: prefer the decoder's
    return [m for m in chosen if not any(_contains(other, m) for other in chosen if other is not m)]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules() if m is not outer)


def _get_path(model: nn.Module, path: str) -> Any:
    current: Any = model
    for part in path.split("."):
        current = getattr(current, part, None)
        if current is None:
            return None
    return current


def off_dtype_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters whose dtype is not the model's dominant one (by element count).

    FSDP2 rejects a shard group that mixes dtypes, so these stay out of the wrap.
    """
    counts: Counter[torch.dtype] = Counter()
    for param in model.parameters():
        counts[param.dtype] += param.numel()
    if len(counts) < 2:
        return []
    dominant = counts.most_common(1)[0][0]
    return [p for p in model.parameters() if p.dtype != dominant]


def fsdp2_wrap(
    model: nn.Module,
    shard_root: bool = True,
    mp_policy: Any = None,
    cpu_offload: bool = False,
) -> list[nn.Module]:
    """Find a HF causal LM's decoder layers and FSDP2-shard each, then the root.

    Every shard, the root's too, is resharded after each forward, so embeddings, head and
    final norm are sharded between steps, not replicated. With `shard_root=False` the root
    (embeddings, head, final norm) stays replicated. Returns
    the detected layers. Parameters of a dtype other than the model's dominant one are left
    out of the shards, stay replicated, and are moved to the shards' compute device (which
    fully_shard does not do for parameters it ignores), also under CPU offload; on a model
    built on the meta device they stay there, for the caller to materialise with the rest.
    `config.architectures` is kept. `cpu_offload` keeps the shards in host memory between
    uses; on a machine without an accelerator the parameters are there already and it
    changes nothing.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if is_fsdp2_model(model):
        raise RuntimeError(
            f"fsdp2_wrap: {type(model).__name__} is already FSDP2-sharded; wrap a model once"
        )
    layers = decoder_layers(model)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fsdp2_wrap: sharding needs a process group, and none is set up: call it inside "
            "distributed_run() on a launch (torchrun), or after "
            "torch.distributed.init_process_group() (a one-rank group for a single process)"
        )
    config = getattr(model, "config", None)
    recorded = getattr(config, "architectures", None)
    architectures = list(recorded) if recorded else None
    ignored = set(off_dtype_params(model))
    # fully_shard's mesh is on the accelerator if there is one, else the CPU; on a CPU mesh
    # the parameters live on the CPU already: nothing to offload.
    offload = cpu_offload and _mesh_device_type() != "cpu"
    options: dict[str, Any] = {
        # Explicit for the root too: FSDP2 keeps a root unsharded after forward by default,
        # which would leave embeddings, head and norm whole on every rank between steps.
        "reshard_after_forward": True,
        "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    for layer in layers:
        fully_shard(layer, ignored_params=_within(layer, ignored) or None, **options)
    if shard_root:
        fully_shard(model, ignored_params=ignored or None, **options)
    _move_to_compute_device(ignored, _shards_device(model))
    if config is not None and architectures is not None:
        config.architectures = architectures
    return layers


def _within(module: nn.Module, params: set[nn.Parameter]) -> set[nn.Parameter]:
    own = {id(p) for p in module.parameters()}
    return {p for p in params if id(p) in own}


def _mesh_device_type() -> str:
    """The device type of the mesh fully_shard makes when given none: the accelerator's,
    where one is there to use. A CUDA build on a machine without a GPU (what a plain `pip
    install torch` gives a CPU runner) names "cuda" as its accelerator all the same."""
    if not torch.accelerator.is_available():
        return "cpu"
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"


def _shards_device(model: nn.Module) -> torch.device:
    """Where the shards compute: their mesh's device (this rank's current one of its type)."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            kind = param.device_mesh.device_type
            if kind == "cpu":
                return torch.device("cpu")
            module = getattr(torch, kind)
            return torch.device(kind, module.current_device())
    return torch.device("cpu")


def _move_to_compute_device(params: set[nn.Parameter], device: torch.device) -> None:
    """Put the replicated off-dtype parameters where the shards compute (also under offload).

    Parameters still on the meta device have no data to move: the caller materialises them
    later (`to_empty`, then a state dict), as it does the shards.
    """
    for param in params:
        if param.device != device and not param.is_meta:
            param.data = param.data.to(device)
