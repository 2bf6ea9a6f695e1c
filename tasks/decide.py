"""Accept or reject a variant: a pure function of warehouse rows and the policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefect import task

from quantgate.catalog.schema import Policy, QualityGate
from quantgate.tasks.quality_stats import QualityStatsError, RecoveryInterval, delta_interval, sample_interval
from quantgate.tasks.records import Decision


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _interval(gate: QualityGate, row: dict[str, Any], items: Sequence[dict[str, Any]],
              confidence: float) -> RecoveryInterval | None:
    if items:
        try:
            return sample_interval(items, gate.metric, higher_is_better=gate.higher_is_better, confidence=confidence)
        except QualityStatsError:
            pass  # e.g. perplexity items stored without their byte counts: the reported stderrs remain
    return delta_interval(row["base_value"], row.get("base_stderr"), row["variant_value"], row.get("variant_stderr"),
                          higher_is_better=gate.higher_is_better, confidence=confidence)


def _quality_checks(policy: Policy, recovery: Sequence[dict[str, Any]], samples: Sequence[dict[str, Any]],
                    flips: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    level = f"{policy.confidence * 100:g}%"
    for gate in policy.quality:
        rows = [r for r in recovery if r["task"] == gate.task and r["metric"] == gate.metric]
        rows.sort(key=lambda r: r["filter"] != "none")
        name = f"{gate.task}/{gate.metric}"
        if not rows or rows[0]["recovery"] is None:
            why = "not measured" if not rows else f"has no recovery (base {rows[0]['base_value']}, variant {rows[0]['variant_value']})"
            if gate.required:
                checks.append({"check": name, "passed": False, "note": f"{name} {why}"})
            else:
                checks.append({"check": name, "passed": None, "note": f"{name} {why} (optional gate)"})
            continue
        r = rows[0]
        key = (gate.task, gate.metric, r["filter"])
        items = [s for s in samples if (s["task"], s["metric"], s["filter"]) == key]
        ci = _interval(gate, r, items, policy.confidence)
        flip = next((f for f in flips if (f["task"], f["metric"], f["filter"]) == key), None)
        point = r["recovery"]
        lower, upper = (ci.lower, ci.upper) if ci else (None, None)
        bound = lower if policy.use_lower_bound else point
        ok = bound is not None and bound >= gate.min_recovery
        op = ">=" if ok else "<"
        evidence = [f"variant {_fmt(r['variant_value'])} vs base {_fmt(r['base_value'])}"]
        if not policy.use_lower_bound:
            verdict = f"{op} {gate.min_recovery}"
            if lower is not None and upper is not None:
                evidence.append(f"{level} CI {_fmt(lower)}–{_fmt(upper)}")
        elif lower is None:
            verdict = f"without a confidence interval (no per-item results or stderr) cannot clear {gate.min_recovery}"
        else:
            verdict = f"({level} CI lower bound {_fmt(lower)}) {op} {gate.min_recovery}"
        if flip:
            evidence.append(f"{flip['flip_rate']:.1%} of {flip['n_items']} items flipped")
        checks.append({
            "check": name, "passed": ok, "value": point, "threshold": gate.min_recovery,
            "lower": lower, "upper": upper, "confidence": policy.confidence,
            "interval": ci.method if ci else None, "n_items": ci.n_items if ci else None,
            "flip_rate": flip["flip_rate"] if flip else None,
            "variant_value": r["variant_value"], "base_value": r["base_value"],
            "note": f"{name} recovery {_fmt(point)} {verdict} ({', '.join(evidence)})",
        })
    return checks


def _speed_check(policy: Policy, speed: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    gate = policy.speed
    if gate is None:
        return None
    name = f"speed {gate.engine}/{gate.scenario}"
    rows = [r for r in speed if r["engine"] == gate.engine and r["scenario"] == gate.scenario]
    if not rows or rows[0]["status"] != "ok" or rows[0]["speedup"] is None:
        why = rows[0]["reason"] if rows and rows[0]["reason"] else "no base measurement" if rows else "not run"
        # Not measured is not evidence either way: the decision says so and rests on quality and size.
        return {"check": name, "passed": None, "note": f"{name} not measured ({why})"}
    s = rows[0]["speedup"]
    ok = s >= gate.min_speedup
    return {"check": name, "passed": ok, "value": s, "threshold": gate.min_speedup,
            "note": f"{name} speedup {s:.2f}x {'>=' if ok else '<'} {gate.min_speedup}x"}


def _serving_check(policy: Policy, serving: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    gate = policy.serving
    if gate is None:
        return None
    name = f"serving {gate.scenario}"
    rows = [r for r in serving if r["scenario"] == gate.scenario]
    if not rows or rows[0]["goodput_requests_per_s"] is None or rows[0]["base_goodput_requests_per_s"] is None:
        why = (rows[0]["reason"] or "no base measurement") if rows else "not run"
        return {"check": name, "passed": None, "note": f"{name} not measured ({why})"}
    r = rows[0]
    goodput, base = r["goodput_requests_per_s"], r["base_goodput_requests_per_s"]
    config = "vLLM's defaults" if r["point"] == "default" else f"tuned config {r['point']}"
    evidence = f"{goodput:.3g} req/s at {r['load']}, {config}; base {base:.3g} req/s ({r['base_point']})"
    check = {"check": name, "value": r["goodput_ratio"], "threshold": gate.min_goodput_ratio, "point": r["point"],
             "settings": r["settings"], "load": r["load"], "goodput": goodput, "base_goodput": base,
             "base_point": r["base_point"]}
    if base == 0:
        # The base meets the SLO on no load: any goodput beats it, none is no evidence either way.
        ok = True if goodput > 0 else None
        return {**check, "passed": ok, "note": f"{name} goodput at the SLO {evidence}: the base meets it on no load"}
    ok = r["goodput_ratio"] >= gate.min_goodput_ratio
    return {**check, "passed": ok, "note": f"{name} goodput at the SLO {r['goodput_ratio']:.2f}x base"
            f" {'>=' if ok else '<'} {gate.min_goodput_ratio}x ({evidence})"}


def _size_check(policy: Policy, size_bytes: int | None, base_size_bytes: int | None) -> dict[str, Any]:
    if not size_bytes or not base_size_bytes:
        return {"check": "size", "passed": False, "note": "size on disk unknown"}
    ratio = size_bytes / base_size_bytes
    ok = ratio <= policy.max_size_ratio
    return {"check": "size", "passed": ok, "value": ratio, "threshold": policy.max_size_ratio,
            "note": f"size {ratio:.2f}x base {'<=' if ok else '>'} {policy.max_size_ratio}x"}


def decide(
    variant: dict[str, Any],
    base_size_bytes: int | None,
    recovery: Sequence[dict[str, Any]],
    speed: Sequence[dict[str, Any]],
    policy: Policy,
    samples: Sequence[dict[str, Any]] = (),
    flips: Sequence[dict[str, Any]] = (),
    serving: Sequence[dict[str, Any]] = (),
) -> Decision:
    """`variant` is a row of `variants`; `recovery`, `speed`, `samples`, `flips` and `serving` are its rows of
    the views `variant_recovery`, `variant_speedup`, `variant_paired_samples`, `variant_flips` and
    `variant_serving`."""
    uid = variant["variant_uid"]
    if variant["status"] != "built":
        # A skipped variant (its backend cannot run where the flow ran) was never measured: not accepted.
        what = "not built (skipped)" if variant.get("skipped") else "build failed"
        return Decision(uid, "reject", f"reject: {what}: {variant['error']}",
                        [{"check": "build", "passed": False, "note": variant["error"]}],
                        policy.hash, None, None, None)
    quality = _quality_checks(policy, recovery, samples, flips)
    checks = list(quality)
    speed_check = _speed_check(policy, speed)
    if speed_check:
        checks.append(speed_check)
    if serving_check := _serving_check(policy, serving):
        checks.append(serving_check)
    checks.append(_size_check(policy, variant.get("size_bytes"), base_size_bytes))

    failed = [c for c in checks if c["passed"] is False]
    verdict = "reject" if failed else "accept"
    ordered = failed + [c for c in checks if c["passed"] is not False]
    reason = f"{verdict}: " + "; ".join(c["note"] for c in ordered)

    def worst(field: str, pick: Callable[[list[float]], float]) -> float | None:
        values = [c[field] for c in quality if c.get(field) is not None]
        return pick(values) if values else None

    return Decision(
        variant_uid=uid, decision=verdict, reason=reason, checks=checks, policy_hash=policy.hash,
        quality_recovery=worst("value", min),
        speedup=speed_check.get("value") if speed_check else None,
        size_ratio=next((c.get("value") for c in checks if c["check"] == "size"), None),
        quality_lower_bound=worst("lower", min),
        flip_rate=worst("flip_rate", max),
    )


decide_task = task(decide, name="decide")
