"""evaluate-model: download → quantize → evaluate → benchmark → decide, one model, into the warehouse."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.states import Failed, State

from quantgate.catalog.schema import (
    DEFAULT_CATALOG, Catalog, CatalogError, ModelSpec, adhoc_model, load_catalog, with_revision,
)
from quantgate.flows import dispatch, interrupts, progress
from quantgate.flows.inputs import model_inputs
from quantgate.tasks import faults
from quantgate.tasks.caching import build_cached, download_cached
from quantgate.tasks.decide import decide_task
from quantgate.tasks.divergence import DivergenceError, kl_eval_key, kl_report_task
from quantgate.tasks.download import DownloadError
from quantgate.tasks.errors import one_line
from quantgate.tasks.evaluate import eval_key, evaluate_task
from quantgate.tasks.quantize import CalibrationError, base_variant, lib_versions, variant_from_row
from quantgate.tasks.records import MetricResult, ModelArtifact, VariantArtifact
from quantgate.warehouse import store


class ModelOutputError(RuntimeError):
    """A base model whose outputs are not finite: nothing can be judged against it; the message is one line."""


USER_ERRORS = (ModelOutputError, CatalogError, DownloadError, CalibrationError, DivergenceError, store.WarehouseError)


def work_dir(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("QUANTGATE_HOME", ".quantgate")).resolve()


def _run_name() -> str:
    params = flow_run.parameters
    rev = f"@{params['revision'][:12]}" if params.get("revision") else ""
    return f"evaluate {params['model']}{rev}" + (f" [{','.join(params['variants'])}]" if params.get("variants") else "")


def resume_key(cat: Catalog, spec: ModelSpec, engines: list[str] | None = None) -> str:
    """What a run was asked to do: the catalog, the model's resolved spec and the engines kept. A rerun
    with the same key resumes an unfinished run; any change starts a fresh one."""
    key = {"catalog": cat.hash, "model": spec.model_dump(mode="json"), "engines": sorted(engines or [])}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


class _Run:
    """The warehouse run a flow run works on, and which of its stages are already complete."""

    def __init__(self, wh: str, run_id: str, attempt_id: str) -> None:
        self.wh, self.run_id, self.attempt_id = wh, run_id, attempt_id
        with store.session(wh, read_only=True) as con:
            self.done = store.completed_stages(con, run_id)

    def is_done(self, stage: str, item: str = "") -> bool:
        return (stage, item) in self.done

    @contextmanager
    def stage(self, stage: str, item: str = "", detail: str | None = None) -> Iterator[Any]:
        """One transaction for a stage's rows and its completion mark: after a crash both are there or neither."""
        with store.session(self.wh) as con, store.transaction(con):
            yield con
            store.mark_stage(con, self.run_id, stage, item, detail, self.attempt_id)
            faults.point(f"write:{stage}")
        self.done[(stage, item)] = detail


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
    gpu_deployment: str | None = None,
) -> list[dict] | State:
    """Evaluate one model (a catalog id, a local folder or a hub id) and every variant the catalog asks for.

    `variants` and `scenarios` replace the catalog's lists for this run; `engines` keeps only those
    engines. `revision` pins a hub model to a commit; `template` is the catalog model whose variants,
    suite and scenarios a model outside the catalog gets; `gpu_deployment` ("gpu-step/gpu-step") sends
    GPU benchmarks to that deployment's work pool instead of running them in this process.
    A rerun after a crash (the model's latest run unfinished, same catalog, spec and engines) resumes
    that run: stages already stored are not done again.
    """
    cat_path = Path(catalog) if catalog else DEFAULT_CATALOG
    try:
        cat = load_catalog(cat_path)
        spec = with_revision(adhoc_model(cat, model, variants, template, scenarios=scenarios, engines=engines),
                             revision)
    except CatalogError as e:
        return Failed(message=str(e))
    attempt_id = str(flow_run.id)
    wh = warehouse or str(store.default_path())
    root = work_dir(workdir)
    log = get_run_logger()
    try:
        with store.session(wh) as con:
            run_id, resumed = store.begin_run(con, attempt_id, "evaluate-model", spec.id,
                                              resume_key(cat, spec, engines),
                                              str(cat_path.resolve()), cat.hash, platform.node(), lib_versions())
            if not resumed:  # a resumed run keeps the prices its costs were computed with
                store.record_prices(con, run_id, cat.gpu_prices, cat.hash)
        run = _Run(wh, run_id, attempt_id)
    except store.WarehouseError as e:  # no warehouse to write a run row into
        return Failed(message=str(e))
    if resumed:
        log.info("resuming run %s of %s: %d stage(s) already complete", run_id, spec.id, len(run.done))
    try:
        with interrupts.guard(), tags("quantgate", f"model:{spec.id}"):
            sha = _evaluate(cat, spec, run, root, gpu_deployment, engines)
    except interrupts.Interrupted as e:
        _finish(run, str(e))  # the next run of the same request resumes it
        raise
    except USER_ERRORS as e:
        # Bad input: one line in the run row and in the flow's state, no traceback.
        _finish(run, str(e))
        return Failed(message=str(e))
    except Exception as e:
        _finish(run, one_line(e))
        raise
    with store.session(wh) as con:
        store.record_inputs(con, run_id, spec.id, *model_inputs(cat, spec, sha))
    _finish(run, None)
    with store.session(wh, read_only=True) as con:
        card = store.rows(con, "SELECT * FROM variant_scorecard WHERE run_id = ?", [run_id])
    _publish(spec.id, card)
    return card


def _finish(run: _Run, error: str | None) -> None:
    try:
        with store.session(run.wh) as con:
            store.finish_run(con, run.run_id, error=error, attempt_id=run.attempt_id)
    except store.WarehouseError as e:
        if error is None:
            raise
        # The warehouse itself is the trouble; the run stays unfinished and the next run resumes it.
        get_run_logger().warning("could not record the failure of run %s: %s", run.run_id, e)


def _nonfinite(metrics: list[MetricResult]) -> str | None:
    bad = [f"{m.task}/{m.metric} = {m.value}" for m in metrics if m.value is not None and not math.isfinite(m.value)]
    return ", ".join(bad[:3]) or None


def _evaluate(cat: Catalog, spec: ModelSpec, run: _Run, root: Path, gpu_deployment: str | None,
              engines: list[str] | None) -> str:
    """All stages of one model that the run has not completed yet; returns the checkpoint's sha."""
    log = get_run_logger()
    run_id, wh = run.run_id, run.wh
    model: ModelArtifact | None = None
    if run.is_done("download"):
        with store.session(wh, read_only=True) as con:
            model = store.model_of(con, run.done[("download", "")] or "")
        if model is not None and not (Path(model.path) / "config.json").is_file():
            model = None  # the folder is gone: fetch it again
    if model is None:
        progress.enter("download", spec.id)
        model = download_cached(spec, root)
        with run.stage("download", "", model.uid) as con:
            store.record_model(con, run_id, model)
            store.record_variant(con, run_id, base_variant(model), role="base")
    base = base_variant(model)

    def known(uid: str) -> dict | None:
        with store.session(wh, read_only=True) as con:
            return store.find_variant(con, uid)

    built: list[VariantArtifact] = []
    for k, name in enumerate(spec.variants, 1):
        progress.enter("quantize", name, k, len(spec.variants))
        variant = None
        if run.is_done("quantize", name):
            with store.session(wh, read_only=True) as con:
                row = store.run_variant(con, run_id, run.done[("quantize", name)] or "")
            variant = variant_from_row(row, cat.variants[name]) if row else None
        if variant is None:
            variant = build_cached(model, cat.variants[name], spec.calibration, root, known)
            log.info("%s: %s%s", name, "reused" if variant.reused else variant.status,
                     f" ({variant.error})" if variant.error else "")
            with run.stage("quantize", name, variant.uid) as con:
                store.record_variant(con, run_id, variant, role="variant")
        built.append(variant)

    suite = cat.suites[spec.suite]
    backend, device, dtype = _eval_setup(load_time=any(cat.variants[n].load_time for n in spec.variants))
    key = eval_key(suite, backend, dtype)
    usable: list[VariantArtifact] = []
    checkpoints = [base, *[b for b in built if b.ok]]
    for k, v in enumerate(checkpoints, 1):
        progress.enter("evaluate", v.name, k, len(checkpoints))
        if run.is_done("evaluate", v.uid):
            with store.session(wh, read_only=True) as con:
                failed = con.execute("SELECT status = 'failed' FROM variants WHERE variant_uid = ?", [v.uid]).fetchone()
            if not (failed and failed[0]):
                usable.append(v)
            continue
        with store.session(wh, read_only=True) as con:
            done = store.has_quality(con, v.uid, key)
        if done:
            log.info("%s: quality results for this evaluation config already stored; reused", v.name)
            with store.session(wh, read_only=True) as con:
                metrics = store.quality_metrics(con, v.uid, key)
        else:
            report = evaluate_task(v.path, suite, backend=backend, device=device, dtype=dtype,
                                   trust_remote_code=spec.trust_remote_code)
            metrics = report.metrics
        bad = _nonfinite(metrics)
        if bad and v is base:
            raise ModelOutputError(f"{spec.id}: the base model's outputs are not finite ({bad})")
        with run.stage("evaluate", v.uid) as con:
            if done:
                store.link_quality(con, run_id, v.uid, key)
            else:
                store.record_quality(con, run_id, v.uid, report)
            if bad:
                # Finite weights can still overflow: NaN/Inf outputs fail the variant, with the reason.
                store.fail_variant(con, v.uid, f"{v.name}: outputs contain NaN/Inf ({bad})")
        if bad:
            log.warning("%s: outputs contain NaN/Inf (%s); marked failed", v.name, bad)
        else:
            usable.append(v)
    variants_ok = [v for v in usable if v is not base]

    # Token-level KL of each variant's next-token distribution from the base's, on the perplexity text.
    kl_text = spec.calibration.text_file
    kl_key = kl_eval_key(kl_text, dtype=dtype)
    for k, v in enumerate(variants_ok, 1):
        progress.enter("kl", v.name, k, len(variants_ok))
        if run.is_done("kl", v.uid):
            continue
        with store.session(wh, read_only=True) as con:
            done = store.has_quality(con, v.uid, kl_key)
        report = None if done else kl_report_task(base.path, v.path, kl_text, device=device, dtype=dtype)
        with run.stage("kl", v.uid) as con:
            if report is not None:
                store.record_quality(con, run_id, v.uid, report, link=False)

    # GPU benchmarks may run on the GPU pool; their results come back here, the one warehouse writer,
    # and each variant's rows are stored with its completion mark as soon as they are all in.
    def store_speed(uid: str, measured: list[dispatch.Measured]) -> None:
        with run.stage("benchmark", uid) as con:
            store.record_measured(con, run_id, uid, measured)
        if (k := [v.uid for v in pending].index(uid) + 1) < len(pending):
            progress.enter("benchmark", pending[k].name, k + 1, len(pending))

    pending = [v for v in [base, *variants_ok] if not run.is_done("benchmark", v.uid)]
    if pending:
        progress.enter("benchmark", pending[0].name, 1, len(pending))
    dispatch.benchmark_all(pending, spec, cat, root, gpu_deployment, engines=engines, on_variant=store_speed)

    if run.is_done("decide"):
        return model.sha
    progress.enter("decide", spec.id)
    with run.stage("decide") as con:
        recovery = store.rows(con, "SELECT * FROM variant_recovery WHERE run_id = ?", [run_id])
        speed = store.rows(con, "SELECT * FROM variant_speedup WHERE run_id = ?", [run_id])
        policy = spec.policy or cat.policy
        samples = store.paired_samples(con, run_id, [(g.task, g.metric) for g in policy.quality])
        flips = store.rows(con, "SELECT * FROM variant_flips WHERE run_id = ?", [run_id])
        serving = store.rows(con, "SELECT * FROM variant_serving WHERE run_id = ?", [run_id])
        rows = store.rows(con, "SELECT v.* FROM variants v JOIN run_variants rv USING (variant_uid)"
                               " WHERE rv.run_id = ? AND rv.role = 'variant'", [run_id])
        of = lambda found, row: [r for r in found if r["variant_uid"] == row["variant_uid"]]  # noqa: E731
        decisions = [
            decide_task(row, base.size_bytes, of(recovery, row), of(speed, row), policy,
                        of(samples, row), of(flips, row), of(serving, row))
            for row in rows
        ]
        store.record_decisions(con, run_id, decisions, policy.model_dump(mode="json"))
    for d in decisions:
        log.info("%s", d.reason)
    progress.finish()
    return model.sha


def _eval_setup(load_time: bool = False) -> tuple[str, str, str]:
    """lm-eval's vLLM backend on a GPU machine that has vLLM, else Transformers (bf16 on GPU, fp32 on CPU).

    With load-time (bitsandbytes) variants every checkpoint of the model, the base included, is evaluated
    with Transformers: those variants exist only as Transformers loads them, and recovery compares the
    base and a variant under the same evaluation config."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "hf", "cpu", "float32"
    return ("vllm" if importlib.util.find_spec("vllm") and not load_time else "hf"), "cuda", "bfloat16"


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
