"""Tiny random-weight models of each family of catalog/families.yaml, made offline from Transformers' own config
classes (the family's real architecture, its dimensions scaled down to build in seconds on 2 CPU cores), with the
tokenizer of the shared tiny model (512 tokens)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tests.shared_data import TINY_MODEL

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Every Linear's in_features (64, 128) divisible by group sizes up to 64; 2 layers, grouped-query attention.
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
# 4 experts, 2 per token.
_MOE = dict(num_experts_per_tok=2, intermediate_size=128)


def tiny_config(family: str) -> PretrainedConfig:
    """The family's Transformers config, its dimensions scaled down (no weights: a shape run draws its own)."""
    import transformers as t

    make: dict[str, Callable[[], object]] = {
        "llama": lambda: t.LlamaConfig(intermediate_size=128, **_COMMON),
        "qwen2": lambda: t.Qwen2Config(intermediate_size=128, **_COMMON),
        "qwen3": lambda: t.Qwen3Config(intermediate_size=128, head_dim=16, **_COMMON),
        "mistral": lambda: t.MistralConfig(intermediate_size=128, sliding_window=16, **_COMMON),
        "gemma2": lambda: t.Gemma2Config(intermediate_size=128, head_dim=16, **_COMMON),
        "gemma3": lambda: t.Gemma3TextConfig(intermediate_size=128, head_dim=16, **_COMMON),
        "phi3": lambda: t.Phi3Config(intermediate_size=128, **_COMMON),
        "qwen2_moe": lambda: t.Qwen2MoeConfig(moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                              num_experts=4, **_MOE, **_COMMON),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(moe_intermediate_size=64, num_experts=4, head_dim=16, **_MOE, **_COMMON),
        "mixtral": lambda: t.MixtralConfig(num_local_experts=4, **_MOE, **_COMMON),
    }
    return make[family]()


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen2_moe", "qwen3_moe", "mixtral")


def tiny_model(family: str):
    """The family's tiny model with random weights (seed 0), in memory."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family))


def write_tiny(family: str, folder: Path) -> Path:
    """The family's tiny model saved in `folder` (float32 safetensors) with the shared tiny model's tokenizer."""
    tiny_model(family).save_pretrained(folder)
    for item in TINY_MODEL.iterdir():
        if item.name.startswith("tokenizer"):
            shutil.copyfile(item, folder / item.name)
    return folder
