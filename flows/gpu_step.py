"""gpu-step: one GPU benchmark (an engine on a scenario for one checkpoint, or a serving scenario's
`vllm serve` runs), run on the GPU work pool.

evaluate-model submits these with `run_deployment` when it is given a GPU deployment. The step never
writes the warehouse: it leaves its result as `<out_dir>/<flow run id>.json` (and returns it), and
the parent flow, the warehouse's one writer, stores it (speed rows, and a serving scenario's loads). Each step holds a slot of the global
concurrency limit `gpu:<host>:<CUDA_VISIBLE_DEVICES>` (limit 1, created on first use), so two
benchmarks never share a GPU even when a worker starts two runs at once.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from quantgate.catalog.schema import scenario_from
from quantgate.flows.dispatch import SERVING_LOGS, measure
from quantgate.tasks.speed.serving import measured_to_dict
from quantgate.tasks.files import write_atomic

SLOT_ENV = "QUANTGATE_GPU_SLOT"


def slot_name() -> str:
    """This worker's GPU: $QUANTGATE_GPU_SLOT, else host and CUDA_VISIBLE_DEVICES."""
    return os.environ.get(SLOT_ENV) or f"gpu:{platform.node()}:{os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}"


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
def gpu_step(model_path: str, engine: str, scenario_name: str, scenario: dict[str, Any], out_dir: str,
             label: str = "") -> dict[str, Any]:
    """Measure `engine` on `scenario` for the checkpoint at `model_path`; the result goes to out_dir."""
    from prefect.concurrency.sync import concurrency

    spec = scenario_from(scenario)
    slot = slot_name()
    ensure_limit(slot)
    get_run_logger().info("waiting for GPU slot %s", slot)
    out = Path(out_dir)
    with concurrency(slot, occupy=1, strict=True):
        measured = measure(model_path, engine, [(scenario_name, spec)], out.parent / SERVING_LOGS / str(flow_run.id),
                           label or Path(model_path).name).measured
    payload = {"runs": [measured_to_dict(result, loads) for result, loads in measured]}
    write_atomic(out / f"{flow_run.id}.json", json.dumps(payload))
    for result, _ in measured:
        get_run_logger().info("%s %s: %s%s", engine, result.scenario, result.status,
                              f" ({result.reason})" if result.reason else "")
    return payload
