"""Bytes a decode step reads, and how close a measured decode speed comes to the memory-bandwidth roofline.

At batch 1 every decode step streams the weights once; the KV cache of a short context is small beside
them and is left out. The embedding table is not streamed: a lookup reads one row per token.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.catalog.errors import QuantgateError
from quantgate.tasks.adapters.speed.checkpoint import safetensors_headers
from quantgate.tasks.adapters.dummy_weights import layout

Tensors = dict[str, tuple[tuple[int, ...], int]]  # name -> (shape, bytes)


class RooflineError(QuantgateError, RuntimeError):
    """A checkpoint whose weights cannot be sized; the message is one line."""


def checkpoint_tensors(model_path: str | Path) -> Tensors:
    """Name -> (shape, bytes) of every tensor in the folder's safetensors files, read from their headers;
    for a folder without weight files (a dummy-weight checkpoint), the layout its config implies."""
    folder = Path(model_path)
    if headers := safetensors_headers(folder):
        return {name: (tuple(info["shape"]), info["data_offsets"][1] - info["data_offsets"][0])
                for name, info in headers.items()}
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise RooflineError(f"{folder}: no safetensors files and no readable config.json ({e})") from None
    quant = config.get("quantization_config")
    if quant is None:
        return layout(config)
    group_size = quant["config_groups"]["group_0"]["weights"]["group_size"]
    return layout({k: v for k, v in config.items() if k != "quantization_config"}, "w4a16", group_size)


def dequantized_tensors(model_path: str | Path) -> Tensors:
    """The layout of the checkpoint once an engine that has no kernels for its format (Transformers on a
    compressed-tensors int4 checkpoint) has decompressed it to its 16-bit dtype: what that engine reads."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return layout({k: v for k, v in config.items() if k != "quantization_config"})


def decode_weight_bytes(tensors: Tensors) -> int:
    """Bytes of weights one decode step reads: everything but the embedding table (one row of it),
    unless the output head is tied to it, when the whole table is read as the head. Packed int4
    weights count at their packed size, with their scales; a compressed weight's recorded shape
    (weight_shape) is metadata, not read."""
    has_head = any(name.endswith("lm_head.weight") for name in tensors)
    total = 0
    for name, (shape, nbytes) in tensors.items():
        if name.endswith(".weight_shape"):
            continue
        if name.endswith("embed_tokens.weight") and has_head:
            total += nbytes // shape[0]
        else:
            total += nbytes
    return total


def kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token takes across all layers (keys and values)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def roofline_tokens_per_s(weight_bytes: int, bandwidth_gbps: float) -> float:
    """The decode speed at which streaming the weights alone would saturate the measured bandwidth."""
    return bandwidth_gbps * 1e9 / weight_bytes


def roofline_fraction(decode_tokens_per_s: float, weight_bytes: int, bandwidth_gbps: float) -> float:
    return decode_tokens_per_s / roofline_tokens_per_s(weight_bytes, bandwidth_gbps)
