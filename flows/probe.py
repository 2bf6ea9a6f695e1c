"""evaluate-model's probe stage (issue 45, item 3): the base re-measured on its suite's probe, every run, and set
beside the model's previous probe (tasks/steps/drift.py says what it is for and how it is judged).

A stage of its own, after the speed measurements and before the decisions, which read its findings. Where the run
measured the base's suite evaluation, the probe is its first items (tasks/steps/drift.probe_of); where it reused
an earlier run's, the probe is measured on its own (the GPU is then free: its engine is the evaluation's, sized the
same). Its rows and findings commit with its mark."""

from __future__ import annotations

import dataclasses
from typing import Any

from prefect import get_run_logger

from quantgate.catalog.models import ModelSpec
from quantgate.catalog.policy import Policy
from quantgate.catalog.records import QualityReport, VariantArtifact
from quantgate.catalog.stages import Stage
from quantgate.catalog.suites import SuiteSpec
from quantgate.flows.stage_run import StageRun
from quantgate.tasks.steps import drift
from quantgate.tasks.steps.evaluate import eval_key, evaluate_task
from quantgate.warehouse import drift as drift_store
from quantgate.warehouse import writers


def probe_base(run: StageRun, base: VariantArtifact, suite: SuiteSpec, policy: Policy, backend: str, device: str,
               dtype: str, spec: ModelSpec) -> None:
    """Measure the suite's probe of `base` (nothing where the suite sets none), store it and its findings."""
    probe = drift.probe_suite(suite, policy)
    if probe is None:
        return
    key = drift.probe_key(probe, backend, dtype)
    probe_eval = drift.probe_eval_key(key, run.run_id)
    suite_key = eval_key(suite, backend, dtype)

    def compute() -> QualityReport:
        # The base's suite evaluation measured in this run holds the probe's items; one reused from an earlier run
        # does not say how today's engine scores, so the probe is then measured on its own.
        measured = run.read(lambda con: drift_store.evaluation_measured_in(con, run.run_id, base.uid, suite_key))
        if measured is not None:
            report = drift.probe_of(probe, measured)
            config = {**report.config, "probe_key": key, "measured_in": suite_key}
        else:
            report = evaluate_task(base.path, probe, backend=backend, device=device, dtype=dtype,
                                   trust_remote_code=spec.trust_remote_code)
            config = {**report.config, "probe_key": key}
        return dataclasses.replace(report, eval_key=probe_eval, config=config)

    def write(con: Any, report: QualityReport | bool, reused: bool) -> str:
        if not reused:
            assert isinstance(report, QualityReport)
            # A side evaluation of the base, as KL's are: the run's link to the base's suite evaluation stays.
            writers.record_quality(con, run.run_id, base.uid, report, link=False)
            if report.status != "ok":
                get_run_logger().warning("the base's probe could not be measured: %s", report.error)
                return probe_eval
        _judge(con, run.run_id, base.uid, key, probe_eval, policy)
        return probe_eval

    run.step(Stage.PROBE, base.uid, stored=lambda con: drift_store.has_probe(con, run.run_id, base.uid) or None,
             compute=compute, write=write, starts=lambda r: 0 if "measured_in" in r.config else 1,
             label="base probe")


def _judge(con: Any, run_id: str, base_uid: str, key: str, probe_eval: str, policy: Policy) -> None:
    """This probe beside the model's previous one of the same checkpoint and probe, stored as findings."""
    previous = drift_store.previous_probe(con, run_id, base_uid, key)
    if previous is None:
        return
    changed = drift.changed_libraries(drift_store.run_versions(con, previous[0]), drift_store.run_versions(con, run_id))
    found = drift.compare(drift_store.probe_items(con, base_uid, previous[1]),
                          drift_store.probe_items(con, base_uid, probe_eval), changed, policy.confidence)
    drift_store.record_drift(con, run_id, base_uid, previous[0], found)
    log = get_run_logger()
    for f in found:
        if f["moved"]:
            log.warning("%s%s", "engine drift: " if f["drifted"] else "base probe moved: ",
                        drift.describe(f, previous[0]) + (f", with {f['changed']}" if f["changed"] else ""))
