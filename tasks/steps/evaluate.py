"""The evaluate step: a suite of lm-eval tasks on one checkpoint, as a QualityReport that never raises."""

from __future__ import annotations

import logging
import time

from prefect import task

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.records import QualityReport
from quantgate.catalog.suites import SuiteSpec
from quantgate.tasks.adapters.evaluators import lm_eval as evaluator
from quantgate.tasks.adapters.evaluators.lm_eval import EVALUATOR, Backend
from quantgate.tasks.runtime import faults

log = logging.getLogger(__name__)


def eval_key(suite: SuiteSpec, backend: Backend = "hf", dtype: str = "float32") -> str:
    """Stable id of an evaluation config. Batch size is left out: changing it reuses earlier results."""
    return evaluator.eval_key(suite, backend, dtype)


def task_words(suite: SuiteSpec) -> list[int] | None:
    """The sizes in words of the suite's tasks sized so, None with a built-in lm-eval task (what an evaluation
    engine's max_model_len is sized by: tasks/adapters/model_memory.eval_max_model_len)."""
    return evaluator.task_words(suite)


def evaluate_variant(
    model_path: str,
    suite: SuiteSpec,
    *,
    backend: Backend = "hf",
    device: str = "cpu",
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> QualityReport:
    """Evaluate a checkpoint; any failure comes back as status "failed" with a one-line error."""
    options = {"backend": backend, "device": device, "dtype": dtype, "trust_remote_code": trust_remote_code}
    start = time.perf_counter()
    try:
        report = evaluator.evaluate(model_path, suite, **options)
        faults.point("evaluate")
        return report
    except Exception as e:
        # Our own errors (an engine that cannot fit the GPU included) are already one line.
        error = str(e) if isinstance(e, QuantgateError) else f"{type(e).__name__}: {e}".splitlines()[0]
        log.warning("evaluation of %s failed: %s", model_path, error)
        return QualityReport(
            eval_key=eval_key(suite, backend, dtype),
            evaluator=EVALUATOR,
            config=evaluator.run_config(model_path, suite, **options),
            metrics=[],
            samples=[],
            seconds=time.perf_counter() - start,
            status="failed",
            error=error,
        )


evaluate_task = task(evaluate_variant, name="evaluate", tags=["evaluate"])
