"""nightly: evaluate every catalog model whose inputs changed since its last successful run (or all).

A model's inputs are its checkpoint (hub commit, local content hash, GGUF hash), its variants'
recipes, suite, scenarios, calibration, policy and the library versions (flows/inputs.py). Every
successful evaluate-model run stores the hash of its inputs; the nightly recomputes it without
downloading anything and starts a run where it differs or no successful run exists.

In-process (no `evaluate_deployment`) the runs are subflows, one after another. Under a Prefect
server the deployment passes `evaluate_deployment: evaluate-model/evaluate-model` and each model
becomes its own flow run on the GPU pool, which starts them in the nightly's order as hosts have room
(each host's worker limit, the pool's concurrency limit); the artifact says the order and the room.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from quantgate.catalog.load import load_catalog
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.flows import dispatch
from quantgate.flows.inputs import ShaUnavailable, current_sha, model_inputs
from quantgate.warehouse import ledger, sessions


def _name() -> str:
    p = flow_run.parameters
    which = "all models" if p.get("all_models") else "changed models"
    return f"nightly: {which}" + (f" of {','.join(p['models'])}" if p.get("models") else "")


def plan(catalog: str | None, warehouse: str | None, workdir: str | None, all_models: bool = False,
         models: list[str] | None = None) -> list[dict[str, Any]]:
    """For each catalog model: action 'run', 'skip' or 'unavailable', and why."""
    from quantgate.flows.live import work_dir

    cat = load_catalog(Path(catalog) if catalog else DEFAULT_CATALOG)
    root = work_dir(workdir)
    chosen = [cat.model(m) for m in models] if models else list(cat.models)
    out: list[dict[str, Any]] = []
    with sessions.session(warehouse or sessions.default_path()) as con:
        for spec in chosen:
            row: dict[str, Any] = {"model": spec.id, "sha": None, "inputs_hash": None, "previous_run": None}
            try:
                row["sha"] = current_sha(spec, root)
            except ShaUnavailable as e:
                out.append({**row, "action": "unavailable", "reason": str(e)})
                continue
            digest, inputs = model_inputs(cat, spec, row["sha"])
            row["inputs_hash"] = digest
            last = ledger.last_success_inputs(con, spec.id)
            if last:
                row["previous_run"] = last["run_id"]
            if all_models:
                out.append({**row, "action": "run", "reason": "all models asked for"})
            elif last is None:
                out.append({**row, "action": "run", "reason": "no successful run yet"})
            elif last["inputs_hash"] != digest:
                before = json.loads(last["inputs"]) if isinstance(last["inputs"], str) else last["inputs"]
                changed = sorted(k for k in set(inputs) | set(before) if inputs.get(k) != before.get(k))
                out.append({**row, "action": "run",
                            "reason": f"changed since run {last['run_id']}: {', '.join(changed) or 'inputs'}"})
            else:
                out.append({**row, "action": "skip", "reason": f"unchanged since run {last['run_id']}"})
    return out


@flow(name="nightly", flow_run_name=_name)
def nightly(
    catalog: str | None = None,
    warehouse: str | None = None,
    workdir: str | None = None,
    all_models: bool = False,
    models: list[str] | None = None,
    evaluate_deployment: str | None = None,
) -> list[dict[str, Any]]:
    """Start an evaluation of each catalog model whose inputs changed (all of them with `all_models`)."""
    from quantgate.flows.evaluate_model import evaluate_model
    from quantgate.flows.live import work_dir

    log = get_run_logger()
    rows = plan(catalog, warehouse, workdir, all_models, models)
    queued = 0
    for row in rows:
        log.info("%s: %s (%s)", row["model"], row["action"], row["reason"])
        if row["action"] != "run":
            continue
        params: dict[str, Any] = {"model": row["model"]}
        for key, value in (("catalog", catalog), ("warehouse", warehouse), ("workdir", workdir)):
            if value is not None:
                params[key] = value
        if evaluate_deployment:
            # The pool starts runs in the order they were created, as many as it has room for.
            queued += 1
            row["order"] = queued
            row["flow_run_id"] = dispatch.submit(
                evaluate_deployment, params, name=f"evaluate {row['model']} (nightly)",
                tags=["quantgate", "nightly", f"model:{row['model']}"],
                idempotency_key=f"nightly:{flow_run.id}:{row['model']}")
            row["status"] = "submitted"
        else:
            if workdir is None:
                params["workdir"] = str(work_dir(None))
            with tags("nightly"):
                state = evaluate_model(**params, return_state=True)
            row["flow_run_id"] = str(state.state_details.flow_run_id)
            row["status"] = state.type.value.lower()
    _publish(rows, dispatch.capacity(evaluate_deployment) if queued else None)
    return rows


def _publish(rows: list[dict[str, Any]], capacity: str | None) -> None:
    lines = ["# nightly", ""]
    if capacity:
        lines += [f"Runs start in the order below, {capacity}.", ""]
    lines += ["| order | model | action | status | reason | flow run |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('order', '—')} | {r['model']} | {r['action']} | {r.get('status', '—')} | {r['reason']}"
                     f" | {r.get('flow_run_id', '—')} |")
    create_markdown_artifact("\n".join(lines), key="nightly-plan", description="what the nightly evaluated and why")
