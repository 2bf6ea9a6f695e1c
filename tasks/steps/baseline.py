"""The base's own checks in a decision: does it measure like the model it claims to be (its scores against the
figures its makers published, within the tolerance the catalog states for the protocol differences), and did its
weights pass through quantization before the run (its provenance: labelled, or by policy keeping an accept from
resting on it). A variant's every figure is a ratio to the base, so these come before any of them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from quantgate.catalog.models import PublishedFigure
from quantgate.catalog.policy import Policy, QualityGate
from quantgate.catalog.records import DecisionCheck
from quantgate.tasks.steps.quality_stats import aggregation, z_score

PROVENANCE_CHECK = "base provenance"


def fmt(x: float | None) -> str:
    return f"{x:.4g}"


def gate_rows(gate: QualityGate, recovery: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gate's rows of `variant_recovery`, the one it judges first: its filter's, else lm-eval's "none" before
    any other."""
    return sorted((r for r in recovery if r["task"] == gate.task and r["metric"] == gate.metric
                   and gate.filter in (None, r["filter"])), key=lambda r: r["filter"] != "none")


def base_se(row: dict[str, Any], items: Sequence[dict[str, Any]]) -> float:
    """The standard error of the base's score: from its per-item scores (`items`, of a mean metric), else lm-eval's
    stderr, else a 0/1 score's binomial one over the items, else 0."""
    values = [s["base_value"] for s in items]
    if len(values) > 1:
        return statistics.stdev(values) / math.sqrt(len(values))
    se, n, base = row.get("base_stderr"), row.get("n_samples"), row["base_value"]
    if se is not None and math.isfinite(se):
        return se
    return math.sqrt(max(base * (1 - base), 0) / n) if n and 0 <= base <= 1 else 0.0


def published_checks(policy: Policy, published: Sequence[PublishedFigure], recovery: Sequence[dict[str, Any]],
                     samples: Sequence[dict[str, Any]]) -> list[DecisionCheck]:
    """One check per published figure that states a tolerance, of a gate of `policy`."""
    checks = []
    for figure in published:
        gate = next((g for g in policy.quality if (g.task, g.metric) == (figure.task, figure.metric)), None)
        if figure.tolerance is not None and gate is not None:
            checks.append(_published_check(policy, gate, figure, gate_rows(gate, recovery), samples))
    return checks


def _published_check(policy: Policy, gate: QualityGate, figure: PublishedFigure, rows: Sequence[dict[str, Any]],
                     samples: Sequence[dict[str, Any]]) -> DecisionCheck:
    """not_comparable where the base's interval lies wholly outside the published value ± its tolerance: the
    protocol differences the entry states cannot explain it, and sampling (the interval) does not either."""
    name = f"baseline {figure.task}/{figure.metric}"
    about = {"kind": "baseline", "name": name, "task": figure.task, "metric": figure.metric, "threshold": figure.value}
    tolerance = figure.tolerance or 0.0
    published = f"the published {fmt(figure.value)} ± {fmt(tolerance)} ({figure.protocol}; {figure.source})"
    if not rows or rows[0]["base_value"] is None:
        return DecisionCheck(**about, outcome="not_measured", note=f"{name}: no base score to set beside {published}")
    r = rows[0]
    key = (gate.task, gate.metric, r["filter"])
    # Per-item scores give a mean metric's spread; a weighted one (bits per byte) has lm-eval's stderr.
    items = [s for s in samples if (s["task"], s["metric"], s["filter"]) == key] if aggregation(gate.metric) == "mean" else []
    base, half = r["base_value"], z_score(policy.confidence) * base_se(r, items)
    low, high = base - half, base + half
    outside = high < figure.value - tolerance or low > figure.value + tolerance
    filtered = f" ({r['filter']})" if r["filter"] != "none" else ""
    note = f"{name}{filtered}: base {fmt(base)} ({policy.confidence * 100:g}% CI [{fmt(low)}, {fmt(high)}])"
    if outside:
        note += f" outside {published}: the base does not measure like the model it claims to be; not comparable"
    else:
        note += f" within {published}"
    detail = {"published": figure.value, "tolerance": tolerance, "protocol": figure.protocol, "source": figure.source,
              "filter": r["filter"], "confidence": policy.confidence}
    return DecisionCheck(**about, outcome="not_comparable" if outside else "pass", note=note, value=base, lower=low,
                         upper=high, items=len(items) or r.get("n_samples"), detail=detail)


def provenance_check(policy: Policy, variant: dict[str, Any]) -> DecisionCheck | None:
    """A label on every verdict against a base whose weights passed through quantization before the run; where the
    policy says `quantized_base: inconclusive`, a check that keeps an accept from resting on it."""
    if not variant.get("base_prequantized"):
        return None
    label = variant.get("base_provenance") or "quantized"
    note = (f"{PROVENANCE_CHECK}: recoveries are against a {label} base (its weights passed through quantization"
            " before this run), not the 16-bit release")
    detail = {"provenance": label, "quantized_base": policy.quantized_base}
    if policy.quantized_base == "inconclusive":
        return DecisionCheck("baseline", PROVENANCE_CHECK, "inconclusive",
                             note + ": no accept rests on such a base (policy quantized_base: inconclusive)",
                             detail=detail)
    return DecisionCheck("baseline", PROVENANCE_CHECK, "pass", note, detail=detail)
