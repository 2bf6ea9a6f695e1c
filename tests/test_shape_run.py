"""A run on a model's shape: a `shape` source (a published config by name, or a local config.json) is written once
with random weights, evaluated, quantized and timed like any model; the warehouse, the verdicts and the report say
its weights were random, and every quality gate is uninformative.

Real catalog loading, dummy_weights writer, `quantgate run` subprocess, Prefect, llm-compressor, lm-eval,
Transformers and DuckDB, on a tiny Qwen2 shape.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.load import load_catalog
from quantgate.catalog.policy import Policy
from quantgate.catalog.records import RANDOM_WEIGHTS
from quantgate.catalog.selection import adhoc_model
from quantgate.catalog.shapes import SHAPES
from quantgate.tasks.adapters.dummy_weights import layout
from quantgate.tasks.steps.decide import decide
from quantgate.tasks.steps.download import fetch_model
from quantgate.tasks.steps.download_error import DownloadError
from quantgate.warehouse import reads, sessions
from tests.cli_runs import CATALOG_HEAD, run_cli, tiny_catalog
from tests.shared_data import TINY_MODEL

# 2 layers of hidden 128; a vocabulary of 320 holds the tokenizer's 256 byte symbols, its two special tokens (at
# bos and eos) and 62 word tokens. The layers outweigh the embeddings (which builds keep in 16 bits), so a W8A16
# build is smaller than the base, as a real model's is.
TINY_SHAPE = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 318, "eos_token_id": 319, "torch_dtype": "bfloat16",
}


def shape_config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_SHAPE))
    return folder / "config.json"


def catalog_with(tmp_path: Path, source: str) -> Path:
    """A catalog of one model whose source is `source` (inline YAML)."""
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG_HEAD + f"""models:
  - id: tiny-shape
    source: {source}
    variants: [int8-w8a16]
    suite: stories
policy:
  version: 1
  quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.95, higher_is_better: false}}]
""")
    return path


def one_line_error(catalog: Path) -> str:
    with pytest.raises(CatalogError) as e:
        load_catalog(catalog)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_shape_source_names_a_published_shape_or_a_config_relative_to_the_catalog(tmp_path):
    cat = load_catalog(catalog_with(tmp_path, "{kind: shape, shape: qwen2.5-14b-instruct}"))
    assert cat.models[0].source.shape == "qwen2.5-14b-instruct"
    config = shape_config(tmp_path / "tiny-qwen2")
    cat = load_catalog(catalog_with(tmp_path, "{kind: shape, config: tiny-qwen2/config.json}"))
    assert cat.models[0].source.config == str(config) and cat.models[0].source.name == "tiny-qwen2"


def _parameters(shape: str) -> int:
    return sum(math.prod(dims) for dims, _ in layout(SHAPES[shape]).values())


def test_qwen25_14b_instruct_has_its_published_size():
    # 14.7B parameters as published (5120 hidden, 48 layers, untied 152064-token embeddings and head).
    assert 14.6e9 < _parameters("qwen2.5-14b-instruct") < 14.9e9


def test_qwen3_30b_a3b_has_its_published_size_and_its_4_layers_their_share():
    # 30.5B parameters as published; 4 of its 48 layers keep the embeddings and head (2 x 151936 x 2048) whole.
    whole, four = _parameters("qwen3-30b-a3b"), _parameters("qwen3-30b-a3b-4-layers")
    embeddings = 2 * 151936 * 2048
    assert 30.4e9 < whole < 30.6e9
    assert four - embeddings == pytest.approx((whole - embeddings) * 4 / 48, rel=1e-6)


@pytest.mark.parametrize(("source", "says"), [
    ("{kind: shape, shape: qwen9-1t}", "models.0.source.shape: unknown shape 'qwen9-1t': known shapes are"
                                       " ['qwen2.5-14b-instruct', 'qwen2.5-7b-instruct', 'qwen3-30b-a3b',"
                                       " 'qwen3-30b-a3b-4-layers']"),
    ("{kind: shape}", "needs exactly one of 'shape'"),
    ("{kind: shape, shape: qwen2.5-7b-instruct, config: x.json}", "needs exactly one of 'shape'"),
    ("{kind: shape, config: missing/config.json}", "models.0.source: shape config"),
])
def test_a_bad_shape_source_is_one_line(tmp_path, source, says):
    assert says in one_line_error(catalog_with(tmp_path, source))


def test_a_config_that_is_no_model_config_is_one_line(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    assert "not valid JSON" in one_line_error(catalog_with(tmp_path, "{kind: shape, config: broken.json}"))
    (tmp_path / "other.json").write_text(json.dumps({"vocab_size": 320}))
    assert "no 'model_type'" in one_line_error(catalog_with(tmp_path, "{kind: shape, config: other.json}"))


def test_the_command_line_spells_a_shape_shape_colon(tmp_path):
    cat = load_catalog(catalog_with(tmp_path, "{kind: shape, shape: qwen2.5-7b-instruct}"))
    named = adhoc_model(cat, "shape:qwen2.5-14b-instruct")
    assert (named.id, named.source.kind, named.source.shape) == ("shape/qwen2.5-14b-instruct", "shape",
                                                                  "qwen2.5-14b-instruct")
    config = shape_config(tmp_path / "tiny-qwen2")
    for ref in (f"shape:{config}", f"shape:{config.parent}"):  # the file, or the folder holding it
        by_path = adhoc_model(cat, ref)
        assert (by_path.id, by_path.source.config) == ("shape/tiny-qwen2", str(config.parent if ref.endswith("2")
                                                                                 else config))
    with pytest.raises(CatalogError, match=r"^shape:qwen9: unknown shape 'qwen9': known shapes are .*config\.json\)$"):
        adhoc_model(cat, "shape:qwen9")


def test_the_checkpoint_is_random_deterministic_and_written_once(tmp_path):
    shape_config(tmp_path / "tiny-qwen2")
    spec = load_catalog(catalog_with(tmp_path, "{kind: shape, config: tiny-qwen2}")).models[0]
    first = fetch_model(spec, tmp_path / "a")
    weights = Path(first.path) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    again = fetch_model(spec, tmp_path / "a")
    elsewhere = fetch_model(spec, tmp_path / "b")
    assert (first.source, first.random_weights, first.architecture) == ("shape", True, "Qwen2ForCausalLM")
    assert again == first and weights.stat().st_mtime_ns == written  # reused, not written again
    assert elsewhere.sha == first.sha and (Path(elsewhere.path) / "model.safetensors").read_bytes() == weights.read_bytes()
    assert first.num_parameters == sum(math.prod(s) for s, _ in layout(TINY_SHAPE).values())


# A larger model of the tiny Llama's family: its 512-token vocabulary, so that the family's tokenizer fits it.
TINY_LLAMA_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 344,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def test_a_shape_carries_its_familys_tokenizer_when_given_one(tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_SHAPE))
    cat = load_catalog(catalog_with(tmp_path, "{kind: shape, config: tiny-llama}"))
    synthetic = fetch_model(adhoc_model(cat, f"shape:{folder}"), tmp_path / "work")
    family = fetch_model(adhoc_model(cat, f"shape:{folder}", tokenizer=str(TINY_MODEL)), tmp_path / "work")
    text = "Once upon a time, a little dog found a red ball."
    ids = AutoTokenizer.from_pretrained(family.path)(text)["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(str(TINY_MODEL))(text)["input_ids"]
    # Another checkpoint than the synthetic tokenizer's (which spells the text byte by byte), same weights' shape.
    assert family.sha != synthetic.sha and family.num_parameters == synthetic.num_parameters
    assert len(AutoTokenizer.from_pretrained(synthetic.path)(text)["input_ids"]) > len(ids)


def test_a_tokenizer_that_does_not_fit_the_shape_is_one_line(tmp_path):
    shape_config(tmp_path / "tiny-qwen2")
    cat = load_catalog(catalog_with(tmp_path, "{kind: shape, config: tiny-qwen2}"))
    with pytest.raises(DownloadError, match=r"has 513 tokens, more than the shape's vocab_size 320: not a "
                                            r"tokenizer of this model's family$"):
        fetch_model(adhoc_model(cat, f"shape:{tmp_path / 'tiny-qwen2'}", tokenizer=str(TINY_MODEL)), tmp_path / "w")
    with pytest.raises(CatalogError, match=r"shape tokenizer .*/nowhere: no tokenizer\.json or tokenizer_config"):
        adhoc_model(cat, "shape:qwen2.5-7b-instruct", tokenizer=str(tmp_path / "nowhere"))
    with pytest.raises(CatalogError, match=r"is for a model's shape \(shape:NAME\), not for 'tiny-shape'"):
        adhoc_model(cat, "tiny-shape", tokenizer=str(TINY_MODEL))


def test_a_generation_config_beside_the_config_goes_with_it(tmp_path):
    shape_config(tmp_path / "tiny-qwen2")
    spec = load_catalog(catalog_with(tmp_path, "{kind: shape, config: tiny-qwen2/config.json}")).models[0]
    without = fetch_model(spec, tmp_path / "work")
    generation = {"bos_token_id": 318, "eos_token_id": [319, 318], "do_sample": True, "temperature": 0.7}
    (tmp_path / "tiny-qwen2" / "generation_config.json").write_text(json.dumps(generation))
    beside = fetch_model(spec, tmp_path / "work")
    assert json.loads((Path(beside.path) / "generation_config.json").read_text()) == generation
    # Another checkpoint, not the folder written before the file was there; without one, the config's tokens.
    assert beside.sha != without.sha and beside.path != without.path
    assert json.loads((Path(without.path) / "generation_config.json").read_text()) == {"bos_token_id": 318,
                                                                                         "eos_token_id": 319}


POLICY = Policy.model_validate({
    "version": 1,
    "quality": [{"task": "ppl", "metric": "word_perplexity", "min_recovery": 0.95, "higher_is_better": False},
                {"task": "qg_gsm8k", "metric": "exact_match", "min_recovery": 0.9, "higher_is_better": True}],  # required, never measured
    "speed": {"engine": "vllm", "scenario": "thr", "min_speedup": 1.0},
    "max_size_ratio": 0.75,
})
# A recovery far under the gate: on a real model it would reject.
LOST = [{"task": "ppl", "metric": "word_perplexity", "filter": "none", "recovery": 0.4, "variant_value": 7.5,
         "base_value": 3.0, "variant_stderr": 0.001, "base_stderr": 0.001}]


@pytest.mark.parametrize(("speedup", "decision"), [(1.4, "inconclusive"), (0.8, "reject")])
def test_random_weights_make_every_quality_gate_uninformative_and_speed_decides(speedup, decision):
    variant = {"variant_uid": "v", "status": "built", "error": None, "size_bytes": 30, "random_weights": True}
    speed = [{"engine": "vllm", "scenario": "thr", "status": "ok", "speedup": speedup, "reason": None}]
    d = decide(variant, 100, LOST, speed, POLICY)
    quality = [c for c in d.checks if c.kind == "quality"]
    assert [(c.name, c.outcome) for c in quality] == [
        ("ppl/word_perplexity", "uninformative"), ("qg_gsm8k/exact_match", "uninformative"),
        ("random weights: quality not measured", "inconclusive")]
    assert all(RANDOM_WEIGHTS in c.note for c in quality)
    assert d.decision == decision and RANDOM_WEIGHTS in d.reason
    # The same rows of a real model: the lost recovery and the unmeasured required gate fail it.
    real = decide({**variant, "random_weights": False}, 100, LOST, speed, POLICY)
    assert real.decision == "reject" and {c.outcome for c in real.checks if c.kind == "quality"} == {"fail"}


@pytest.mark.slow
def test_a_shape_run_measures_speed_and_says_quality_is_not_measured(tmp_path, prefect_api):
    config = shape_config(tmp_path / "tiny-qwen2")
    cat = tiny_catalog(tmp_path, config, {"int8-w8a16": "{method: rtn, scheme: W8A16, group_size: null}"}, limit=2)
    cat.write_text(cat.read_text().replace("{kind: local, path:", "{kind: shape, config:"))
    wh = tmp_path / "w.ducklake"
    result = run_cli(["run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(tmp_path / "work")], prefect_api)
    assert result.returncode == 0, result.stderr[-3000:]
    # The verdict table says it, one line above it and in the deciding check.
    assert f"tiny: {RANDOM_WEIGHTS}; its speed, memory and time are the model's" in result.stdout
    assert re.search(r"int8-w8a16 +│ inconclusive +│ random weights: quality not measured", result.stdout)
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT source, random_weights FROM models").fetchall() == [("shape", True)]
        card = reads.rows(con, "SELECT variant, decision, reason, random_weights, speedup FROM variant_scorecard")
        assert [(c["variant"], c["decision"], c["random_weights"]) for c in card] == [("int8-w8a16", "inconclusive", True)]
        assert RANDOM_WEIGHTS in card[0]["reason"]
        # The quality suite ran on both checkpoints (its time is part of the cost), and decided nothing.
        evaluated = con.execute("SELECT count(DISTINCT variant_uid) FROM quality_results"
                                " WHERE task = 'qg_simple_stories'").fetchone()[0]
        assert evaluated == 2
        quality = reads.rows(con, "SELECT name, outcome, note FROM decision_checks WHERE kind = 'quality'")
        assert {(q["name"], q["outcome"]) for q in quality} == {
            ("qg_simple_stories/bits_per_byte", "uninformative"), ("random weights: quality not measured", "inconclusive")}
        assert all(RANDOM_WEIGHTS in q["note"] for q in quality)
        # Speed decides as usual, on real timings of both checkpoints.
        speed = reads.rows(con, "SELECT outcome, value FROM decision_checks WHERE kind = 'speed'")
        assert speed[0]["outcome"] == "pass" and speed[0]["value"] == card[0]["speedup"] > 0
    # A script reading the verdicts as JSON (a rerun: every stage reused) sees the weights were random on each row.
    again = run_cli(["run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(tmp_path / "work"), "-q",
                     "-f", "json"], prefect_api)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [(v["variant"], v["decision"], v["random_weights"]) for v in json.loads(again.stdout)] == [
        ("int8-w8a16", "inconclusive", True)]
    report = run_cli(["report", "-w", str(wh), "--out", str(tmp_path / "report.html")])
    assert report.returncode == 0, report.stderr
    html = (tmp_path / "report.html").read_text()
    assert "tiny (shape run, random weights)" in html and "tiny: a shape run with random weights" in html
