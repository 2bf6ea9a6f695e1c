"""How a model's speed jobs run on the host its run was placed on, and how a flow starts runs of another deployment.

A single-machine user gives no deployment names and everything runs in-process (Prefect's ephemeral API is
enough). Under a Prefect server the nightly and the release watcher start `evaluate-model` runs on the model pool
(`submit`), and each run does all of its model's work on the host that took it (tasks/runtime/placement.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from prefect import get_run_logger, tags

from quantgate.catalog.load import Catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import SpeedResult, VariantArtifact
from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.catalog.settings import settings
from quantgate.tasks.runtime import launch
from quantgate.tasks.steps.benchmark import engine_sessions
from quantgate.tasks.steps.measure import Measured, backend_of, measure_task
from quantgate.tasks.steps.measure import measure as measure_speed
from quantgate.warehouse import statements

SERVING_LOGS = "serving-logs"


def submit(deployment: str, parameters: dict[str, Any], *, name: str, tags: Sequence[str] = (),
           idempotency_key: str | None = None) -> str:
    """Create a run of `deployment` ("flow/deployment") now; returns its flow-run id without waiting.
    The same idempotency key returns the run already created for it."""
    from prefect.deployments import run_deployment

    run = run_deployment(deployment, parameters=parameters, timeout=0, flow_run_name=name, tags=list(tags),
                         idempotency_key=idempotency_key)
    return str(run.id)


def capacity(deployment: str) -> str:
    """How many runs of `deployment` its work pool takes at once, in words: its concurrency limit and its
    workers' limits, for a person reading why a run waits."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkerFilter, WorkerFilterStatus

    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(client.read_deployment_by_name(deployment).work_pool_name)
        online = client.read_workers_for_work_pool(pool.name, worker_filter=WorkerFilter(
            status=WorkerFilterStatus(any_=["ONLINE"])))
    limit = f"at most {pool.concurrency_limit} at once" if pool.concurrency_limit else "no pool-wide limit"
    return f"on pool {pool.name} ({limit}; {len(online)} worker(s) online, each within its own --limit)"


@dataclass(frozen=True, eq=False)  # each job is its own: compared and hashed by identity
class SpeedJob:
    """What one engine start measures on one checkpoint: the scenarios of one engine that need the same
    engine options (one load, one vLLM start), or a serving scenario (one `vllm serve` per sweep point)."""

    variant: VariantArtifact
    engine: str
    scenarios: tuple[tuple[str, ScenarioSpec], ...]
    # The base checkpoint a variant's paired scenarios alternate their passes with (run_scenarios' pair_with).
    pair_with: str | None = None

    @property
    def label(self) -> str:
        return f"{self.engine} {'+'.join(name for name, _ in self.scenarios)} on {self.variant.name}"


@dataclass(frozen=True)
class JobResult:
    measured: list[Measured]
    engine_starts: int
    started_at: datetime | None = None


def speed_jobs(variant: VariantArtifact, scenarios: Sequence[tuple[str, ScenarioSpec]],
               engines: Sequence[str] | None = None, base_path: str | None = None) -> list[SpeedJob]:
    """A checkpoint's scenarios as engine starts: per engine, one job for each distinct engine option set
    (tasks/steps/benchmark.engine_sessions), and one per serving scenario; a variant leaves out the base-only
    scenarios and engines, and its engine sessions alternate their paired scenarios' passes with the base at
    `base_path`."""
    base = variant.method == "base"
    if not base:
        scenarios = [(name, s) for name, s in scenarios if not s.base_only]

    def runs_on(s: ScenarioSpec) -> list[str]:
        return [e for e in _kept(s.engines, engines) if base or e not in s.base_only_engines]

    jobs = []
    for engine in dict.fromkeys(e for _, s in scenarios for e in runs_on(s)):
        mine = [(name, s) for name, s in scenarios if engine in runs_on(s)]
        # `vllm serve` and `vllm bench` start their own engine for each scenario.
        alone = [item for item in mine if not backend_of(engine, [item]).session]
        jobs += [SpeedJob(variant, engine, (item,)) for item in alone]
        shared = [item for item in mine if item not in alone]
        pair = None if base else base_path
        jobs += [SpeedJob(variant, engine, tuple(group), pair) for group in engine_sessions(variant.path or "", shared)]
    return jobs


def measure(model_path: str, engine: str, scenarios: Sequence[tuple[str, ScenarioSpec]], log_dir: Path,
            label: str, in_flow: bool = True, pair_with: str | None = None) -> JobResult:
    """One engine start's scenarios on one checkpoint here, through their backend (tasks/steps/measure.py): an engine
    session (offline, latency scenarios that share engine options, alternating with the base at `pair_with`), a
    `vllm bench`, or `vllm serve` driven through a serving scenario's loads (one run per point of its sweep, logs
    under log_dir). `in_flow` runs it as a Prefect task of the flow run; a process of a lane calls the function."""
    # Which GPUs the process that measured saw: a lane's one GPU, or all of this process's.
    seen = {"cuda_visible_devices": settings().cuda_visible_devices}
    run = (measure_task.with_options(task_run_name=f"{engine} {'+'.join(n for n, _ in scenarios)} on {label}")
           if in_flow else measure_speed)
    measured = [(dataclasses.replace(r, details={**r.details, **seen}), loads)
                for r, loads in run(model_path, engine, scenarios, work_dir=log_dir, pair_with=pair_with)]
    results = [r for r, _ in measured]
    # An engine session's rows share its starts; a bench or a server is a start of its own per row.
    starts = (_starts(results) if backend_of(engine, scenarios).session
              else sum(_starts([r]) for r in results))
    return JobResult(measured, starts)


def _starts(results: Sequence[SpeedResult]) -> int:
    """Engine starts behind rows that share one start (each row carries them: none when it never began)."""
    return max((int(r.details.get("engine_starts", 0)) for r in results), default=0)


class Measurements:
    """The speed jobs of a run's checkpoints, every result handed to `on_variant(uid, result)` as soon as all of a
    checkpoint's jobs are in (nothing is written to the warehouse here).

    `start(v)` runs a checkpoint's jobs now, side by side in `pool` (one GPU: each engine loads beside whatever
    else shares the GPU and measures once it has it alone, tasks/runtime/launch.measuring); `run(variants)` takes the
    rest, each variant's scenarios as speed jobs (one engine start each: `speed_jobs`) in `lanes` (GPU ids: one
    job per GPU at a time, in a process that sees only that GPU; None: this process's view), so that two
    measurements never share a GPU, and waits for all. A variant's engine sessions alternate passes with the
    base at `base_path` (speed_jobs)."""

    def __init__(self, spec: ModelSpec, cat: Catalog, root: Path, engines: Sequence[str] | None = None,
                 on_variant: Callable[[str, JobResult], None] | None = None, lanes: Sequence[str | None] = (None,),
                 pool: launch.Jobs | None = None, base_path: str | None = None) -> None:
        self.spec, self.root, self.engines, self.lanes, self.base_path = spec, root, engines, lanes, base_path
        self.scenarios = [(name, cat.scenarios[name]) for name in spec.scenarios]
        self._on_variant, self._pool = on_variant, pool
        self._jobs: dict[str, list[SpeedJob]] = {}
        self._variants: dict[str, VariantArtifact] = {}
        self._rank: dict[str, int] = {}  # the order checkpoints were given in, which their measurements keep
        self._done: dict[SpeedJob, JobResult] = {}
        self._results: dict[str, JobResult] = {}
        self._started: list[Future[None]] = []
        self._finishing = threading.Lock()

    def variant(self, uid: str) -> VariantArtifact:
        """The checkpoint of uid `uid` among those given."""
        return self._variants[uid]

    def start(self, v: VariantArtifact) -> None:
        """`v`'s jobs begin now in the pool."""
        self._add(v)
        self._started += [self._pool.submit(self._run_job, job, None) for job in self._jobs[v.uid]]  # type: ignore[union-attr]

    def run(self, variants: Sequence[VariantArtifact]) -> dict[str, JobResult]:
        """The jobs of `variants` (those not started), and every result of the started ones, by variant uid."""
        for v in variants:
            self._add(v)
        launch.in_lanes([job for v in variants for job in self._jobs[v.uid]], self.lanes, self._run_job)
        for future in self._started:
            future.result()
        return self._results

    def _add(self, v: VariantArtifact) -> None:
        with self._finishing:
            self._rank[v.uid] = len(self._rank)
            self._variants[v.uid] = v
            self._jobs[v.uid] = speed_jobs(v, self.scenarios, self.engines, self.base_path)

    def _run_job(self, job: SpeedJob, lane: str | None) -> None:
        v = job.variant
        log_dir = self.root / SERVING_LOGS / v.name / "+".join(name for name, _ in job.scenarios)
        label = f"{self.spec.id}/{v.name}"
        started = statements.now()
        # Checkpoints measure in the order they were given: each one's rows are in before the next one's begin.
        with tags(f"model:{self.spec.id}", f"variant:{v.name}"), launch.ranked(self._rank[v.uid]):
            if lane is None:
                result = measure(v.path or "", job.engine, job.scenarios, log_dir, label, pair_with=job.pair_with)
            else:
                get_run_logger().info("GPU %s: %s", lane, job.label)
                result = launch.on_gpus(lane, None, measure, v.path or "", job.engine, job.scenarios, log_dir,
                                        label, False, job.pair_with)
        self._done[job] = dataclasses.replace(result, started_at=started)
        self._finish_if_complete(v)

    def _finish_if_complete(self, v: VariantArtifact) -> None:
        jobs = self._jobs[v.uid]
        with self._finishing:
            if v.uid in self._results or not all(job in self._done for job in jobs):
                return
            starts = [self._done[job].started_at for job in jobs if self._done[job].started_at is not None]
            self._results[v.uid] = JobResult([m for job in jobs for m in self._done[job].measured],
                                             sum(self._done[job].engine_starts for job in jobs),
                                             min(starts, default=None))
        if self._on_variant:
            self._on_variant(v.uid, self._results[v.uid])


def benchmark_all(
    variants: Sequence[VariantArtifact], spec: ModelSpec, cat: Catalog, root: Path,
    engines: Sequence[str] | None = None, on_variant: Callable[[str, JobResult], None] | None = None,
    lanes: Sequence[str | None] = (None,),
) -> dict[str, JobResult]:
    """Every (scenario, engine) of `spec` on every variant, by variant uid, in catalog order (only the engines
    named in `engines`, when given); serving scenarios (vLLM only) bring their loads along (`Measurements.run`)."""
    base = next((v.path for v in variants if v.method == "base"), None)
    return Measurements(spec, cat, root, engines, on_variant, lanes, base_path=base).run(variants)


def _kept(declared: Sequence[str], engines: Sequence[str] | None) -> list[str]:
    return [e for e in declared if not engines or e in engines]
