"""Prefect task caching of download, the calibration check and quantize on the real tiny model (ephemeral API,
real llm-compressor): a second run is served from the cache records under the work dir, a cached build whose
checkpoint was deleted is built again rather than trusted, a build's key is not computed again for the same
inputs, and a refused calibration set is refused every time."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from prefect import flow

from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import ModelArtifact
from quantgate.catalog.sources import LocalSource
from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.catalog.variants import TextCalibration, VariantSpec
from quantgate.tasks.steps import caching
from quantgate.tasks.steps.caching import (
    CACHE_DIR, KEY_MEMO, build_cached, calibration_check_key, check_calibration_cached, download_cached, download_key,
    quantize_key, remembered_quantize_key,
)
from quantgate.tasks.steps import quantize
from quantgate.tasks.steps.calibration import CalibrationError, evaluated_documents
from quantgate.warehouse import sessions
from tests.shared_data import SHARED

pytestmark = pytest.mark.slow

INT8 = VariantSpec(name="int8-w8a16", method="rtn", scheme="W8A16", group_size=None)


@flow
def fetch_and_build(model_path: str, root: str) -> tuple:
    from prefect.runtime import flow_run

    spec = ModelSpec(id="tiny", source=LocalSource(path=model_path), variants=("int8-w8a16",), suite="s")
    model = download_cached(spec, Path(root))
    variant = build_cached(model, INT8, TextCalibration(), Path(root))
    return str(flow_run.id), model, variant


def task_states(flow_run_id: str) -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    out: dict[str, list[str]] = {}
    for r in sorted(runs, key=lambda r: r.expected_start_time or r.created):
        out.setdefault(r.name, []).append(r.state.name)
    return out


def test_second_run_is_served_from_the_cache_and_a_deleted_build_is_rebuilt(tiny_model, tmp_path):
    root = tmp_path / "work"
    run1, model, built = fetch_and_build(str(tiny_model), str(root))
    assert task_states(run1) == {"download tiny": ["Completed"], "quantize tiny/int8-w8a16": ["Completed"]}
    assert built.ok and not built.reused and (Path(built.path) / quantize.MARKER).is_file()
    # The cache key is the variant uid: model sha + recipe hash + quantizer library versions.
    _, recipe_hash = quantize.recipe_for(INT8)
    uid = quantize.variant_uid(model, recipe_hash, quantize.lib_versions())
    assert built.uid == uid and quantize_key(model, INT8, TextCalibration()).startswith(f"quantize-{uid}-")
    keys = sorted(p.name for p in (root / CACHE_DIR / "keys").iterdir())
    spec = ModelSpec(id="tiny", source=LocalSource(path=str(tiny_model)), variants=(), suite="s")
    assert keys == sorted([download_key(spec, root / "models"), quantize_key(model, INT8, TextCalibration())])

    run2, model2, again = fetch_and_build(str(tiny_model), str(root))
    assert task_states(run2) == {"download tiny": ["Cached"], "quantize tiny/int8-w8a16": ["Cached"]}
    assert model2 == model and again.reused and again.uid == built.uid and again.path == built.path

    shutil.rmtree(built.path)  # the cache record now names a checkpoint that is gone
    run3, _, rebuilt = fetch_and_build(str(tiny_model), str(root))
    # The stale hit is not trusted: the same task runs again with a refreshed cache record.
    assert task_states(run3) == {"download tiny": ["Cached"], "quantize tiny/int8-w8a16": ["Cached", "Completed"]}
    assert not rebuilt.reused and (Path(rebuilt.path) / quantize.MARKER).is_file()
    run4, _, cached = fetch_and_build(str(tiny_model), str(root))
    assert task_states(run4)["quantize tiny/int8-w8a16"] == ["Cached"] and cached.reused


# --- the calibration overlap check ---------------------------------------------------------------------------

SUITE = SuiteSpec(tasks=(LocalTask(name="qg_piqa", limit=20),))  # and its KL text: the stories, by default
STORIES = SHARED / "eval" / "simple_stories" / "simple_stories.txt"


@flow
def check(model_path: str, root: str, calibration_path: str | None) -> tuple:
    from prefect.runtime import flow_run

    spec = ModelSpec(id="tiny", source=LocalSource(path=model_path), variants=("gptq",), suite="s")
    model = download_cached(spec, Path(root))
    calib = TextCalibration(path=calibration_path, samples=4, seq_len=64)
    try:
        return str(flow_run.id), check_calibration_cached(calib, model, SUITE, Path(root)), None
    except CalibrationError as e:
        return str(flow_run.id), None, str(e)


def test_a_passing_calibration_check_is_served_from_the_cache_and_a_refusal_never_is(tiny_model, tmp_path):
    root = tmp_path / "work"

    def checks() -> list[str]:  # the calibration check's cache records
        return sorted(p.name for p in (root / CACHE_DIR / "keys").glob("calibration-*"))

    run1, samples, error = check(str(tiny_model), str(root), None)  # the standard library: shares nothing
    assert error is None and task_states(run1)["check calibration tiny"] == ["Completed"]
    run2, again, _ = check(str(tiny_model), str(root), None)
    # The second run does not check again: a real cache hit, the first run's samples.
    assert task_states(run2)["check calibration tiny"] == ["Cached"] and again == samples
    assert len(checks()) == 1
    # Calibrating on the KL text is refused on every run, in one line; a refusal leaves no cache record.
    for _ in range(2):
        run, refused, error = check(str(tiny_model), str(root), str(STORIES))
        assert refused is None and task_states(run)["check calibration tiny"] == ["Failed"]
        assert f"calibration set text {STORIES} overlaps the KL text item" in error and "\n" not in error
        assert len(checks()) == 1


def test_the_calibration_check_key_follows_what_its_verdict_depends_on(tiny_model, tmp_path):
    model = ModelArtifact(model_id="tiny", path=str(tiny_model), source="local", revision=None, sha="a" * 64)
    text = tmp_path / "calibration.txt"
    text.write_text("A paragraph of calibration text.\n\nAnother one.\n")
    calib = TextCalibration(path=str(text), samples=2, seq_len=8)
    evaluated = evaluated_documents(SUITE)
    key = calibration_check_key(calib, model, evaluated)
    assert key is not None and calibration_check_key(calib, model, evaluated_documents(SUITE)) == key
    kl_text = tmp_path / "kl.txt"
    kl_text.write_text("\n\n".join(STORIES.read_text().split("\n\n")[:3]))  # its first stories
    changed = [
        calibration_check_key(calib.model_copy(update={"seed": 1}), model, evaluated),  # the spec
        calibration_check_key(calib, replace(model, sha="b" * 64), evaluated),  # the tokenizer's checkpoint
        calibration_check_key(calib, model, evaluated_documents(  # the evaluated items
            SuiteSpec(tasks=(LocalTask(name="qg_piqa", limit=21),)))),
        calibration_check_key(calib, model, evaluated_documents(  # the KL text
            SUITE.model_copy(update={"kl_text": str(kl_text)}))),
    ]
    text.write_text("Other calibration text.\n\nSame file, same spec.\n")
    changed.append(calibration_check_key(calib, model, evaluated))  # the set's documents as read
    assert key not in changed and len(set(changed)) == len(changed)
    # A set that cannot be read has no key: the check runs and says why.
    assert calibration_check_key(TextCalibration(path=str(tmp_path / "gone.txt")), model, evaluated) is None


def test_an_overlapping_calibration_is_refused_on_a_rerun_too(tmp_path, capfd):
    from tests.test_bad_input import assert_one_line, quantgate, write_catalog

    catalog = write_catalog(tmp_path, method="gptq", scheme="W4A16",
                            calibration=f"{{path: {STORIES}, samples: 2, seq_len: 64}}")
    args = ["run", "-c", str(catalog), "tiny", "-w", str(tmp_path / "w.ducklake"), "--workdir", str(tmp_path / "work")]
    messages = [assert_one_line(*quantgate(capfd, *args), f"calibration set text {STORIES.resolve()} overlaps") for _ in range(2)]
    assert messages[0] == messages[1]
    with sessions.session(tmp_path / "w.ducklake", read_only=True) as con:
        attempts = [a for (a,) in con.execute("SELECT attempt_id FROM run_attempts ORDER BY started_at").fetchall()]
    assert len(attempts) == 2 and all(task_states(a)["check calibration tiny"] == ["Failed"] for a in attempts)


# --- the build key, kept by its inputs -----------------------------------------------------------------------

GPTQ = VariantSpec(name="gptq-w4a16-g32", method="gptq", scheme="W4A16", group_size=32)
PARAGRAPHS = "\n\n".join(f"Paragraph {i} of a calibration text that the tiny model's tokenizer splits into tokens."
                         for i in range(8))


def _recomputed(*args, **kwargs):
    raise AssertionError("the build key was computed again")


def test_a_build_key_is_computed_once_for_the_same_inputs(tiny_model, tmp_path, monkeypatch):
    root = tmp_path / "work"
    model = ModelArtifact(model_id="tiny", path=str(tiny_model), source="local", revision=None, sha="a" * 64)
    text = tmp_path / "calibration.txt"
    text.write_text(PARAGRAPHS)
    calib = TextCalibration(path=str(text), samples=2, seq_len=16)
    keys = {s.name: remembered_quantize_key(model, s, calib, root) for s in (INT8, GPTQ)}
    assert keys == {s.name: quantize_key(model, s, calib) for s in (INT8, GPTQ)}
    assert len(list((root / CACHE_DIR / KEY_MEMO).iterdir())) == 2
    with monkeypatch.context() as m:  # the recipe and the calibration samples are not made again
        m.setattr(quantize, "recipe_for", _recomputed)
        m.setattr(caching, "load_calibration", _recomputed)
        assert {s.name: remembered_quantize_key(model, s, calib, root) for s in (INT8, GPTQ)} == keys
    # What the key is computed from changes: it is computed anew.
    other = {
        "checkpoint": remembered_quantize_key(replace(model, sha="b" * 64), INT8, calib, root),
        "spec": remembered_quantize_key(model, GPTQ.model_copy(update={"group_size": 16}), calib, root),
        "calibration spec": remembered_quantize_key(model, GPTQ, calib.model_copy(update={"seed": 1}), root),
    }
    text.write_text(PARAGRAPHS.replace("Paragraph", "Section"))
    other["calibration documents"] = remembered_quantize_key(model, GPTQ, calib, root)
    assert not set(other.values()) & set(keys.values()) and len(set(other.values())) == len(other)
    # A calibrated key changes with the calibration; an uncalibrated one does not.
    assert remembered_quantize_key(model, INT8, calib, root) == keys[INT8.name]
    # The engine a run serves with is in the key (what vLLM cannot load is refused only there), from the same memo.
    served = {e: remembered_quantize_key(model, INT8, calib, root, e) for e in ("vllm", "hf")}
    assert len({*served.values(), keys[INT8.name]}) == 3 and served["vllm"].startswith(keys[INT8.name])


def test_a_rerun_of_a_build_is_a_cache_hit_without_computing_its_key(tiny_model, tmp_path, monkeypatch):
    root = tmp_path / "work"
    _, _, built = fetch_and_build(str(tiny_model), str(root))
    monkeypatch.setattr(quantize, "recipe_for", _recomputed)
    run, _, again = fetch_and_build(str(tiny_model), str(root))
    assert task_states(run)["quantize tiny/int8-w8a16"] == ["Cached"] and again.reused and again.uid == built.uid


def test_a_key_names_the_record_it_caches_so_a_moved_record_misses_instead_of_failing(tiny_model, tmp_path,
                                                                                      monkeypatch):
    """Cached results are pickled: after a record class moves (as quantgate.tasks.records did to
    quantgate.catalog.records) a key of the old shape would hit a result that cannot be unpickled, and fail the
    step. Each key names its record's module, class and fields, so such a record misses and is made anew."""
    spec = ModelSpec(id="tiny", source=LocalSource(path=str(tiny_model)), variants=("int8-w8a16",), suite="s")
    model = ModelArtifact("tiny", str(tiny_model), "local", None, "ab" * 20)
    assert caching.record_identity(ModelArtifact).startswith("quantgate.catalog.records.ModelArtifact(model_id,")
    keys = (download_key(spec, tmp_path), quantize_key(model, INT8, TextCalibration()))
    monkeypatch.setattr(caching, "record_identity", lambda cls: f"quantgate.tasks.records.{cls.__qualname__}()")
    moved = (download_key(spec, tmp_path), quantize_key(model, INT8, TextCalibration()))
    assert all(k is not None for k in keys) and keys[0] != moved[0] and keys[1] != moved[1]
