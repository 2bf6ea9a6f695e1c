"""gpu-step: one GPU benchmark (an engine on a scenario for one checkpoint, or a serving scenario's
`vllm serve` runs), run on the GPU work pool.

evaluate-model submits these with `run_deployment` when it is given a GPU deployment. The step writes its own
rows (speed rows, and a serving scenario's loads and requests) into the warehouse under the parent's run, from
the host that measured them; the parent marks its benchmark stage once every step is in. Each step holds a slot
of the global concurrency limit `gpu:<host>:<CUDA_VISIBLE_DEVICES>` (limit 1, created on first use), so two
benchmarks never share a GPU even when a worker starts two runs at once.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from quantgate.catalog.scenarios import scenario_from
from quantgate.catalog.settings import settings
from quantgate.flows.dispatch import SERVING_LOGS, measure
from quantgate.warehouse import store


def slot_name() -> str:
    """This worker's GPU: $QUANTGATE_GPU_SLOT, else host and CUDA_VISIBLE_DEVICES."""
    return settings().gpu_slot or f"gpu:{platform.node()}:{settings().cuda_visible_devices or 'all'}"


def ensure_limit(name: str, limit: int = 1) -> None:
    """Create the global concurrency limit `name` unless it exists (two steps racing: one wins)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
            except ObjectAlreadyExists:
                pass


def _name() -> str:
    p = flow_run.parameters
    return f"{p['engine']} {p['scenario_name']} on {p.get('label') or Path(p['model_path']).name}"


@flow(name="gpu-step", flow_run_name=_name)
def gpu_step(model_path: str, engine: str, scenario_name: str, scenario: dict[str, Any], warehouse: str,
             run_id: str, variant_uid: str, work_dir: str, label: str = "") -> list[dict[str, Any]]:
    """Measure `engine` on `scenario` for the checkpoint at `model_path` and store the rows under run `run_id`;
    returns each row's scenario, status and reason."""
    from prefect.concurrency.sync import concurrency

    spec = scenario_from(scenario)
    slot = slot_name()
    ensure_limit(slot)
    get_run_logger().info("waiting for GPU slot %s", slot)
    with concurrency(slot, occupy=1, strict=True):
        measured = measure(model_path, engine, [(scenario_name, spec)], Path(work_dir) / SERVING_LOGS / str(flow_run.id),
                           label or Path(model_path).name).measured
    with store.session(warehouse) as con:
        store.record_measured(con, run_id, variant_uid, measured)
    for result, _ in measured:
        get_run_logger().info("%s %s: %s%s", engine, result.scenario, result.status,
                              f" ({result.reason})" if result.reason else "")
    return [{"scenario": r.scenario, "status": r.status, "reason": r.reason} for r, _ in measured]
