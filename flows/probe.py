"""evaluate-model's probe stage (issue 45, item 3): the base re-measured on its suite's probe, every run, and set
beside the model's previous probe (tasks/steps/drift.py says what it is for and how it is judged).

A stage of its own, run after the speed measurements (the GPU is then free: the probe's engine is the evaluation's,
sized the same) and before the decisions, which read its findings. Its rows and findings commit with its mark."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from prefect import get_run_logger

from quantgate.catalog.models import ModelSpec
from quantgate.catalog.policy import Policy
from quantgate.catalog.records import QualityReport, VariantArtifact
from quantgate.catalog.suites import SuiteSpec
from quantgate.tasks.steps import drift
from quantgate.tasks.steps.evaluate import evaluate_task
from quantgate.warehouse import drift as drift_store
from quantgate.warehouse import writers

STAGE = "probe"


class StageRun(Protocol):
    """What the stage needs of evaluate-model's run: its id and its one way to run a stage (`_Run.step`)."""

    run_id: str

    def step(self, stage: str, item: str, *, stored: Callable[[Any], Any], compute: Callable[[], Any],
             write: Callable[[Any, Any, bool], str | None], starts: Callable[[Any], int] = ...,
             label: str = "") -> Any: ...


def probe_base(run: StageRun, base: VariantArtifact, suite: SuiteSpec, policy: Policy, backend: str, device: str,
               dtype: str, spec: ModelSpec) -> None:
    """Measure the suite's probe of `base` (nothing where the suite sets none), store it and its findings."""
    probe = drift.probe_suite(suite, policy)
    if probe is None:
        return
    key = drift.probe_key(probe, backend, dtype)
    eval_key = drift.probe_eval_key(key, run.run_id)

    def compute() -> QualityReport:
        report = evaluate_task(base.path, probe, backend=backend, device=device, dtype=dtype,
                               trust_remote_code=spec.trust_remote_code)
        return dataclasses.replace(report, eval_key=eval_key, config={**report.config, "probe_key": key})

    def write(con: Any, report: QualityReport | bool, reused: bool) -> str:
        if not reused:
            assert isinstance(report, QualityReport)
            # A side evaluation of the base, as KL's are: the run's link to the base's suite evaluation stays.
            writers.record_quality(con, run.run_id, base.uid, report, link=False)
            if report.status != "ok":
                get_run_logger().warning("the base's probe could not be measured: %s", report.error)
                return eval_key
        _judge(con, run.run_id, base.uid, key, eval_key, policy)
        return eval_key

    run.step(STAGE, base.uid, stored=lambda con: drift_store.has_probe(con, run.run_id, base.uid) or None,
             compute=compute, write=write, starts=lambda _: 1, label="base probe")


def _judge(con: Any, run_id: str, base_uid: str, key: str, eval_key: str, policy: Policy) -> None:
    """This probe beside the model's previous one of the same checkpoint and probe, stored as findings."""
    previous = drift_store.previous_probe(con, run_id, base_uid, key)
    if previous is None:
        return
    changed = drift.changed_libraries(drift_store.run_versions(con, previous[0]), drift_store.run_versions(con, run_id))
    found = drift.compare(drift_store.probe_items(con, base_uid, previous[1]),
                          drift_store.probe_items(con, base_uid, eval_key), changed, policy.confidence)
    drift_store.record_drift(con, run_id, base_uid, previous[0], found)
    log = get_run_logger()
    for f in found:
        if f["moved"]:
            log.warning("%s%s", "engine drift: " if f["drifted"] else "base probe moved: ",
                        drift.describe(f, previous[0]) + (f", with {f['changed']}" if f["changed"] else ""))
