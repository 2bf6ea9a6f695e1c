"""The engine-drift sentinel (issue 45, item 3) on real runs: the tiny model through evaluate-model twice with a
probe in its suite, each run re-measuring its base on the probe's items (lm-eval, Transformers, DuckLake, all real)
and setting them beside the previous run's. Same versions: no flag. Another recorded library version with the base
held: no flag, the verdicts say it held. Another version and a base that moved: every verdict of the run says
"engine drift" with the library, the move and its interval; the regressions view and `quantgate checks` say so.

Only one version of each library is installed here, so the earlier run's program is made another one the way the
brief allows: the first run is a real run, and its recorded version row (runs.versions) is then changed to name an
older Transformers before the second run compares against it. Where the base must have moved, the first run's probe
items are also set to what an engine that scores every document 2% less likely would have stored (its
log-likelihoods × 1.02): a real older engine is what would write them, and none can run beside this one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantgate.catalog.policy import Policy
from quantgate.flows import evaluate_model as em
from quantgate.flows.cli import app
from quantgate.warehouse import drift, reads, sessions
from tests.cli_runs import copy_warehouse, tiny_catalog
from tests.shared_data import TINY_MODEL

pytestmark = pytest.mark.slow

OLD_TRANSFORMERS = "4.0.0"


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> tuple[Path, Path, Path, str]:
    """(catalog, work dir, warehouse, run id) of one real run whose suite probes 3 stories of its base."""
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    tmp = tmp_path_factory.mktemp("drift")
    cat = tiny_catalog(tmp, TINY_MODEL, {"rtn-w8a16": "{method: rtn, scheme: W8A16, group_size: null}"})
    cat.write_text(cat.read_text().replace("    batch_size: 8\n", "    batch_size: 8\n    probe: 3\n", 1))
    wh, work = tmp / "w.ducklake", tmp / "work"
    em.evaluate_model(model="tiny", catalog=str(cat), warehouse=str(wh), workdir=str(work))
    with sessions.session(wh, read_only=True) as con:
        (run_id,) = con.execute("SELECT run_id FROM runs").fetchone()
    return cat, work, wh, run_id


def second(first: tuple[Path, Path, Path, str], tmp_path: Path, *edits: str) -> tuple[Path, str]:
    """A copy of the first run's warehouse, `edits` (SQL, `?` the first run's id) applied, then a second real run
    into it; (warehouse, second run id)."""
    cat, work, wh, run1 = first
    copy = tmp_path / "w.ducklake"
    copy_warehouse(wh, copy)
    with sessions.session(copy) as con:
        for sql in edits:
            con.execute(sql, [run1] * sql.count("?"))
    em.evaluate_model(model="tiny", catalog=str(cat), warehouse=str(copy), workdir=str(work))
    with sessions.session(copy, read_only=True) as con:
        (run2,) = con.execute("SELECT run_id FROM runs WHERE run_id <> ?", [run1]).fetchone()
    return copy, run2


# The first run's recorded Transformers made an older one (why: the module's docstring).
OLDER_PROGRAM = f"UPDATE runs SET versions = json_merge_patch(versions, '{{\"transformers\": \"{OLD_TRANSFORMERS}\"}}')" \
                " WHERE run_id = ?"
# ... and the base's probe items as an engine 2% less sure of every document stored them.
OLDER_SCORES = "UPDATE quality_samples SET value = value * 1.02 WHERE eval_key LIKE 'probe:%' AND eval_key LIKE '%' || ?"


def probe_stages(con) -> dict[str, tuple[bool, int]]:
    """{run id: (whether its probe was taken from its suite evaluation, the probe stage's engine starts)}."""
    found = con.execute("SELECT e.run_id, e.config->>'$.measured_in' IS NOT NULL, s.engine_starts FROM quality_evals e"
                        " JOIN run_stages s ON s.run_id = e.run_id AND s.stage = 'probe'"
                        " WHERE e.eval_key LIKE 'probe:%'").fetchall()
    return {run_id: (derived, starts) for run_id, derived, starts in found}


def checks_of(wh: Path, run_id: str) -> list[dict]:
    with sessions.session(wh, read_only=True) as con:
        return reads.rows(con, "SELECT v.name, c.name AS check, c.outcome, c.note, c.value, c.lower, c.upper"
                               " FROM decision_checks c JOIN variants v USING (variant_uid)"
                               " WHERE c.run_id = ? AND c.name = 'engine drift'", [run_id])


def test_the_same_versions_and_the_same_base_flag_nothing(first, tmp_path: Path) -> None:
    _, _, wh1, run1 = first
    with sessions.session(wh1, read_only=True) as con:
        # The first run recorded the scoring libraries with the others, and stored its probe (3 documents).
        versions = drift.run_versions(con, run1)
        assert {"lm_eval", "transformers", "torch", "datasets"} <= set(versions)
        (key, n) = con.execute("SELECT eval_key, count(DISTINCT doc_id) FROM quality_samples WHERE eval_key LIKE"
                               " 'probe:%' GROUP BY eval_key").fetchone()
        assert key.endswith(f":{run1}") and n == 3
        assert drift.findings(con, run1) == []  # nothing before it to compare with
    wh, run2 = second(first, tmp_path)
    with sessions.session(wh, read_only=True) as con:
        found = drift.findings(con, run2)
        moved = reads.rows(con, "SELECT * FROM regressions WHERE kind = 'engine drift'")
        probes = probe_stages(con)
    # The first run measured its base's suite, and took the probe's items from it (no engine of its own); the
    # second reused that evaluation, so it measured its probe anew: the same items scored alike either way.
    assert probes == {run1: (True, 0), run2: (False, 1)}
    # Measured again, item for item the same: compared, not moved, nothing changed, no check on any verdict.
    assert found and all(f["previous_run_id"] == run1 and f["ratio"] == 1 and not f["moved"] and not f["drifted"]
                         and f["changed"] == "" for f in found)
    assert {(f["task"], f["metric"]) for f in found} >= {("qg_simple_stories", "bits_per_byte")}
    assert checks_of(wh, run2) == []
    assert moved and all(r["change"] == "unchanged" and not r["flagged"] for r in moved)


def test_another_library_version_with_the_base_held_is_no_drift(first, tmp_path: Path) -> None:
    wh, run2 = second(first, tmp_path, OLDER_PROGRAM)
    with sessions.session(wh, read_only=True) as con:
        found = drift.findings(con, run2)
        current = drift.run_versions(con, run2)["transformers"]
    assert all(not f["drifted"] and f["changed"] == f"transformers {OLD_TRANSFORMERS} → {current}" for f in found)
    (check,) = checks_of(wh, run2)
    assert check["outcome"] == "pass" and check["note"].startswith("engine drift: none: the base's probe held (base"
                                                                   " qg_simple_stories/bits_per_byte")
    assert check["note"].endswith(f"across transformers {OLD_TRANSFORMERS} → {current}")


def test_a_base_moved_with_a_library_is_engine_drift_in_every_verdict(first, tmp_path: Path) -> None:
    _, _, _, run1 = first
    wh, run2 = second(first, tmp_path, OLDER_PROGRAM, OLDER_SCORES)
    with sessions.session(wh, read_only=True) as con:
        current = drift.run_versions(con, run2)["transformers"]
        (bpb,) = [f for f in drift.findings(con, run2) if f["metric"] == "bits_per_byte"]
        regressions = reads.rows(con, "SELECT * FROM regressions WHERE kind = 'engine drift'"
                                      " AND measure = 'qg_simple_stories/bits_per_byte (base probe)'")
    # The older engine's log-likelihoods were 2% lower: its bits per byte 2% higher, so today's base scores
    # 1/1.02 of it, better, on all 3 documents alike: an interval that excludes 1.
    assert bpb["drifted"] and bpb["items"] == 3 and bpb["value"] < bpb["previous_value"]
    assert bpb["ratio"] == pytest.approx(1.02, rel=1e-9) and 1 < bpb["lower"] <= bpb["upper"]
    assert bpb["changed"] == f"transformers {OLD_TRANSFORMERS} → {current}"
    (check,) = checks_of(wh, run2)  # one variant, one verdict: it carries the finding
    assert check["outcome"] == "pass" and check["value"] == pytest.approx(1.02, rel=1e-9)
    assert check["note"].startswith(f"engine drift: base qg_simple_stories/bits_per_byte {bpb['previous_value']:.4g}"
                                    f" → {bpb['value']:.4g} (×1.02, 95% CI [")
    assert f"on 3 probe items since run {run1[:8]}, with transformers {OLD_TRANSFORMERS} → {current}:" in check["note"]
    with sessions.session(wh, read_only=True) as con:
        (reason,) = con.execute("SELECT reason FROM decisions WHERE run_id = ?", [run2]).fetchone()
    assert "engine drift: base qg_simple_stories/bits_per_byte" in reason
    # The regressions view tells the engine's move from a variant's: flagged as drift, with the library.
    (row,) = regressions
    assert (row["variant"], row["change"], row["flagged"], row["basis"]) == (
        "base", "better", True, f"transformers {OLD_TRANSFORMERS} → {current}")
    # `quantgate checks` shows it beside the variant's other checks.
    shown = CliRunner().invoke(app, ["checks", "tiny", "-w", str(wh), "-f", "json"])
    assert shown.exit_code == 0, shown.output
    assert [c["check"] for c in json.loads(shown.output) if c["check"] == "engine drift"] == ["engine drift"]


def test_arithmetic_is_not_drift_and_a_move_without_a_library_change_is_not_attributed() -> None:
    """Two real checkpoints of one model whose logits differ in their last bits (stories260k and its MLP zero-padded
    copy, max logit difference 2e-5) scored by lm-eval: a move the paired interval resolves, far below a material
    one; and a real move (the older engine's numbers, as above) with no library changed is no drift."""
    from quantgate.catalog.suites import LocalTask, SuiteSpec
    from quantgate.tasks.steps import drift as sentinel
    from quantgate.tasks.steps.evaluate import evaluate_variant

    suite = SuiteSpec(tasks=(LocalTask(name="qg_simple_stories", limit=3),))

    def items(model: Path, scale: float = 1.0) -> list[dict]:
        report = evaluate_variant(str(model), suite)
        assert report.status == "ok", report.error
        higher = {(m.task, m.metric): m.higher_is_better for m in report.metrics}
        return [{"task": s.task, "metric": s.metric, "filter": s.filter, "doc_id": s.doc_id, "value": s.value * scale,
                 "weight": s.detail.get("weight"), "higher_is_better": higher[(s.task, s.metric)]}
                for s in report.samples]

    padded, plain = items(TINY_MODEL), items(TINY_MODEL.parent / "stories260k")
    (bpb,) = [f for f in sentinel.compare(plain, padded, ["torch 2.0 → 2.1"], 0.95) if f["metric"] == "bits_per_byte"]
    assert bpb["items"] == 3 and bpb["ratio"] != 1 and abs(bpb["ratio"] - 1) < sentinel.MATERIAL
    assert not bpb["moved"] and not bpb["drifted"]
    older = [{**r, "value": r["value"] * 1.02} for r in padded]
    (moved,) = [f for f in sentinel.compare(older, padded, [], 0.95) if f["metric"] == "bits_per_byte"]
    assert moved["moved"] and not moved["drifted"] and moved["changed"] == ""
    # On a verdict: said, and not as drift.
    policy = Policy.model_validate({"version": 1, "quality": [{"task": "qg_simple_stories", "metric": "bits_per_byte",
                                                               "min_recovery": 0.95, "higher_is_better": False}]})
    check = sentinel.drift_check(policy, [{**moved, "previous_run_id": "r1"}])
    assert check is not None and check.outcome == "pass" and check.detail["drifted"] is False
    assert check.note.startswith("engine drift: none attributed: base qg_simple_stories/bits_per_byte")
    assert check.note.endswith("with no recorded library changed (the engine did not repeat itself)")


def test_a_probe_taken_from_the_suite_evaluation_is_the_probe_measured_on_its_own() -> None:
    """The probe of a run that measured its base's suite is that evaluation's first items (flows/probe.py): the tiny
    model scored by lm-eval on MMLU (a group: each subject's first items, under the subject and under the group)
    and the stories' perplexity (weighted per document), once with the suite's limits and once with the probe's
    own. Item for item and metric for metric the same."""
    from quantgate.catalog.suites import LocalTask, SuiteSpec
    from quantgate.tasks.steps import drift as sentinel
    from quantgate.tasks.steps.evaluate import evaluate_variant

    suite = SuiteSpec(tasks=(LocalTask(name="qg_mmlu", limit=3), LocalTask(name="qg_simple_stories", limit=4)),
                      probe=2)
    probe = sentinel.probe_suite(suite, Policy.model_validate(
        {"version": 1, "quality": [{"task": t, "metric": m, "min_recovery": 0.9, "higher_is_better": h}
                                   for t, m, h in (("qg_mmlu", "acc", True),
                                                   ("qg_simple_stories", "bits_per_byte", False))]}))
    assert probe is not None
    whole, alone = evaluate_variant(str(TINY_MODEL), suite), evaluate_variant(str(TINY_MODEL), probe)
    assert whole.status == alone.status == "ok", (whole.error, alone.error)
    taken = sentinel.probe_of(probe, whole)

    def by_item(report) -> dict:
        return {(s.task, s.metric, s.filter, s.doc_id): s.value for s in report.samples}

    assert len(by_item(whole)) > len(by_item(taken)) == len(by_item(alone))
    assert by_item(taken) == pytest.approx(by_item(alone), rel=1e-6)
    assert {"qg_mmlu", "qg_mmlu_anatomy", "qg_simple_stories"} <= {s.task for s in taken.samples}
    metrics = {(m.task, m.metric, m.filter): m for m in alone.metrics if m.value is not None}
    derived = {(m.task, m.metric, m.filter): m for m in taken.metrics}
    for key in [("qg_mmlu", "acc", "none"), ("qg_mmlu_anatomy", "acc", "none"),
                ("qg_simple_stories", "bits_per_byte", "none"), ("qg_simple_stories", "word_perplexity", "none")]:
        assert derived[key].value == pytest.approx(metrics[key].value, rel=1e-6), key
        assert derived[key].higher_is_better == metrics[key].higher_is_better
