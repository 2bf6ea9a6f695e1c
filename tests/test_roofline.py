"""Bytes per decode step, KV bytes per token and the roofline fraction, on the 7B shape and real files."""

from __future__ import annotations

import pytest

from quantgate.tasks.adapters.dummy_weights import QWEN25_7B_INSTRUCT, layout, write_dummy_checkpoint
from quantgate.tasks.adapters.roofline import (
    RooflineError, checkpoint_tensors, decode_weight_bytes, dequantized_tensors, kv_bytes_per_token, roofline_fraction,
    roofline_tokens_per_s,
)
from tests.shapes import TINY_QWEN

HIDDEN, VOCAB = 3584, 152064
EMBED = VOCAB * HIDDEN * 2  # one bf16 table: 1.09 GB


def test_bf16_7b_reads_everything_but_the_embedding_table():
    tensors = layout(QWEN25_7B_INSTRUCT)
    total = sum(nbytes for _, nbytes in tensors.values())

    assert total == 15_231_233_024  # the published checkpoint's size
    assert decode_weight_bytes(tensors) == total - EMBED + HIDDEN * 2


def test_w4a16_7b_reads_packed_weights_scales_and_the_bf16_head():
    tensors = layout(QWEN25_7B_INSTRUCT, "w4a16", 128)
    linear = 28 * (3584 * 3584 * 2 + 512 * 3584 * 2 + 3 * 18944 * 3584)  # q,o + k,v + gate,up,down weights
    packed = sum(b for n, (_, b) in tensors.items() if n.endswith("weight_packed"))
    scales = sum(b for n, (_, b) in tensors.items() if n.endswith("weight_scale"))

    assert packed == linear // 2 and scales == linear // 128 * 2
    read = decode_weight_bytes(tensors)
    assert read == packed + scales + EMBED + HIDDEN * 2 + _small(tensors)  # head in bf16, one embedding row
    assert 0.29 < read / decode_weight_bytes(layout(QWEN25_7B_INSTRUCT)) < 0.33


def _small(tensors) -> int:
    """Norms and biases: read every step, tiny."""
    return sum(b for n, (_, b) in tensors.items() if n.endswith((".bias", "norm.weight")))


def test_a_tied_head_counts_the_table_once_and_metadata_not_at_all():
    tied = {"model.embed_tokens.weight": ((100, 8), 1600), "model.layers.0.mlp.weight_packed": ((8, 1), 32),
            "model.layers.0.mlp.weight_shape": ((2,), 16)}
    untied = {**tied, "lm_head.weight": ((100, 8), 1600)}

    assert decode_weight_bytes(tied) == 1600 + 32
    assert decode_weight_bytes(untied) == 1600 + 32 + 16


def test_headers_of_written_files_agree_with_the_layout(tmp_path):
    tiny = {**QWEN25_7B_INSTRUCT, **TINY_QWEN}
    written = write_dummy_checkpoint(tmp_path / "w4", tiny, quant="w4a16", group_size=32, max_shard_bytes=50_000)
    config_only = write_dummy_checkpoint(tmp_path / "cfg", tiny, quant="w4a16", group_size=32, write_weights=False)

    assert len(written.shards) > 1
    assert checkpoint_tensors(written.path) == checkpoint_tensors(config_only.path) == layout(tiny, "w4a16", 32)
    # What Transformers reads once it has decompressed the int4 weights: the 16-bit layout.
    assert dequantized_tensors(written.path) == layout(tiny)
    with pytest.raises(RooflineError, match="no safetensors files and no readable config.json"):
        checkpoint_tensors(tmp_path / "empty")


def test_kv_bytes_and_roofline_arithmetic():
    # Qwen2.5-7B: 28 layers x (K and V) x 4 KV heads x 128 dims x 2 bytes.
    assert kv_bytes_per_token(QWEN25_7B_INSTRUCT) == 28 * 2 * 4 * 128 * 2 == 57_344
    assert kv_bytes_per_token({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 4) == 2 * 2 * 4 * 16 * 4
    # 14.1 GB a token on 4.3 TB/s: at most ~304 tokens/s; 150 tokens/s is about half of it.
    assert roofline_tokens_per_s(14_141_245_440, 4300.0) == pytest.approx(304.07, abs=0.01)
    assert roofline_fraction(150.0, 14_141_245_440, 4300.0) == pytest.approx(150 / 304.07, rel=1e-4)
