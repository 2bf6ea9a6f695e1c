"""The engine-drift sentinel (issue 45, item 3): is the base still measured the same way?

A verdict is a ratio to the base, and a nightly scores with whatever vLLM, lm-eval, Transformers and torch are
installed; their upgrades move scores. Each run whose suite sets `probe` re-measures the base on a small frozen
item set (the first `probe` items of each gated task, the evaluation's own engine and arguments) and sets it
beside the model's previous run's probe, item for item. The probes compare only where nothing but the program can
differ: the same checkpoint (the base's uid names its sha) and the same probe (`probe_key`: tasks, limits,
protocol, task configs, backend, dtype). A move beyond the paired interval's noise while library versions changed
is engine drift, and every verdict of the run says so ("engine drift: base qg_mmlu/acc moved 0.512 → 0.488 ...
with vllm 0.11.0 → 0.12.0"); with the same versions nothing is flagged.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from quantgate.catalog.policy import Policy
from quantgate.catalog.records import DecisionCheck, MetricResult, QualityReport, SampleResult
from quantgate.catalog.suites import SuiteSpec
from quantgate.tasks.adapters.evaluators.lm_eval import local_task_configs
from quantgate.tasks.adapters.evaluators.lm_eval_rows import GROUP_DOC_BLOCK
from quantgate.tasks.steps.quality_stats import QualityStatsError, aggregate, aggregation, paired_bootstrap

DRIFT_CHECK = "engine drift"
# The libraries that score an evaluation, beside those that build (tasks/steps/quantize.lib_versions): recorded
# with each run, so that drift names the one that changed.
ENGINE_LIBS = ("lm_eval", "vllm", "datasets", "tokenizers")
# A move smaller than this share of the score is arithmetic (summation order, padding), not drift: a
# perplexity's per-document values move in their last bits between any two engines, and its paired interval is so
# narrow that it would exclude 1 all the same. Gates judge recoveries of 0.9-0.99, a hundred times coarser.
MATERIAL = 0.001
# Recorded versions that describe the program rather than name a library's version.
_NOT_A_LIBRARY = ("lock_drift",)


def engine_versions() -> dict[str, str]:
    """{name: version} of the scoring libraries installed here (vLLM only where it is)."""
    found = {}
    for name in ENGINE_LIBS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def probe_suite(suite: SuiteSpec, policy: Policy) -> SuiteSpec | None:
    """The suite's probe: each task a quality gate names (every task where no gate names one), limited to the
    suite's `probe` items; None when the suite sets no probe."""
    if suite.probe is None:
        return None
    gated = {g.task for g in policy.quality}
    tasks = [t for t in suite.tasks if t.name in gated] or list(suite.tasks)
    limited = tuple(t.model_copy(update={"limit": min(t.limit or suite.probe, suite.probe)}) for t in tasks)
    return suite.model_copy(update={"tasks": limited})


def probe_key(probe: SuiteSpec, backend: str, dtype: str) -> str:
    """What makes two probes comparable, without the library versions they are compared across: the probe's tasks
    and protocol, each local task's resolved config (its YAML and the code it calls, by hash), backend and dtype.
    A built-in lm-eval task's config is lm-eval's own: a change of it is lm-eval's version."""
    configs = {name: [leaf.config for leaf in leaves] for name, leaves in local_task_configs(probe).items()}
    key = {"suite": probe.model_dump(mode="json"), "configs": configs, "backend": backend, "dtype": dtype}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def probe_eval_key(key: str, run_id: str) -> str:
    """The probe's evaluation key: its own per run (a probe is measured anew each run, never reused)."""
    return f"probe:{key}:{run_id}"


def probe_of(probe: SuiteSpec, evaluation: QualityReport) -> QualityReport:
    """The probe as the base's suite evaluation of this run measured it: its first items of each probe task (a
    group's: of each subtask) are the probe's items, asked with the same engine, arguments and protocol; each
    metric again from those items, as lm-eval aggregates it. Saves the probe's own engine start and evaluation (at
    7B, 155 s after the measurements: results/h200/shape7b-1). Items scored within a larger batch may differ from
    a probe's own in their last bits, which `compare` does not take for a move (MATERIAL)."""
    began = time.monotonic()
    limits = {t.name: t.limit or probe.probe or 0 for t in probe.tasks}
    group_of = {s.detail["subtask"]: s.task for s in evaluation.samples if s.task in limits and "subtask" in s.detail}
    kept = [s for s in evaluation.samples if _in_probe(s, limits, group_of)]
    by_metric: dict[tuple[str, str, str], list[SampleResult]] = defaultdict(list)
    for s in kept:
        by_metric[(s.task, s.metric, s.filter)].append(s)
    metrics = []
    for m in evaluation.metrics:
        items = [s for s in by_metric.get((m.task, m.metric, m.filter), []) if s.value is not None]
        if not items:
            continue
        agg = aggregation(m.metric)
        value = aggregate(agg, [s.value for s in items], [s.detail.get("weight") or 1.0 for s in items])
        metrics.append(MetricResult(m.task, m.metric, m.filter, value, None, len(items), m.task_version,
                                    m.higher_is_better))
    return QualityReport(evaluation.eval_key, evaluation.evaluator, evaluation.config, metrics, kept,
                         time.monotonic() - began)


def _in_probe(s: SampleResult, limits: dict[str, int], group_of: dict[str, str]) -> bool:
    if s.task in limits:  # a task's own items, or a group's (each subtask's ids in a block of its own)
        return s.doc_id % GROUP_DOC_BLOCK < limits[s.task]
    group = group_of.get(s.task)
    return group is not None and s.doc_id < limits[group]


def changed_libraries(previous: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each recorded version that differs between two runs, 'name a → b' ('absent' where one run had none)."""
    names = sorted((set(previous) | set(current)) - set(_NOT_A_LIBRARY))
    return [f"{n} {previous.get(n) or 'absent'} → {current.get(n) or 'absent'}" for n in names
            if previous.get(n) != current.get(n)]


def compare(previous: Sequence[dict[str, Any]], current: Sequence[dict[str, Any]], changed: Sequence[str],
            confidence: float) -> list[dict[str, Any]]:
    """One finding per (task, metric, filter) the two probes share: both scores on their common items, the ratio
    current ÷ previous (inverted where lower is better, as a recovery is: below 1 is worse) with its paired
    bootstrap interval, and whether it is drift (interval excluding 1, a material move, libraries changed)."""
    before = {(r["task"], r["metric"], r["filter"], r["doc_id"]): r for r in previous}
    pairs: dict[tuple[str, str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for r in current:
        old = before.get((r["task"], r["metric"], r["filter"], r["doc_id"]))
        if old is not None and _finite(old["value"]) and _finite(r["value"]):
            pairs[(r["task"], r["metric"], r["filter"])].append((old, r))
    return [f for (task, metric, filter_), items in sorted(pairs.items())
            if (f := _finding(task, metric, filter_, items, changed, confidence)) is not None]


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _finding(task: str, metric: str, filter_: str, items: list[tuple[dict[str, Any], dict[str, Any]]],
             changed: Sequence[str], confidence: float) -> dict[str, Any] | None:
    agg, higher = aggregation(metric), items[0][1]["higher_is_better"]
    if higher is None:
        return None  # a metric lm-eval gives no direction (a pair metric's): no ratio to read
    old_w = [o["weight"] or 1.0 for o, _ in items]
    new_w = [n["weight"] or 1.0 for _, n in items]
    try:
        ci = paired_bootstrap([o["value"] for o, _ in items], [n["value"] for _, n in items], higher_is_better=higher,
                              agg=agg, base_weights=old_w, variant_weights=new_w, confidence=confidence)
    except QualityStatsError:
        return None
    moved = (ci.recovery is not None and ci.lower is not None and ci.upper is not None
             and (ci.lower > 1 or ci.upper < 1) and abs(ci.recovery - 1) > MATERIAL)
    return {"task": task, "metric": metric, "filter": filter_, "items": len(items), "higher_is_better": higher,
            "previous_value": aggregate(agg, [o["value"] for o, _ in items], old_w),
            "value": aggregate(agg, [n["value"] for _, n in items], new_w),
            "ratio": ci.recovery, "lower": ci.lower, "upper": ci.upper, "confidence": confidence,
            "moved": moved, "drifted": moved and bool(changed), "changed": ", ".join(changed)}


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.4g}"


def describe(f: dict[str, Any], previous_run_id: str) -> str:
    """One finding in words: the base's score then and now, the ratio with its interval, on how many items."""
    what = f"{f['task']}/{f['metric']}" + (f",{f['filter']}" if f["filter"] != "none" else "")
    return (f"base {what} {_fmt(f['previous_value'])} → {_fmt(f['value'])} (×{_fmt(f['ratio'])},"
            f" {f['confidence'] * 100:g}% CI [{_fmt(f['lower'])}, {_fmt(f['upper'])}]) on {f['items']} probe items"
            f" since run {previous_run_id[:8]}")


def drift_check(policy: Policy, findings: Sequence[dict[str, Any]]) -> DecisionCheck | None:
    """The run's drift finding on every verdict, a label (its outcome `pass`: the ratios of this run are its own
    engine's, base and variants alike where both were measured in it): drift on a gated metric, or, where
    libraries changed and the base held, that it held. Nothing where no library changed and nothing moved."""
    gated = {(g.task, g.metric) for g in policy.quality}
    mine = [f for f in findings if (f["task"], f["metric"]) in gated] or list(findings)
    if not mine:
        return None
    drifted = [f for f in mine if f["drifted"]]
    moved = [f for f in mine if f["moved"] and not f["drifted"]]
    previous = mine[0]["previous_run_id"]
    detail = {"previous_run_id": previous, "changed": mine[0]["changed"], "drifted": bool(drifted)}
    if drifted:
        note = (f"{DRIFT_CHECK}: " + "; ".join(describe(f, previous) for f in drifted)
                + f", with {drifted[0]['changed']}: this run's verdicts compare against a base the engine moved;"
                " a variant's change since that run may be the engine's")
        worst = max(drifted, key=lambda f: abs((f["ratio"] or 1) - 1))
        return DecisionCheck("baseline", DRIFT_CHECK, "pass", note, task=worst["task"], metric=worst["metric"],
                             value=worst["ratio"], lower=worst["lower"], upper=worst["upper"], threshold=1.0,
                             items=worst["items"], detail=detail)
    if moved:  # beyond noise with the same recorded versions: not attributed to a library
        return DecisionCheck("baseline", DRIFT_CHECK, "pass",
                             f"{DRIFT_CHECK}: none attributed: " + "; ".join(describe(f, previous) for f in moved)
                             + ", with no recorded library changed (the engine did not repeat itself)", detail=detail)
    if not mine[0]["changed"]:
        return None
    return DecisionCheck("baseline", DRIFT_CHECK, "pass",
                         f"{DRIFT_CHECK}: none: the base's probe held ({describe(mine[0], previous)}) across"
                         f" {mine[0]['changed']}", detail=detail)
