"""Decisions you can trust, in the warehouse: flip rates, per-item stderrs, regressions across runs, the
scorecard's confidence columns and export. Real DuckDB, rows seeded through the warehouse's own writers."""

import math

import duckdb
import numpy as np
import pytest
from lm_eval.api.metrics import mean_stderr

from quantgate.catalog.policy import Policy
from quantgate.catalog.records import (
    MetricResult, ModelArtifact, QualityReport, SampleResult, SpeedResult, VariantArtifact,
)
from quantgate.tasks.steps.decide import decide
from quantgate.warehouse import lake, ledger, reads, sessions, transfer, writers

N_ITEMS, N_DOCS = 200, 12
RNG = np.random.default_rng(7)
BASE_ACC = (RNG.random(N_ITEMS) < 0.7).astype(float)
BYTES = RNG.integers(300, 700, size=N_DOCS).astype(float)
BASE_LL = -BYTES * RNG.uniform(0.6, 0.7, size=N_DOCS)
POLICY = Policy.model_validate({
    "version": 1,
    "quality": [{"task": "qg_simple_stories", "metric": "bits_per_byte", "min_recovery": 0.95, "higher_is_better": False},
                {"task": "qg_piqa", "metric": "acc", "min_recovery": 0.95, "higher_is_better": True}],
    "max_size_ratio": 0.75,
})


def lose(acc, k):
    """The first k right answers turned wrong."""
    out = acc.copy()
    out[np.flatnonzero(acc == 1)[:k]] = 0
    return out


def quality(key, acc, ll):
    bpb = -ll.sum() / (math.log(2) * BYTES.sum())
    return QualityReport(eval_key=key, evaluator="lm-eval", config={}, seconds=1.0, metrics=[
        MetricResult("qg_piqa", "acc", "none", float(acc.mean()), mean_stderr(list(acc)), N_ITEMS, "1", True),
        MetricResult("qg_simple_stories", "bits_per_byte", "none", float(bpb), None, N_DOCS, "1", False),
    ], samples=[SampleResult("qg_piqa", i, "acc", float(x), {"target": 0, "lls": [-1.0, -2.0]}) for i, x in enumerate(acc)]
      + [SampleResult("qg_simple_stories", i, "bits_per_byte", float(x), {"ll": float(x), "weight": float(b)})
         for i, (x, b) in enumerate(zip(ll, BYTES))])


def variant(uid, name, method="gptq", size=100):
    return VariantArtifact(uid=uid, model_uid="m@abc", name=name, method=method, scheme="W4A16", bits=4, group_size=32,
                           path=f"/x/{uid}", recipe=f"recipe of {uid}", recipe_hash=uid, size_bytes=size)


def speed(tps):
    return [SpeedResult(engine="transformers", scenario="s", status="ok", reason=None, config={"x": 1}, tokens_per_s=tps)]


def seed(con, run_id, key, builds, started):
    """One evaluate-model run of model m: `builds` maps (uid, name) to (acc items, ll per doc, tokens/s)."""
    ledger.start_run(con, run_id, "evaluate-model", "m", "c.yaml", "h", "host", {})
    con.execute("UPDATE runs SET started_at = ? WHERE run_id = ?", [started, run_id])
    writers.record_model(con, run_id, ModelArtifact("m", "/m", "local", None, "abc" * 10))
    for (uid, name), (acc, ll, tps) in builds.items():
        v = variant(uid, name, method="base", size=400) if name == "base" else variant(uid, name)
        writers.record_variant(con, run_id, v, "base" if name == "base" else "variant")
        writers.record_quality(con, run_id, uid, quality(key, acc, ll))
        writers.record_speed(con, run_id, uid, speed(tps))
    ledger.finish_run(con, run_id)


@pytest.fixture
def warehouse(tmp_path):
    path = tmp_path / "w.ducklake"
    with sessions.session(path) as con:
        # Run 1. gptq loses 6 items; awq (recipe a1) loses 4.
        seed(con, "r1", "k1", {
            ("base", "base"): (BASE_ACC, BASE_LL, 100.0),
            ("g1", "gptq"): (lose(BASE_ACC, 6), BASE_LL * 1.02, 150.0),
            ("a1", "awq"): (lose(BASE_ACC, 4), BASE_LL * 1.03, 140.0),
        }, "2026-01-01 10:00:00")
        # Run 2, a new evaluation config (eval_key k2): gptq's piqa drops by 40 items (planted regression),
        # its bits_per_byte moves 0.1% (noise) and it got a third slower; the base is scored identically
        # and 2% faster. awq was rebuilt with another recipe (a2) that loses 60 items.
        seed(con, "r2", "k2", {
            ("base", "base"): (BASE_ACC, BASE_LL, 102.0),
            ("g1", "gptq"): (lose(BASE_ACC, 46), BASE_LL * 1.021, 100.0),
            ("a2", "awq"): (lose(BASE_ACC, 60), BASE_LL * 1.03, 140.0),
        }, "2026-01-02 10:00:00")
    return path


@pytest.fixture
def con(warehouse):
    with sessions.session(warehouse) as con:
        yield con


def test_flip_rate_counts_items_that_changed_both_ways(con):
    # One variant that both loses and gains: 5 right → wrong, 3 wrong → right.
    mixed = lose(BASE_ACC, 5)
    mixed[np.flatnonzero(BASE_ACC == 0)[:3]] = 1
    seed(con, "r3", "k3", {("base", "base"): (BASE_ACC, BASE_LL, 100.0), ("x1", "mixed"): (mixed, BASE_LL, 100.0)},
         "2026-01-03 10:00:00")
    flips = reads.rows(con, "SELECT * FROM variant_flips WHERE run_id = 'r3'")
    assert [(f["task"], f["metric"]) for f in flips] == [("qg_piqa", "acc")]  # bits_per_byte is not scored 0/1
    f = flips[0]
    assert (f["n_items"], f["flips_to_wrong"], f["flips_to_right"]) == (N_ITEMS, 5, 3)
    assert (f["to_wrong_rate"], f["to_right_rate"], f["flip_rate"]) == pytest.approx((5 / N_ITEMS, 3 / N_ITEMS, 8 / N_ITEMS))
    # Accuracy moved by only 2 items; the flip rate shows that 8 changed.
    assert f["variant_value"] - f["base_value"] == pytest.approx(-2 / N_ITEMS)
    by_run = {(r["run_id"], r["variant_uid"]): r["flip_rate"] for r in reads.rows(con, "SELECT * FROM variant_flips")}
    assert by_run[("r1", "g1")] == pytest.approx(6 / N_ITEMS) and by_run[("r2", "g1")] == pytest.approx(46 / N_ITEMS)


def test_per_item_stderr_fills_in_what_lm_eval_does_not_report(con):
    se = {(r["variant_uid"], r["eval_key"], r["metric"]): r["stderr"] for r in reads.rows(con, "SELECT * FROM sample_stderr")}
    assert se[("base", "k1", "acc")] == pytest.approx(mean_stderr(list(BASE_ACC)))
    # bits_per_byte: the linearised stderr agrees with a plain bootstrap over documents.
    idx = np.random.default_rng(0).integers(0, N_DOCS, size=(4000, N_DOCS))
    boot = -BASE_LL[idx].sum(1) / (math.log(2) * BYTES[idx].sum(1))
    assert se[("base", "k1", "bits_per_byte")] == pytest.approx(boot.std(), rel=0.15)
    (filled,) = con.execute("SELECT se FROM stg_run_quality_se WHERE run_id = 'r1' AND variant_uid = 'base'"
                            " AND metric = 'bits_per_byte'").fetchone()
    assert filled == pytest.approx(se[("base", "k1", "bits_per_byte")])


def test_regressions_flag_what_moved_beyond_noise_and_nothing_else(con):
    rows = {(r["kind"], r["variant"], r["measure"]): r for r in reads.rows(con, "SELECT * FROM regressions")}
    acc = rows[("quality", "gptq", "qg_piqa/acc")]
    assert (acc["change"], acc["flagged"]) == ("worse", True)
    assert acc["delta"] == pytest.approx(-40 / N_ITEMS) and abs(acc["delta"]) > acc["noise"] > 0
    assert (acc["run_id"], acc["previous_run_id"], acc["basis"]) == ("r2", "r1", "eval_key k1 → k2")
    bpb = rows[("quality", "gptq", "qg_simple_stories/bits_per_byte")]
    assert (bpb["change"], bpb["flagged"]) == ("within noise", False) and bpb["delta"] != 0
    assert rows[("quality", "base", "qg_piqa/acc")]["change"] == "unchanged"

    slow = rows[("speed", "gptq", "transformers/s tokens_per_s")]
    assert (slow["previous_value"], slow["value"], slow["change"], slow["flagged"]) == (150.0, 100.0, "worse", True)
    assert rows[("speed", "base", "transformers/s tokens_per_s")]["change"] == "within noise"  # +2% < 10%

    # The rebuilt awq: same name, another build, recovery fell far beyond noise.
    recipe = rows[("recipe", "awq", "qg_piqa/acc recovery")]
    assert (recipe["variant_uid"], recipe["previous_variant_uid"], recipe["flagged"]) == ("a2", "a1", True)
    assert recipe["previous_value"] == pytest.approx(1 - 4 / BASE_ACC.sum())
    assert recipe["value"] == pytest.approx(1 - 60 / BASE_ACC.sum())
    assert rows[("recipe", "awq", "qg_simple_stories/bits_per_byte recovery")]["change"] == "unchanged"
    # Builds seen in one run only have no quality or speed history.
    assert not [k for k in rows if k[0] in ("quality", "speed") and k[1] == "awq"]
    flagged = [k for k, r in rows.items() if r["flagged"]]
    assert sorted(flagged) == sorted([("quality", "gptq", "qg_piqa/acc"), ("speed", "gptq", "transformers/s tokens_per_s"),
                                      ("recipe", "awq", "qg_piqa/acc recovery")])


def decide_run(con, run_id):
    """What the flow's decide stage does: the run's rows of the views, one decision per variant, stored."""
    recovery = reads.rows(con, "SELECT * FROM variant_recovery WHERE run_id = ?", [run_id])
    samples = reads.paired_samples(con, run_id, [(g.task, g.metric) for g in POLICY.quality])
    flips = reads.rows(con, "SELECT * FROM variant_flips WHERE run_id = ?", [run_id])
    variants = reads.rows(con, "SELECT v.* FROM variants v JOIN run_variants rv USING (variant_uid)"
                               " WHERE rv.run_id = ? AND rv.role = 'variant' ORDER BY name", [run_id])
    mine = lambda rows, v: [r for r in rows if r["variant_uid"] == v["variant_uid"]]  # noqa: E731
    decisions = [decide(v, 400, mine(recovery, v), [], POLICY, mine(samples, v), mine(flips, v)) for v in variants]
    writers.record_decisions(con, run_id, decisions, POLICY.model_dump(mode="json"))
    return samples


def test_decisions_from_paired_items_reach_the_scorecard(con):
    samples = decide_run(con, "r2")
    assert {(s["task"], s["metric"]) for s in samples} == {("qg_piqa", "acc"), ("qg_simple_stories", "bits_per_byte")}
    assert {s["base_weight"] for s in samples if s["metric"] == "bits_per_byte"} == set(BYTES)
    card = {r["variant"]: r for r in reads.rows(con, "SELECT * FROM variant_scorecard")}
    awq = card["awq"]
    assert awq["decision"] == "reject" and awq["reason"].startswith("reject: qg_piqa/acc recovery")
    assert awq["quality_lower_bound"] < awq["quality_recovery"] < 0.95
    assert awq["flip_rate"] == pytest.approx(60 / N_ITEMS)
    assert (awq["deciding_check"], awq["deciding_threshold"]) == ("qg_piqa/acc", 0.95)
    assert awq["deciding_value"] == pytest.approx(awq["quality_recovery"])


def test_three_verdicts_are_stored_as_check_rows_and_the_scorecard_shows_the_deciding_one(con):
    # 200 piqa items (BASE_ACC, ~140 right) and the same stories: lossless, 5 answers lost, 60 lost.
    seed(con, "r3", "k3", {("base", "base"): (BASE_ACC, BASE_LL, 100.0),
                           ("x0", "lossless"): (BASE_ACC, BASE_LL, 100.0),
                           ("x5", "five-lost"): (lose(BASE_ACC, 5), BASE_LL, 100.0),
                           ("x60", "sixty-lost"): (lose(BASE_ACC, 60), BASE_LL, 100.0)}, "2026-01-03 10:00:00")
    decide_run(con, "r3")
    card = {r["variant"]: r for r in reads.rows(con, "SELECT * FROM variant_scorecard")}
    assert {v: r["decision"] for v, r in card.items()} == {
        "lossless": "accept", "five-lost": "inconclusive", "sixty-lost": "reject"}
    assert card["lossless"]["deciding_check"] is None and card["lossless"]["items_to_decide"] is None
    unsure, bad = card["five-lost"], card["sixty-lost"]
    assert (unsure["deciding_check"], unsure["deciding_threshold"]) == ("qg_piqa/acc", 0.95)
    right = int(BASE_ACC.sum())
    assert unsure["deciding_value"] == pytest.approx(1 - 5 / right) and unsure["items_to_decide"] > N_ITEMS
    assert f"~{round(unsure['items_to_decide'], -2):,} items would decide (have {N_ITEMS})" in unsure["reason"]
    assert bad["deciding_check"] == "qg_piqa/acc" and bad["deciding_value"] == pytest.approx(1 - 60 / right)

    rows = reads.rows(con, "SELECT * FROM decision_checks WHERE run_id = 'r3' AND variant_uid = 'x5' ORDER BY position")
    assert [(r["kind"], r["name"], r["outcome"]) for r in rows] == [
        ("quality", "qg_simple_stories/bits_per_byte", "pass"), ("quality", "qg_piqa/acc", "inconclusive"),
        ("size", "size", "pass")]
    piqa = rows[1]
    assert (piqa["task"], piqa["metric"], piqa["items"], piqa["threshold"]) == ("qg_piqa", "acc", N_ITEMS, 0.95)
    assert piqa["lower"] < 0.95 <= piqa["upper"] and piqa["items_to_decide"] == unsure["items_to_decide"]
    assert 0 < piqa["min_detectable_drop"] < 1 and piqa["note"] in unsure["reason"]
    # The scorecard's power: the least powered gate, here piqa's 200 items (the stories give a tight interval).
    assert (unsure["power_basis"], unsure["min_detectable_drop"]) == ("qg_piqa/acc", pytest.approx(piqa["min_detectable_drop"]))

    # Deciding again replaces the rows rather than adding to them.
    decide_run(con, "r3")
    assert con.execute("SELECT count(*) FROM decision_checks WHERE run_id = 'r3'").fetchone()[0] == 9


def test_a_verdict_that_steps_down_is_a_flagged_regression(con):
    builds = lambda acc: {("base", "base"): (BASE_ACC, BASE_LL, 100.0), ("y", "int8"): (acc, BASE_LL, 100.0)}  # noqa: E731
    seed(con, "r3", "k3", builds(BASE_ACC), "2026-01-03 10:00:00")
    decide_run(con, "r3")
    seed(con, "r4", "k4", builds(lose(BASE_ACC, 5)), "2026-01-04 10:00:00")
    decide_run(con, "r4")
    (row,) = reads.rows(con, "SELECT * FROM regressions WHERE kind = 'decision'")
    assert (row["variant"], row["basis"], row["change"], row["flagged"]) == ("int8", "accept → inconclusive", "worse", True)
    assert (row["run_id"], row["previous_run_id"]) == ("r4", "r3")


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_export_round_trips_every_table_and_view(con, tmp_path, fmt):
    files = transfer.export(con, tmp_path / fmt, fmt)
    names = {n for (n,) in con.execute("SELECT table_name FROM information_schema.tables WHERE table_catalog ="
                                       " current_database() AND table_schema = 'main'").fetchall()}
    assert {f.stem for f in files} == names and {"regressions", "variant_flips", "quality_samples", "decisions"} <= names
    reader = "read_parquet" if fmt == "parquet" else "read_csv"
    for f in files:
        (exported,) = duckdb.sql(f"SELECT count(*) FROM {reader}('{f}')").fetchone()
        assert exported == con.execute(f'SELECT count(*) FROM "{f.stem}"').fetchone()[0], f.name
    query = "SELECT variant_uid, eval_key, task, doc_id, metric, value FROM {} ORDER BY ALL"
    back = duckdb.sql(query.format(f"{reader}('{tmp_path / fmt / f'quality_samples.{fmt}'}')")).fetchall()
    assert back == con.execute(query.format("quality_samples")).fetchall()
    with pytest.raises(lake.WarehouseError, match="unknown export format 'xlsx'"):
        transfer.export(con, tmp_path / "x", "xlsx")


def test_cli_report_lists_regressions_before_the_scorecard_and_export_writes_files(warehouse, tmp_path):
    from typer.testing import CliRunner

    from quantgate.flows.cli import app

    out = CliRunner().invoke(app, ["report", "-w", str(warehouse)], terminal_width=250)
    assert out.exit_code == 0, out.output
    text = out.output
    assert text.index("Changes beyond noise") < text.index("qg_piqa/acc recovery") < text.index("quality_lower_bound")
    assert "eval_key k1 → k2" in text and "within noise" not in text  # only what moved is listed

    done = CliRunner().invoke(app, ["export", str(tmp_path / "csv"), "--format", "csv", "-w", str(warehouse)])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "csv" / "regressions.csv").exists() and "csv files in" in done.output
    bad = CliRunner().invoke(app, ["export", str(tmp_path / "x"), "--format", "xlsx", "-w", str(warehouse)])
    assert bad.exit_code != 0 and "unknown format 'xlsx'" in bad.output
