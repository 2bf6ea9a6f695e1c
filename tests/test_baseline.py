"""A base a verdict can rest on (issue 45), in the decision: its provenance (weights that passed through quantization
before the run: labelled, or by policy no accept), its scores against the figures its makers published
(not_comparable outside the entry's tolerance), a variant above its base by more than rounding explains
(anomalous), and what the warehouse, the end of a run, `quantgate checks` and the report say of them. Real
checkpoints and DuckLake; decisions made by tasks/steps/decide.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantgate.catalog.models import PublishedFigure
from quantgate.catalog.policy import Policy
from quantgate.catalog.records import (
    Decision, MetricResult, ModelArtifact, QualityReport, SampleResult, VariantArtifact,
)
from quantgate.catalog.sources import LocalSource
from quantgate.flows.cli import app
from quantgate.flows.verdicts import model_notes, verdict_row
from quantgate.tasks.steps.decide import decide
from quantgate.tasks.steps.download import fetch_model
from quantgate.warehouse import ledger, reads, report, sessions, writers
from tests.test_provenance import quantized_checkpoint, spec

POLICY = Policy.model_validate({
    "version": 1, "max_size_ratio": 0.75,
    "quality": [{"task": "qg_mmlu", "metric": "acc", "min_recovery": 0.95, "higher_is_better": True}],
})
VARIANT = {"variant_uid": "v", "status": "built", "error": None, "size_bytes": 30}
# The base scores 0.7 on 400 items; published at 0.72, our protocol within 0.05 of it.
BASE = [1] * 280 + [0] * 120
PUBLISHED = PublishedFigure(task="qg_mmlu", metric="acc", value=0.72, tolerance=0.05, protocol="0-shot, base model",
                            source="a model card, table 1")


def rows(base: list[int], variant: list[int]) -> dict[str, list[dict]]:
    """variant_recovery, variant_paired_samples and variant_flips rows of qg_mmlu/acc from per-item 0/1 scores."""
    b, v = sum(base) / len(base), sum(variant) / len(variant)
    key = {"task": "qg_mmlu", "metric": "acc", "filter": "none"}
    return {"recovery": [{**key, "recovery": v / b, "variant_value": v, "base_value": b, "variant_stderr": None,
                          "base_stderr": None, "n_samples": len(base), "chance": 0.25}],
            "samples": [{**key, "doc_id": i, "base_value": x, "variant_value": y, "base_weight": None,
                         "variant_weight": None} for i, (x, y) in enumerate(zip(base, variant))],
            "flips": [{**key, "n_items": len(base), "flip_rate": sum(x != y for x, y in zip(base, variant)) / len(base)}]}


def loses(base: list[int], k: int) -> list[int]:
    out = base[:]
    for i in [i for i, x in enumerate(base) if x][:k]:
        out[i] = 0
    return out


# --- provenance in the decision -------------------------------------------------------------------


def test_a_quantized_base_labels_an_accept_and_the_policy_can_keep_it_inconclusive() -> None:
    evidence = rows(BASE, BASE)  # a lossless variant on 400 items: accepted
    label = {"base_prequantized": True, "base_provenance": "Q4_K_M GGUF"}
    plain = decide(VARIANT, 100, speed=[], policy=POLICY, **evidence)
    assert plain.decision == "accept" and "base provenance" not in plain.reason
    labelled = decide(VARIANT | label, 100, speed=[], policy=POLICY, **evidence)
    assert labelled.decision == "accept"
    assert labelled.reason.endswith("base provenance: recoveries are against a Q4_K_M GGUF base (its weights passed"
                                    " through quantization before this run), not the 16-bit release")
    strict = POLICY.model_copy(update={"quantized_base": "inconclusive"})
    held = decide(VARIANT | label, 100, speed=[], policy=strict, **evidence)
    assert held.decision == "inconclusive"
    assert held.reason.startswith("inconclusive: base provenance: recoveries are against a Q4_K_M GGUF base")
    assert "no accept rests on such a base (policy quantized_base: inconclusive)" in held.reason
    assert held.checks[-1].kind == "baseline" and held.checks[-1].outcome == "inconclusive"
    # A reject stays a reject: the base's provenance never excuses a loss.
    lost = decide(VARIANT | label, 100, speed=[], policy=strict, **rows(BASE, loses(BASE, 60)))
    assert lost.decision == "reject" and lost.reason.startswith("reject: qg_mmlu/acc recovery")
    assert Policy.model_validate({"version": 1, "quality": []}).quantized_base == "allow"


# --- a base against its published figure, a variant above its base -------------------------------


def test_a_base_outside_its_published_figure_makes_the_verdict_not_comparable() -> None:
    within = decide(VARIANT, 100, speed=[], policy=POLICY, published=[PUBLISHED], **rows(BASE, BASE))
    assert within.decision == "accept" and within.checks[0].kind == "baseline" and within.checks[0].outcome == "pass"
    assert within.checks[0].note.startswith("baseline qg_mmlu/acc: base 0.7 (95% CI [0.655")
    assert "within the published 0.72 ± 0.05 (0-shot, base model; a model card, table 1)" in within.checks[0].note
    # The same variant against a base made to miss its figure (a broken conversion scores 0.55): its interval,
    # [0.50, 0.60], lies wholly below 0.67, and neither a pass nor a failure of the variant is a verdict.
    broken = [1] * 220 + [0] * 180
    for variant, decided_before in ((broken, "accept"), (loses(broken, 80), "reject")):
        assert decide(VARIANT, 100, speed=[], policy=POLICY, **rows(broken, variant)).decision == decided_before
        d = decide(VARIANT, 100, speed=[], policy=POLICY, published=[PUBLISHED], **rows(broken, variant))
        assert d.decision == "not_comparable", d.reason
        assert d.reason.startswith("not_comparable: baseline qg_mmlu/acc: base 0.55 (95% CI [0.501")
        assert ("outside the published 0.72 ± 0.05 (0-shot, base model; a model card, table 1): the base does not"
                " measure like the model it claims to be") in d.reason
        check = d.checks[0]
        assert (check.outcome, check.value, check.threshold, check.items) == ("not_comparable", 0.55, 0.72, 400)
        assert check.upper < 0.67
    # A figure without a tolerance is shown, never checked; so is any figure of a model with random weights.
    shown = PUBLISHED.model_copy(update={"tolerance": None})
    assert decide(VARIANT, 100, speed=[], policy=POLICY, published=[shown], **rows(broken, broken)).decision == "accept"
    shape = decide(VARIANT | {"random_weights": True}, 100, speed=[], policy=POLICY, published=[PUBLISHED],
                   **rows(broken, broken))
    assert shape.decision == "inconclusive" and all(c.kind != "baseline" for c in shape.checks)


def test_a_variant_above_its_base_beyond_noise_and_rounding_is_anomalous() -> None:
    # The base gets 140 of 400 right; the crafted variant those and 100 more: recovery 1.71, its interval far above 1.
    weak = [1] * 140 + [0] * 260
    leaked = [1] * 240 + [0] * 160
    d = decide(VARIANT, 100, speed=[], policy=POLICY, **rows(weak, leaked))
    assert d.decision == "not_comparable", d.reason
    (check,) = [c for c in d.checks if c.kind == "quality"]
    assert check.outcome == "anomalous" and check.lower > 1.02
    assert d.reason.startswith("not_comparable: qg_mmlu/acc recovery 1.714 (95% CI [")
    assert ("; anomalous: the variant scores above its base beyond the interval's noise and rounding's gain (lower"
            f" bound {check.lower:.4g} > 1 + max_gain 0.02): a leak or a bug, not comparable") in d.reason
    # A gain rounding explains (3 items of 400 flipped right: recovery 1.02, its interval spanning 1) is a pass.
    lucky = weak[:]
    for i in range(140, 143):
        lucky[i] = 1
    fine = decide(VARIANT, 100, speed=[], policy=POLICY, **rows(weak, lucky))
    assert fine.decision == "accept" and fine.checks[0].outcome == "pass" and fine.checks[0].lower < 1.02
    # A looser policy lets the same gain pass: max_gain is the rounding the policy allows.
    loose = POLICY.model_copy(update={"max_gain": 1.0})
    assert decide(VARIANT, 100, speed=[], policy=loose, **rows(weak, leaked)).decision == "accept"


# --- the warehouse, the end of a run, `quantgate checks`, the report ------------------------------


def quality(key: str, scores: list[int]) -> QualityReport:
    acc = sum(scores) / len(scores)
    return QualityReport(eval_key=key, evaluator="lm-eval", config={}, seconds=1.0, metrics=[
        MetricResult("qg_mmlu", "acc", "none", acc, (acc * (1 - acc) / len(scores)) ** 0.5, len(scores), "1", True)],
        samples=[SampleResult("qg_mmlu", i, "acc", float(x), {"target": 0, "lls": [-1.0, -2.0, -3.0, -4.0]})
                 for i, x in enumerate(scores)])


def build(model: ModelArtifact, uid: str, name: str, size: int = 100) -> VariantArtifact:
    return VariantArtifact(uid=uid, model_uid=model.uid, name=name, method="base" if name == "base" else "gptq",
                           scheme=None, bits=4, group_size=128, path=f"/x/{uid}", recipe=None, recipe_hash=uid,
                           size_bytes=size)


def decided_run(wh: Path, model: ModelArtifact, base: list[int], builds: dict[str, list[int]],
                published: tuple[PublishedFigure, ...] = ()) -> None:
    """One evaluate-model run of `model` (its base scoring `base`, each build its scores), decided and stored."""
    with sessions.session(wh) as con:
        ledger.start_run(con, "r1", "evaluate-model", model.model_id, "c.yaml", "h", "host", {})
        writers.record_model(con, "r1", model)
        writers.record_variant(con, "r1", build(model, "base", "base", 400), "base")
        writers.record_quality(con, "r1", "base", quality("k", base))
        for name, scores in builds.items():
            writers.record_variant(con, "r1", build(model, name, name), "variant")
            writers.record_quality(con, "r1", name, quality("k", scores))
        evidence = reads.decision_evidence(con, "r1", [("qg_mmlu", "acc")])
        decisions = [decide(row, 400, policy=POLICY, published=published, **evidence.of(row["variant_uid"]))
                     for row in evidence.variants]
        writers.record_decisions(con, "r1", decisions, POLICY.model_dump(mode="json"))
        ledger.finish_run(con, "r1")


def test_the_scorecard_the_run_end_checks_and_report_say_what_the_base_is(tiny_model: Path, tmp_path: Path) -> None:
    folder = quantized_checkpoint(tiny_model, tmp_path / "m", {"quant_method": "fp8"})
    model = fetch_model(spec(LocalSource(path=str(folder))), tmp_path / "cache")
    wh = tmp_path / "w.ducklake"
    decided_run(wh, model, BASE, {"lossless": BASE, "lossy": loses(BASE, 60)})
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT prequantized, provenance, provenance_detail->>'evidence' FROM models").fetchall() == [
            (True, "8-bit fp8 (quantization_config)", "config.json quantization_config")]
        assert reads.model_of(con, model.uid) == model
        card = reads.rows(con, "SELECT * FROM variant_scorecard ORDER BY variant")
    assert [(r["variant"], r["decision"], r["base_prequantized"], r["base_provenance"]) for r in card] == [
        ("lossless", "accept", True, "8-bit fp8 (quantization_config)"),
        ("lossy", "reject", True, "8-bit fp8 (quantization_config)")]
    assert verdict_row(card[0])["base_provenance"] == "8-bit fp8 (quantization_config)"
    assert model_notes(card) == ["m: recoveries are against a 8-bit fp8 (quantization_config) base (its weights passed"
                                 " through quantization before this run), not the 16-bit release"]
    checks = CliRunner().invoke(app, ["checks", "m", "lossless", "-w", str(wh), "-f", "json"])
    assert checks.exit_code == 0, checks.output
    (label,) = [c for c in json.loads(checks.output) if c["kind"] == "baseline"]
    assert (label["check"], label["outcome"]) == ("base provenance", "pass")
    assert "recoveries are against a 8-bit fp8 (quantization_config) base" in label["note"]
    html = report.render(sessions.connect(wh))
    assert "<p class='note provenance'>m: recoveries are against a 8-bit fp8 (quantization_config) base" in html


def test_a_not_comparable_run_in_the_warehouse_and_on_the_command_line(tmp_path: Path) -> None:
    model = ModelArtifact("m", "/m", "local", None, "abc" * 10)
    broken = [1] * 220 + [0] * 180
    weak = [1] * 140 + [0] * 260
    wh = tmp_path / "w.ducklake"
    decided_run(wh, model, broken, {"fine": broken, "lossy": loses(broken, 80)}, (PUBLISHED,))
    with sessions.session(wh, read_only=True) as con:
        card = {r["variant"]: r for r in reads.rows(con, "SELECT * FROM variant_scorecard")}
    assert {v: r["decision"] for v, r in card.items()} == {"fine": "not_comparable", "lossy": "not_comparable"}
    # The deciding check is the baseline's, before the lossy variant's failed gate.
    assert (card["lossy"]["deciding_check"], card["lossy"]["deciding_outcome"]) == ("baseline qg_mmlu/acc", "not_comparable")
    assert verdict_row(card["lossy"])["deciding_check"] == "baseline qg_mmlu/acc 0.55 vs 0.72 (not comparable)"
    assert card["fine"]["base_prequantized"] is False and verdict_row(card["fine"])["base_provenance"] is None
    html = report.render(sessions.connect(wh))
    assert "<tr class='not_comparable'>" in html and "baseline qg_mmlu/acc: 0.55 vs 0.72 (not comparable)" in html
    text = CliRunner().invoke(app, ["checks", "m", "-w", str(wh), "-f", "csv"])
    assert text.exit_code == 0 and "not_comparable" in text.output

    # A model without published figures and a variant crafted far above its base: not comparable, by its gate.
    sessions.close_all()
    wh2 = tmp_path / "w2.ducklake"
    decided_run(wh2, model, weak, {"leaked": [1] * 240 + [0] * 160})
    with sessions.session(wh2, read_only=True) as con:
        (row,) = reads.rows(con, "SELECT * FROM variant_scorecard")
    assert (row["decision"], row["deciding_outcome"]) == ("not_comparable", "anomalous")
    assert verdict_row(row)["deciding_check"].startswith("qg_mmlu/acc 1.714 vs 0.95")
    assert verdict_row(row)["deciding_check"].endswith("(anomalous)")


def test_a_verdict_that_becomes_not_comparable_is_not_ranked_a_regression(tmp_path: Path) -> None:
    model = ModelArtifact("m", "/m", "local", None, "abc" * 10)
    wh = tmp_path / "w.ducklake"
    decided_run(wh, model, BASE, {"v": BASE})
    with sessions.session(wh) as con:
        con.execute("UPDATE runs SET started_at = started_at - INTERVAL 1 DAY WHERE run_id = 'r1'")
        ledger.start_run(con, "r2", "evaluate-model", "m", "c.yaml", "h", "host", {})
        writers.link_variant(con, "r2", "v", "variant", reused=True)
        writers.record_decisions(con, "r2", [Decision("v", "not_comparable", "not_comparable: …", [], POLICY.hash,
                                                      1.0, None, 0.25)], {})
        ledger.finish_run(con, "r2")
        (moved,) = reads.rows(con, "SELECT * FROM regressions WHERE kind = 'decision'")
    assert (moved["basis"], moved["change"], moved["flagged"]) == ("accept → not_comparable", "unknown", False)




def test_the_catalog_states_tolerances_and_the_policy_its_options() -> None:
    from pydantic import ValidationError

    from quantgate.catalog.load import load_catalog
    from quantgate.catalog.paths import DEFAULT_CATALOG

    reference = next(m for m in load_catalog(DEFAULT_CATALOG).models if m.id == "qwen2.5-coder-1.5b-instruct")
    assert [(f.task, f.tolerance) for f in reference.published] == [("qg_mmlu", 0.1), ("qg_gsm8k_cot", 0.2)]
    assert (reference.policy.quantized_base, reference.policy.max_gain) == ("allow", 0.02)
    with pytest.raises(ValidationError, match=r"tolerance of a fraction is a fraction too, got 5 \(a percentage\? write 0.05\)"):
        PUBLISHED.model_validate({**PUBLISHED.model_dump(), "tolerance": 5})
    with pytest.raises(ValidationError, match="quantized_base"):
        Policy.model_validate({"version": 1, "quality": [], "quantized_base": "maybe"})
