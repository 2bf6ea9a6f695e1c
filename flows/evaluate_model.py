"""evaluate-model: download → quantize → evaluate → benchmark → decide, one model, into the warehouse."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from prefect.states import Failed, State

from quantgate.catalog.schema import (
    DEFAULT_CATALOG, Catalog, CatalogError, ModelSpec, adhoc_model, load_catalog, with_revision,
)
from quantgate.flows import dispatch
from quantgate.flows.inputs import model_inputs
from quantgate.tasks.caching import build_cached, download_cached
from quantgate.tasks.decide import decide_task
from quantgate.tasks.divergence import DivergenceError, kl_eval_key, kl_report_task
from quantgate.tasks.download import DownloadError
from quantgate.tasks.errors import one_line
from quantgate.tasks.evaluate import eval_key, evaluate_task
from quantgate.tasks.quantize import CalibrationError, base_variant, lib_versions
from quantgate.tasks.records import ModelArtifact, VariantArtifact
from quantgate.warehouse import store


USER_ERRORS = (CatalogError, DownloadError, CalibrationError, DivergenceError)


def work_dir(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("QUANTGATE_HOME", ".quantgate")).resolve()


def _run_name() -> str:
    params = flow_run.parameters
    rev = f"@{params['revision'][:12]}" if params.get("revision") else ""
    return f"evaluate {params['model']}{rev}" + (f" [{','.join(params['variants'])}]" if params.get("variants") else "")


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
    """
    cat_path = Path(catalog) if catalog else DEFAULT_CATALOG
    cat = load_catalog(cat_path)
    spec = with_revision(adhoc_model(cat, model, variants, template, scenarios=scenarios, engines=engines), revision)
    run_id = str(flow_run.id)
    wh = warehouse or str(store.default_path())
    root = work_dir(workdir)
    with store.session(wh) as con:
        store.start_run(con, run_id, "evaluate-model", spec.id, str(cat_path.resolve()), cat.hash,
                        platform.node(), lib_versions())
    try:
        with tags("quantgate", f"model:{spec.id}"):
            sha = _evaluate(cat, spec, run_id, wh, root, gpu_deployment, engines)
    except USER_ERRORS as e:
        # Bad input: one line in the run row and in the flow's state, no traceback.
        with store.session(wh) as con:
            store.finish_run(con, run_id, error=str(e))
        return Failed(message=str(e))
    except Exception as e:
        with store.session(wh) as con:
            store.finish_run(con, run_id, error=one_line(e))
        raise
    with store.session(wh) as con:
        store.record_inputs(con, run_id, spec.id, *model_inputs(cat, spec, sha))
        store.finish_run(con, run_id)
        card = store.rows(con, "SELECT * FROM variant_scorecard WHERE run_id = ?", [run_id])
    _publish(spec.id, card)
    return card


def _evaluate(cat: Catalog, spec: ModelSpec, run_id: str, wh: str, root: Path, gpu_deployment: str | None,
              engines: list[str] | None) -> str:
    """All steps of one model; returns the checkpoint's sha."""
    log = get_run_logger()
    model: ModelArtifact = download_cached(spec, root)
    with store.session(wh) as con:
        store.record_model(con, run_id, model)
        base = base_variant(model)
        store.record_variant(con, run_id, base, role="base")

    def known(uid: str) -> dict | None:
        with store.session(wh, read_only=True) as con:
            return store.find_variant(con, uid)

    built: list[VariantArtifact] = []
    for name in spec.variants:
        variant = build_cached(model, cat.variants[name], spec.calibration, root, known)
        log.info("%s: %s%s", name, "reused" if variant.reused else variant.status,
                 f" ({variant.error})" if variant.error else "")
        with store.session(wh) as con:
            store.record_variant(con, run_id, variant, role="variant")
        built.append(variant)

    suite = cat.suites[spec.suite]
    backend, device, dtype = _eval_setup()
    key = eval_key(suite, backend, dtype)
    for v in [base, *[b for b in built if b.ok]]:
        with store.session(wh, read_only=True) as con:
            done = store.has_quality(con, v.uid, key)
        if done:
            log.info("%s: quality results for this evaluation config already stored; reused", v.name)
            with store.session(wh) as con:
                store.link_quality(con, run_id, v.uid, key)
            continue
        report = evaluate_task(v.path, suite, backend=backend, device=device, dtype=dtype,
                               trust_remote_code=spec.trust_remote_code)
        with store.session(wh) as con:
            store.record_quality(con, run_id, v.uid, report)

    # Token-level KL of each variant's next-token distribution from the base's, on the perplexity text.
    kl_text = spec.calibration.text_file
    kl_key = kl_eval_key(kl_text, dtype=dtype)
    for v in [b for b in built if b.ok]:
        with store.session(wh, read_only=True) as con:
            done = store.has_quality(con, v.uid, kl_key)
        if not done:
            report = kl_report_task(base.path, v.path, kl_text, device=device, dtype=dtype)
            with store.session(wh) as con:
                store.record_quality(con, run_id, v.uid, report, link=False)

    # GPU benchmarks may run on the GPU pool; their results come back here, the one warehouse writer.
    measured = dispatch.benchmark_all([base, *[b for b in built if b.ok]], spec, cat, root, gpu_deployment,
                                      engines=engines)
    for uid, results in measured.items():
        with store.session(wh) as con:
            store.record_speed(con, run_id, uid, results)

    with store.session(wh) as con:
        recovery = store.rows(con, "SELECT * FROM variant_recovery WHERE run_id = ?", [run_id])
        speed = store.rows(con, "SELECT * FROM variant_speedup WHERE run_id = ?", [run_id])
        policy = spec.policy or cat.policy
        samples = store.paired_samples(con, run_id, [(g.task, g.metric) for g in policy.quality])
        flips = store.rows(con, "SELECT * FROM variant_flips WHERE run_id = ?", [run_id])
        rows = store.rows(con, "SELECT v.* FROM variants v JOIN run_variants rv USING (variant_uid)"
                               " WHERE rv.run_id = ? AND rv.role = 'variant'", [run_id])
        of = lambda found, row: [r for r in found if r["variant_uid"] == row["variant_uid"]]  # noqa: E731
        decisions = [
            decide_task(row, base.size_bytes, of(recovery, row), of(speed, row), policy,
                        of(samples, row), of(flips, row))
            for row in rows
        ]
        store.record_decisions(con, run_id, decisions, policy.model_dump(mode="json"))
    for d in decisions:
        log.info("%s", d.reason)
    return model.sha


def _eval_setup() -> tuple[str, str, str]:
    """lm-eval's vLLM backend on a GPU machine that has vLLM, else Transformers (bf16 on GPU, fp32 on CPU)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "hf", "cpu", "float32"
    return ("vllm" if importlib.util.find_spec("vllm") else "hf"), "cuda", "bfloat16"


def _publish(model_id: str, card: list[dict]) -> None:
    """The run's scorecard as Prefect artifacts: a markdown card and a table of decisions."""
    fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
    lines = [f"# {model_id}", "", "| variant | decision | recovery | 95% CI low | KL | speedup | size ratio | reason |",
             "|---|---|---|---|---|---|---|---|"]
    for r in card:
        lines.append(f"| {r['variant']} | {r['decision']} | {fmt(r['quality_recovery'])} | {fmt(r['quality_lower_bound'])}"
                     f" | {fmt(r['kl'])} | {fmt(r['speedup'])} | {fmt(r['size_ratio'])} | {r['reason']} |")
    key = "".join(c if c.isalnum() else "-" for c in model_id.lower())[:80]
    create_markdown_artifact("\n".join(lines), key=f"scorecard-{key}", description=f"quantgate scorecard for {model_id}")
    columns = ("variant", "method", "bits", "decision", "quality_recovery", "quality_lower_bound", "flip_rate", "kl",
               "speedup", "size_ratio", "reason")
    create_table_artifact([{c: r[c] for c in columns} for r in card], key=f"decisions-{key}",
                          description=f"quantgate decisions for {model_id}")
