"""evaluate-model's benchmark stage: each checkpoint's speed reused from an earlier run of its speed key, measured by
the first checkpoint of its key to be ready, or taken from the one of its key that measures it (flows/speed_plan.py
says which); the measurements run through flows/dispatch.py."""

from __future__ import annotations

import threading
from pathlib import Path

from prefect import get_run_logger

from quantgate.catalog.load import Catalog
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import VariantArtifact
from quantgate.catalog.stages import Stage
from quantgate.flows import dispatch
from quantgate.flows.speed_plan import SpeedPlan
from quantgate.flows.stage_run import StageRun
from quantgate.tasks.runtime import launch
from quantgate.warehouse import reads, writers


class SpeedStage:
    """The benchmark stage: each checkpoint's speed reused from an earlier run of its speed key (format, scenarios,
    libraries, device), measured by the first checkpoint of its key to be ready, or taken from the one of its key
    that measures it; each checkpoint's rows stored with its mark as soon as they are in. With a `pool` (one GPU)
    measuring begins at `ready`, else at `finish`."""

    def __init__(self, run: StageRun, plan: SpeedPlan, spec: ModelSpec, cat: Catalog, root: Path,
                 base: VariantArtifact, engines: list[str] | None, remeasure: bool, lanes: list[str | None],
                 pool: launch.Jobs | None) -> None:
        self.run, self.plan, self.remeasure, self.early = run, plan, remeasure, pool is not None
        self.measurements = dispatch.Measurements(spec, cat, root, engines, self._store, lanes, pool, base.path)
        self.started: dict[str, VariantArtifact] = {}
        self.takers: dict[str, list[VariantArtifact]] = {}
        self.sources: dict[str, tuple[str, str] | None] = {}
        self.lock = threading.Lock()

    def ready(self, v: VariantArtifact) -> None:
        """A checkpoint is there: it claims its speed key, and on one GPU its engines start now."""
        if not self.plan.claim(v) or not self.early or self.run.is_done(Stage.BENCHMARK, v.uid):
            return
        if not self.remeasure and self._source(v) is not None:
            return  # an earlier run measured the key: linked in `finish`
        self.started[v.uid] = v
        self.run.enter(Stage.BENCHMARK, v.uid, v.name)
        self.measurements.start(v)

    def finish(self, checkpoints: list[VariantArtifact]) -> None:
        """The speed of every checkpoint not yet stored: reused, measured (those not started yet) or taken; returns
        once every row is stored."""
        log = get_run_logger()
        todo: list[VariantArtifact] = []
        ready = [*checkpoints, *(v for v in self.started.values() if v not in checkpoints)]
        for v in checkpoints:
            if self.run.is_done(Stage.BENCHMARK, v.uid) or v.uid in self.started:
                continue
            key = self.plan.key(v)
            source = None if self.remeasure else self._source(v)
            measurer = self.plan.measurer(v, ready)
            if source is not None and source[0] != self.run.run_id:
                log.info("%s: speed unchanged since run %s (same format, scenarios, libraries and device); reused",
                         v.name, source[0])
                with self.run.stage(Stage.BENCHMARK, v.uid, f"reused from run {source[0]}") as commit:
                    writers.link_speed(commit.con, self.run.run_id, v.uid, key, source)
            elif measurer.uid == v.uid:
                todo.append(v)
            else:
                with self.lock:
                    # `_store` marks the measurer done before it takes the lock to hand its rows to the takers.
                    later = not self.run.is_done(Stage.BENCHMARK, measurer.uid)
                    if later:
                        self.takers.setdefault(measurer.uid, []).append(v)
                if not later:
                    _take_speed(self.run, v, measurer, key)
        for v in todo:
            self.run.enter(Stage.BENCHMARK, v.uid, v.name)
        self.measurements.run(todo)

    def _source(self, v: VariantArtifact) -> tuple[str, str] | None:
        """The run and checkpoint whose stored rows have `v`'s speed key, read once per checkpoint."""
        if v.uid not in self.sources:
            self.sources[v.uid] = self.run.read(lambda con: reads.speed_source(con, self.plan.key(v)))
        return self.sources[v.uid]

    def _store(self, uid: str, result: dispatch.JobResult) -> None:
        v = self.measurements.variant(uid)
        with self.run.stage(Stage.BENCHMARK, uid, started=result.started_at,
                            engine_starts=result.engine_starts) as commit:
            writers.record_measured(commit.con, self.run.run_id, uid, result.measured)
            writers.link_speed(commit.con, self.run.run_id, uid, self.plan.key(v))
        with self.lock:
            takers = self.takers.pop(uid, [])
        for taker in takers:
            _take_speed(self.run, taker, v, self.plan.key(taker))


def _take_speed(run: StageRun, v: VariantArtifact, measurer: VariantArtifact, key: str) -> None:
    get_run_logger().info("%s: same format as %s (config, quantization layout, tensor shapes): its speed rows"
                          " stand for it", v.name, measurer.name)
    with run.stage(Stage.BENCHMARK, v.uid, f"same format as {measurer.name}: its speed rows") as commit:
        writers.link_speed(commit.con, run.run_id, v.uid, key, (run.run_id, measurer.uid))
