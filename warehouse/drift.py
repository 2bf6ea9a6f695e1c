"""The engine-drift sentinel's reads and writes (issue 45, item 3): a run's recorded versions, the probe of the base
a run measured (a side evaluation of the base, stored as quality rows under its own `probe:` key), the model's
previous probe of the same checkpoint and probe key, and the findings (table engine_drift)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from quantgate.catalog.records import QualityReport, SampleResult
from quantgate.warehouse.reads import quality_metrics, rows
from quantgate.warehouse.statements import delete, now, transaction

_DRIFT_COLUMNS = ("task", "metric", "filter", "items", "higher_is_better", "previous_value", "value", "ratio", "lower",
                  "upper", "confidence", "moved", "drifted", "changed")


def run_versions(con, run_id: str) -> dict[str, Any]:
    """The library versions a run recorded when it began (runs.versions), {} where none."""
    found = con.execute("SELECT versions FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return _json(found[0] if found else None)


def has_probe(con, run_id: str, variant_uid: str) -> bool:
    """Whether the run stored its probe of this base (measured, or failed with its reason)."""
    return con.execute("SELECT 1 FROM quality_evals WHERE variant_uid = ? AND run_id = ? AND eval_key LIKE 'probe:%'",
                       [variant_uid, run_id]).fetchone() is not None


def evaluation_measured_in(con, run_id: str, variant_uid: str, eval_key: str) -> QualityReport | None:
    """The variant's evaluation under `eval_key` as this run measured it (its metrics and per-item rows); None where
    the run did not measure it (reused from an earlier run's) or the evaluation failed."""
    found = rows(con, "SELECT evaluator, config, seconds FROM quality_evals WHERE variant_uid = ? AND eval_key = ?"
                      " AND run_id = ? AND status = 'ok'", [variant_uid, eval_key, run_id])
    if not found:
        return None
    samples = rows(con, "SELECT task, doc_id, metric, value, detail, filter FROM quality_samples"
                        " WHERE variant_uid = ? AND eval_key = ? ORDER BY task, metric, filter, doc_id",
                   [variant_uid, eval_key])
    return QualityReport(eval_key=eval_key, evaluator=found[0]["evaluator"], config=_json(found[0]["config"]),
                         metrics=quality_metrics(con, variant_uid, eval_key),
                         samples=[SampleResult(**{**s, "detail": _json(s["detail"])}) for s in samples],
                         seconds=found[0]["seconds"])


def _json(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else dict(value or {})


def previous_probe(con, run_id: str, variant_uid: str, probe_key: str) -> tuple[str, str] | None:
    """(run id, eval key) of the latest probe of the same base and probe key that an earlier evaluate-model run
    measured successfully; None where there is none (a first run, a new checkpoint, a changed probe)."""
    found = con.execute(
        "SELECT e.run_id, e.eval_key FROM quality_evals e JOIN runs r USING (run_id)"
        " WHERE e.variant_uid = ? AND e.eval_key LIKE ? AND e.status = 'ok' AND e.run_id <> ?"
        " AND r.flow_name = 'evaluate-model'"
        " AND r.started_at <= (SELECT started_at FROM runs WHERE run_id = ?)"
        " ORDER BY r.started_at DESC, e.created_at DESC LIMIT 1",
        [variant_uid, f"probe:{probe_key}:%", run_id, run_id]).fetchone()
    return (found[0], found[1]) if found else None


def probe_items(con, variant_uid: str, eval_key: str) -> list[dict[str, Any]]:
    """A probe's per-item values (a perplexity's log-likelihood with its weight) and each metric's direction."""
    return rows(con, "SELECT s.task, s.metric, s.filter, s.doc_id, s.value, (s.detail->>'$.weight')::DOUBLE AS weight,"
                     " q.higher_is_better FROM quality_samples s JOIN quality_results q USING (variant_uid, eval_key,"
                     " task, metric, filter) WHERE s.variant_uid = ? AND s.eval_key = ?"
                     " ORDER BY s.task, s.metric, s.filter, s.doc_id", [variant_uid, eval_key])


def record_drift(con, run_id: str, variant_uid: str, previous_run_id: str, findings: Sequence[dict[str, Any]]) -> None:
    """The run's findings, replacing any it stored before (a rerun of the stage after a crash)."""
    with transaction(con):
        delete(con, "engine_drift", {"run_id": run_id})
        if findings:
            con.executemany(
                f"INSERT INTO engine_drift (run_id, variant_uid, previous_run_id, {', '.join(_DRIFT_COLUMNS)},"
                f" recorded_at) VALUES ({', '.join('?' * (len(_DRIFT_COLUMNS) + 4))})",
                [[run_id, variant_uid, previous_run_id, *(f[c] for c in _DRIFT_COLUMNS), now()] for f in findings])


def findings(con, run_id: str) -> list[dict[str, Any]]:
    """The run's drift findings, as tasks/steps/drift.drift_check reads them."""
    return rows(con, "SELECT * FROM engine_drift WHERE run_id = ? ORDER BY task, metric, filter", [run_id])
