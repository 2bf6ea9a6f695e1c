"""The warehouse's writes of what runs find: models and their builds, evaluations, speed rows and serving loads,
decisions with their checks, the GPU suite's steps, prices and endpoints, and the links that say which of them a
run looks at. Each is one transaction, or joins the caller's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from quantgate.catalog.records import (
    Decision, ModelArtifact, QualityReport, ServingLoad, Slo, SpeedResult, VariantArtifact,
)
from quantgate.warehouse.reads import has_quality
from quantgate.warehouse.statements import as_json, delete, insert_new, now, replace, transaction


def _provenance(model: ModelArtifact) -> dict[str, Any]:
    """A model's provenance columns: a model with none found is not prequantized (stored, unlike NULL: unknown)."""
    p = model.provenance
    return {"prequantized": bool(p and p.quantized), "provenance": p.label if p else None,
            "provenance_detail": as_json(asdict(p)) if p else None}


def record_model(con, run_id: str, model: ModelArtifact) -> None:
    with transaction(con):
        insert_new(con, "models", {"model_uid": model.uid}, {
            "model_id": model.model_id, "source": model.source, "revision": model.revision, "sha": model.sha,
            "path": model.path, "architecture": model.architecture, "num_parameters": model.num_parameters,
            "size_bytes": model.size_bytes, "random_weights": model.random_weights, **_provenance(model),
            "first_run_id": run_id})
        # A row stored before migration 0015 has no provenance: this run's reading of the same checkpoint is it.
        if con.execute("SELECT 1 FROM models WHERE model_uid = ? AND prequantized IS NULL", [model.uid]).fetchone():
            values = _provenance(model)
            con.execute(f"UPDATE models SET {', '.join(f'{c} = ?' for c in values)} WHERE model_uid = ?",
                        [*values.values(), model.uid])


def record_variant(con, run_id: str, v: VariantArtifact, role: str) -> None:
    """Store a build once; a failed (or skipped) build may be replaced by a later successful one of the same uid."""
    with transaction(con):
        existing = con.execute("SELECT status FROM variants WHERE variant_uid = ?", [v.uid]).fetchone()
        if not (existing and (existing[0] == "built" or v.status != "built")):
            if existing:
                con.execute("DELETE FROM variants WHERE variant_uid = ?", [v.uid])
            # A skipped variant is stored as status 'failed' with skipped = true (migration 0007).
            con.execute(
                "INSERT INTO variants (variant_uid, model_uid, name, method, scheme, bits, group_size, path, recipe,"
                " recipe_hash, lib_versions, size_bytes, build_seconds, peak_memory_bytes, status, error,"
                " created_run_id, created_at, weights, skipped)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [v.uid, v.model_uid, v.name, v.method, v.scheme, v.bits, v.group_size, v.path, v.recipe,
                 v.recipe_hash, as_json(v.lib_versions), v.size_bytes, v.build_seconds, v.peak_memory_bytes,
                 "failed" if v.status == "skipped" else v.status, v.error, run_id, now(), v.weights,
                 v.status == "skipped"],
            )
        link_variant(con, run_id, v.uid, role, v.reused)


def fail_variant(con, variant_uid: str, error: str) -> None:
    """A built variant that turned out unusable (e.g. NaN/Inf outputs): failed, with the reason."""
    with transaction(con):
        con.execute("UPDATE variants SET status = 'failed', error = ? WHERE variant_uid = ?", [error, variant_uid])


def link_variant(con, run_id: str, variant_uid: str, role: str, reused: bool) -> None:
    """The run looks at this variant (built by it, or reused); a second call updates `reused`."""
    with transaction(con):
        if not insert_new(con, "run_variants", {"run_id": run_id, "variant_uid": variant_uid},
                          {"role": role, "reused": reused}):
            con.execute("UPDATE run_variants SET reused = ? WHERE run_id = ? AND variant_uid = ?",
                        [reused, run_id, variant_uid])


def record_quality(con, run_id: str, variant_uid: str, report: QualityReport, link: bool = True) -> None:
    """Store one evaluation with all its metrics and samples in one transaction, replacing a failed one.

    `link` makes it the run's evaluation of the variant (the suite); side measurements such as the
    KL divergence are stored without moving that link.
    """
    with transaction(con):
        if link:
            con.execute(
                "UPDATE run_variants SET eval_key = ? WHERE run_id = ? AND variant_uid = ?",
                [report.eval_key, run_id, variant_uid],
            )
        if has_quality(con, variant_uid, report.eval_key):
            return
        for table in ("quality_evals", "quality_results", "quality_samples"):
            con.execute(f"DELETE FROM {table} WHERE variant_uid = ? AND eval_key = ?", [variant_uid, report.eval_key])
        con.execute(
            "INSERT INTO quality_evals VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [variant_uid, report.eval_key, run_id, report.evaluator, as_json(report.config), report.seconds,
             report.status, report.error, now()],
        )
        if report.metrics:
            con.executemany(
                "INSERT INTO quality_results VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [[variant_uid, report.eval_key, run_id, m.task, m.metric, m.filter, m.value, m.stderr, m.n_samples,
                  m.task_version, m.higher_is_better] for m in report.metrics],
            )
        if report.samples:
            import pandas as pd

            samples = pd.DataFrame(
                {
                    "variant_uid": variant_uid,
                    "eval_key": report.eval_key,
                    "task": [s.task for s in report.samples],
                    "doc_id": [s.doc_id for s in report.samples],
                    "metric": [s.metric for s in report.samples],
                    "filter": [s.filter for s in report.samples],
                    "value": [s.value for s in report.samples],
                    "detail": [as_json(s.detail) for s in report.samples],
                }
            )
            con.register("_samples", samples)
            con.execute("INSERT INTO quality_samples SELECT * FROM _samples")
            con.unregister("_samples")


def link_quality(con, run_id: str, variant_uid: str, eval_key: str) -> None:
    with transaction(con):
        con.execute(
            "UPDATE run_variants SET eval_key = ? WHERE run_id = ? AND variant_uid = ?", [eval_key, run_id, variant_uid]
        )


_SPEED_COLUMNS = (
    "engine", "scenario", "status", "reason", "config", "device", "num_requests", "input_tokens", "output_tokens",
    "tokens_per_s", "requests_per_s", "ttft_ms", "tpot_ms", "e2el_ms", "peak_memory_bytes", "energy_j_per_token",
    "repetitions", "versions", "total_tokens_per_s", "decode_tokens_per_s", "bandwidth_gbps",
    "weight_bytes_per_token", "roofline_fraction", "nvml_peak_bytes", "torch_peak_bytes", "kv_cache_tokens",
    "kv_cache_bytes", "details",
)
_JSON_SPEED = {"config", "repetitions", "versions", "details"}


def record_speed(con, run_id: str, variant_uid: str, results: Sequence[SpeedResult]) -> None:
    with transaction(con):
        for r in results:
            d = asdict(r)
            values = {c: as_json(d[c]) if c in _JSON_SPEED else d[c] for c in _SPEED_COLUMNS if c not in ("engine", "scenario")}
            replace(con, "speed_results", {"run_id": run_id, "variant_uid": variant_uid, "engine": r.engine,
                                           "scenario": r.scenario}, {**values, "created_at": now()})


def link_speed(con, run_id: str, variant_uid: str, speed_key: str, source: tuple[str, str] | None = None) -> None:
    """The run's speed rows for the variant: measured by itself (no source), or those of `source` (run,
    checkpoint): an earlier run's, or another checkpoint's of the same format."""
    source_run, source_uid = source or (run_id, variant_uid)
    con.execute("UPDATE run_variants SET speed_key = ?, speed_run_id = ?, speed_variant_uid = ?"
                " WHERE run_id = ? AND variant_uid = ?",
                [speed_key, source_run, None if source_uid == variant_uid else source_uid, run_id, variant_uid])


def record_serving(con, run_id: str, variant_uid: str, engine: str, scenario: str, loads: Sequence[ServingLoad],
                   slo: Slo | None) -> None:
    """Store a serving scenario's loads and every request of them, replacing an earlier write of the same run."""
    import pandas as pd

    key = [run_id, variant_uid, engine, scenario]
    where = "run_id = ? AND variant_uid = ? AND engine = ? AND scenario = ?"
    with transaction(con):
        con.execute(f"DELETE FROM serving_requests WHERE {where}", key)
        con.execute(f"DELETE FROM serving_loads WHERE {where}", key)
        for load in loads:
            ok = [r for r in load.records if r.success]
            con.execute(
                "INSERT INTO serving_loads VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [*key, load.label, load.max_concurrency, load.request_rate, len(load.records), load.duration_s,
                 len(ok), len(load.records) - len(ok), sum(r.output_tokens for r in ok), load.energy_j,
                 slo.ttft_ms if slo else None, slo.tpot_ms if slo else None, slo.e2el_ms if slo else None, now()],
            )
            if not load.records:
                continue
            ms = lambda s: None if s is None else s * 1000  # noqa: E731
            frame = pd.DataFrame(
                {
                    "run_id": run_id, "variant_uid": variant_uid, "engine": engine, "scenario": scenario,
                    "load": load.label,
                    "request_index": [r.index for r in load.records],
                    "success": [r.success for r in load.records],
                    "error": [r.error for r in load.records],
                    "prompt_tokens": [r.prompt_len for r in load.records],
                    "output_tokens": [r.output_tokens for r in load.records],
                    "ttft_ms": [ms(r.ttft_s) for r in load.records],
                    "tpot_ms": [ms(r.tpot_s) for r in load.records],
                    "e2el_ms": [ms(r.e2el_s) for r in load.records],
                    "itl_ms": [[gap * 1000 for gap in r.itl_s] for r in load.records],
                    "arrival_offset_s": [r.arrival_offset_s for r in load.records],
                    "start_offset_s": [r.start_offset_s for r in load.records],
                }
            )
            con.register("_requests", frame)
            con.execute("INSERT INTO serving_requests SELECT * FROM _requests")
            con.unregister("_requests")


def record_measured(con, run_id: str, variant_uid: str,
                    measured: Sequence[tuple[SpeedResult, Sequence[ServingLoad]]]) -> None:
    """Speed rows and, for serving runs, their loads, judged against the SLO in the row's config, in one transaction."""
    with transaction(con):
        record_speed(con, run_id, variant_uid, [result for result, _ in measured])
        for result, loads in measured:
            if result.config.get("kind") == "serving":
                slo = result.config.get("slo")
                record_serving(con, run_id, variant_uid, result.engine, result.scenario, loads,
                               Slo(**slo) if slo else None)


_CHECK_COLUMNS = ("kind", "name", "task", "metric", "value", "lower", "upper", "threshold", "outcome",
                  "min_detectable_drop", "items", "items_to_decide", "note", "detail")


def record_decisions(con, run_id: str, decisions: Sequence[Decision], policy: dict[str, Any]) -> None:
    """Each decision and its checks (`decision_checks`, one row each, in the decision's order), together."""
    checks_sql = (f"INSERT INTO decision_checks (run_id, variant_uid, position, {', '.join(_CHECK_COLUMNS)})"
                  f" VALUES ({', '.join('?' * (len(_CHECK_COLUMNS) + 3))})")
    with transaction(con):
        for d in decisions:
            replace(con, "decisions", {"run_id": run_id, "variant_uid": d.variant_uid}, {
                "decision": d.decision, "reason": d.reason, "quality_recovery": d.quality_recovery,
                "speedup": d.speedup, "size_ratio": d.size_ratio, "policy_hash": d.policy_hash,
                "policy": as_json(policy), "decided_at": now(), "quality_lower_bound": d.quality_lower_bound,
                "flip_rate": d.flip_rate})
            delete(con, "decision_checks", {"run_id": run_id, "variant_uid": d.variant_uid})
            for position, c in enumerate(d.checks):
                row = asdict(c)
                con.execute(checks_sql, [run_id, d.variant_uid, position,
                                         *(as_json(row[k]) if k == "detail" else row[k] for k in _CHECK_COLUMNS)])


def record_suite_step(con, run_id: str, index: int, part: str, engine: str, build: str, scenarios: Sequence[str],
                      status: str, reason: str | None, started_s: float | None, seconds: float | None) -> None:
    with transaction(con):
        replace(con, "suite_steps", {"run_id": run_id, "step_index": index}, {
            "part": part, "engine": engine, "build": build, "scenarios": list(scenarios), "status": status,
            "reason": reason, "started_s": started_s, "seconds": seconds})


def record_prices(con, run_id: str, prices: dict[str, float], catalog_hash: str | None = None) -> None:
    """The price table (US$ per device-hour by device kind) a run's costs are computed with."""
    with transaction(con):
        con.execute("DELETE FROM run_prices WHERE run_id = ?", [run_id])
        for device, usd in sorted(prices.items()):
            con.execute("INSERT INTO run_prices VALUES (?, ?, ?, ?, ?)", [run_id, device, float(usd), catalog_hash, now()])


def record_endpoint(con, run_id: str, variant_uid: str, engine: str, scenario: str, base_url: str, model: str,
                    identity: dict[str, Any]) -> None:
    """The server behind an endpoint run: its name and version where it exposes them, and what it said."""
    with transaction(con):
        replace(con, "serving_endpoints", {"run_id": run_id, "variant_uid": variant_uid, "engine": engine,
                                           "scenario": scenario}, {
            "base_url": base_url, "model": model, "server": identity.get("server"),
            "server_version": identity.get("server_version"), "identity": as_json(identity), "probed_at": now()})
