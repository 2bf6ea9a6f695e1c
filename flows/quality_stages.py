"""evaluate-model's quality stages: the suite on each checkpoint (`evaluate`) and each variant's token-level KL from
the base (`kl`), both scored as this machine scores quality (`EvalSetup`). A checkpoint whose outputs are not finite
fails there: a variant with that reason, the base with `ModelOutputError` (nothing can be judged against it)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import MetricResult, QualityReport, VariantArtifact
from quantgate.catalog.stages import Stage
from quantgate.catalog.suites import SuiteSpec
from quantgate.flows.stage_run import StageRun
from quantgate.tasks.runtime import gpu_memory
from quantgate.tasks.steps.divergence import kl_eval_key, kl_reports_task
from quantgate.tasks.steps.evaluate import eval_key, evaluate_task
from quantgate.warehouse import reads, statements, writers


class ModelOutputError(QuantgateError, RuntimeError):
    """A base model whose outputs are not finite: nothing can be judged against it; the message is one line."""


@dataclass(frozen=True)
class EvalSetup:
    """How quality is scored on this machine: lm-eval's backend, the device and the 16-bit (or CPU fp32) dtype."""

    backend: str
    device: str
    dtype: str


def eval_setup(load_time: bool = False) -> EvalSetup:
    """lm-eval's vLLM backend on a GPU machine that has vLLM, else Transformers (bf16 on GPU, fp32 on CPU).

    With load-time (bitsandbytes) variants every checkpoint of the model, the base included, is evaluated
    with Transformers: those variants exist only as Transformers loads them, and recovery compares the
    base and a variant under the same evaluation config."""
    from quantgate.tasks.adapters.engines import cuda_available

    if not cuda_available():
        return EvalSetup("hf", "cpu", "float32")
    return EvalSetup("vllm" if importlib.util.find_spec("vllm") and not load_time else "hf", "cuda", "bfloat16")


def nonfinite(metrics: list[MetricResult]) -> str | None:
    """The first few metrics that are NaN or infinite, in one line; None when all are finite."""
    bad = [f"{m.task}/{m.metric} = {m.value}" for m in metrics if m.value is not None and not math.isfinite(m.value)]
    return ", ".join(bad[:3]) or None


def evaluate(run: StageRun, v: VariantArtifact, suite: SuiteSpec, setup: EvalSetup, spec: ModelSpec, is_base: bool,
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
        if is_base and (bad := nonfinite(report.metrics)):  # raised before anything of it is stored
            raise ModelOutputError(f"{spec.id}: the base model's outputs are not finite ({bad})")
        reports[v.uid] = report
        return report.metrics

    def write(con: Any, metrics: list[MetricResult], reused: bool) -> None:
        if reused:
            get_run_logger().info("%s: quality results for this evaluation config already stored; reused", v.name)
            writers.link_quality(con, run.run_id, v.uid, key)
        else:
            writers.record_quality(con, run.run_id, v.uid, reports.pop(v.uid))
        if (bad := nonfinite(metrics)) and not is_base:
            # Finite weights can still overflow: NaN/Inf outputs fail the variant, with the reason.
            writers.fail_variant(con, v.uid, f"{v.name}: outputs contain NaN/Inf ({bad})")

    reports: dict[str, QualityReport] = {}
    if run.is_done(Stage.EVALUATE, v.uid):
        return not run.read(lambda con: reads.variant_failed(con, v.uid))
    with gpu_memory.settles_on_load(evals):
        metrics = run.step(Stage.EVALUATE, v.uid, stored=stored, compute=compute, write=write, starts=lambda _: 1,
                           label=v.name)
    if bad := nonfinite(metrics):
        if is_base:
            raise ModelOutputError(f"{spec.id}: the base model's outputs are not finite ({bad})")
        get_run_logger().warning("%s: outputs contain NaN/Inf (%s); marked failed", v.name, bad)
        return False
    return True


def kl(run: StageRun, base: VariantArtifact, variants: list[VariantArtifact], suite: SuiteSpec,
       setup: EvalSetup) -> None:
    """Token-level KL of each variant's next-token distribution from the base's, on the suite's KL text: the
    base loaded once, each variant in turn; each variant's rows stored with its own mark."""
    kl_text = suite.kl_text
    key = kl_eval_key(kl_text, dtype=setup.dtype)
    todo = [v for v in variants if not run.is_done(Stage.KL, v.uid)]
    stored = {v.uid for v in todo if run.read(lambda con, v=v: reads.has_quality(con, v.uid, key))}
    started = statements.now()
    missing = {v.uid: v.path for v in todo if v.uid not in stored}
    for v in todo:
        if v.uid in missing:
            run.enter(Stage.KL, v.uid, v.name)
    reports = kl_reports_task(base.path, missing, kl_text, device=setup.device, dtype=setup.dtype) if missing else {}
    first = next(iter(reports), None)
    for v in todo:
        starts = (2 if v.uid == first else 1) if v.uid in reports else 0  # the base's load, once, with the first
        with run.stage(Stage.KL, v.uid, started=started, engine_starts=starts) as commit:
            if v.uid in reports:
                writers.record_quality(commit.con, run.run_id, v.uid, reports[v.uid], link=False)
