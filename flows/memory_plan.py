"""What a model's run asks of its GPU, stage by stage, read before any stage starts (tasks/adapters/model_memory.py):
a stage that cannot fit stops the run there, in one line; the rest say how many jobs share the GPU and what each
evaluation is promised until its engine has loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger

from quantgate.catalog.load import Catalog
from quantgate.catalog.models import ModelSpec
from quantgate.tasks.adapters import model_memory
from quantgate.tasks.steps.divergence import WINDOW_TOKENS
from quantgate.tasks.steps.evaluate import task_words


@dataclass(frozen=True)
class GpuShare:
    """What the run's unmeasured jobs ask of the GPU: the memory promised to each evaluation until its engine has
    loaded, and how many jobs fit at once (None: not known, the setting decides)."""

    eval_bytes: int = 0
    fit: int | None = None


def gpu_share(cat: Catalog, spec: ModelSpec, model_path: str | Path, backend: str, device: str) -> GpuShare:
    """Every stage of the run sized by the model and checked against the GPU (model_memory.CapacityError, one line,
    for the first that cannot fit); nothing on a CPU, or for a model that cannot be sized (its engines' own checks
    then hold)."""
    if device != "cuda":
        return GpuShare()
    log = get_run_logger()
    gpu = model_memory.gpu_bytes()
    suite = cat.suites[spec.suite]
    variants = [(cat.variants[n], cat.calibration_for(spec, cat.variants[n])) for n in spec.variants]
    plan = model_memory.plan_run(model_path, variants, backend=backend, words=task_words(suite),
                                 hf_batch=suite.batch_size, kl_window=WINDOW_TOKENS, gpu_bytes=gpu)
    if plan is None:
        log.warning("%s: its GPU memory cannot be sized from its config; stages are not checked before they start",
                    spec.id)
        return GpuShare()
    plan.check(gpu, spec.id)
    fit = plan.jobs_per_gpu(gpu)
    log.info("GPU memory by stage (GPU: %s GiB): %s; %s jobs fit at once", model_memory.gib(gpu or 0),
             plan.summary(), fit or "?")
    return GpuShare(plan.eval_bytes, fit)
