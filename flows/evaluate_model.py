"""evaluate-model: download → quantize → evaluate → benchmark → decide, one model, into the warehouse."""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import deployment, flow_run
from prefect.states import Failed, State

from quantgate.catalog.errors import CatalogError, QuantgateError, one_line
from quantgate.catalog.load import Catalog, load_catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.records import Decision, MetricResult, ModelArtifact, QualityReport, VariantArtifact
from quantgate.catalog.selection import adhoc_model, with_revision
from quantgate.catalog.settings import host_name, settings
from quantgate.catalog.suites import SuiteSpec
from quantgate.catalog.variants import CalibrationSpec, VariantSpec
from quantgate.flows import dispatch, interrupts, progress
from quantgate.flows.inputs import model_inputs
from quantgate.flows.live import work_dir
from quantgate.flows.memory_plan import gpu_share
from quantgate.flows.probe import probe_base
from quantgate.flows.speed_plan import SpeedPlan
from quantgate.tasks.adapters.model_memory import CapacityError
from quantgate.tasks.runtime import environment, faults, gpu_memory, launch, placement
from quantgate.tasks.steps.caching import build_cached, check_calibration_cached, download_cached
from quantgate.tasks.steps.calibration import CalibrationError
from quantgate.tasks.steps.decide import decide_task
from quantgate.tasks.steps.divergence import DivergenceError, kl_eval_key, kl_reports_task
from quantgate.tasks.steps.download import DownloadError
from quantgate.tasks.steps.drift import engine_versions
from quantgate.tasks.steps.evaluate import eval_key, evaluate_task
from quantgate.tasks.steps.quantize import base_variant, lib_versions, variant_from_row
from quantgate.warehouse import drift, lake, ledger, reads, sessions, statements, writers

T = TypeVar("T")


class ModelOutputError(QuantgateError, RuntimeError):
    """A base model whose outputs are not finite: nothing can be judged against it; the message is one line."""


# Bad input, or a model too large for this host: one line in the run row and in the flow's state.
USER_ERRORS = (ModelOutputError, CatalogError, DownloadError, CalibrationError, DivergenceError, CapacityError,
               lake.WarehouseError)


def _run_name() -> str:
    params = flow_run.parameters
    rev = f"@{params['revision'][:12]}" if params.get("revision") else ""
    return f"evaluate {params['model']}{rev}" + (f" [{','.join(params['variants'])}]" if params.get("variants") else "")


def resume_key(cat: Catalog, spec: ModelSpec, engines: list[str] | None = None) -> str:
    """What a run was asked to do: the catalog, the model's resolved spec and the engines kept. A rerun
    with the same key resumes an unfinished run; any change starts a fresh one."""
    key = {"catalog": cat.hash, "model": spec.model_dump(mode="json"), "engines": sorted(engines or [])}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


@dataclass
class StageCommit:
    """A stage's open transaction, and the detail its completion mark will carry."""

    con: Any
    detail: str | None


class _Run:
    """The warehouse run a flow run works on, and which of its stages are already complete."""

    def __init__(self, wh: str, run_id: str, attempt_id: str) -> None:
        self.wh, self.run_id, self.attempt_id = wh, run_id, attempt_id
        with sessions.session(wh, read_only=True) as con:
            self.done = ledger.completed_stages(con, run_id)
        # How many items each stage has, and how many have begun: "step k of N" in the live view.
        self.totals: dict[str, int] = {}
        self._begun: dict[str, int] = {}

    def enter(self, stage: str, item: str = "", label: str = "") -> None:
        """The run begins an item of a stage (for the live view and for an interrupt's reason); its stage mark
        ends it."""
        self._begun[stage] = k = self._begun.get(stage, 0) + 1
        progress.begin(stage, item, label, k, max(k, self.totals.get(stage, 1)))

    def is_done(self, stage: str, item: str = "") -> bool:
        return (stage, item) in self.done

    def read(self, query: Callable[[Any], T]) -> T:
        with sessions.session(self.wh, read_only=True) as con:
            return query(con)

    @contextmanager
    def stage(self, stage: str, item: str = "", detail: str | None = None, started: datetime | None = None,
              engine_starts: int = 0) -> Iterator[StageCommit]:
        """One transaction for a stage's rows and its completion mark: after a crash both are there or neither.
        The body may set the mark's detail on what it yields, once its rows say what it is."""
        with sessions.session(self.wh) as con, statements.transaction(con):
            commit = StageCommit(con, detail)
            yield commit
            ledger.mark_stage(con, self.run_id, stage, item, commit.detail, self.attempt_id, started or statements.now(),
                             engine_starts, marked_before=(stage, item) in self.done)
            faults.point(f"write:{stage}")
        self.done[(stage, item)] = commit.detail
        progress.end(stage, item)

    def step(self, stage: str, item: str, *, stored: Callable[[Any], T | None], compute: Callable[[], T],
             write: Callable[[Any, T, bool], str | None], starts: Callable[[T], int] = lambda _: 0,
             label: str = "") -> T:
        """Reuse what is stored, else compute, and store with the stage mark: the one way a stage runs.

        `stored(con)` is the stage's result already in the warehouse (this run's, after a crash, or any run's
        of the same content), or None; `compute()` makes it; `write(con, value, reused)` stores or links it
        and returns the mark's detail. The mark carries the stage's start and its engine starts."""
        found = self.read(stored)
        if found is not None and self.is_done(stage, item):
            return found
        self.enter(stage, item, label)
        started = statements.now()
        try:
            value = found if found is not None else compute()
        except BaseException:
            progress.end(stage, item, completed=False)
            raise
        with self.stage(stage, item, None, started, 0 if found is not None else starts(value)) as commit:
            commit.detail = write(commit.con, value, found is not None)
        return value


@flow(name="evaluate-model", flow_run_name=_run_name)
def evaluate_model(
    model: str,
    catalog: str | None = None,
    warehouse: str | None = None,
    variants: list[str] | None = None,
    workdir: str | None = None,
    scenarios: list[str] | None = None,
    engines: list[str] | None = None,
    revision: str | None = None,
    template: str | None = None,
    tokenizer: str | None = None,
    remeasure: bool = False,
    gpus: str | None = None,
    gpu_count: int = 1,
) -> list[dict] | State:
    """Evaluate one model (a catalog id, a local folder or a hub id) and every variant the catalog asks for.

    `variants` and `scenarios` replace the catalog's lists for this run; `engines` keeps only those
    engines. `revision` pins a hub model to a commit; `template` is the catalog model whose variants,
    suite and scenarios a model outside the catalog gets; `tokenizer` is a shape's tokenizer folder. Speed rows
    an earlier run measured with the same scenarios, libraries and device are reused unless `remeasure`.
    `gpus` ("0,1", default: what CUDA_VISIBLE_DEVICES shows) are the lanes: one measurement per GPU at a time,
    different checkpoints side by side. A run of the deployment instead holds `gpu_count` GPUs of the host whose
    worker took it, and its model's lock, for all of its work (tasks/runtime/placement.py).
    A rerun after a crash (the model's latest run unfinished, same catalog, spec and engines) resumes
    that run: stages already stored are not done again.
    """
    cat_path = Path(catalog) if catalog else DEFAULT_CATALOG
    try:
        cat = load_catalog(cat_path)
        spec = with_revision(adhoc_model(cat, model, variants, template, scenarios=scenarios, engines=engines,
                                         tokenizer=tokenizer),
                             revision)
    except CatalogError as e:
        return Failed(message=str(e))
    # A run of the deployment is placed on its worker's host; Prefect starts it again after a crash, up to a limit.
    pooled = deployment.id is not None
    attempt = flow_run.run_count or 1
    if pooled and attempt > settings().max_attempts:
        return Failed(message=f"{spec.id}: started {attempt - 1} times without finishing; not started again"
                              f" (QUANTGATE_MAX_ATTEMPTS={settings().max_attempts})")
    try:
        with placement.placed(spec.id, gpu_count) if pooled else nullcontext() as where:
            return _run(cat, cat_path, spec, warehouse, workdir, engines, remeasure,
                        where.lanes if where else launch.lanes_from(gpus), where, attempt)
    except placement.PlacementError as e:
        return Failed(message=str(e))


def _run(cat: Catalog, cat_path: Path, spec: ModelSpec, warehouse: str | None, workdir: str | None,
         engines: list[str] | None, remeasure: bool, lanes: list[str | None],
         where: placement.Placement | None, attempt: int) -> list[dict] | State:
    """The flow run's work, where it was placed: its warehouse run begun or resumed, its stages, its scorecard.
    Each start of the same flow run (`attempt`: Prefect's retry after a crash) is an attempt of its own."""
    attempt_id = str(flow_run.id) + (f"#{attempt}" if attempt > 1 else "")
    wh = warehouse or str(sessions.default_path())
    root = work_dir(workdir)
    log = get_run_logger()
    if where is not None:
        log.info("placed on %s: %s", where.host, ", ".join(where.limits))
    try:
        with sessions.session(wh) as con:
            run_id, resumed = ledger.begin_run(con, attempt_id, "evaluate-model", spec.id,
                                              resume_key(cat, spec, engines), str(cat_path.resolve()), cat.hash,
                                              host_name(),
                                              {**lib_versions(), **engine_versions(), **environment.program()},
                                              exclusive=where is not None)
            if not resumed:  # a resumed run keeps the prices its costs were computed with
                writers.record_prices(con, run_id, cat.gpu_prices, cat.hash)
        run = _Run(wh, run_id, attempt_id)
    except lake.WarehouseError as e:  # no warehouse to write a run row into
        return Failed(message=str(e))
    if resumed:
        log.info("resuming run %s of %s: %d stage(s) already complete", run_id, spec.id, len(run.done))
    try:
        with interrupts.guard(), tags("quantgate", f"model:{spec.id}"):
            sha = _evaluate(cat, spec, run, root, engines, remeasure, lanes)
    except interrupts.Interrupted as e:
        # A run of the deployment cancelled from Prefect gets its worker's SIGTERM: it ends Cancelled, not Crashed
        # (which the retry automation would start again), and its row says cancelled.
        cancel = interrupts.prefect_cancellation() if where is not None else None
        if cancel is not None:
            reason = f"cancelled from Prefect during {e.stages}" + (f": {cancel}" if cancel else "")
            log.info("%s", reason)
            _finish(run, reason, cancelled=True)
            interrupts.end_cancelled(reason)
        _finish(run, str(e))  # the next run of the same request resumes it
        raise
    except USER_ERRORS as e:
        # Bad input: one line in the run row and in the flow's state, no traceback.
        _finish(run, str(e))
        return Failed(message=str(e))
    except Exception as e:
        _finish(run, one_line(e))
        raise
    with sessions.session(wh) as con:
        ledger.record_inputs(con, run_id, spec.id, *model_inputs(cat, spec, sha))
    _finish(run, None)
    with sessions.session(wh, read_only=True) as con:
        card = reads.scorecard(con, run_id)
    _publish(spec.id, card)
    return card


def _finish(run: _Run, error: str | None, cancelled: bool = False) -> None:
    try:
        with sessions.session(run.wh) as con:
            ledger.finish_run(con, run.run_id, error=error, attempt_id=run.attempt_id, cancelled=cancelled)
    except lake.WarehouseError as e:
        if error is None:
            raise
        # The warehouse itself is the trouble; the run stays unfinished and the next run resumes it.
        get_run_logger().warning("could not record the failure of run %s: %s", run.run_id, e)


def _nonfinite(metrics: list[MetricResult]) -> str | None:
    bad = [f"{m.task}/{m.metric} = {m.value}" for m in metrics if m.value is not None and not math.isfinite(m.value)]
    return ", ".join(bad[:3]) or None


@dataclass(frozen=True)
class EvalSetup:
    """How quality is scored on this machine: lm-eval's backend, the device and the 16-bit (or CPU fp32) dtype."""

    backend: str
    device: str
    dtype: str


def _evaluate(cat: Catalog, spec: ModelSpec, run: _Run, root: Path, engines: list[str] | None, remeasure: bool,
              lanes: list[str | None]) -> str:
    """All stages of one model that the run has not completed yet; returns the checkpoint's sha.

    Work whose time is not measured (builds, evaluations, KL, engine starts) runs a few jobs at a time on a GPU,
    one at a time on a CPU; a measurement has its GPU alone, one per speed key (checkpoints of one format share
    their rows)."""
    log = get_run_logger()
    # vLLM's compile cache in the work dir: every engine start of the same shape, in any run, reuses it.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    run.totals = {"quantize": len(spec.variants), "evaluate": 1 + len(spec.variants), "kl": len(spec.variants),
                  "benchmark": 1 + len(spec.variants)}
    model = _download(run, spec, root, cat)
    base = base_variant(model)
    suite = cat.suites[spec.suite]
    setup = _eval_setup(load_time=any(cat.variants[n].load_time for n in spec.variants))
    plan = SpeedPlan(spec, cat, engines)
    # Before any build: every stage sized by the model; one that cannot fit the GPU stops the run here.
    share = gpu_share(cat, spec, model.path, setup.backend, setup.device)

    # The base first: on a CPU (one job at a time) a base whose outputs are not finite stops the run before any
    # build; on a GPU its evaluation runs beside the builds, and each variant is evaluated as its build ends.
    # On one GPU each checkpoint's engines start as soon as it is built, beside the builds and evaluations, and
    # measure when the GPU is theirs alone (tasks/runtime/launch.GpuClock): the run waits for an engine start only where
    # nothing else is left to do. Elsewhere (a CPU, several lanes) the benchmarks follow KL.
    early = starts_engines_early(setup, lanes)
    with launch.gpu_clock(), launch.jobs(settings().engines_per_gpu if early else 1) as engine_pool:
        speed = _SpeedStage(run, plan, spec, cat, root, base, engines, remeasure, lanes,
                            engine_pool if early else None)
        # The unmeasured phase, its jobs and KL, holds a share of the GPU from here to KL's end, so no measurement
        # slips into a gap between its jobs (on the H200, measurements that did kept KL waiting behind them).
        # Each evaluation is promised the memory its engine takes (sized by the model), until it has loaded: the
        # speed engines started beside take what is left; as many jobs run at once as fit the GPU.
        with launch.sharing(), gpu_memory.promised_memory(1 + len(spec.variants), share.eval_bytes) as evals:
            with launch.jobs(launch.shared_slots(lanes, setup.device == "cuda", share.fit)) as pool:
                base_quality = pool.submit(_quality, run, base, suite, setup, spec, True, evals)
                if base_quality.done():  # one job at a time: it ran already, and a broken base stops the run here
                    base_quality.result()
                builds = [pool.submit(_build_and_evaluate, run, model, cat.variants[name],
                                      cat.calibration_for(spec, cat.variants[name]), spec, root, suite, setup,
                                      speed.ready, evals)
                          for name in spec.variants]
                speed.ready(base)  # after the builds, which start first: the slowest build is the critical path
                base_quality.result()  # raises ModelOutputError when the base's outputs are not finite
                built = [future.result() for future in builds]
            variants_ok = [v for v, usable in built if usable]
            _kl(run, base, variants_ok, suite, setup)
        speed.finish([base, *variants_ok])
    # After the measurements, on a free GPU: the base's probe, beside the previous run's (engine drift).
    probe_base(run, base, suite, spec.policy or cat.policy, setup.backend, setup.device, setup.dtype, spec)

    decisions = _decide(run, spec, cat, base)
    for d in decisions:
        log.info("%s", d.reason)
    progress.finish()
    return model.sha


def starts_engines_early(setup: EvalSetup, lanes: list[str | None]) -> bool:
    """Whether speed jobs start as checkpoints are built, beside the unmeasured work: on one GPU. A CPU runs one
    job at a time anyway, and with several lanes the unmeasured work is not on the GPU a measurement takes, so
    there the benchmarks follow KL."""
    return setup.device == "cuda" and lanes == [None]


def _download(run: _Run, spec: ModelSpec, root: Path, cat: Catalog) -> ModelArtifact:
    def stored(con: Any) -> ModelArtifact | None:
        model = reads.model_of(con, run.done.get(("download", "")) or "")
        return model if model is not None and (Path(model.path) / "config.json").is_file() else None  # gone: fetch again

    def write(con: Any, model: ModelArtifact, reused: bool) -> str:
        if not reused:
            writers.record_model(con, run.run_id, model)
            writers.record_variant(con, run.run_id, base_variant(model), role="base")
        return model.uid

    def download() -> ModelArtifact:
        model = download_cached(spec, root)
        # Before anything of the model is stored: calibration sharing text with what is evaluated is refused,
        # for every set a variant of it is built with (each set once; a pass is cached under the work dir).
        for calib in cat.calibration_sets(spec):
            check_calibration_cached(calib, model, cat.suites[spec.suite], root)
        return model

    return run.step("download", "", stored=stored, compute=download, write=write, label=spec.id)


def _build_and_evaluate(run: _Run, model: ModelArtifact, vspec: VariantSpec, calib: CalibrationSpec, spec: ModelSpec,
                        root: Path, suite: SuiteSpec, setup: EvalSetup, ready: Callable[[VariantArtifact], None],
                        evals: gpu_memory.MemoryPromise) -> tuple[VariantArtifact, bool]:
    """A variant built (or reused) with calibration set `calib`, announced `ready`, and evaluated: (variant, usable
    for the next stages)."""
    log = get_run_logger()

    def stored(con: Any) -> VariantArtifact | None:
        row = reads.run_variant(con, run.run_id, run.done.get(("quantize", vspec.name)) or "")
        return variant_from_row(row, vspec) if row else None

    def build() -> VariantArtifact:
        variant = build_cached(model, vspec, calib, root, lambda uid: run.read(lambda c: reads.find_variant(c, uid)))
        log.info("%s: %s%s", vspec.name, "reused" if variant.reused else variant.status,
                 f" ({variant.error})" if variant.error else "")
        return variant

    def write(con: Any, variant: VariantArtifact, reused: bool) -> str:
        if not reused:
            writers.record_variant(con, run.run_id, variant, role="variant")
        return variant.uid

    variant = run.step("quantize", vspec.name, stored=stored, compute=build, write=write, label=vspec.name)
    if not variant.ok:
        return variant, False
    ready(variant)
    return variant, _quality(run, variant, suite, setup, spec, False, evals)


def _quality(run: _Run, v: VariantArtifact, suite: SuiteSpec, setup: EvalSetup, spec: ModelSpec, is_base: bool,
             evals: gpu_memory.MemoryPromise) -> bool:
    """The suite on one checkpoint, stored with its mark; False when its outputs are not finite (the variant
    is failed with that reason; for the base it is an error: nothing can be judged against it). Its unit of
    `evals` is settled once its engine has loaded."""
    key = eval_key(suite, setup.backend, setup.dtype)

    def stored(con: Any) -> list[MetricResult] | None:
        return reads.quality_metrics(con, v.uid, key) if reads.has_quality(con, v.uid, key) else None

    def compute() -> list[MetricResult]:
        report = evaluate_task(v.path, suite, backend=setup.backend, device=setup.device, dtype=setup.dtype,
                               trust_remote_code=spec.trust_remote_code)
        if is_base and (bad := _nonfinite(report.metrics)):  # raised before anything of it is stored
            raise ModelOutputError(f"{spec.id}: the base model's outputs are not finite ({bad})")
        reports[v.uid] = report
        return report.metrics

    def write(con: Any, metrics: list[MetricResult], reused: bool) -> None:
        if reused:
            get_run_logger().info("%s: quality results for this evaluation config already stored; reused", v.name)
            writers.link_quality(con, run.run_id, v.uid, key)
        else:
            writers.record_quality(con, run.run_id, v.uid, reports.pop(v.uid))
        if (bad := _nonfinite(metrics)) and not is_base:
            # Finite weights can still overflow: NaN/Inf outputs fail the variant, with the reason.
            writers.fail_variant(con, v.uid, f"{v.name}: outputs contain NaN/Inf ({bad})")

    reports: dict[str, QualityReport] = {}
    if run.is_done("evaluate", v.uid):
        return not run.read(lambda con: reads.variant_failed(con, v.uid))
    with gpu_memory.settles_on_load(evals):
        metrics = run.step("evaluate", v.uid, stored=stored, compute=compute, write=write, starts=lambda _: 1,
                           label=v.name)
    if bad := _nonfinite(metrics):
        if is_base:
            raise ModelOutputError(f"{spec.id}: the base model's outputs are not finite ({bad})")
        get_run_logger().warning("%s: outputs contain NaN/Inf (%s); marked failed", v.name, bad)
        return False
    return True


def _kl(run: _Run, base: VariantArtifact, variants: list[VariantArtifact], suite: SuiteSpec, setup: EvalSetup) -> None:
    """Token-level KL of each variant's next-token distribution from the base's, on the suite's KL text: the
    base loaded once, each variant in turn; each variant's rows stored with its own mark."""
    kl_text = suite.kl_text
    key = kl_eval_key(kl_text, dtype=setup.dtype)
    todo = [v for v in variants if not run.is_done("kl", v.uid)]
    stored = {v.uid for v in todo if run.read(lambda con, v=v: reads.has_quality(con, v.uid, key))}
    started = statements.now()
    missing = {v.uid: v.path for v in todo if v.uid not in stored}
    for v in todo:
        if v.uid in missing:
            run.enter("kl", v.uid, v.name)
    reports = kl_reports_task(base.path, missing, kl_text, device=setup.device, dtype=setup.dtype) if missing else {}
    first = next(iter(reports), None)
    for v in todo:
        starts = (2 if v.uid == first else 1) if v.uid in reports else 0  # the base's load, once, with the first
        with run.stage("kl", v.uid, started=started, engine_starts=starts) as commit:
            if v.uid in reports:
                writers.record_quality(commit.con, run.run_id, v.uid, reports[v.uid], link=False)


class _SpeedStage:
    """The benchmark stage: each checkpoint's speed reused from an earlier run of its speed key (format, scenarios,
    libraries, device), measured by the first checkpoint of its key to be ready, or taken from the one of its key
    that measures it; each checkpoint's rows stored with its mark as soon as they are in. With a `pool` (one GPU)
    measuring begins at `ready`, else at `finish`."""

    def __init__(self, run: _Run, plan: SpeedPlan, spec: ModelSpec, cat: Catalog, root: Path, base: VariantArtifact,
                 engines: list[str] | None, remeasure: bool, lanes: list[str | None], pool: launch.Jobs | None) -> None:
        self.run, self.plan, self.remeasure, self.early = run, plan, remeasure, pool is not None
        self.measurements = dispatch.Measurements(spec, cat, root, engines, self._store, lanes, pool, base.path)
        self.started: dict[str, VariantArtifact] = {}
        self.takers: dict[str, list[VariantArtifact]] = {}
        self.sources: dict[str, tuple[str, str] | None] = {}
        self.lock = threading.Lock()

    def ready(self, v: VariantArtifact) -> None:
        """A checkpoint is there: it claims its speed key, and on one GPU its engines start now."""
        if not self.plan.claim(v) or not self.early or self.run.is_done("benchmark", v.uid):
            return
        if not self.remeasure and self._source(v) is not None:
            return  # an earlier run measured the key: linked in `finish`
        self.started[v.uid] = v
        self.run.enter("benchmark", v.uid, v.name)
        self.measurements.start(v)

    def finish(self, checkpoints: list[VariantArtifact]) -> None:
        """The speed of every checkpoint not yet stored: reused, measured (those not started yet) or taken; returns
        once every row is stored."""
        log = get_run_logger()
        todo: list[VariantArtifact] = []
        ready = [*checkpoints, *(v for v in self.started.values() if v not in checkpoints)]
        for v in checkpoints:
            if self.run.is_done("benchmark", v.uid) or v.uid in self.started:
                continue
            key = self.plan.key(v)
            source = None if self.remeasure else self._source(v)
            measurer = self.plan.measurer(v, ready)
            if source is not None and source[0] != self.run.run_id:
                log.info("%s: speed unchanged since run %s (same format, scenarios, libraries and device); reused",
                         v.name, source[0])
                with self.run.stage("benchmark", v.uid, f"reused from run {source[0]}") as commit:
                    writers.link_speed(commit.con, self.run.run_id, v.uid, key, source)
            elif measurer.uid == v.uid:
                todo.append(v)
            else:
                with self.lock:
                    # `_store` marks the measurer done before it takes the lock to hand its rows to the takers.
                    later = not self.run.is_done("benchmark", measurer.uid)
                    if later:
                        self.takers.setdefault(measurer.uid, []).append(v)
                if not later:
                    _take_speed(self.run, v, measurer, key)
        for v in todo:
            self.run.enter("benchmark", v.uid, v.name)
        self.measurements.run(todo)

    def _source(self, v: VariantArtifact) -> tuple[str, str] | None:
        """The run and checkpoint whose stored rows have `v`'s speed key, read once per checkpoint."""
        if v.uid not in self.sources:
            self.sources[v.uid] = self.run.read(lambda con: reads.speed_source(con, self.plan.key(v)))
        return self.sources[v.uid]

    def _store(self, uid: str, result: dispatch.JobResult) -> None:
        v = self.measurements.variant(uid)
        with self.run.stage("benchmark", uid, started=result.started_at, engine_starts=result.engine_starts) as commit:
            writers.record_measured(commit.con, self.run.run_id, uid, result.measured)
            writers.link_speed(commit.con, self.run.run_id, uid, self.plan.key(v))
        with self.lock:
            takers = self.takers.pop(uid, [])
        for taker in takers:
            _take_speed(self.run, taker, v, self.plan.key(taker))


def _take_speed(run: _Run, v: VariantArtifact, measurer: VariantArtifact, key: str) -> None:
    get_run_logger().info("%s: same format as %s (config, quantization layout, tensor shapes): its speed rows"
                          " stand for it", v.name, measurer.name)
    with run.stage("benchmark", v.uid, f"same format as {measurer.name}: its speed rows") as commit:
        writers.link_speed(commit.con, run.run_id, v.uid, key, (run.run_id, measurer.uid))


def _decide(run: _Run, spec: ModelSpec, cat: Catalog, base: VariantArtifact) -> list[Decision]:
    run_id = run.run_id
    policy = spec.policy or cat.policy

    def compute(con: Any) -> list[Decision]:
        evidence = reads.decision_evidence(con, run_id, [(g.task, g.metric) for g in policy.quality])
        found = drift.findings(con, run_id)
        # The model's published figures: the base is checked against those that state a tolerance; its probe's
        # findings (engine drift) label every verdict.
        return [decide_task(row, base.size_bytes, policy=policy, published=spec.published, drift=found,
                            **evidence.of(row["variant_uid"]))
                for row in evidence.variants]

    if run.is_done("decide"):
        return []
    run.enter("decide", "", spec.id)
    started = statements.now()
    with run.stage("decide", started=started) as commit:
        decisions = compute(commit.con)
        writers.record_decisions(commit.con, run_id, decisions, policy.model_dump(mode="json"))
    return decisions


def _eval_setup(load_time: bool = False) -> EvalSetup:
    """lm-eval's vLLM backend on a GPU machine that has vLLM, else Transformers (bf16 on GPU, fp32 on CPU).

    With load-time (bitsandbytes) variants every checkpoint of the model, the base included, is evaluated
    with Transformers: those variants exist only as Transformers loads them, and recovery compares the
    base and a variant under the same evaluation config."""
    import importlib.util

    from quantgate.tasks.adapters.engines import cuda_available

    if not cuda_available():
        return EvalSetup("hf", "cpu", "float32")
    return EvalSetup("vllm" if importlib.util.find_spec("vllm") and not load_time else "hf", "cuda", "bfloat16")


def _publish(model_id: str, card: list[dict]) -> None:
    """The run's scorecard as Prefect artifacts: a markdown card and a table of decisions."""
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"# {model_id}", "",
             "| variant | decision | recovery | 95% CI low | KL | long context | speedup | size ratio | reason |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in card:
        lines.append(f"| {r['variant']} | {r['decision']} | {fmt(r['quality_recovery'])} | {fmt(r['quality_lower_bound'])}"
                     f" | {fmt(r['kl'])} | {fmt(r['long_context'])} | {fmt(r['speedup'])} | {fmt(r['size_ratio'])}"
                     f" | {r['reason']} |")
    key = "".join(c if c.isalnum() else "-" for c in model_id.lower())[:80]
    create_markdown_artifact("\n".join(lines), key=f"scorecard-{key}", description=f"quantgate scorecard for {model_id}")
    columns = ("variant", "method", "bits", "decision", "quality_recovery", "quality_lower_bound", "flip_rate", "kl",
               "long_context", "speedup", "size_ratio", "reason")
    create_table_artifact([{c: r[c] for c in columns} for r in card], key=f"decisions-{key}",
                          description=f"quantgate decisions for {model_id}")
