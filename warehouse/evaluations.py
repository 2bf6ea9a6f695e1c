"""The stored evaluations a run's figures come from, as `quantgate reproduce` reads them: each checkpoint's
evaluation config (what quantgate asked lm-eval for) and its per-item results, to set a re-run outside quantgate
beside them."""

from __future__ import annotations

import json
from typing import Any

from quantgate.warehouse.reads import latest_run, rows


def resolve_run(con, run_or_model: str) -> str | None:
    """A run id as given, else the latest finished run of the model of that id; None when neither is stored."""
    if con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_or_model]).fetchone():
        return run_or_model
    return latest_run(con, run_or_model)


def run_evaluations(con, run_id: str, variant: str | None = None) -> list[dict[str, Any]]:
    """Each checkpoint of the run with the suite evaluation it uses (run_variants.eval_key), base first: its name,
    role, method, the evaluation's key, the run that measured it, its status and its config (a dict)."""
    found = rows(con, "SELECT v.name AS variant, rv.role, v.method, v.variant_uid, e.eval_key,"
                      " e.run_id AS measured_run_id, e.status, e.config"
                      " FROM run_variants rv JOIN variants v USING (variant_uid)"
                      " JOIN quality_evals e ON e.variant_uid = rv.variant_uid AND e.eval_key = rv.eval_key"
                      " WHERE rv.run_id = ? AND (? IS NULL OR v.name = ?)"
                      " ORDER BY rv.role = 'variant', v.name", [run_id, variant, variant])
    for r in found:
        r["config"] = json.loads(r["config"]) if isinstance(r["config"], str) else (r["config"] or {})
    return found


def evaluation_samples(con, variant_uid: str, eval_key: str) -> list[dict[str, Any]]:
    """The per-item results of one stored evaluation (quality_samples), in task, metric, filter, doc order."""
    return rows(con, "SELECT task, metric, filter, doc_id, value FROM quality_samples"
                     " WHERE variant_uid = ? AND eval_key = ? ORDER BY task, metric, filter, doc_id",
                [variant_uid, eval_key])
