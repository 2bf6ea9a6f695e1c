"""gpu-suite: the speed half of quantgate on a GPU (or several side by side), with dummy weights of a real model shape.

Builds dummy checkpoints of the shape (BF16 without weight files, for vLLM's dummy loader and
Transformers' random init on the device; W4A16 with random packed weights written), records them as
a model and variants with weights 'dummy', then runs catalog/gpu.yaml's steps in their order. Each step
is one isolated unit (an engine process, a `vllm bench throughput` run or a `vllm serve` server): a
failure is recorded as a failed row and the next step runs. After `deadline_s` no step starts; the rest
are recorded as skipped ("deadline"). A step that starts is given at most what is left of
deadline_s + grace_s. With --gpus 0,1 each GPU takes the next step nobody has started, in a process that
sees only that GPU, and tensor-parallel steps run after them on all of them.

    python -m quantgate.flows.gpu_suite --warehouse gpu.ducklake --deadline-s 330 [--gpus 0,1]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import deployment, flow_run

from quantgate.catalog.errors import QuantgateError, one_line
from quantgate.catalog.gpu_suite import GpuSuiteSpec, SuiteStep, load_gpu_suite
from quantgate.catalog.load import load_catalog
from quantgate.catalog.paths import CATALOG_DIR, DEFAULT_CATALOG
from quantgate.catalog.records import ModelArtifact, ServingLoad, SpeedResult, VariantArtifact
from quantgate.catalog.scenarios import ScenarioSpec
from quantgate.catalog.settings import host_name
from quantgate.flows.live import work_dir
from quantgate.tasks.adapters import engines
from quantgate.tasks.adapters.speed.options import resolve_device
from quantgate.tasks.runtime import environment, launch, placement
from quantgate.tasks.runtime.launch import in_lanes
from quantgate.tasks.steps.benchmark import engine_sessions
from quantgate.tasks.steps.measure import measure
from quantgate.tasks.adapters.dummy_weights import SHAPES, layout, write_dummy_checkpoint
from quantgate.warehouse import ledger, reads, sessions, writers

DEFAULT_SUITE = CATALOG_DIR / "gpu.yaml"
FLOW_NAME = "gpu-suite"
# The libraries whose versions a suite run records (those installed).
RUN_LIBS = ("quantgate", "torch", "transformers", "vllm", "compressed-tensors", "prefect", "duckdb")


class GpuSuiteError(QuantgateError, RuntimeError):
    """A suite that cannot run as asked; the message is one line."""


@dataclass
class Clock:
    """Seconds since the run began, against the deadline for starting steps and the hard end."""

    deadline_s: float
    grace_s: float
    now: Callable[[], float] = time.monotonic
    start: float = field(default=math.nan)

    def __post_init__(self) -> None:
        if math.isnan(self.start):
            self.start = self.now()

    def elapsed(self) -> float:
        return self.now() - self.start

    def expired(self) -> bool:
        return self.elapsed() >= self.deadline_s

    def step_timeout(self, step_timeout_s: float) -> float:
        return max(1.0, min(step_timeout_s, self.deadline_s + self.grace_s - self.elapsed()))


@dataclass(frozen=True)
class StepOutcome:
    status: str  # ok | failed | skipped
    reason: str | None


def run_steps(
    steps: Sequence[tuple[int, SuiteStep]],
    clock: Clock,
    execute: Callable[[int, SuiteStep, float, str | None], StepOutcome],
    skip: Callable[[int, SuiteStep, str], None],
    record: Callable[[int, SuiteStep, StepOutcome, float | None, float | None], None],
    lanes: Sequence[str | None] = (None,),
    wide: Callable[[SuiteStep], bool] = lambda step: False,
    interrupt: Callable[[], None] = launch.interrupt_children,
) -> list[StepOutcome]:
    """Run steps in order: each gets execute(index, step, timeout_s, lane) unless the deadline has passed,
    when it gets skip(index, step, reason) instead. An exception from a step is its failure.

    With several lanes (GPUs), each lane takes the next step nobody has started, so steps run side by side,
    one per lane (tasks/runtime/launch.in_lanes); steps that need every lane (`wide`, e.g. tensor parallel) run after
    the others, alone, with lane None. An interrupt (SIGINT) lets no lane start another step and calls
    `interrupt` to end the running ones, so that they are recorded before it goes on."""
    outcomes: dict[int, StepOutcome] = {}

    def one(pos: int, index: int, step: SuiteStep, lane: str | None) -> None:
        if clock.expired():
            reason = f"deadline: not started, {clock.elapsed():.0f} s in and deadline_s is {clock.deadline_s:g}"
            skip(index, step, reason)
            outcome, started, seconds = StepOutcome("skipped", reason), None, None
        else:
            started = clock.elapsed()
            try:
                outcome = execute(index, step, clock.step_timeout(step.timeout_s), lane)
            except Exception as e:  # a step's own failure; the suite goes on
                outcome = StepOutcome("failed", one_line(e))
            seconds = clock.elapsed() - started
        record(index, step, outcome, started, seconds)
        outcomes[pos] = outcome

    todo = [(pos, index, step) for pos, (index, step) in enumerate(steps)]
    if len(lanes) == 1:
        for pos, index, step in todo:
            one(pos, index, step, lanes[0])
        return [outcomes[pos] for pos in range(len(todo))]

    in_lanes([item for item in todo if not wide(item[2])], lanes, lambda item, lane: one(*item, lane), interrupt)
    for pos, index, step in todo:
        if wide(step):
            one(pos, index, step, None)
    return [outcomes[pos] for pos in range(len(todo))]


# --- builds ------------------------------------------------------------------------------------


@dataclass
class Build:
    name: str
    path: Path
    quant: str | None
    group_size: int
    variant: VariantArtifact
    stamp: dict[str, Any]


MARKER = "quantgate-dummy.json"


def shape_config(spec: GpuSuiteSpec, shape: str) -> dict[str, Any]:
    if shape not in spec.shapes:
        raise GpuSuiteError(f"unknown shape {shape!r}; the suite defines {sorted(spec.shapes)}")
    s = spec.shapes[shape]
    if s.preset not in SHAPES:
        raise GpuSuiteError(f"shape {shape!r}: unknown preset {s.preset!r}; known: {sorted(SHAPES)}")
    return {**SHAPES[s.preset], **s.overrides}


def prepare(
    spec: GpuSuiteSpec, shape: str, config: dict[str, Any], root: Path, names: set[str]
) -> tuple[ModelArtifact, dict[str, Build]]:
    """The folder of each named build with its config and tokenizer (weights come later, only if a
    step runs), and the model and variant records, identified by the shape's config. A folder made
    earlier from the same config is kept as it is, weights included."""
    sha = hashlib.sha256(json.dumps({"config": config, "weights": "dummy"}, sort_keys=True).encode()).hexdigest()
    bf16 = layout(config)
    model = ModelArtifact(
        model_id=shape,
        path=str(root),
        source="local",
        revision=None,
        sha=sha,
        architecture=(config.get("architectures") or [None])[0],
        num_parameters=sum(math.prod(dims) for dims, _ in bf16.values()),
        size_bytes=sum(nbytes for _, nbytes in bf16.values()),
        random_weights=True,  # every build is dummy weights of the shape: speed only, as a shape run's
    )
    builds = {}
    for name, b in spec.builds.items():
        if name not in names:
            continue
        path = root / name
        stamp = {"config_sha": sha, "quant": b.quant, "group_size": b.group_size}
        if _marker(path) not in (stamp, {**stamp, "weights": True}):
            write_dummy_checkpoint(path, config, quant=b.quant, group_size=b.group_size, write_weights=False)
            (path / MARKER).write_text(json.dumps(stamp, sort_keys=True))
        variant = VariantArtifact(
            uid=f"{model.uid}:dummy-{name}",
            model_uid=model.uid,
            name=name,
            method="base" if name == spec.base_build else "dummy",
            scheme=b.quant.upper() if b.quant else None,
            bits=4 if b.quant == "w4a16" else None,
            group_size=b.group_size if b.quant else None,
            path=str(path),
            recipe=None,
            recipe_hash=None,
            size_bytes=sum(nbytes for _, nbytes in layout(config, b.quant, b.group_size).values()),
            weights="dummy",
        )
        builds[name] = Build(name, path, b.quant, b.group_size, variant, stamp)
    return model, builds


def ensure_weights(build: Build, config: dict[str, Any]) -> None:
    """Write a quantized build's random weights once (vLLM's dummy loader cannot fill packed int32
    weights); a BF16 build stays without weight files and is initialised by the engine."""
    done = {**build.stamp, "weights": True}
    if build.quant is None or _marker(build.path) == done:
        return
    # Steps on two GPUs may need the same build at once: the first writes it, the other waits for it.
    with open(build.path.with_name(build.path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _marker(build.path) == done:
            return
        # In a process of its own: random values are drawn fastest on the GPU, and this flow's process must
        # not keep a CUDA context (and the allocator's cache) through every later step.
        launch.on_gpus(None, None, partial(write_dummy_checkpoint, quant=build.quant, group_size=build.group_size,
                                           write_weights=True), build.path, config)
        (build.path / MARKER).write_text(json.dumps(done, sort_keys=True))


def _marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


# --- the flow ----------------------------------------------------------------------------------


def suite_prices(spec: GpuSuiteSpec, spec_hash: str) -> tuple[dict[str, float], str]:
    """The suite file's gpu_prices, else the packaged catalog's; with the hash of the file they came from."""
    if spec.gpu_prices is not None:
        return dict(spec.gpu_prices), spec_hash
    cat = load_catalog(DEFAULT_CATALOG)
    return dict(cat.gpu_prices), cat.hash


def check_steps(spec: GpuSuiteSpec) -> None:
    """Every engine step's scenarios must form one engine session (tasks/steps/benchmark.engine_sessions), since
    they share one start."""
    for i, step in enumerate(spec.steps):
        if not step.engine_session:
            continue
        sessions = engine_sessions("", [(name, spec.scenarios[name]) for name in step.scenarios])
        if len(sessions) > 1:
            raise GpuSuiteError(
                f"steps.{i}: scenarios {sessions[0][0][0]!r} and {sessions[1][0][0]!r} need different engine options;"
                " put them in separate steps"
            )


@task(name="gpu-step", cache_policy=NO_CACHE, task_run_name="{label}")
def _execute(label: str, step: SuiteStep, build: Build, scenarios: list[tuple[str, ScenarioSpec]],
             config: dict[str, Any], work: Path, timeout_s: float, wh: str, run_id: str,
             gpus: str | None = None) -> StepOutcome:
    """One step, here or (with `gpus`) in a process that sees only those GPUs."""
    args = (step, build, scenarios, config, work, timeout_s, wh, run_id)
    return run_step(*args) if gpus is None else launch.on_gpus(gpus, timeout_s, run_step, *args)


def run_step(step: SuiteStep, build: Build, scenarios: list[tuple[str, ScenarioSpec]], config: dict[str, Any],
             work: Path, timeout_s: float, wh: str, run_id: str) -> StepOutcome:
    """Its build's weights if still missing, then the engine, bench or server (tasks/steps/measure.py); each row
    stored as soon as it is in (a sweep's points one by one)."""
    deadline = time.monotonic() + timeout_s
    ensure_weights(build, config)
    remaining = max(1.0, deadline - time.monotonic())
    work.mkdir(parents=True, exist_ok=True)
    measured = measure(str(build.path), step.engine, scenarios, work_dir=work, timeout_s=remaining,
                       on_point=partial(_store_measured, wh, run_id, build.variant.uid))
    return _summarise([result for result, _ in measured])


def _store_measured(wh: str, run_id: str, uid: str, result: SpeedResult, loads: list[ServingLoad]) -> None:
    with sessions.session(wh) as con:
        writers.record_measured(con, run_id, uid, [(result, loads)])


def _summarise(results: list[SpeedResult]) -> StepOutcome:
    failed = [r for r in results if r.status == "failed"]
    if failed:
        return StepOutcome("failed", f"{failed[0].scenario}: {failed[0].reason}")
    if all(r.status == "skipped" for r in results):
        return StepOutcome("skipped", results[0].reason)
    return StepOutcome("ok", None)


def _unavailable(step: SuiteStep, scenarios: list[tuple[str, ScenarioSpec]]) -> str | None:
    device = "cuda" if step.on_gpu else resolve_device(scenarios[0][1].device)
    return engines.availability(step.engine_started, device)


def select_steps(spec: GpuSuiteSpec, parts: list[str] | None) -> list[tuple[int, SuiteStep]]:
    """The steps of `parts` (default all) with their index in the file; named parts run in the order given."""
    known_parts = sorted({s.part for s in spec.steps})
    if parts and (unknown := sorted(set(parts) - set(known_parts))):
        raise GpuSuiteError(f"unknown part(s) {unknown}; the suite has {known_parts}")
    steps = [(i, s) for i, s in enumerate(spec.steps) if not parts or s.part in parts]
    return sorted(steps, key=lambda item: parts.index(item[1].part)) if parts else steps


@flow(name=FLOW_NAME, log_prints=True)
def gpu_suite(
    warehouse: str | None = None,
    workdir: str | None = None,
    shape: str = "qwen2.5-7b-instruct",
    suite: str | None = None,
    parts: list[str] | None = None,
    deadline_s: float = 330.0,
    grace_s: float = 60.0,
    gpus: list[str] | None = None,
) -> list[dict]:
    """Run the GPU suite's steps (those of `parts`, default all) for one shape into the warehouse. With
    several `gpus` (ids as nvidia-smi numbers them), steps run side by side, one per GPU, and tensor-parallel
    ones after them. A run of the deployment holds as many of its host's GPUs (tasks/runtime/placement.py)."""
    if deployment.id is None:
        return _suite(warehouse, workdir, shape, suite, parts, deadline_s, grace_s, gpus)
    with placement.placed(f"gpu-suite-{shape}", len(gpus) if gpus else 1) as where:
        held = list(where.gpus) if len(where.gpus) > 1 else None
        return _suite(warehouse, workdir, shape, suite, parts, deadline_s, grace_s, held)


def _suite(warehouse: str | None, workdir: str | None, shape: str, suite: str | None, parts: list[str] | None,
           deadline_s: float, grace_s: float, gpus: list[str] | None) -> list[dict]:
    log = get_run_logger()
    suite_path = Path(suite) if suite else DEFAULT_SUITE
    spec = load_gpu_suite(suite_path)
    check_steps(spec)
    config = shape_config(spec, shape)
    steps = select_steps(spec, parts)
    lanes: list[str | None] = list(gpus) if gpus else [None]
    clock = Clock(deadline_s, grace_s)
    run_id = str(flow_run.id)
    wh = warehouse or str(sessions.default_path())
    root = work_dir(workdir) / "gpu" / shape
    _start_run(wh, run_id, shape, suite_path, spec)
    with ledger.run_outcome(wh, run_id):
        model, builds = prepare(spec, shape, config, root, {spec.base_build, *(s.build for _, s in steps)})
        _record_builds(wh, run_id, spec, model, builds)

        scenarios_of = partial(_dummy_scenarios, spec)

        def rows_for(step: SuiteStep, status: str, reason: str) -> list[SpeedResult]:
            return [SpeedResult(step.rows_engine, n, status, reason, s.model_dump(mode="json"))  # type: ignore[arg-type]
                    for n, s in scenarios_of(step)]

        def skip(index: int, step: SuiteStep, reason: str) -> None:
            with sessions.session(wh) as con:
                writers.record_speed(con, run_id, builds[step.build].variant.uid, rows_for(step, "skipped", reason))

        def execute(index: int, step: SuiteStep, timeout_s: float, lane: str | None) -> StepOutcome:
            scenarios = scenarios_of(step)
            if (why := _unavailable(step, scenarios)) is not None:
                skip(index, step, why)
                return StepOutcome("skipped", why)
            # A wide step (lane None) in a run over several GPUs gets all of them.
            on = lane if lane is not None else (",".join(gpus) if gpus else None)
            try:
                return _execute(_step_label(index, step) + (f" on GPU {on}" if on else ""), step, builds[step.build],
                                scenarios, config, root / "logs" / f"step{index:02d}", timeout_s, wh, run_id, on)
            except Exception as e:
                reason = one_line(e)
                with sessions.session(wh) as con:
                    writers.record_speed(con, run_id, builds[step.build].variant.uid, rows_for(step, "failed", reason))
                return StepOutcome("failed", reason)

        def record(index: int, step: SuiteStep, outcome: StepOutcome, started: float | None, seconds: float | None) -> None:
            log.info("%s: %s%s%s", _step_label(index, step), outcome.status,
                     f" in {seconds:.0f} s" if seconds is not None else "", f" ({outcome.reason})" if outcome.reason else "")
            with sessions.session(wh) as con:
                writers.record_suite_step(con, run_id, index, step.part, step.engine, step.build, step.scenarios,
                                        outcome.status, outcome.reason, started, seconds)

        def wide(step: SuiteStep) -> bool:
            return any(s.tensor_parallel_size > 1 for _, s in scenarios_of(step))

        run_steps(steps, clock, execute, skip, record, lanes, wide)
    with sessions.session(wh) as con:
        return reads.suite_steps(con, run_id)


def _start_run(wh: str, run_id: str, shape: str, suite_path: Path, spec: GpuSuiteSpec) -> None:
    """The run's row (the suite file and its spec's hash, this process's library versions and program) and the
    GPU prices its costs are figured with."""
    spec_hash = hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    with sessions.session(wh) as con:
        ledger.start_run(con, run_id, FLOW_NAME, shape, str(suite_path.resolve()), spec_hash, host_name(),
                         {**environment.library_versions(RUN_LIBS), **environment.program()})
        prices, prices_from = suite_prices(spec, spec_hash)
        writers.record_prices(con, run_id, prices, prices_from)


def _record_builds(wh: str, run_id: str, spec: GpuSuiteSpec, model: ModelArtifact, builds: dict[str, Build]) -> None:
    """The dummy model and its builds, the suite's base build as the base."""
    with sessions.session(wh) as con:
        writers.record_model(con, run_id, model)
        for name, b in builds.items():
            writers.record_variant(con, run_id, b.variant, role="base" if name == spec.base_build else "variant")


def _step_label(index: int, step: SuiteStep) -> str:
    return f"{index:02d} {step.engine} {step.build} {'+'.join(step.scenarios)}"


def _dummy_scenarios(spec: GpuSuiteSpec, step: SuiteStep) -> list[tuple[str, ScenarioSpec]]:
    """The step's scenarios with dummy weights: a dummy build can only run with random or written-random weights."""
    return [(n, spec.scenarios[n].model_copy(update={"weights": "dummy"})) for n in step.scenarios]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quantgate.flows.gpu_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--warehouse", help="the warehouse (default $QUANTGATE_WAREHOUSE or quantgate.ducklake)")
    parser.add_argument("--workdir", help="where the dummy checkpoints and logs go (default .quantgate)")
    parser.add_argument("--shape", default="qwen2.5-7b-instruct")
    parser.add_argument("--suite", help="GPU suite YAML (default catalog/gpu.yaml)")
    parser.add_argument("--parts", help="comma-separated parts to run (default all)")
    parser.add_argument("--deadline-s", type=float, default=330.0, help="no step starts after this many seconds")
    parser.add_argument("--grace-s", type=float, default=60.0, help="a started step may run this far past the deadline")
    parser.add_argument("--gpus", help="comma-separated GPU ids as nvidia-smi numbers them, to run steps side by side on, one step per GPU (e.g. 0,1)")
    args = parser.parse_args(argv)
    steps = gpu_suite(
        warehouse=args.warehouse,
        workdir=args.workdir,
        shape=args.shape,
        suite=args.suite,
        parts=args.parts.split(",") if args.parts else None,
        deadline_s=args.deadline_s,
        grace_s=args.grace_s,
        gpus=args.gpus.split(",") if args.gpus else None,
    )
    for s in steps:
        took = "" if s["seconds"] is None else f"{s['seconds']:6.1f} s"
        print(f"{s['step_index']:>2} {s['status']:<8} {took:>8}  {s['engine']:<12} {s['build']:<12} "
              f"{','.join(s['scenarios']):<28} {s['reason'] or ''}")


if __name__ == "__main__":
    main()
