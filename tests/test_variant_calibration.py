"""Variants that name their own calibration set, through the evaluate-model flow on the real tiny model (real
Prefect, llm-compressor on the CPU, lm-eval and DuckDB): one recipe with two calibration sets is two builds of
two uids, each built with its own set; a variant's set that overlaps the evaluated text is refused before any
build, as the model's own set is."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from quantgate.catalog.load import load_catalog
from quantgate.flows.evaluate_model import evaluate_model
from quantgate.tasks.steps.calibration import load_calibration
from quantgate.tasks.steps.quantize import lib_versions, recipe_for, variant_uid
from quantgate.warehouse import reads, sessions
from tests.shared_data import SHARED, TINY_MODEL

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not TINY_MODEL.is_dir(), reason=f"shared tiny model not found at {TINY_MODEL}")]

STORIES = SHARED / "eval" / "simple_stories" / "simple_stories.txt"


def catalog(tmp: Path, second_set: str) -> Path:
    """Two GPTQ variants of one recipe on the tiny model: `gptq` with the model's calibration, `gptq-other`
    with the catalog's set `second_set`."""
    path = tmp / "catalog.yaml"
    path.write_text(textwrap.dedent(f"""
        version: 1
        variants:
          gptq:       {{method: gptq, scheme: W4A16, group_size: 32}}
          gptq-other: {{method: gptq, scheme: W4A16, group_size: 32, calibration_set: {second_set}}}
        suites:
          stories: {{tasks: [{{name: qg_simple_stories, limit: 1}}]}}
        calibrations:
          # The standard library's text as the model's set is, in another order.
          stdlib-seed1: {{kind: text, samples: 4, seq_len: 32, seed: 1}}
          # The suite's own (and KL) text: the overlap check refuses it.
          stories: {{kind: text, path: {STORIES}, samples: 2, seq_len: 64}}
        models:
          - id: tiny
            source: {{kind: local, path: {TINY_MODEL}}}
            variants: [gptq, gptq-other]
            suite: stories
            calibration: {{kind: text, samples: 4, seq_len: 32}}
        policy:
          version: 1
          quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.5, higher_is_better: false}}]
    """))
    return path


def test_one_recipe_with_two_calibration_sets_is_two_variants_each_built_with_its_own(tmp_path):
    cat_path = catalog(tmp_path, "stdlib-seed1")
    wh = str(tmp_path / "w.ducklake")
    card = evaluate_model(model="tiny", catalog=str(cat_path), warehouse=wh, workdir=str(tmp_path / "work"))
    with sessions.session(wh, read_only=True) as con:
        rows = {r["name"]: r for r in reads.rows(con, "SELECT v.*, r.reused FROM variants v JOIN run_variants r"
                                                       " USING (variant_uid) WHERE r.role = 'variant'")}
        model = reads.model_of(con, rows["gptq"]["model_uid"])
    assert {r["variant"] for r in card} == {"gptq", "gptq-other"}
    # Both built, neither a reuse of the other.
    assert all(r["status"] == "built" and not r["reused"] and (Path(r["path"]) / "config.json").is_file()
               for r in rows.values())
    # The same recipe, two uids: each is the uid of the build with its own calibration's samples.
    assert rows["gptq"]["recipe_hash"] == rows["gptq-other"]["recipe_hash"]
    assert rows["gptq"]["variant_uid"] != rows["gptq-other"]["variant_uid"]
    cat = load_catalog(cat_path)
    spec = cat.model("tiny")
    for name, r in rows.items():
        samples = load_calibration(cat.calibration_for(spec, cat.variants[name]), model.path)
        recipe_hash = recipe_for(cat.variants[name])[1]
        assert r["variant_uid"] == variant_uid(model, recipe_hash, lib_versions(), samples.fingerprint), name


def test_a_variants_calibration_set_on_the_evaluated_text_is_refused_before_any_build(tmp_path):
    cat_path = catalog(tmp_path, "stories")
    wh, work = str(tmp_path / "w.ducklake"), tmp_path / "work"
    state = evaluate_model(model="tiny", catalog=str(cat_path), warehouse=wh, workdir=str(work), return_state=True)
    assert state.is_failed()
    # One line naming the variant's set (the model's own set, checked first, passes).
    assert state.message.startswith("calibration set stories overlaps ") and "\n" not in state.message
    with sessions.session(wh, read_only=True) as con:
        assert reads.rows(con, "SELECT status, error FROM runs") == [{"status": "failed", "error": state.message}]
        assert con.execute("SELECT count(*) FROM variants").fetchone()[0] == 0
    assert not (work / "variants").exists() or not any((work / "variants").iterdir())
