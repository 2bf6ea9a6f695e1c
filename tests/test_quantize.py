"""The quantize step on real tiny Llama checkpoints, with real llm-compressor runs on CPU."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantgate.catalog.records import CalibrationSamples, ModelArtifact
from quantgate.catalog.variants import ChatCalibration, TextCalibration, VariantSpec
from quantgate.tasks.adapters.quantizers import llmcompressor
from quantgate.tasks.adapters.quantizers.batching import CALIBRATION_TOKENS_PER_BATCH
from quantgate.tasks.steps.quantize import MARKER, base_variant, build_variant, lib_versions, recipe_for, variant_uid
from tests.shared_data import SHARED, local_artifact, with_chat_template

DATA = SHARED
TINY = DATA / "models" / "stories260k-i256"  # every Linear in_features divisible by 32 and 64
TINY_172 = DATA / "models" / "stories260k"  # intermediate size 172: group 32 cannot divide down_proj
STORIES = DATA / "eval" / "simple_stories" / "simple_stories.txt"
PROMPT = "Once upon a time"

pytestmark = [pytest.mark.skipif(not TINY.is_dir() or not STORIES.is_file(), reason="needs ../shared/data"),
              pytest.mark.usefixtures("one_torch_thread")]




@pytest.fixture(scope="module")
def model() -> ModelArtifact:
    return local_artifact(TINY, "fixed-test-sha-i256")


@pytest.fixture(scope="module")
def calib() -> TextCalibration:
    return TextCalibration(path=str(STORIES), samples=10, seq_len=160)  # one sample per story


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("variants")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY)


def _greedy(path: str | Path, tokenizer) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def _perplexity(path: str | Path, tokenizer) -> float:
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tokenizer(STORIES.read_text()[:1500], return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


@pytest.fixture(scope="module")
def base_tokens(tokenizer) -> list[int]:
    return _greedy(TINY, tokenizer)


def test_recipe_hash_is_stable_and_tracks_the_spec():
    g32 = VariantSpec(name="gptq-w4a16-g32", method="gptq", group_size=32)
    text, digest = recipe_for(g32)
    assert recipe_for(g32.model_copy(update={"name": "another-name"})) == (text, digest)
    assert recipe_for(g32.model_copy(update={"group_size": 64}))[1] != digest
    assert recipe_for(g32.model_copy(update={"method": "awq"}))[1] != digest
    groups = yaml.safe_load(text)["default_stage"]["default_modifiers"]["GPTQModifier"]["config_groups"]
    assert groups["group_0"]["weights"]["group_size"] == 32 and groups["group_0"]["weights"]["num_bits"] == 4
    # The preset's own group size keeps the readable preset name in the recipe.
    assert "scheme: W4A16" in recipe_for(g32.model_copy(update={"group_size": 128}))[0]


def test_variant_uid_depends_on_model_recipe_and_versions(model):
    versions = lib_versions()
    uid = variant_uid(model, "r1", versions)
    assert len(uid) == 16 and uid == variant_uid(model, "r1", versions)
    assert uid != variant_uid(model, "r2", versions)
    assert uid != variant_uid(local_artifact(TINY, "other-sha"), "r1", versions)
    assert uid != variant_uid(model, "r1", {**versions, "llmcompressor": "0.0.0"})
    assert uid != variant_uid(model, "r1", versions, calibration="c1")


@pytest.mark.parametrize(
    ("count", "seq_len", "batch_size"),
    [(256, 512, 32), (8, 128, 8), (64, 128, 64), (200, 100, 163), (3, 32_768, 1)],
)
def test_calibration_runs_in_token_budget_batches(count, seq_len, batch_size, monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(llmcompressor, "oneshot", lambda **kwargs: seen.update(kwargs))
    samples = CalibrationSamples(label="t", seq_len=seq_len, input_ids=((1,) * seq_len,) * count)
    spec = VariantSpec(name="awq-w4a16-g32", method="awq", scheme="W4A16", group_size=32)
    llmcompressor.quantize(TINY, spec, samples, tmp_path)
    assert seen["batch_size"] == batch_size and seen["num_calibration_samples"] == count
    assert batch_size * seq_len <= CALIBRATION_TOKENS_PER_BATCH or batch_size == 1
    # The batching is how the build runs, not what it builds: the recipe (and so the variant uid) omits it.
    assert seen["recipe"] == llmcompressor.recipe_text(spec)


def test_base_variant_points_at_the_model(model):
    base = base_variant(model)
    assert base.uid == f"{model.uid}:base" and base.method == "base" and base.path == str(TINY)
    assert base.size_bytes == (TINY / "model.safetensors").stat().st_size


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_build_reloads_and_generates_like_base(method, model, calib, out_root, tokenizer, base_tokens):
    spec = VariantSpec(name=f"{method}-w4a16-g32", method=method, scheme="W4A16", group_size=32)
    art = build_variant(model, spec, calib, out_root)
    assert art.status == "built", art.error
    assert not art.reused and art.path == str(out_root / art.uid)
    assert (Path(art.path) / MARKER).is_file() and (Path(art.path) / "recipe.yaml").is_file()
    assert art.recipe == recipe_for(spec)[0] and art.lib_versions == lib_versions()
    assert art.bits == 4 and art.group_size == 32 and art.build_seconds > 0 and art.peak_memory_bytes > 0
    assert 0 < art.size_bytes < base_variant(model).size_bytes

    config = json.loads((Path(art.path) / "config.json").read_text())
    qconfig = config["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors"
    assert qconfig["config_groups"]["group_0"]["weights"]["group_size"] == 32
    tokens = _greedy(art.path, tokenizer)
    same = sum(a == b for a, b in zip(tokens, base_tokens, strict=True)) / len(base_tokens)
    print(f"{method}: {same:.0%} of 20 greedy tokens match base: {tokenizer.decode(tokens)!r}")
    # Seen: GPTQ matches all 20 tokens, AWQ the first 14 (then a different but fluent ending).
    assert tokens[:10] == base_tokens[:10] and same >= 0.6


def test_chat_calibration_calibrates_the_build_and_keys_its_uid(calib, tmp_path):
    # The same checkpoint (and sha) with a chat template: only the calibration set differs between the builds.
    chat_model = local_artifact(with_chat_template(tmp_path / "chat-model"), "fixed-test-sha-i256")
    lines = [json.dumps({"messages": [{"role": "user", "content": f"What comes after {i}?"},
                                      {"role": "assistant", "content": f"After {i} comes {i + 1}."}]})
             for i in range(200)]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines))
    chat = ChatCalibration(path=str(tmp_path / "chat.jsonl"), samples=16, seq_len=64)
    spec = VariantSpec(name="gptq-w4a16-g32", method="gptq", scheme="W4A16", group_size=32)
    from_chat = build_variant(chat_model, spec, chat, tmp_path / "variants")
    from_text = build_variant(chat_model, spec, calib, tmp_path / "variants")
    assert from_chat.status == from_text.status == "built", (from_chat.error, from_text.error)
    assert from_chat.uid != from_text.uid and not from_text.reused


def test_same_spec_is_reused_without_rebuilding(model, calib, out_root):
    spec = VariantSpec(name="gptq-w4a16-g32", method="gptq", scheme="W4A16", group_size=32)
    first = build_variant(model, spec, calib, out_root)
    marker = Path(first.path) / MARKER
    written = marker.stat().st_mtime_ns
    start = time.perf_counter()
    again = build_variant(model, spec.model_copy(update={"name": "same-recipe"}), calib, out_root)
    assert time.perf_counter() - start < 5
    assert again.reused and again.uid == first.uid and again.path == first.path and again.name == "same-recipe"
    assert again.size_bytes == first.size_bytes and marker.stat().st_mtime_ns == written


def test_warehouse_row_with_existing_folder_is_reused(model, calib, out_root, tmp_path):
    spec = VariantSpec(name="gptq-w4a16-g32", method="gptq", scheme="W4A16", group_size=32)
    first = build_variant(model, spec, calib, out_root)
    row = {
        "variant_uid": first.uid, "model_uid": first.model_uid, "method": "gptq", "scheme": "W4A16", "bits": 4,
        "group_size": 32, "path": first.path, "recipe": first.recipe, "recipe_hash": first.recipe_hash,
        "lib_versions": json.dumps(first.lib_versions), "size_bytes": first.size_bytes, "status": "built",
    }  # fmt: skip
    seen = []
    art = build_variant(model, spec, calib, tmp_path, existing=lambda uid: seen.append(uid) or row)
    assert seen == [first.uid]
    assert art.reused and art.path == first.path and art.lib_versions == first.lib_versions
    assert list(tmp_path.iterdir()) == []


def test_half_written_build_is_not_reused(model, calib, tmp_path, tokenizer):
    spec = VariantSpec(name="rtn-w4a16-g32", method="rtn", scheme="W4A16", group_size=32)
    uid = variant_uid(model, recipe_for(spec)[1], lib_versions())
    crashed_tmp = tmp_path / f".{uid}.crashed.tmp"
    for folder in (crashed_tmp, tmp_path / uid):  # a crashed build, and a final folder with no marker
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"truncated")
    art = build_variant(model, spec, calib, tmp_path)
    assert art.status == "built" and not art.reused and art.uid == uid
    assert (Path(art.path) / MARKER).is_file()
    assert len(_greedy(art.path, tokenizer)) == 20  # a real checkpoint replaced the junk
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == [crashed_tmp.name]


def test_w2a16_builds_and_is_much_worse(model, calib, out_root, tokenizer):
    spec = VariantSpec(name="rtn-w2a16-g32", method="rtn", scheme="W2A16", group_size=32)
    art = build_variant(model, spec, calib, out_root)
    assert art.status == "built", art.error
    assert art.bits == 2 and "num_bits: 2" in art.recipe
    base_ppl, w2_ppl = _perplexity(TINY, tokenizer), _perplexity(art.path, tokenizer)
    print(f"perplexity base {base_ppl:.2f}, W2A16 {w2_ppl:.2f}")
    assert w2_ppl > 3 * base_ppl


def test_indivisible_group_size_fails_with_one_line(calib, tmp_path):
    spec = VariantSpec(name="gptq-w4a16-g32", method="gptq", scheme="W4A16", group_size=32)
    art = build_variant(local_artifact(TINY_172, "fixed-test-sha-172"), spec, calib, tmp_path)
    assert art.status == "failed" and art.path is None and not art.ok
    assert art.error.startswith(
        "gptq-w4a16-g32: group size 32 does not divide in_features 172 of model.layers.0.mlp.down_proj"
    )
    assert "\n" not in art.error
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_nan_weights_fail_the_build(calib, tmp_path):
    poisoned = tmp_path / "poisoned"
    model = AutoModelForCausalLM.from_pretrained(TINY)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(poisoned)
    AutoTokenizer.from_pretrained(TINY).save_pretrained(poisoned)
    spec = VariantSpec(name="rtn-w8a16", method="rtn", scheme="W8A16", group_size=None)
    art = build_variant(local_artifact(poisoned, "poisoned"), spec, calib, tmp_path / "out")
    assert art.status == "failed" and "NaN/Inf" in art.error and "\n" not in art.error
    assert list((tmp_path / "out").iterdir()) == []
