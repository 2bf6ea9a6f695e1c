"""The size curve (issue 42, item 3): what a verdict costs as the model grows, stage by stage: measured where a run
measured it, predicted (and labelled so) for larger models on one and on two H200s.

    python benchmarks/size_curve.py                  # the committed H200 runs: reference12 (1.5B), shape7b-1 (7B)
    python benchmarks/size_curve.py DIR [DIR ...]    # other results folders (tables-only exports)
    python benchmarks/size_curve.py --write          # ... and replace its section of docs/gpu.md

Measured: each folder's tables, loaded as benchmarks/summarize.py loads them (today's views over them): the seconds of
each stage (stage_times, run_timeline, measurement_windows) and the peaks the tables store: NVML's per speed engine
(speed_results.nvml_peak_bytes), torch's allocator per build (variants.peak_memory_bytes). Evaluations and KL store no
peak.

Predicted, for the reference configuration (the template's variants, calibration, suite and scenarios, as a shape run
with `--template` is judged): the GPU memory of every stage from tasks/adapters/model_memory.py, as the run sizes it
before it starts (the stage that cannot fit in the run's own CapacityError line), the speed engines as
tasks/steps/benchmark.py sizes them; the seconds of each stage from a straight line in parameter count through the
measured points, each line printed with the table. Nothing else goes in.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # summarize and its gpu.summary, also when imported as benchmarks.*

from summarize import load  # noqa: E402

from quantgate.catalog.load import Catalog, load_catalog  # noqa: E402
from quantgate.catalog.models import ModelSpec  # noqa: E402
from quantgate.catalog.paths import DEFAULT_CATALOG  # noqa: E402
from quantgate.catalog.scenarios import ScenarioSpec  # noqa: E402
from quantgate.catalog.shapes import (  # noqa: E402
    LLAMA31_70B_INSTRUCT, QWEN25_14B_INSTRUCT, QWEN25_32B_INSTRUCT, SHAPES,
)
from quantgate.catalog.variants import CalibrationSize, VariantSpec  # noqa: E402
from quantgate.tasks.adapters import engines, model_memory  # noqa: E402
from quantgate.tasks.adapters.model_memory import CapacityError, RunPlan, StageNeed, gib  # noqa: E402
from quantgate.tasks.adapters.roofline import Tensors, checkpoint_tensors  # noqa: E402
from quantgate.tasks.adapters.speed.checkpoint import text_config  # noqa: E402
from quantgate.tasks.adapters.speed.options import engine_options, sized_kv_cache  # noqa: E402
from quantgate.tasks.runtime import launch  # noqa: E402
from quantgate.tasks.steps.benchmark import engine_sessions  # noqa: E402
from quantgate.tasks.steps.divergence import WINDOW_TOKENS  # noqa: E402
from quantgate.tasks.steps.evaluate import task_words  # noqa: E402
from quantgate.warehouse import reads  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "h200"
# The measured points: the reference model's run, with variants (real weights), and the 7B shape's (random weights).
DEFAULT_FOLDERS = (RESULTS / "reference12", RESULTS / "shape7b-1")
PAGE = REPO / "docs" / "gpu.md"
BEGIN, END = "<!-- size-curve:begin -->", "<!-- size-curve:end -->"
# The configuration each point was judged with (shape7b-1 ran with --template qwen2.5-coder-1.5b-instruct).
TEMPLATE = "qwen2.5-coder-1.5b-instruct"
# An H200 as NVML reports it: "NVIDIA H200, 143771 MiB" (nvidia-smi, benchmarks/results/h200/suite7-crosscheck/log.txt).
H200_BYTES = 143_771 << 20
PREDICTED: tuple[tuple[str, dict[str, Any]], ...] = (
    ("qwen2.5-14b-instruct", QWEN25_14B_INSTRUCT),
    ("qwen2.5-32b-instruct", QWEN25_32B_INSTRUCT),
    ("llama-3.1-70b-instruct", LLAMA31_70B_INSTRUCT),
)
GPU_COUNTS = (1, 2)
# Parts of a stage's need that tensor parallelism (vLLM) or a layer split (Transformers) divides over the GPUs; the
# others (CUDA context, engine workspaces, a calibration's working set, a window's logits) each GPU holds whole.
SPLIT_PARTS = frozenset({"weights", "KV cache", "base", "variant"})
# The decision reads the warehouse and loads no model: its time does not grow with it.
FLAT = frozenset({"decide"})
# Stages a point measures only where its variants were built and judged: they grow as the base's stage beside them
# does, by their ratio to it at the points that measured both.
ALONGSIDE = {"evaluate variants": "evaluate base", "windows, variants": "windows, base"}
# The benchmark stage's span is its measurement windows and its waits for the GPU: the windows are predicted, the waits
# are not; the wall is the sum along the critical path (wall_floor).
UNFITTED = frozenset({"benchmark", "wall"})
BILLION = 1e9


# --- the reference configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    """The catalog model whose variants, calibration, suite and scenarios every point is judged with."""

    cat: Catalog
    spec: ModelSpec

    @property
    def variants(self) -> list[tuple[VariantSpec, CalibrationSize | None]]:
        # As flows/memory_plan.gpu_share pairs them.
        return [(self.cat.variants[n], self.cat.calibration_for(self.spec, self.cat.variants[n]))
                for n in self.spec.variants]

    @property
    def scenarios(self) -> list[tuple[str, ScenarioSpec]]:
        return [(n, self.cat.scenarios[n]) for n in self.spec.scenarios]


def template(catalog: Path = DEFAULT_CATALOG, model_id: str = TEMPLATE) -> Template:
    cat = load_catalog(catalog)
    return Template(cat, cat.model(model_id))


def time_columns(variants: Sequence[str]) -> list[str]:
    return ["download", *(f"quantize {v}" for v in variants), "evaluate base", "evaluate variants", "kl",
            "benchmark", "windows, base", "windows, variants", "probe", "decide", "wall"]


def memory_columns(variants: Sequence[str]) -> list[str]:
    return [*(f"quantize {v}" for v in variants), "evaluate base", "evaluate variants", "kl", "vllm engine",
            "transformers engine", "vllm pair"]


# --- measured ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One measured run: per column its seconds and the peak its tables store (None: no such work in the run, or no
    peak stored for it)."""

    label: str
    model_id: str
    parameters: int
    random_weights: bool
    device: str | None
    seconds: dict[str, float | None]
    peaks: dict[str, int | None]


def measured(folder: Path, variants: Sequence[str]) -> list[Point]:
    """The evaluate-model runs of a results folder, in start order."""
    con = load(folder)
    try:
        runs = con.execute("SELECT run_id FROM runs WHERE flow_name = 'evaluate-model' ORDER BY started_at").fetchall()
        return [_point(con, folder.name, run_id, variants) for (run_id,) in runs]
    finally:
        con.close()


def _point(con: duckdb.DuckDBPyConnection, label: str, run_id: str, variants: Sequence[str]) -> Point:
    (base,) = con.execute("SELECT variant_uid FROM run_variants WHERE run_id = ? AND role = 'base'",
                          [run_id]).fetchone()
    model = reads.model_of(con, base.removesuffix(":base"))  # tasks/steps/quantize.base_variant's uid
    assert model is not None, f"{label}: no model row for {base}"
    items = reads.rows(con, "SELECT stage, item, checkpoint, seconds FROM stage_times WHERE run_id = ?", [run_id])
    # A stage's seconds from its first start to its last end: its items may overlap (stage_times says why).
    spans = dict(con.execute("SELECT stage, epoch(max(ended_at) - min(started_at)) FROM stage_times"
                             " WHERE run_id = ? GROUP BY stage", [run_id]).fetchall())
    windows = con.execute("SELECT variant_uid = ?, seconds FROM measurement_windows WHERE run_id = ?",
                          [base, run_id]).fetchall()
    (wall,) = con.execute("SELECT wall_seconds FROM run_timeline WHERE run_id = ?", [run_id]).fetchone()
    evaluations = {r["item"]: r["seconds"] for r in items if r["stage"] == "evaluate"}
    builds = {r["checkpoint"]: r["seconds"] for r in items if r["stage"] == "quantize"}
    seconds = {
        "download": spans.get("download"),
        **{f"quantize {v}": builds.get(v) for v in variants},
        "evaluate base": evaluations.pop(base, None),
        "evaluate variants": max(evaluations.values(), default=None),
        "kl": spans.get("kl"),
        "benchmark": spans.get("benchmark"),
        "windows, base": sum(s for is_base, s in windows if is_base) or None,
        "windows, variants": sum(s for is_base, s in windows if not is_base) or None,
        "probe": spans.get("probe"),
        "decide": spans.get("decide"),
        "wall": wall,
    }
    return Point(label, model.model_id, int(model.num_parameters), bool(model.random_weights),
                 _device(con, run_id), seconds, _peaks(con, run_id, base, variants))


def _peaks(con: duckdb.DuckDBPyConnection, run_id: str, base: str, variants: Sequence[str]) -> dict[str, int | None]:
    """NVML's peak of the base's engines (its largest session), torch's allocator's of each build."""
    engine = dict(con.execute("SELECT engine, max(nvml_peak_bytes) FROM speed_results WHERE run_id = ?"
                              " AND variant_uid = ? AND status = 'ok' GROUP BY engine", [run_id, base]).fetchall())
    built = dict(con.execute("SELECT v.name, v.peak_memory_bytes FROM run_variants rv JOIN variants v"
                             " USING (variant_uid) WHERE rv.run_id = ? AND rv.role = 'variant'", [run_id]).fetchall())
    found = {**{f"quantize {v}": built.get(v) for v in variants},
             "vllm engine": engine.get("vllm"), "transformers engine": engine.get("transformers")}
    return {k: None if v is None or v != v else int(v) for k, v in found.items()}  # v != v: NaN


def _device(con: duckdb.DuckDBPyConnection, run_id: str) -> str | None:
    row = con.execute("SELECT any_value(device) FROM speed_results WHERE run_id = ? AND device IS NOT NULL",
                      [run_id]).fetchone()
    return row[0] if row else None


# --- predicted: GPU memory --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizing:
    """What each stage of a model's run asks of each of `gpus` H200s: model_memory's figures, on two GPUs split as
    tensor parallel 2 would split them. `stops`: the run's CapacityError line (it stops before any stage);
    `problems`: speed engines that cannot start and paired passes that fall back, each the runtime's line."""

    model_id: str
    parameters: int
    gpus: int
    needs: dict[str, StageNeed]
    slots: int
    stops: str | None
    problems: tuple[str, ...]


def per_gpu(need: StageNeed, gpus: int) -> StageNeed:
    return StageNeed(need.stage, {k: math.ceil(v / gpus) if k in SPLIT_PARTS else v for k, v in need.parts.items()})


def _split(plan: RunPlan, gpus: int) -> RunPlan:
    jobs = tuple(tuple(per_gpu(s, gpus) for s in job) for job in plan.jobs)
    return RunPlan(jobs, tuple(per_gpu(s, gpus) for s in plan.alone), max(job[-1].bytes for job in jobs))


def sizing(model_id: str, config: dict[str, Any], gpus: int, tpl: Template) -> Sizing:
    """A model's run sized as flows/memory_plan.gpu_share sizes it, on `gpus` H200s."""
    suite = tpl.cat.suites[tpl.spec.suite]
    # flows/quality_stages.eval_setup on a GPU with vLLM: Transformers only for load-time (bitsandbytes) variants.
    backend = "hf" if any(v.load_time for v, _ in tpl.variants) else "vllm"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))  # a shape: its config, no weights
        # Tensor parallel 2 holds weights and KV cache as one GPU of twice the memory would, halved on each (_split).
        plan = model_memory.plan_run(folder, tpl.variants, backend=backend, words=task_words(suite),
                                     hf_batch=suite.batch_size, kl_window=WINDOW_TOKENS, gpu_bytes=gpus * H200_BYTES)
        tensors = checkpoint_tensors(folder)
        speed = speed_engines(folder, tensors, tpl, gpus)
    if plan is None:
        raise SystemExit(f"{model_id}: its config cannot be sized")
    plan = _split(plan, gpus)
    try:
        plan.check(H200_BYTES, model_id)
        stops = None
    except CapacityError as e:
        stops = str(e)
    return Sizing(model_id, sum(math.prod(shape) for shape, _ in tensors.values()), gpus,
                  {**_stage_needs(plan, tpl), **speed},
                  launch.shared_slots([None], True, plan.jobs_per_gpu(H200_BYTES)), stops, _problems(speed))


def _stage_needs(plan: RunPlan, tpl: Template) -> dict[str, StageNeed]:
    """The plan's stages by column: the base's evaluation, each build, the largest variant's evaluation, KL."""
    stages = {s.stage: s for job in plan.jobs for s in job} | {s.stage: s for s in plan.alone}
    names = [v.name for v, _ in tpl.variants]
    return {**{f"quantize {n}": stages[f"quantize {n}"] for n in names},
            "evaluate base": stages["evaluate base"],
            "evaluate variants": max((stages[f"evaluate {n}"] for n in names), key=lambda s: s.bytes),
            "kl": stages["kl"]}


def _runs_on(scenario: ScenarioSpec, engine: str, base: bool) -> bool:
    """Whether a speed pass of `engine` on this scenario runs for the base, or for a variant."""
    if scenario.kind == "serving" or engine not in scenario.engines:  # serving: vllm serve, sized by vLLM
        return False
    return base or not (scenario.base_only or engine in scenario.base_only_engines)


def _kv_bytes(folder: Path, scenarios: Sequence[tuple[str, ScenarioSpec]], engine: str) -> int | None:
    """The largest KV cache of an engine's starts for these scenarios, as tasks/steps/benchmark.run_scenarios sizes
    it (one start per group of engine_sessions); 0 for an engine that sizes none, None when it does not start."""
    sizes = []
    for group in engine_sessions(str(folder), scenarios):
        opts = engine_options(group[0][1], "cuda")
        if engines.kind(engine).reserves_gpu_share:
            opts = sized_kv_cache(opts, folder, [s for _, s in group])
        sizes.append(opts.kv_cache_memory_bytes or 0)
    return max(sizes, default=None)


def speed_engines(folder: Path, tensors: Tensors, tpl: Template, gpus: int) -> dict[str, StageNeed]:
    """Each GPU's share of the base's engines, and of the largest variant's vLLM engine with its base's beside it for
    paired passes: weights, KV cache and overhead, the sum tasks/adapters/speed/options.start_memory_bytes admits a
    start by."""
    overhead = model_memory.engine_overhead_bytes(text_config(folder) or {})
    base = model_memory.loaded_weight_bytes(tensors)
    variant = max(model_memory.variant_weight_bytes(tensors, v) for v, _ in tpl.variants)

    def engine(stage: str, weights: int, kv: int) -> StageNeed:
        return per_gpu(StageNeed(stage, {"weights": weights, "KV cache": kv, "engine": overhead}), gpus)

    out = {}
    for name in ("vllm", "transformers"):
        kv = _kv_bytes(folder, [(n, s) for n, s in tpl.scenarios if _runs_on(s, name, True)], name)
        if kv is not None:
            out[f"{name} engine"] = engine(f"benchmark base ({name})", base, kv)
    kv = _kv_bytes(folder, [(n, s) for n, s in tpl.scenarios if _runs_on(s, "vllm", False)], "vllm")
    if kv is not None:  # the base's engine loads with the variant's session's options (benchmark._pairing)
        out["vllm pair"] = StageNeed("paired passes (vllm)", {
            "variant's engine": engine("benchmark variant (vllm)", variant, kv).bytes,
            "base's engine": engine("benchmark base beside it (vllm)", base, kv).bytes})
    return out


def _problems(speed: dict[str, StageNeed]) -> tuple[str, ...]:
    """Speed engines too large for the GPU (they fail before they start) and paired passes whose two engines do not
    fit together (each then timed in its own process), in the runtime's words."""
    lines = [why for k in ("vllm engine", "transformers engine") if k in speed and (why := speed[k].over(H200_BYTES))]
    if pair := speed.get("vllm pair"):
        if why := model_memory.pair_problem(pair.parts["variant's engine"], pair.parts["base's engine"], H200_BYTES):
            lines.append(f"paired passes: {why}")
    return tuple(lines)


# --- predicted: seconds -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """seconds = intercept + slope x parameters: least squares over the points that measured the stage, through the
    origin from a single point; FLAT stages the longest measured at any size."""

    column: str
    intercept: float
    slope: float
    rule: str

    def at(self, parameters: int) -> float:
        return self.intercept + self.slope * parameters

    def line(self) -> str:
        return (f"`{self.column}`: {self.intercept:.1f} s + {self.slope * BILLION:.2f} s per billion parameters"
                f" ({self.rule})")


def fit(points: Sequence[Point], column: str) -> Fit | None:
    """The column's line over the points (ALONGSIDE columns: their base stage's, scaled); None: none measured it."""
    if column in ALONGSIDE:
        return _alongside(points, column, ALONGSIDE[column])
    have = [(p.parameters, p.seconds[column], p.label) for p in points if p.seconds.get(column) is not None]
    if not have:
        return None
    labels = ", ".join(label for _, _, label in have)
    if column in FLAT:
        return Fit(column, max(t for _, t, _ in have), 0.0, f"the longest of {labels}, at any size")
    if len(have) == 1:
        n, t, label = have[0]
        return Fit(column, 0.0, t / n, f"in proportion to parameters from {label} alone")
    slope, intercept = np.polyfit([n for n, _, _ in have], [t for _, t, _ in have], 1)
    return Fit(column, float(intercept), float(slope), f"least squares through {labels}")


def _alongside(points: Sequence[Point], column: str, beside: str) -> Fit | None:
    base = fit(points, beside)
    both = [p for p in points if p.seconds.get(column) is not None and p.seconds.get(beside)]
    if base is None or not both:
        return None
    ratio = float(np.mean([p.seconds[column] / p.seconds[beside] for p in both]))
    labels = ", ".join(p.label for p in both)
    return Fit(column, base.intercept * ratio, base.slope * ratio,
               f"`{beside}`'s line x {ratio:.3f}, their ratio in {labels}")


def makespan(jobs: Sequence[float], slots: int) -> float:
    """When the last of `jobs` ends, started in order, each on the first of `slots` to come free (the run's pool)."""
    free = [0.0] * max(1, slots)
    for job in jobs:
        free[free.index(min(free))] += job
    return max(free)


def wall_floor(seconds: dict[str, float | None], variants: Sequence[str], slots: int) -> float:
    """Start to decisions along the critical path: download; the base's evaluation and each variant's build and
    evaluation (the longest), `slots` at a time; KL; every measurement window; the probe; the decision. Waits
    between them are not counted."""
    s = {k: v or 0.0 for k, v in seconds.items()}  # a stage the run did not have takes no time
    jobs = [s["evaluate base"], *(s[f"quantize {v}"] + s["evaluate variants"] for v in variants)]
    windows = s["windows, base"] + s["windows, variants"]
    return s["download"] + makespan(jobs, slots) + s["kl"] + windows + s["probe"] + s["decide"]


@dataclass(frozen=True)
class Prediction:
    sizing: Sizing
    seconds: dict[str, float | None]


def predict(points: Sequence[Point], sizings: Sequence[Sizing], variants: Sequence[str]) -> list[Prediction]:
    fits = {c: f for c in time_columns(variants) if c not in UNFITTED and (f := fit(points, c)) is not None}
    out = []
    for s in sizings:
        if s.stops:  # the run stops before any stage
            out.append(Prediction(s, {}))
            continue
        seconds: dict[str, float | None] = {c: f.at(s.parameters) for c, f in fits.items()}
        seconds["wall"] = wall_floor(seconds, variants, s.slots)
        out.append(Prediction(s, seconds))
    return out


# --- the report -------------------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _secs(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _gpus(n: int) -> str:
    return "1 × H200" if n == 1 else f"{n} × H200, tensor parallel {n}"


def _billions(n: int) -> str:
    return f"{n / BILLION:.2f} B"


def report(points: Sequence[Point], predictions: Sequence[Prediction], variants: Sequence[str],
           checks: Sequence[str] = ()) -> str:
    times, memory = time_columns(variants), memory_columns(variants)
    head = ["", "model", "parameters", "weights", "GPUs"]
    lines = ["### Seconds per stage", ""]
    rows = [[f"measured ({p.label})", p.model_id, _billions(p.parameters), "random" if p.random_weights else "real",
             p.device or "—", *(_secs(p.seconds[c], 1) for c in times)] for p in points]
    rows += [["predicted", q.sizing.model_id, _billions(q.sizing.parameters), "—", _gpus(q.sizing.gpus),
              *(_secs(q.seconds.get(c), 0) for c in times[:-1]),
              "does not start" if q.sizing.stops else f"{q.seconds['wall']:,.0f} (floor)"] for q in predictions]
    lines += _table(head + times, rows)
    lines += ["", "`windows`: the speed measurements' own seconds (the base's, the variants'), each with the GPU alone;"
              " `benchmark`: the stage's span, the windows and the waits for the GPU; `wall`: the run's start to its"
              " decisions. —: no such stage in the run (or not predicted).", ""]
    lines += ["### Peak GPU memory per stage, GiB (predicted: per GPU)", ""]
    rows = [[f"measured ({p.label})", p.model_id, _billions(p.parameters), "random" if p.random_weights else "real",
             p.device or "—", *("—" if p.peaks.get(c) is None else gib(p.peaks[c]) for c in memory), "—"]
            for p in points]
    rows += [["predicted", q.sizing.model_id, _billions(q.sizing.parameters), "—", _gpus(q.sizing.gpus),
              *(_need(q.sizing.needs.get(c)) for c in memory), str(q.sizing.slots)] for q in predictions]
    lines += _table(head + memory + ["jobs at once"], rows)
    lines += ["", "Measured: torch's allocator's peak in each build's process (`variants.peak_memory_bytes`), NVML's"
              " peak of the base's engines (`speed_results.nvml_peak_bytes`, its largest session); —: no peak in the"
              " folder's tables (evaluations, KL and paired passes store none). Predicted:"
              " `tasks/adapters/model_memory.py`'s need of each stage against"
              f" {gib(model_memory.usable_bytes(H200_BYTES))} usable GiB a GPU"
              f" ({model_memory.GPU_USABLE_SHARE:.0%} of NVML's {gib(H200_BYTES)}), `over` where it cannot fit;"
              " `vllm pair`: a variant's engine with its base's beside it (paired passes); `jobs at once`: builds"
              " and evaluations sharing the GPU (RunPlan.jobs_per_gpu, at most QUANTGATE_SHARED_JOBS_PER_GPU).", ""]
    if checks:
        lines += ["Sized by `model_memory` beside the peaks measured, where the point's config is a published"
                  " shape:", ""]
        lines += [*checks, ""]
    return "\n".join(lines + _prediction_notes(points, predictions, variants)) + "\n"


def _need(need: StageNeed | None) -> str:
    if need is None:
        return "—"
    return gib(need.bytes) + (" over" if need.over(H200_BYTES) else "")


def _prediction_notes(points: Sequence[Point], predictions: Sequence[Prediction], variants: Sequence[str]) -> list[str]:
    lines = ["### The prediction: a model, not a measurement", "",
             "Seconds, each stage a straight line in parameter count over the measured points:", ""]
    lines += [f"- {f.line()}" for c in time_columns(variants) if c not in UNFITTED and (f := fit(points, c))]
    for p in points:
        if unmeasured := [c for c in ("evaluate variants", "kl", "probe") if p.seconds.get(c) is None]:
            lines.append(f"- {p.label} measured no {', no '.join(unmeasured)}: those lines stand on the other points.")
    lines += ["- `wall` (floor): download, then the base's evaluation and each variant's build and evaluation (the"
              " longest) as many at a time as `jobs at once`, then KL, every window, the probe and the decision;"
              " waits are not counted."]
    for p in points:
        if all(p.seconds.get(c) is not None for c in ("evaluate variants", "kl")):
            floor = wall_floor(p.seconds, variants, 1 + len(variants))
            lines.append(f"  On {p.label}'s own stages, with all its jobs side by side, it gives {floor:.1f} s"
                         f" against its measured {p.seconds['wall']:.1f} s ({floor / p.seconds['wall']:.2f}x).")
    lines += ["- Two GPUs: each stage's weights and KV cache split over both, as tensor parallel 2 would split them,"
              " the rest whole on each; their seconds are the one-GPU lines (what a second GPU saves is not"
              " measured).", "", "Where a stage cannot fit, in the runtime's words:", ""]
    for q in predictions:
        said = [q.sizing.stops] if q.sizing.stops else []
        said += list(q.sizing.problems)
        lines.append(f"- {q.sizing.model_id} on {_gpus(q.sizing.gpus)}: "
                     + ("; ".join(f"`{s}`" for s in said) if said else "every stage fits."))
    return lines


def render(folders: Sequence[Path], tpl: Template) -> str:
    """The size curve as Markdown: the measured points of `folders` and the predictions beside them."""
    variants = [v.name for v, _ in tpl.variants]
    points = [p for folder in folders for p in measured(folder, variants)]
    sizings = [sizing(name, config, gpus, tpl) for name, config in PREDICTED for gpus in GPU_COUNTS]
    checks = [line for p in points if (line := sized_against(p, tpl))]
    return report(points, predict(points, sizings, variants), variants, checks)


def sized_against(point: Point, tpl: Template) -> str | None:
    """model_memory's need beside each peak the point stored, for a point whose model is a published shape (a run of
    `shape:NAME`); None for any other (its config is not in the folder)."""
    config = SHAPES.get(point.model_id.removeprefix("shape/"))
    if config is None:
        return None
    needs = sizing(point.model_id, config, 1, tpl).needs
    said = [f"`{c}` {gib(needs[c].bytes)} GiB against {gib(peak)} ({needs[c].bytes / peak:.2f}x)"
            for c, peak in point.peaks.items() if peak and c in needs]
    return f"- {point.label}: {', '.join(said)}" if said else None


def write_docs(text: str, page: Path = PAGE) -> None:
    """Replace the generated part of the page's section (between BEGIN and END)."""
    doc = page.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    page.write_text(doc[:start] + "\n" + text + doc[end:])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path, help="results folders (default: reference12, shape7b-1)")
    parser.add_argument("--write", action="store_true", help=f"also replace the section in {PAGE.relative_to(REPO)}")
    args = parser.parse_args(argv)
    text = render(args.folders or DEFAULT_FOLDERS, template())
    print(text, end="")
    if args.write:
        write_docs(text)


if __name__ == "__main__":
    main()
