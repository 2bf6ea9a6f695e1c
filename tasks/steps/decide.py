"""Accept, reject, call inconclusive or not comparable a variant: a pure function of warehouse rows, the policy and
the model's published figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import task

from quantgate.catalog.models import PublishedFigure
from quantgate.catalog.policy import Policy, QualityGate
from quantgate.catalog.records import RANDOM_WEIGHTS, CheckOutcome, Decision, DecisionCheck, Verdict
from quantgate.tasks.steps.baseline import base_se, gate_rows, provenance_check, published_checks
from quantgate.tasks.steps.drift import drift_check
from quantgate.tasks.steps.quality_stats import (
    QualityStatsError, RecoveryInterval, delta_interval, items_to_decide, sample_interval, z_score,
)

# The reason lists what makes the verdict not comparable first, then failures, then what the data could not
# decide, then the rest in policy order.
_REASON_ORDER = {"not_comparable": 0, "anomalous": 0, "fail": 1, "inconclusive": 2}


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _about(n: int) -> str:
    """n to two significant figures, e.g. 2,874 → 2,900: the estimate is no finer than that."""
    return f"{round(n, 2 - len(str(n))):,}" if n >= 100 else str(n)


def _interval(gate: QualityGate, row: dict[str, Any], items: Sequence[dict[str, Any]],
              confidence: float, chance: float) -> RecoveryInterval | None:
    if items:
        try:
            return sample_interval(items, gate.metric, higher_is_better=gate.higher_is_better, confidence=confidence,
                                   chance=chance)
        except QualityStatsError:
            pass  # e.g. perplexity items stored without their byte counts: the reported stderrs remain
    return delta_interval(row["base_value"], row.get("base_stderr"), row["variant_value"], row.get("variant_stderr"),
                          higher_is_better=gate.higher_is_better, confidence=confidence, chance=chance)


def _base_margin(row: dict[str, Any], items: Sequence[dict[str, Any]],
                 confidence: float) -> tuple[float, float, float] | None:
    """The base's margin over the metric's chance level with its interval at `confidence`, where the metric has
    a chance level (baseline.base_se: from the base's per-item scores, else lm-eval's, else binomial)."""
    chance, base = row.get("chance"), row["base_value"]
    if chance is None or base is None:
        return None
    margin, half = base - chance, z_score(confidence) * base_se(row, items)
    return margin, margin - half, margin + half


def _uninformative(name: str, gate: QualityGate, row: dict[str, Any], margin: tuple[float, float, float],
                   policy: Policy, about: dict[str, Any]) -> DecisionCheck:
    point, low, high = margin
    level = f"{policy.confidence * 100:g}%"
    note = (f"{name} uninformative: base {_fmt(row['base_value'])} vs chance {_fmt(row['chance'])} (margin"
            f" {_fmt(point)}, {level} CI [{_fmt(low)}, {_fmt(high)}]): {gate.task} cannot measure this model")
    detail = {"chance": row["chance"], "base_margin": point, "base_margin_lower": low, "base_margin_upper": high,
              "recovery": row["recovery"], "variant_value": row["variant_value"], "base_value": row["base_value"],
              "filter": row["filter"]}
    return DecisionCheck(**about, outcome="uninformative", note=note, items=row.get("n_samples"), detail=detail)


def _random_weights(gate: QualityGate) -> DecisionCheck:
    """A quality gate of a model with random weights: whatever its scores, it neither passes nor fails."""
    name = f"{gate.task}/{gate.metric}"
    return DecisionCheck("quality", name, "uninformative", f"{name} uninformative: {RANDOM_WEIGHTS}", task=gate.task,
                         metric=gate.metric, threshold=gate.min_recovery, detail={"random_weights": True})


def _quality_outcome(policy: Policy, point: float, ci: RecoveryInterval | None, threshold: float) -> CheckOutcome:
    if not policy.use_lower_bound:
        return "pass" if point >= threshold else "fail"
    if ci is None or ci.lower is None or ci.upper is None:
        return "inconclusive"
    if ci.lower >= threshold:
        return "pass"
    return "fail" if ci.upper < threshold else "inconclusive"


def _format_loss(gate: QualityGate, filter_: str, formats: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """How much of an exact-match loss under `filter_` is format: the shares of answers the filter could extract
    (base, variant) and the recovery under the task's most lenient other filter, where the task has one."""
    mine = [f for f in formats if f["task"] == gate.task]
    strict = next((f for f in mine if f["filter"] == filter_), None)
    others = [f for f in mine if f["filter"] != filter_ and f["base_right_share"]]
    if strict is None or not others or not strict["base_right_share"]:
        return None
    lenient = max(others, key=lambda f: f["base_right_share"])
    return {"filter": filter_, "base_extracted_share": strict["base_extracted_share"],
            "extracted_share": strict["extracted_share"], "recovery": strict["right_share"] / strict["base_right_share"],
            "other_filter": lenient["filter"], "other_recovery": lenient["right_share"] / lenient["base_right_share"]}


def _mostly_format(loss: dict[str, Any]) -> bool:
    """The variant lost fewer answers to the format than it kept: its lenient recovery has less than half the
    strict one's loss, and fewer of its answers meet the strict format than the base's."""
    return (loss["recovery"] < 1 and 1 - loss["other_recovery"] < (1 - loss["recovery"]) / 2
            and loss["extracted_share"] < loss["base_extracted_share"])


def _quality_check(policy: Policy, gate: QualityGate, recovery: Sequence[dict[str, Any]],
                   samples: Sequence[dict[str, Any]], flips: Sequence[dict[str, Any]],
                   formats: Sequence[dict[str, Any]] = ()) -> DecisionCheck:
    name = f"{gate.task}/{gate.metric}"
    about = {"kind": "quality", "name": name, "task": gate.task, "metric": gate.metric, "threshold": gate.min_recovery}
    rows = gate_rows(gate, recovery)
    if not rows or rows[0]["recovery"] is None:
        why = "not measured" if not rows else f"has no recovery (base {rows[0]['base_value']}, variant {rows[0]['variant_value']})"
        if gate.required:
            return DecisionCheck(**about, outcome="fail", note=f"{name} {why}")
        return DecisionCheck(**about, outcome="not_measured", note=f"{name} {why} (optional gate)")
    r = rows[0]
    key = (gate.task, gate.metric, r["filter"])
    items = [s for s in samples if (s["task"], s["metric"], s["filter"]) == key]
    margin = _base_margin(r, items, policy.confidence) if gate.higher_is_better else None
    if margin is not None and margin[1] <= 0:
        return _uninformative(name, gate, r, margin, policy, about)
    above = gate.recovery == "above_chance" and r.get("recovery_above_chance") is not None
    ci = _interval(gate, r, items, policy.confidence, r["chance"] if above else 0.0)
    flip = next((f for f in flips if (f["task"], f["metric"], f["filter"]) == key), None)
    point, threshold = (r["recovery_above_chance"] if above else r["recovery"]), gate.min_recovery
    lower, upper = (ci.lower, ci.upper) if ci else (None, None)
    n = ci.n_items if ci and ci.n_items else r.get("n_samples")
    mde = ci.min_detectable_drop if ci else None
    outcome = _quality_outcome(policy, point, ci, threshold)
    to_decide = (items_to_decide(n, point, lower, upper, threshold)
                 if outcome == "inconclusive" and lower is not None and upper is not None and n else None)
    loss = _format_loss(gate, r["filter"], formats) if gate.metric == "exact_match" else None
    note = _quality_note(policy, f"{name} recovery{' above chance' if above else ''}", r, outcome, point, threshold,
                         (lower, upper), [*_flip_evidence(flip), *_mde_evidence(mde)], above)
    note += _quality_suffix(outcome, loss, lower is not None and upper is not None, to_decide, n)
    # A gain beyond the interval's noise that rounding the weights cannot explain: a leak or a bug, not a verdict.
    if lower is not None and lower > 1 + policy.max_gain:
        outcome = "anomalous"
        note += (f"; anomalous: the variant scores above its base beyond the interval's noise and rounding's gain"
                 f" (lower bound {_fmt(lower)} > 1 + max_gain {policy.max_gain:g}): a leak or a bug, not comparable")
    detail = {"confidence": policy.confidence, "interval": ci.method if ci else None, "filter": r["filter"],
              "variant_value": r["variant_value"], "base_value": r["base_value"],
              "flip_rate": flip["flip_rate"] if flip else None, "recovery_basis": "above_chance" if above else "plain",
              "chance": r.get("chance"), "base_margin": margin[0] if margin else None, "format": loss}
    return DecisionCheck(**about, outcome=outcome, note=note, value=point, lower=lower, upper=upper,
                         min_detectable_drop=mde, items=n, items_to_decide=to_decide, detail=detail)


def _flip_evidence(flip: dict[str, Any] | None) -> list[str]:
    return [f"{flip['flip_rate']:.1%} of {flip['n_items']} items flipped"] if flip else []


def _mde_evidence(mde: float | None) -> list[str]:
    return [f"min detectable drop {mde:.2g}"] if mde is not None else []


def _quality_note(policy: Policy, what: str, r: dict[str, Any], outcome: CheckOutcome, point: float,
                  threshold: float, bounds: tuple[float | None, float | None], extra: list[str], above: bool) -> str:
    """A quality check's figures: recovery, its interval against the threshold, the scores and `extra` evidence."""
    lower, upper = bounds
    spread = lower is not None and upper is not None
    evidence = [f"variant {_fmt(r['variant_value'])} vs base {_fmt(r['base_value'])}", *extra]
    interval = f"{policy.confidence * 100:g}% CI [{_fmt(lower)}, {_fmt(upper)}]" if spread else ""
    if not policy.use_lower_bound:
        verdict = f"{'>=' if outcome == 'pass' else '<'} {threshold}"
        if spread:
            evidence.insert(1, interval)
    elif not spread:
        verdict = "without a confidence interval (no per-item results or stderr): inconclusive"
    elif outcome == "inconclusive":
        verdict = f"({interval}) spans {threshold}"
    else:
        verdict = f"({interval}) {'>=' if outcome == 'pass' else '<'} {threshold}"
    if above:
        evidence.append(f"chance {_fmt(r['chance'])}")
    return f"{what} {_fmt(point)} {verdict} ({', '.join(evidence)})"


def _quality_suffix(outcome: CheckOutcome, loss: dict[str, Any] | None, spread: bool, to_decide: int | None,
                    n: int | None) -> str:
    """What a failed or undecided quality check adds: how much of its loss is format, the items that would decide."""
    note = ""
    if loss and outcome in ("fail", "inconclusive") and _mostly_format(loss):
        note += (f"; mostly format: {loss['extracted_share']:.0%} of its answers in the {loss['filter']} format vs the"
                 f" base's {loss['base_extracted_share']:.0%}, recovery {_fmt(loss['other_recovery'])} under"
                 f" {loss['other_filter']}")
    if outcome == "inconclusive" and spread:
        note += ": inconclusive"
        if to_decide:
            note += f"; ~{_about(to_decide)} items would decide (have {n:,})"
    return note


def _speed_check(policy: Policy, speed: Sequence[dict[str, Any]]) -> DecisionCheck | None:
    gate = policy.speed
    if gate is None:
        return None
    name = f"speed {gate.engine}/{gate.scenario}"
    rows = [r for r in speed if r["engine"] == gate.engine and r["scenario"] == gate.scenario]
    if not rows or rows[0]["status"] != "ok" or rows[0]["speedup"] is None:
        why = rows[0]["reason"] if rows and rows[0]["reason"] else "no base measurement" if rows else "not run"
        # Not measured is not evidence either way: the decision says so and rests on quality and size.
        return DecisionCheck("speed", name, "not_measured", f"{name} not measured ({why})", threshold=gate.min_speedup)
    row, t = rows[0], gate.min_speedup
    s, low, high = row["speedup"], row.get("speedup_low"), row.get("speedup_high")
    # The passes' range, not the medians alone: a ratio of medians a few passes wide says no more than the
    # passes do (reference4 and reference5 measured GPTQ at 1.15x and 0.90x of the same base). One pass a side
    # is no range: the ratio decides.
    ranged = low is not None and high is not None and min(row.get("passes") or 0, row.get("base_passes") or 0) >= 2
    lo, hi = (low, high) if ranged else (s, s)
    outcome: CheckOutcome = "pass" if lo >= t else "fail" if hi < t else "inconclusive"
    verdict = {"pass": f">= {t}x", "fail": f"< {t}x",
               "inconclusive": f"spans {t}x: inconclusive; more or longer passes would decide"}[outcome]
    # Where the host paced the passes (the engine's Python, not the GPU), the ratio is the host's as much as the
    # checkpoints': the verdict says so, so that nobody keeps it as the GPU's, and by default it decides nothing.
    host = (f"; host-bound (the engine's busiest process on a CPU {row['host_busy_share']:.0%} of a pass, decode steps"
            " 3x or more its weights' memory floor): this ratio moves with the host") if row.get("host_bound") else ""
    if row.get("host_bound") and gate.host_bound == "uninformative":
        outcome, verdict = "uninformative", f"uninformative for {t}x"
        host += " and decides nothing (policy speed.host_bound: decide lets it)"
    if not ranged:
        return DecisionCheck("speed", name, outcome, f"{name} speedup {s:.2f}x {verdict}{host}", value=s, threshold=t,
                             detail={"host_bound": bool(row.get("host_bound"))})
    paired = bool(row.get("paired"))
    passes = (f"its {row['passes']} passes, each beside a base pass" if paired
              else f"every pairing of its {row['passes']} passes with the base's {row['base_passes']}")
    return DecisionCheck("speed", name, outcome,
                         f"{name} speedup {s:.2f}x ({passes}: {lo:.2f}-{hi:.2f}x) {verdict}{host}",
                         value=s, lower=lo, upper=hi, threshold=t,
                         detail={"passes": row["passes"], "base_passes": row["base_passes"], "paired": paired,
                                 "host_bound": bool(row.get("host_bound"))})


def _serving_check(policy: Policy, serving: Sequence[dict[str, Any]]) -> DecisionCheck | None:
    gate = policy.serving
    if gate is None:
        return None
    name = f"serving {gate.scenario}"
    rows = [r for r in serving if r["scenario"] == gate.scenario]
    if not rows or rows[0]["goodput_requests_per_s"] is None or rows[0]["base_goodput_requests_per_s"] is None:
        why = (rows[0]["reason"] or "no base measurement") if rows else "not run"
        return DecisionCheck("serving", name, "not_measured", f"{name} not measured ({why})",
                             threshold=gate.min_goodput_ratio)
    r = rows[0]
    goodput, base = r["goodput_requests_per_s"], r["base_goodput_requests_per_s"]
    config = "vLLM's defaults" if r["point"] == "default" else f"tuned config {r['point']}"
    evidence = f"{goodput:.3g} req/s at {r['load']}, {config}; base {base:.3g} req/s ({r['base_point']})"
    detail = {"point": r["point"], "settings": r["settings"], "load": r["load"], "goodput": goodput,
              "base_goodput": base, "base_point": r["base_point"], "host_bound": bool(r.get("host_bound"))}
    if base == 0:
        # The base meets the SLO on no load: any goodput beats it, none is no evidence either way.
        outcome: CheckOutcome = "pass" if goodput > 0 else "not_measured"
        note = f"{name} goodput at the SLO {evidence}: the base meets it on no load"
    elif r.get("host_bound") and gate.host_bound == "uninformative":
        outcome = "uninformative"
        note = (f"{name} goodput at the SLO {r['goodput_ratio']:.2f}x base ({evidence}) uninformative for"
                f" {gate.min_goodput_ratio}x: host-bound (the served checkpoints' vLLM engines in this run's offline"
                " or latency passes): this ratio moves with the host and decides nothing (policy serving.host_bound:"
                " decide lets it)")
    else:
        outcome = "pass" if r["goodput_ratio"] >= gate.min_goodput_ratio else "fail"
        note = (f"{name} goodput at the SLO {r['goodput_ratio']:.2f}x base"
                f" {'>=' if outcome == 'pass' else '<'} {gate.min_goodput_ratio}x ({evidence})")
    return DecisionCheck("serving", name, outcome, note, value=r["goodput_ratio"], threshold=gate.min_goodput_ratio,
                         detail=detail)


def _size_check(policy: Policy, size_bytes: int | None, base_size_bytes: int | None) -> DecisionCheck:
    if not size_bytes or not base_size_bytes:
        return DecisionCheck("size", "size", "fail", "size on disk unknown", threshold=policy.max_size_ratio)
    ratio = size_bytes / base_size_bytes
    ok = ratio <= policy.max_size_ratio
    return DecisionCheck("size", "size", "pass" if ok else "fail",
                         f"size {ratio:.2f}x base {'<=' if ok else '>'} {policy.max_size_ratio}x",
                         value=ratio, threshold=policy.max_size_ratio)


def _no_informative_gate(quality: Sequence[DecisionCheck], random_weights: bool = False) -> DecisionCheck | None:
    """An inconclusive check when every quality gate the base could be measured on is at chance for it, or the
    weights are random: the verdict cannot rest on quality, and says so (a size or speed failure still rejects)."""
    uninformative = [c.name for c in quality if c.outcome == "uninformative"]
    if not uninformative or any(c.outcome not in ("uninformative", "not_measured") for c in quality):
        return None
    if random_weights:  # named for it too: the name is what the end-of-run table shows of the deciding check
        return DecisionCheck("quality", "random weights: quality not measured", "inconclusive",
                             f"{RANDOM_WEIGHTS} ({', '.join(uninformative)})")
    return DecisionCheck("quality", "no informative quality gate", "inconclusive",
                         f"no informative quality gate ({', '.join(uninformative)} at chance for the base):"
                         " quality cannot be judged on this suite")


def verdict_of(checks: Sequence[DecisionCheck]) -> Verdict:
    """not_comparable when the base measured outside its published figure or a variant scored anomalously above
    it (every ratio is then suspect, a failed one too), else reject when any check fails, inconclusive when none
    fails but one could not be decided, else accept."""
    outcomes = {c.outcome for c in checks}
    if outcomes & {"not_comparable", "anomalous"}:
        return "not_comparable"
    return "reject" if "fail" in outcomes else "inconclusive" if "inconclusive" in outcomes else "accept"


def decide(
    variant: dict[str, Any],
    base_size_bytes: int | None,
    recovery: Sequence[dict[str, Any]],
    speed: Sequence[dict[str, Any]],
    policy: Policy,
    samples: Sequence[dict[str, Any]] = (),
    flips: Sequence[dict[str, Any]] = (),
    serving: Sequence[dict[str, Any]] = (),
    formats: Sequence[dict[str, Any]] = (),
    published: Sequence[PublishedFigure] = (),
    drift: Sequence[dict[str, Any]] = (),
) -> Decision:
    """`variant` is a row of `variants`; `recovery`, `speed`, `samples`, `flips`, `serving` and `formats` are its
    rows of the views `variant_recovery`, `variant_speedup`, `variant_paired_samples`, `variant_flips`,
    `variant_serving` and `variant_answer_format`. A variant row whose `random_weights` is true (its model's, a run
    on the model's shape) has every quality gate uninformative: its speed, serving and size checks decide as usual.
    Its `base_prequantized` and `base_provenance` (its model's) label the verdict (baseline.provenance_check);
    `published` are the model's published figures, each with a tolerance checked against the base's score;
    `drift` the run's engine-drift findings (rows of engine_drift: tasks/steps/drift.py), a label on the verdict."""
    uid = variant["variant_uid"]
    if variant["status"] != "built":
        # A skipped variant (its backend cannot run where the flow ran) was never measured: not accepted.
        what = "not built (skipped)" if variant.get("skipped") else "build failed"
        return Decision(uid, "reject", f"reject: {what}: {variant['error']}",
                        [DecisionCheck("build", "build", "fail", variant["error"] or what)], policy.hash, None, None, None)
    random_weights = bool(variant.get("random_weights"))
    quality = [_random_weights(gate) if random_weights else _quality_check(policy, gate, recovery, samples, flips, formats)
               for gate in policy.quality]
    if (blind := _no_informative_gate(quality, random_weights)) is not None:
        quality.append(blind)
    # Random weights score noise: no published figure is theirs.
    baseline = [] if random_weights else published_checks(policy, published, recovery, samples)
    speed_check = _speed_check(policy, speed)
    size_check = _size_check(policy, variant.get("size_bytes"), base_size_bytes)
    checks = [c for c in (*baseline, *quality, speed_check, _serving_check(policy, serving), size_check,
                          provenance_check(policy, variant), drift_check(policy, drift)) if c is not None]
    verdict = verdict_of(checks)
    ordered = sorted(checks, key=lambda c: _REASON_ORDER.get(c.outcome, 3))
    lowers = [c.lower for c in quality if c.lower is not None]
    values = [c.value for c in quality if c.value is not None]
    flip_rates = [c.detail["flip_rate"] for c in quality if c.detail.get("flip_rate") is not None]
    return Decision(
        variant_uid=uid, decision=verdict, reason=f"{verdict}: " + "; ".join(c.note for c in ordered), checks=checks,
        policy_hash=policy.hash,
        quality_recovery=min(values, default=None),
        speedup=speed_check.value if speed_check else None,
        size_ratio=size_check.value,
        quality_lower_bound=min(lowers, default=None),
        flip_rate=max(flip_rates, default=None),
    )


decide_task = task(decide, name="decide")
