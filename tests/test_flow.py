"""End to end: the evaluate-model flow on the real tiny model, with real Prefect, llm-compressor,
lm-eval, transformers and DuckDB, into a temporary warehouse; then the same model again."""

import csv
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quantgate.flows.evaluate_model import evaluate_model
from quantgate.tasks.runtime import environment
from quantgate.warehouse import reads, sessions

pytestmark = pytest.mark.slow

TABLES = ("models", "variants", "quality_evals", "quality_results", "quality_samples")


def counts(con, tables=TABLES):
    return {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in tables}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_model_module):
    tmp = tmp_path_factory.mktemp("flow")
    wh, work = str(tmp / "w.ducklake"), str(tmp / "work")
    first = evaluate_model(model="stories260k", warehouse=wh, workdir=work)
    with sessions.session(wh, read_only=True) as con:
        after_first = counts(con)
    second = evaluate_model(model="stories260k", warehouse=wh, workdir=work)
    return wh, first, second, after_first


@pytest.fixture(scope="module")
def tiny_model_module():
    from tests.shared_data import TINY_MODEL

    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    return TINY_MODEL


def test_first_run_stores_every_stage(two_runs):
    wh, first, _, _ = two_runs
    with sessions.session(wh, read_only=True) as con:
        (run_id, status, versions) = con.execute(
            "SELECT run_id, status, versions FROM runs ORDER BY started_at LIMIT 1").fetchone()
        assert status == "completed"
        # The run names the program that made it: the libraries and the lock this environment came from.
        assert json.loads(versions)["lock"] == environment.program()["lock"] and "transformers" in json.loads(versions)
        built = reads.rows(con, "SELECT name, method, status, size_bytes, recipe_hash FROM variants ORDER BY name")
        assert [(r["name"], r["method"], r["status"]) for r in built] == [
            ("awq-w4a16-g32", "awq", "built"), ("base", "base", "built"), ("bnb-nf4", "bnb", "built"),
            ("gptq-w4a16-g32", "gptq", "built"), ("rtn-w2a16-g32", "rtn", "built")]
        assert all(r["size_bytes"] > 0 for r in built)
        per_variant = dict(con.execute(
            "SELECT variant_uid, count(*) FROM quality_results"
            " WHERE metric IN ('bits_per_byte', 'acc') OR task = 'qg_passkey' GROUP BY 1").fetchall())
        assert len(per_variant) == 5 and set(per_variant.values()) == {3}
        piqa_items = con.execute("SELECT count(DISTINCT doc_id) FROM quality_samples WHERE task = 'qg_piqa'").fetchone()[0]
        assert piqa_items == 100
        # Long context: 5 depths x 4 facts in a 150-word document, each scored 0/1 by exact match.
        passkey = con.execute("SELECT count(DISTINCT doc_id), min(value), max(value) FROM quality_samples"
                              " WHERE task = 'qg_passkey' AND metric = 'exact_match'").fetchone()
        assert passkey[0] == 20 and 0 <= passkey[1] <= passkey[2] <= 1
        # Every checkpoint has its speed rows (stg_speed_results); AWQ and GPTQ W4A16 g32 share a format (the same
        # config, quantization layout and shapes), so one of them was measured for both: 4 measured, 5 judged.
        # Transformers times the base and the bitsandbytes build; the compressed-tensors builds it would decompress
        # to 16 bits (the base's kernels again) are skipped with that reason.
        speed = reads.rows(con, "SELECT v.name, s.engine, s.status, s.reason, s.output_tokens FROM stg_speed_results s"
                                " JOIN variants v USING (variant_uid) WHERE s.run_id = ?", [run_id])
        transformers = {r["name"]: r for r in speed if r["engine"] == "transformers"}
        assert len(transformers) == 5
        assert {n for n, r in transformers.items() if r["status"] == "ok"} == {"base", "bnb-nf4"}
        assert all(r["status"] == "skipped" and "decompresses this compressed-tensors checkpoint" in r["reason"]
                   for n, r in transformers.items() if n not in ("base", "bnb-nf4"))
        assert {transformers[n]["output_tokens"] for n in ("base", "bnb-nf4")} == {4 * 8}  # 4 prompts x 8, EOS ignored
        vllm = [r for r in speed if r["engine"] == "vllm"]
        assert len(vllm) == 5 and all(r["status"] == "skipped" and "vllm" in r["reason"] for r in vllm)
        assert con.execute("SELECT count(DISTINCT variant_uid) FROM speed_results WHERE run_id = ?",
                           [run_id]).fetchone()[0] == 4


def test_policy_judges_4bit_and_rejects_2bit_on_confidence_bounds(two_runs):
    _, first, _, _ = two_runs
    card = {r["variant"]: r for r in first}
    w2 = card["rtn-w2a16-g32"]
    assert w2["decision"] == "reject"
    assert w2["reason"].startswith("reject: qg_simple_stories/bits_per_byte recovery")
    assert "95% CI [" in w2["reason"] and w2["quality_recovery"] < 0.5
    for name in ("awq-w4a16-g32", "gptq-w4a16-g32"):
        row = card[name]
        # 4-bit keeps cross-entropy within ~10% of base on this 260K-parameter model; 2-bit loses most of it.
        assert row["quality_recovery"] > 0.9
        assert row["quality_lower_bound"] <= row["quality_recovery"]
        assert row["flip_rate"] is not None
        assert 0 < row["kl"] < w2["kl"]  # token-level KL from base: 2-bit drifts much further
        assert "speed vllm/gpu-throughput not measured" in row["reason"]
        # On a CPU only Transformers runs, and it would time these compressed-tensors builds decompressed (the
        # base's kernels again): no speedup is claimed for them.
        assert row["speedup"] is None
        assert "95% CI [" in row["reason"] and row["min_detectable_drop"] is not None
    # Its own policy (catalog/policy-tiny.yaml) gates cross-entropy only: the model is at chance on piqa.
    # Calibrated on text no suite evaluates (the standard library), 4-bit GPTQ of this 260K-parameter model
    # keeps ~94% of its cross-entropy on the stories: not accepted at 0.95. (It was, at 0.967, while it was
    # calibrated on the very stories it is scored on.)
    gptq = card["gptq-w4a16-g32"]
    assert gptq["decision"] in ("reject", "inconclusive"), gptq["reason"]
    assert gptq["quality_lower_bound"] < 0.95 and 0.9 < gptq["quality_recovery"] < 0.96
    assert gptq["reason"].startswith(f"{gptq['decision']}: qg_simple_stories/bits_per_byte recovery")


def test_under_the_default_policy_piqa_is_uninformative_for_a_base_at_chance(two_runs):
    """stories260k scores about 0.5 on 2-choice piqa: under the default policy (which gates piqa) that gate is
    uninformative for every variant, with its chance level from the stored items, and decides nothing."""
    from quantgate.catalog.load import load_catalog
    from quantgate.tasks.steps.decide import decide

    wh, _, _, _ = two_runs
    policy = load_catalog().policy
    assert ("qg_piqa", "acc") in {(g.task, g.metric) for g in policy.quality}
    with sessions.session(wh, read_only=True) as con:
        run_id = con.execute("SELECT run_id FROM runs ORDER BY started_at LIMIT 1").fetchone()[0]
        piqa = reads.rows(con, "SELECT chance, base_value, recovery, recovery_above_chance FROM variant_recovery"
                               " WHERE run_id = ? AND task = 'qg_piqa' AND metric = 'acc'", [run_id])
        evidence = reads.decision_evidence(con, run_id, [(g.task, g.metric) for g in policy.quality])
        base_size = con.execute("SELECT size_bytes FROM variants WHERE name = 'base'").fetchone()[0]
    assert len(piqa) == 4 and {r["chance"] for r in piqa} == {0.5}  # piqa's two solutions per item
    assert all(r["recovery_above_chance"] == pytest.approx((r["recovery"] * r["base_value"] - 0.5)
                                                           / (r["base_value"] - 0.5)) for r in piqa)
    for row in evidence.variants:
        d = decide(row, base_size, policy=policy, **evidence.of(row["variant_uid"]))
        check = next(c for c in d.checks if c.name == "qg_piqa/acc")
        assert check.outcome == "uninformative", check.note
        assert re.search(r"qg_piqa/acc uninformative: base 0\.\d+ vs chance 0\.5 .*qg_piqa cannot measure this"
                         r" model", check.note)
        assert "no informative quality gate" not in d.reason  # bits per byte has no chance level: it decides


def test_bitsandbytes_nf4_goes_through_every_stage_on_cpu(two_runs):
    wh, first, _, _ = two_runs
    card = {r["variant"]: r for r in first}
    nf4 = card["bnb-nf4"]
    assert (nf4["method"], nf4["scheme"], nf4["bits"], nf4["group_size"], nf4["build_status"]) == (
        "bnb", "nf4", 4, None, "built")
    # Quality (lm-eval's hf backend on the model bitsandbytes quantized as it loaded), KL, speed, size, decision.
    assert 0.8 < nf4["quality_recovery"] < 1.0 and nf4["kl"] > 0 and nf4["long_context"] is not None
    assert nf4["speedup_basis"] == "transformers/tiny-offline" and nf4["speedup"] > 0
    # In memory: two weights a byte (plus block scales); the fp32 embeddings stay as they are.
    assert 0.1 < nf4["size_ratio"] < 0.4
    assert nf4["reason"].split(":")[0] == nf4["decision"] and "qg_simple_stories/bits_per_byte recovery" in nf4["reason"]
    with sessions.session(wh, read_only=True) as con:
        row = reads.rows(con, "SELECT recipe, lib_versions, path FROM variants WHERE name = 'bnb-nf4'")[0]
        vllm = reads.rows(con, "SELECT s.reason FROM speed_results s JOIN variants v USING (variant_uid)"
                               " WHERE v.name = 'bnb-nf4' AND s.engine = 'vllm'")
    assert '"bnb_4bit_quant_type": "nf4"' in row["recipe"] and "bitsandbytes" in row["lib_versions"]
    assert not any(p.suffix == ".safetensors" for p in Path(row["path"]).iterdir())
    assert vllm and all("vllm" in r["reason"] for r in vllm)


def test_long_context_metric_is_in_the_scorecard(two_runs):
    wh, first, _, _ = two_runs
    for row in first:
        # The 260K-parameter model finds few or none of the facts; the value is there, recovery only where base > 0.
        assert row["long_context"] is not None and 0 <= row["long_context"] <= 1, row
        assert row["long_context_base"] is not None
    with sessions.session(wh, read_only=True) as con:
        lc = reads.rows(con, "SELECT * FROM variant_long_context")
    assert {r["long_context_task"] for r in lc} == {"qg_passkey"} and {r["long_context_items"] for r in lc} == {20}


def test_scorecard_is_published_as_prefect_artifacts(two_runs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[
            "scorecard-stories260k", "decisions-stories260k"])))
    assert {a.key for a in artifacts} == {"scorecard-stories260k", "decisions-stories260k"}
    table = next(a for a in artifacts if a.key == "decisions-stories260k")
    assert "gptq-w4a16-g32" in str(table.data) and "reject" in str(table.data)


def test_second_run_reuses_builds_and_adds_no_duplicates(two_runs):
    wh, first, second, after_first = two_runs
    with sessions.session(wh, read_only=True) as con:
        assert counts(con) == after_first
        runs = reads.rows(con, "SELECT run_id FROM runs ORDER BY started_at")
        assert len(runs) == 2
        reused = reads.rows(con, "SELECT role, reused FROM run_variants WHERE run_id = ? AND role = 'variant'", [runs[1]["run_id"]])
        assert len(reused) == 4 and all(r["reused"] for r in reused)
        assert con.execute("SELECT count(*) FROM decisions").fetchone()[0] == 8
    assert [r["variant"] for r in second] == [r["variant"] for r in first]
    assert all(r["reused"] for r in second)
    assert [r["decision"] for r in second] == [r["decision"] for r in first]


def test_cli_sql_is_read_only_and_errors_are_one_line(two_runs):
    wh, first = two_runs[0], two_runs[1]
    cli = [sys.executable, "-m", "quantgate.flows.cli"]
    ok = subprocess.run([*cli, "sql", "select variant, decision from variant_scorecard", "-w", wh, "-f", "csv"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "rtn-w2a16-g32,reject" in ok.stdout
    assert sorted(ok.stdout.splitlines()[1:]) == sorted(f"{r['variant']},{r['decision']}" for r in first)
    write = subprocess.run([*cli, "sql", "delete from runs", "-w", wh], capture_output=True, text=True)
    assert write.returncode != 0 and "queries only (SELECT, EXPLAIN), not DELETE" in write.stderr
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 2
    unknown = subprocess.run([*cli, "run", "no-such-model", "-w", wh], capture_output=True, text=True)
    assert unknown.returncode == 1
    assert unknown.stderr.strip().count("\n") == 0 and "unknown model 'no-such-model'" in unknown.stderr


def test_every_measurement_has_its_window_and_nothing_overlaps_it(two_runs):
    """The CPU run measures after KL, one engine at a time; the view holds the GPU run to the same rule, where
    engines start beside the builds and evaluations (tests/test_gpu_clock.py has that interleaving)."""
    wh, *_ = two_runs
    with sessions.session(wh, read_only=True) as con:
        measured = con.execute("SELECT count(*) FROM speed_results WHERE status = 'ok'").fetchone()[0]
        windows = reads.rows(con, "SELECT * FROM measurement_windows")
    assert measured and len(windows) == measured
    assert all(w["seconds"] > 0 and w["waited_s"] >= 0 for w in windows)
    assert [(w["overlapping_work"], w["overlapping_measurements"]) for w in windows] == [(0, 0)] * len(windows)


def test_a_runs_end_fits_100_columns_with_the_verdict_first(two_runs):
    """Last in this module: it adds a third (cached) run."""
    wh, first = two_runs[0], two_runs[1]
    cli = [sys.executable, "-m", "quantgate.flows.cli"]
    env = {**os.environ, "COLUMNS": "100"}  # as on a terminal of 100 columns (the output here is a pipe)
    done = subprocess.run([*cli, "run", "stories260k", "-w", wh, "--workdir", str(Path(wh).parent / "work"), "-q"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) <= 100, done.stdout
    header = [c.strip() for c in re.split("[┃│]", next(line for line in lines if "variant" in line))]
    assert header[1:-1] == ["variant", "decision", "deciding_check", "size", "speedup"]
    for row in first:
        assert any(row["variant"] in line and f" {row['decision']} " in line for line in lines), row
    assert "every check: quantgate checks stories260k [VARIANT]" in done.stdout

    one = subprocess.run([*cli, "checks", "stories260k", "gptq-w4a16-g32", "-w", wh], capture_output=True, text=True,
                         env=env)
    assert one.returncode == 0 and max(map(len, one.stdout.splitlines())) <= 100, one.stdout + one.stderr
    assert "qg_simple_stories/bits_per_byte" in one.stdout and "awq-w4a16-g32" not in one.stdout
    every = subprocess.run([*cli, "checks", "stories260k", "-w", wh, "-f", "csv"], capture_output=True, text=True)
    checks = list(csv.DictReader(io.StringIO(every.stdout)))
    assert {c["variant"] for c in checks} == {r["variant"] for r in first}
    assert {c["kind"] for c in checks} >= {"quality", "size", "speed"} and all(c["note"] for c in checks)
