"""The warehouse's named reads: what flows, the CLI and the report ask of it, each a function named for what it
reads (a run's scorecard, the evidence its decisions are made from, the stored builds, evaluations and speed rows a
run may reuse), and `rows`, the query they are made of."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb

from quantgate.catalog.records import MetricResult, ModelArtifact, Provenance
from quantgate.catalog.stages import Stage


def rows(con, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """Each row of a query as a dict by column name."""
    cur = con.execute(sql, list(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def scorecard(con, run_id: str) -> list[dict[str, Any]]:
    return rows(con, "SELECT * FROM variant_scorecard WHERE run_id = ?", [run_id])


@dataclass(frozen=True)
class DecisionEvidence:
    """What the decisions of a run are made from, each a view's rows for the run's variants."""

    variants: list[dict[str, Any]]
    recovery: list[dict[str, Any]]
    speedup: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    flips: list[dict[str, Any]]
    serving: list[dict[str, Any]]
    formats: list[dict[str, Any]]

    def of(self, variant_uid: str) -> dict[str, list[dict[str, Any]]]:
        """One variant's rows, by the names tasks/steps/decide.decide takes them under."""
        def mine(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [r for r in found if r["variant_uid"] == variant_uid]

        return {"recovery": mine(self.recovery), "speed": mine(self.speedup), "samples": mine(self.samples),
                "flips": mine(self.flips), "serving": mine(self.serving), "formats": mine(self.formats)}


def decision_evidence(con, run_id: str, gated: Sequence[tuple[str, str]]) -> DecisionEvidence:
    def view(name: str) -> list[dict[str, Any]]:
        return rows(con, f"SELECT * FROM {name} WHERE run_id = ?", [run_id])

    # The model's random_weights beside each variant (a run on a model's shape measures no quality), and whether
    # its weights passed through quantization before (its provenance, as verdicts name it).
    variants = rows(con, "SELECT v.*, coalesce(m.random_weights, false) AS random_weights,"
                         " m.prequantized AS base_prequantized, m.provenance AS base_provenance FROM variants v"
                         " JOIN run_variants rv USING (variant_uid) LEFT JOIN models m USING (model_uid)"
                         " WHERE rv.run_id = ? AND rv.role = 'variant'", [run_id])
    return DecisionEvidence(variants, view("variant_recovery"), view("variant_speedup"),
                            paired_samples(con, run_id, list(gated)), view("variant_flips"), view("variant_serving"),
                            view("variant_answer_format"))


def paired_samples(con, run_id: str, metrics: Sequence[tuple[str, str]] = ()) -> list[dict[str, Any]]:
    """Rows of `variant_paired_samples` of one run; only these (task, metric) pairs when any are given."""
    where, params = "run_id = ?", [run_id]
    if metrics:
        where += " AND (task, metric) IN (VALUES " + ", ".join("(?, ?)" for _ in metrics) + ")"
        params += [x for pair in metrics for x in pair]
    return rows(con, f"SELECT * FROM variant_paired_samples WHERE {where} ORDER BY variant_uid, task, metric, filter, doc_id",
                params)


def latest_run(con, model_id: str) -> str | None:
    """The model's latest finished evaluate-model run."""
    found = con.execute("SELECT run_id FROM latest_runs WHERE model_id = ?", [model_id]).fetchone()
    return found[0] if found else None


def decision_checks(con, run_id: str, variant: str | None = None) -> list[dict[str, Any]]:
    """Every check behind a run's decisions (or one variant's), in the order the policy applied them."""
    return rows(con, "SELECT v.name AS variant, c.position, c.kind, c.name AS check, c.outcome, c.value, c.lower,"
                     " c.upper, c.threshold, c.items, c.items_to_decide, c.note"
                     " FROM decision_checks c JOIN variants v USING (variant_uid)"
                     " WHERE c.run_id = ? AND (? IS NULL OR v.name = ?) ORDER BY v.name, c.position",
                [run_id, variant, variant])


def stage_summary(con, run_id: str) -> list[dict[str, Any]]:
    """Seconds per stage of a run (from the first start to the last end of its items, which may overlap),
    the longest item, engine starts and how many items were reused, in the order the stages began."""
    return rows(
        con,
        "SELECT stage, count(*) AS checkpoints, round(epoch(max(ended_at) - min(started_at)), 1) AS seconds,"
        " round(max(seconds), 1) AS busiest_s, sum(engine_starts) AS engine_starts,"
        " count(*) FILTER (WHERE reused) AS reused"
        " FROM stage_times WHERE run_id = ? GROUP BY stage ORDER BY min(started_at)",
        [run_id],
    )


def model_of(con, model_uid: str) -> ModelArtifact | None:
    row = con.execute("SELECT model_id, path, source, revision, sha, architecture, num_parameters, size_bytes,"
                      " coalesce(random_weights, false), provenance_detail FROM models WHERE model_uid = ?",
                      [model_uid]).fetchone()
    if row is None:
        return None
    detail = json.loads(row[-1]) if isinstance(row[-1], str) else row[-1]
    return ModelArtifact(*row[:-1], provenance=Provenance(**detail) if detail else None)


def run_variant(con, run_id: str, variant_uid: str) -> dict[str, Any] | None:
    """A variant's row as a run recorded it (any status), with that run's `reused` flag."""
    found = rows(con, "SELECT v.*, rv.reused FROM variants v JOIN run_variants rv USING (variant_uid)"
                      " WHERE rv.run_id = ? AND v.variant_uid = ?", [run_id, variant_uid])
    return found[0] if found else None


def find_variant(con, uid: str) -> dict[str, Any] | None:
    row = con.execute("SELECT * FROM variants WHERE variant_uid = ? AND status = 'built'", [uid]).fetchone()
    if row is None:
        return None
    return dict(zip([d[0] for d in con.description], row))


def variant_failed(con, variant_uid: str) -> bool:
    found = con.execute("SELECT status = 'failed' FROM variants WHERE variant_uid = ?", [variant_uid]).fetchone()
    return bool(found and found[0])


def has_quality(con, variant_uid: str, eval_key: str) -> bool:
    row = con.execute(
        "SELECT 1 FROM quality_evals WHERE variant_uid = ? AND eval_key = ? AND status = 'ok'", [variant_uid, eval_key]
    ).fetchone()
    return row is not None


def quality_metrics(con, variant_uid: str, eval_key: str) -> list[MetricResult]:
    found = con.execute("SELECT task, metric, filter, value, stderr, n_samples, task_version, higher_is_better"
                        " FROM quality_results WHERE variant_uid = ? AND eval_key = ?", [variant_uid, eval_key]).fetchall()
    return [MetricResult(*r) for r in found]


def speed_source(con, speed_key: str) -> tuple[str, str] | None:
    """(run, checkpoint) of the latest benchmark stage that measured rows with this speed key (a format, its
    scenarios, libraries and device): what a rerun, or another checkpoint of the same format, would measure
    again."""
    found = con.execute(
        "SELECT rv.run_id, rv.variant_uid FROM run_variants rv JOIN run_stages st ON st.run_id = rv.run_id"
        " AND st.stage = ? AND st.item = rv.variant_uid"
        " WHERE rv.speed_key = ? AND coalesce(rv.speed_run_id, rv.run_id) = rv.run_id"
        " AND coalesce(rv.speed_variant_uid, rv.variant_uid) = rv.variant_uid"
        " ORDER BY st.completed_at DESC LIMIT 1",
        [Stage.BENCHMARK, speed_key],
    ).fetchone()
    return (found[0], found[1]) if found else None


def run_timeline(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """A run's wall time from its start to its decisions, and its engine starts (the `run_timeline` view)."""
    return rows(con, "SELECT * FROM run_timeline WHERE run_id = ?", [run_id])


def latest_scorecards(con: duckdb.DuckDBPyConnection, model_id: str | None = None) -> list[dict[str, Any]]:
    """The scorecard of each model's latest run, or of one model's."""
    where, params = ("WHERE model_id = ?", [model_id]) if model_id else ("", [])
    return rows(con, f"SELECT * FROM variant_scorecard {where}", params)


def changes_since_previous(con: duckdb.DuckDBPyConnection, model_id: str | None = None) -> list[dict[str, Any]]:
    """What moved beyond noise since each model's previous run (or one model's): the `regressions` that changed,
    flagged ones (worse) first."""
    return rows(con, "SELECT * FROM regressions WHERE change IN ('worse', 'better', 'changed')"
                     f" {'AND model_id = ?' if model_id else ''}"
                     " ORDER BY flagged DESC, model_id, variant, kind, measure", [model_id] if model_id else [])


def endpoint_scenarios(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """Each scenario of a bench-endpoint run, in order: its speed row, the server that answered (where it said)
    and what its output tokens cost."""
    return rows(
        con,
        "SELECT s.scenario, s.status, s.reason, s.tokens_per_s, s.ttft_ms, s.tpot_ms, e.server, e.server_version,"
        " c.usd_per_million_output_tokens, c.usd_per_million_output_tokens_at_slo, c.slo_load"
        " FROM speed_results s LEFT JOIN serving_endpoints e USING (run_id, variant_uid, engine, scenario)"
        " LEFT JOIN variant_cost c USING (run_id, variant_uid, engine, scenario)"
        " WHERE s.run_id = ? ORDER BY s.scenario", [run_id])


def suite_steps(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """The GPU suite's steps of a run, in order: what each ran, its status and why, and when."""
    return rows(con, "SELECT * FROM suite_steps WHERE run_id = ? ORDER BY step_index", [run_id])
