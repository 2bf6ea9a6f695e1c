"""Dummy checkpoints: tiny configs through the same code path the 7B shapes take on the GPU machine."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from quantgate.tasks.adapters.dummy_weights import (
    QWEN25_7B_INSTRUCT, W4_SCALE, DummyWeightsError, w4a16_quantization_config, write_dummy_checkpoint,
)
from tests.shapes import TINY_QWEN

TINY = {**QWEN25_7B_INSTRUCT, **TINY_QWEN}


def _tensors(folder) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                out[name] = (t.get_dtype(), tuple(t.get_shape()))
    return out


def test_qwen25_7b_shapes_match_the_published_checkpoint(tmp_path):
    cfg = AutoConfig.for_model("qwen2", **{k: v for k, v in QWEN25_7B_INSTRUCT.items() if k != "model_type"})
    assert (cfg.hidden_size // cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4)
    assert cfg.rope_parameters["rope_theta"] == 1e6
    ck = write_dummy_checkpoint(tmp_path / "qwen", QWEN25_7B_INSTRUCT, write_weights=False)
    # Qwen2.5-7B-Instruct's model.safetensors.index.json: total_size 15231233024 (7.62B bf16 parameters).
    assert ck.weight_bytes == 15_231_233_024
    assert ck.num_parameters == 7_615_616_512
    assert ck.shards == () and not list(ck.path.glob("*.safetensors"))
    assert json.loads((ck.path / "config.json").read_text())["vocab_size"] == 152064
    _assert_tokenizer(ck.path, 152064, eos_id=151645, pad_id=151643, cls="Qwen2Tokenizer")
    w4 = write_dummy_checkpoint(tmp_path / "qwen-w4", QWEN25_7B_INSTRUCT, quant="w4a16", write_weights=False)
    assert w4.num_parameters == ck.num_parameters
    assert 0.3 < w4.weight_bytes / ck.weight_bytes < 0.4


def test_bf16_checkpoint_loads_in_transformers_across_shards(tmp_path):
    ck = write_dummy_checkpoint(tmp_path / "bf16", TINY, max_shard_bytes=100_000)
    assert len(ck.shards) > 1
    index = json.loads((ck.path / "model.safetensors.index.json").read_text())
    tensors = _tensors(ck.path)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == ck.weight_bytes
    assert all(dtype == "BF16" for dtype, _ in tensors.values())
    # Qwen2 has q/k/v biases and an untied lm_head.
    assert tensors["model.layers.0.self_attn.k_proj.bias"][1] == (32,)
    assert tensors["lm_head.weight"][1] == (1000, 64)

    model, info = AutoModelForCausalLM.from_pretrained(ck.path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 1000) and torch.isfinite(logits).all()
    out = model.generate(torch.tensor([[5, 6]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, 6)

    # Rewriting the folder as one file leaves no stale shards or index behind.
    again = write_dummy_checkpoint(tmp_path / "bf16", TINY)
    assert again.shards == ("model.safetensors",)
    assert sorted(p.name for p in again.path.glob("model*")) == ["model.safetensors"]


def test_w4a16_checkpoint_decompresses_in_transformers(tmp_path):
    ck = write_dummy_checkpoint(tmp_path / "w4", TINY, quant="w4a16", group_size=32)
    tensors = _tensors(ck.path)
    assert tensors["model.layers.1.mlp.down_proj.weight_packed"] == ("I32", (64, 128 // 8))
    assert tensors["model.layers.1.mlp.down_proj.weight_scale"] == ("BF16", (64, 128 // 32))
    assert tensors["model.layers.1.mlp.down_proj.weight_shape"] == ("I64", (2,))
    assert tensors["model.layers.0.self_attn.q_proj.bias"] == ("BF16", (64,))
    assert tensors["lm_head.weight"] == ("BF16", (1000, 64))  # ignored by the scheme

    model, info = AutoModelForCausalLM.from_pretrained(ck.path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()
    w = model.model.layers[1].mlp.down_proj.weight.float()
    assert w.shape == (64, 128)
    # Decompressed values are int4 codes (-8..7) times scales of at most 1.5 * W4_SCALE.
    assert 0 < w.abs().max() <= 8 * 1.5 * W4_SCALE * 1.01
    assert w.std() == pytest.approx(0.02, rel=0.3)


def _assert_tokenizer(path, vocab_size: int, eos_id: int, pad_id: int, cls: str) -> None:
    tok = AutoTokenizer.from_pretrained(path)
    assert type(tok).__name__ == cls
    assert len(tok) == tok.vocab_size == vocab_size
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (eos_id, pad_id, None)
    assert tok.num_special_tokens_to_add() == 0
    ids = tok.convert_tokens_to_ids(["Ġab", "Ġc", "Ġzz"])
    text = tok.decode(ids)
    assert text == " ab c zz"
    assert tok(text, add_special_tokens=False).input_ids == ids
    assert tok.decode([ids[0], eos_id, ids[1]], skip_special_tokens=True) == " ab c"
    # Any id decodes (random weights emit any id), byte symbols included.
    assert isinstance(tok.decode(list(range(vocab_size))), str)


def test_tokenizer_has_exactly_vocab_size_tokens_and_round_trips(tmp_path):
    ck = write_dummy_checkpoint(tmp_path / "tok", TINY, write_weights=False)
    # transformers 5 loads every qwen2 checkpoint's tokenizer as Qwen2Tokenizer (as vLLM will).
    _assert_tokenizer(ck.path, 1000, eos_id=999, pad_id=998, cls="Qwen2Tokenizer")
    llama = {**TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2}
    ck = write_dummy_checkpoint(tmp_path / "llama", llama, write_weights=False)
    _assert_tokenizer(ck.path, 1000, eos_id=2, pad_id=1, cls="TokenizersBackend")
    gen = json.loads((ck.path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_w4a16_layout_matches_llm_compressor(tmp_path, tiny_model):
    """Quantize the shared tiny Llama with llm-compressor's W4A16 preset and write a dummy checkpoint
    from the same config: same quantization_config, same tensor names, dtypes and shapes."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    group = 32  # the tiny model's 64-wide layers cannot take the preset's 128
    ref = tmp_path / "llmc"
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    scheme = _preset_with_group(group)
    oneshot(
        model=model,
        recipe=[QuantizationModifier(targets=["Linear"], config_groups={"group_0": scheme}, ignore=["lm_head"])],
    )
    model.save_pretrained(ref, save_compressed=True)
    ref_config = json.loads((ref / "config.json").read_text())

    base_config = {k: v for k, v in ref_config.items() if k != "quantization_config"}
    ck = write_dummy_checkpoint(tmp_path / "dummy", base_config, quant="w4a16", group_size=group)
    ours = json.loads((ck.path / "config.json").read_text())
    assert ours["quantization_config"] == ref_config["quantization_config"]
    assert w4a16_quantization_config(group) == ref_config["quantization_config"]
    assert _tensors(ck.path) == _tensors(ref)


def _preset_with_group(group_size: int):
    from compressed_tensors.quantization import preset_name_to_scheme

    preset = preset_name_to_scheme("W4A16", ["Linear"])
    return preset.model_copy(update={"weights": preset.weights.model_copy(update={"group_size": group_size})})


def test_unworkable_requests_are_one_line_errors(tmp_path):
    with pytest.raises(DummyWeightsError, match="in_features 64 is not a multiple of group_size 128"):
        write_dummy_checkpoint(tmp_path / "a", TINY, quant="w4a16", group_size=128)
    assert not (tmp_path / "a").exists()
    with pytest.raises(DummyWeightsError, match="vocab_size 200 is too small"):
        write_dummy_checkpoint(tmp_path / "d", {**TINY, "vocab_size": 200, "bos_token_id": 1, "eos_token_id": 2})
    with pytest.raises(DummyWeightsError, match="eos_token_id=999 is outside the vocabulary"):
        write_dummy_checkpoint(tmp_path / "b", {**TINY, "vocab_size": 900, "bos_token_id": 1})
    with pytest.raises(DummyWeightsError, match="quant must be"):
        write_dummy_checkpoint(tmp_path / "c", TINY, quant="w8a8")
