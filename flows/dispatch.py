"""Where a step runs: in this process, or as a run of another deployment on another work pool.

A single-machine user gives no deployment names and everything runs in-process (Prefect's ephemeral
API is enough). Under a Prefect server, evaluate-model sends its GPU benchmarks to the `gpu-step`
deployment (GPU pool) and the nightly and the release watcher start `evaluate-model` runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prefect import get_run_logger, tags

from quantgate.catalog.schema import Catalog, ModelSpec, ScenarioSpec
from quantgate.tasks.benchmark import benchmark_task
from quantgate.tasks.records import SpeedResult, VariantArtifact
from quantgate.tasks.serving import ServingLoad, measured_from_dict, serving_task

GPU_RESULTS = "gpu-results"
SERVING_LOGS = "serving-logs"
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
# A speed row and, for a serving scenario, its loads with their per-request rows.
Measured = tuple[SpeedResult, list[ServingLoad]]


def is_gpu_work(engine: str, scenario: ScenarioSpec) -> bool:
    """vLLM needs a GPU, and so does any scenario pinned to cuda; the rest stays with the CPU flow."""
    return engine == "vllm" or scenario.device == "cuda"


def submit(deployment: str, parameters: dict[str, Any], *, name: str, tags: Sequence[str] = (),
           idempotency_key: str | None = None) -> str:
    """Create a run of `deployment` ("flow/deployment") now; returns its flow-run id without waiting.
    The same idempotency key returns the run already created for it."""
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters=parameters, timeout=0, flow_run_name=name, tags=list(tags),
                         idempotency_key=idempotency_key)
    return str(run.id)


def wait(run_ids: Sequence[str], timeout_s: float, poll_s: float = 2.0) -> dict[str, Any]:
    """Poll the API until every run is final or `timeout_s` passes; flow run objects by id."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    runs: dict[str, Any] = {}
    pending = list(run_ids)
    with get_client(sync_client=True) as client:
        while True:
            for rid in list(pending):
                run = client.read_flow_run(rid)
                runs[rid] = run
                if run.state is not None and run.state.type.value in FINAL:
                    pending.remove(rid)
            if not pending or time.monotonic() >= deadline:
                return runs
            time.sleep(poll_s)


def measure(model_path: str, engine: str, name: str, scenario: ScenarioSpec, log_dir: Path,
            label: str) -> list[Measured]:
    """One (engine, scenario) on one checkpoint here: an engine run (offline, latency), or `vllm serve`
    driven through the scenario's loads (serving; one run per point of its sweep, logs under log_dir)."""
    if scenario.kind == "serving":
        serve = serving_task.with_options(task_run_name=f"serve {name} on {label}")
        return serve(model_path, name, scenario, work_dir=log_dir)
    bench = benchmark_task.with_options(task_run_name=f"benchmark {engine} {name} on {label}")
    return [(bench(model_path, engine, name, scenario), [])]


def benchmark_all(
    variants: Sequence[VariantArtifact], spec: ModelSpec, cat: Catalog, root: Path,
    gpu_deployment: str | None = None, timeout_s: float = 6 * 3600, engines: Sequence[str] | None = None,
    on_variant: Callable[[str, list[Measured]], None] | None = None,
) -> dict[str, list[Measured]]:
    """Every (scenario, engine) of `spec` on every variant, by variant uid, in catalog order (only the
    engines named in `engines`, when given); serving scenarios (vLLM only) bring their loads along.

    With `gpu_deployment`, GPU work is submitted first as runs of that deployment (one per variant,
    engine and scenario; the GPU pool's workers take one GPU each), CPU work runs here meanwhile, and
    the GPU runs' results are read from the files they leave under `root`/gpu-results. A GPU run that
    fails or does not finish becomes a failed row saying so; nothing is written to the warehouse here:
    `on_variant(uid, results)` gets each variant's results as soon as all of them are in (right after
    its local runs when it has no GPU runs), so the caller can store them as they come.
    """
    log = get_run_logger()
    out_dir = root / GPU_RESULTS
    pending: dict[tuple[str, str, str], str] = {}

    def keys(v: VariantArtifact) -> list[tuple[tuple[str, str, str], ScenarioSpec]]:
        return [((v.uid, name, engine), cat.scenarios[name])
                for name in spec.scenarios for engine in _kept(cat.scenarios[name].engines, engines)]

    if gpu_deployment:
        for v in variants:
            for key, scenario in keys(v):
                _, name, engine = key
                if is_gpu_work(engine, scenario):
                    params = {"model_path": v.path, "engine": engine, "scenario_name": name,
                              "scenario": scenario.model_dump(mode="json"), "out_dir": str(out_dir),
                              "label": f"{spec.id}/{v.name}"}
                    pending[key] = submit(
                        gpu_deployment, params, name=f"{engine} {name} on {spec.id}/{v.name}",
                        tags=["quantgate", "gpu", f"model:{spec.id}", f"variant:{v.name}", f"engine:{engine}"])
        if pending:
            log.info("%d GPU benchmark step(s) submitted to %s", len(pending), gpu_deployment)
    local: dict[tuple[str, str, str], list[Measured]] = {}
    results: dict[str, list[Measured]] = {}
    for v in variants:
        for key, scenario in keys(v):
            if key not in pending:
                _, name, engine = key
                with tags(f"model:{spec.id}", f"variant:{v.name}"):
                    local[key] = measure(v.path, engine, name, scenario, root / SERVING_LOGS / v.name / name,
                                         f"{spec.id}/{v.name}")
        if not any(key in pending for key, _ in keys(v)):
            results[v.uid] = [m for key, _ in keys(v) for m in local[key]]
            if on_variant:
                on_variant(v.uid, results[v.uid])
    runs = wait(list(pending.values()), timeout_s) if pending else {}
    for v in variants:
        if v.uid in results:
            continue
        results[v.uid] = [
            m for key, scenario in keys(v)
            for m in (local[key] if key in local else _gpu_result(runs[pending[key]], out_dir, key[2], key[1], scenario))
        ]
        if on_variant:
            on_variant(v.uid, results[v.uid])
    return results


def _kept(declared: Sequence[str], engines: Sequence[str] | None) -> list[str]:
    return [e for e in declared if not engines or e in engines]


def _gpu_result(run: Any, out_dir: Path, engine: str, name: str, scenario: ScenarioSpec) -> list[Measured]:
    file = out_dir / f"{run.id}.json"
    state = run.state
    if state is not None and state.type.value == "COMPLETED" and file.is_file():
        return [measured_from_dict(r) for r in json.loads(file.read_text())["runs"]]
    if state is not None and state.type.value == "COMPLETED":
        reason = f"GPU run {run.name} completed but left no result file {file} (is the work dir shared?)"
    elif state is None or state.type.value not in FINAL:
        reason = f"GPU run {run.name} did not finish in time (state {state.name if state else 'unknown'})"
    else:
        reason = f"GPU run {run.name} {state.type.value.lower()}: {(state.message or '').strip()[:200]}"
    return [(SpeedResult(engine, name, "failed", reason, scenario.model_dump(mode="json")), [])]
