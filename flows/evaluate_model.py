"""evaluate-model: one model into the warehouse, as its stages: download, quantize (each variant built), evaluate
(the suite on each checkpoint), kl, benchmark (each checkpoint's speed), probe (the base beside its previous run),
decide (catalog/stages.py names them).

Each stage is declared once, in a module of its own: flows/checkpoint_stages.py (download, quantize),
flows/quality_stages.py (evaluate, kl), flows/speed_stage.py (benchmark), flows/probe.py (probe), and `_decide`
here; each runs through the run's ledger (flows/stage_run.py), which reuses what the run stored before a crash.
This module is the flow: its run begun or resumed and ended, and the order of its stages, with what runs beside
what."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import deployment, flow_run
from prefect.states import Failed, State

from quantgate.catalog.errors import CatalogError, one_line
from quantgate.catalog.load import Catalog, load_catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.records import Decision, ModelArtifact, VariantArtifact
from quantgate.catalog.selection import adhoc_model, with_revision
from quantgate.catalog.settings import host_name, settings
from quantgate.catalog.stages import Stage
from quantgate.catalog.suites import SuiteSpec
from quantgate.catalog.variants import CalibrationSpec, VariantSpec
from quantgate.flows import interrupts, progress
from quantgate.flows.checkpoint_stages import build, download
from quantgate.flows.inputs import model_inputs
from quantgate.flows.live import work_dir
from quantgate.flows.memory_plan import GpuShare, gpu_share
from quantgate.flows.probe import probe_base
from quantgate.flows.quality_stages import EvalSetup, ModelOutputError, eval_setup, evaluate, kl
from quantgate.flows.speed_plan import SpeedPlan
from quantgate.flows.speed_stage import SpeedStage
from quantgate.flows.stage_run import StageRun
from quantgate.tasks.adapters.model_memory import CapacityError
from quantgate.tasks.runtime import environment, gpu_memory, launch, placement
from quantgate.tasks.steps.calibration import CalibrationError
from quantgate.tasks.steps.decide import decide_task
from quantgate.tasks.steps.divergence import DivergenceError
from quantgate.tasks.steps.download import DownloadError
from quantgate.tasks.steps.drift import engine_versions
from quantgate.tasks.steps.quantize import base_variant, lib_versions
from quantgate.warehouse import drift, lake, ledger, reads, sessions, statements, writers

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
        run = StageRun(wh, run_id, attempt_id)
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
            run.finish(reason, cancelled=True)
            interrupts.end_cancelled(reason)
        run.finish(str(e))  # the next run of the same request resumes it
        raise
    except USER_ERRORS as e:
        # Bad input: one line in the run row and in the flow's state, no traceback.
        run.finish(str(e))
        return Failed(message=str(e))
    except Exception as e:
        run.finish(one_line(e))
        raise
    with sessions.session(wh) as con:
        ledger.record_inputs(con, run_id, spec.id, *model_inputs(cat, spec, sha))
    run.finish(None)
    with sessions.session(wh, read_only=True) as con:
        card = reads.scorecard(con, run_id)
    _publish(spec.id, card)
    return card


def _evaluate(cat: Catalog, spec: ModelSpec, run: StageRun, root: Path, engines: list[str] | None, remeasure: bool,
              lanes: list[str | None]) -> str:
    """All stages of one model that the run has not completed yet; returns the checkpoint's sha.

    Work whose time is not measured (builds, evaluations, KL, engine starts) runs a few jobs at a time on a GPU,
    one at a time on a CPU; a measurement has its GPU alone, one per speed key (checkpoints of one format share
    their rows)."""
    # vLLM's compile cache in the work dir: every engine start of the same shape, in any run, reuses it.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    run.totals = {Stage.QUANTIZE: len(spec.variants), Stage.EVALUATE: 1 + len(spec.variants),
                  Stage.KL: len(spec.variants), Stage.BENCHMARK: 1 + len(spec.variants)}
    model = download(run, spec, root, cat)
    base = base_variant(model)
    setup = eval_setup(load_time=any(cat.variants[n].load_time for n in spec.variants))
    plan = SpeedPlan(spec, cat, engines)
    # Before any build: every stage sized by the model; one that cannot fit the GPU stops the run here.
    share = gpu_share(cat, spec, model.path, setup.backend, setup.device)

    # On one GPU each checkpoint's engines start as soon as it is built, beside the builds and evaluations, and
    # measure when the GPU is theirs alone (tasks/runtime/launch.GpuClock): the run waits for an engine start only
    # where nothing else is left to do. Elsewhere (a CPU, several lanes) the benchmarks follow KL.
    early = starts_engines_early(setup, lanes)
    with launch.gpu_clock(), launch.jobs(settings().engines_per_gpu if early else 1) as engine_pool:
        speed = SpeedStage(run, plan, spec, cat, root, base, engines, remeasure, lanes, engine_pool if early else None)
        variants_ok = _build_evaluate_kl(run, cat, spec, root, model, base, setup, share, lanes, speed.ready)
        speed.finish([base, *variants_ok])
    # After the measurements, on a free GPU: the base's probe, beside the previous run's (engine drift).
    probe_base(run, base, cat.suites[spec.suite], spec.policy or cat.policy, setup.backend, setup.device,
               setup.dtype, spec)
    for d in _decide(run, spec, cat, base):
        get_run_logger().info("%s", d.reason)
    progress.finish()
    return model.sha


def _build_evaluate_kl(run: StageRun, cat: Catalog, spec: ModelSpec, root: Path, model: ModelArtifact,
                       base: VariantArtifact, setup: EvalSetup, share: GpuShare, lanes: list[str | None],
                       ready: Callable[[VariantArtifact], None]) -> list[VariantArtifact]:
    """The unmeasured stages: the base evaluated, each variant built and evaluated, then each usable variant's KL;
    each checkpoint announced `ready` (its speed key claimed, its engines started on one GPU) once it is there.
    Returns the variants usable for the next stages.

    The base first: on a CPU (one job at a time) a base whose outputs are not finite stops the run before any
    build; on a GPU its evaluation runs beside the builds, and each variant is evaluated as its build ends."""
    suite = cat.suites[spec.suite]
    # The unmeasured phase, its jobs and KL, holds a share of the GPU from here to KL's end, so no measurement
    # slips into a gap between its jobs (on the H200, measurements that did kept KL waiting behind them).
    # Each evaluation is promised the memory its engine takes (sized by the model), until it has loaded: the
    # speed engines started beside take what is left; as many jobs run at once as fit the GPU.
    with launch.sharing(), gpu_memory.promised_memory(1 + len(spec.variants), share.eval_bytes) as evals:
        with launch.jobs(launch.shared_slots(lanes, setup.device == "cuda", share.fit)) as pool:
            base_quality = pool.submit(evaluate, run, base, suite, setup, spec, True, evals)
            if base_quality.done():  # one job at a time: it ran already, and a broken base stops the run here
                base_quality.result()
            builds = [pool.submit(_build_and_evaluate, run, model, cat.variants[name],
                                  cat.calibration_for(spec, cat.variants[name]), spec, root, suite, setup, ready, evals)
                      for name in spec.variants]
            ready(base)  # after the builds, which start first: the slowest build is the critical path
            base_quality.result()  # raises ModelOutputError when the base's outputs are not finite
            built = [future.result() for future in builds]
        variants_ok = [v for v, usable in built if usable]
        kl(run, base, variants_ok, suite, setup)
    return variants_ok


def _build_and_evaluate(run: StageRun, model: ModelArtifact, vspec: VariantSpec, calib: CalibrationSpec,
                        spec: ModelSpec, root: Path, suite: SuiteSpec, setup: EvalSetup,
                        ready: Callable[[VariantArtifact], None],
                        evals: gpu_memory.MemoryPromise) -> tuple[VariantArtifact, bool]:
    """A variant's job: built (or reused) with calibration set `calib`, announced `ready`, and evaluated: (variant,
    usable for the next stages)."""
    variant = build(run, model, vspec, calib, root, setup.backend)
    if not variant.ok:
        return variant, False
    ready(variant)
    return variant, evaluate(run, variant, suite, setup, spec, False, evals)


def starts_engines_early(setup: EvalSetup, lanes: list[str | None]) -> bool:
    """Whether speed jobs start as checkpoints are built, beside the unmeasured work: on one GPU. A CPU runs one
    job at a time anyway, and with several lanes the unmeasured work is not on the GPU a measurement takes, so
    there the benchmarks follow KL."""
    return setup.device == "cuda" and lanes == [None]


def _decide(run: StageRun, spec: ModelSpec, cat: Catalog, base: VariantArtifact) -> list[Decision]:
    """The verdicts, from the run's stored evidence and its probe's findings, stored with the stage's mark."""
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

    if run.is_done(Stage.DECIDE):
        return []
    run.enter(Stage.DECIDE, "", spec.id)
    started = statements.now()
    with run.stage(Stage.DECIDE, started=started) as commit:
        decisions = compute(commit.con)
        writers.record_decisions(commit.con, run_id, decisions, policy.model_dump(mode="json"))
    return decisions


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
