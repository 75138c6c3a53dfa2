"""Tiny Hugging Face models built from configs (never downloaded), one per architecture."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

ARCHITECTURES = ("llama", "qwen2", "moe", "gpt2", "vlm")
VOCAB = 128


def _decoder_config(**extra: Any) -> dict[str, Any]:
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        **extra,
    }


def build(arch: str, seed: int = 0) -> nn.Module:
    """The same weights on every rank for the same seed."""
    torch.manual_seed(seed)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**_decoder_config()))
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**_decoder_config()))
    if arch == "moe":
        return _moe_with_fp32_router()
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                n_embd=32,
                n_layer=2,
                n_head=4,
                vocab_size=VOCAB,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=1,
                resid_pdrop=0.0,  # no dropout: the sharded and reference runs must agree
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    if arch == "vlm":
        from transformers import (
            CLIPVisionConfig,
            LlamaConfig,
            LlavaConfig,
            LlavaForConditionalGeneration,
        )

        vision = CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        )
        config = LlavaConfig(vision_config=vision, text_config=LlamaConfig(**_decoder_config()))
        return LlavaForConditionalGeneration(config)
    raise ValueError(f"unknown architecture {arch!r}")


def _moe_with_fp32_router() -> nn.Module:
    """A DeepSeek-V3-style MoE in bf16 whose router weights stay fp32, as in the real model."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        **_decoder_config(
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
        )
    )
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.data = param.data.float()
    return model


def tokens(seed: int = 1, batch: int = 2, length: int = 8) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)
