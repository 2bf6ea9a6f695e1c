"""The size curve (benchmarks/size_curve.py, issue 42 item 3) over the committed H200 runs: its measured rows are
the tables' own figures, its predicted memory is model_memory's (so the docs and the runtime agree), a 70B model on one
H200 stops where the runtime would, every predicted row says so, and docs/gpu.md shows what the script prints."""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from benchmarks import size_curve as sc
from quantgate.catalog.shapes import LLAMA31_70B_INSTRUCT, QWEN25_7B_INSTRUCT
from quantgate.tasks.adapters import model_memory as mm
from quantgate.tasks.adapters.speed.options import engine_options, sized_kv_cache, start_memory_bytes
from quantgate.tasks.steps.divergence import WINDOW_TOKENS
from quantgate.tasks.steps.evaluate import task_words

REFERENCE, SHAPE_7B = sc.DEFAULT_FOLDERS


@pytest.fixture(scope="module")
def tpl() -> sc.Template:
    return sc.template()


@pytest.fixture(scope="module")
def variants(tpl) -> list[str]:
    return [v.name for v, _ in tpl.variants]


@pytest.fixture(scope="module")
def points(variants) -> dict[str, sc.Point]:
    found = [p for folder in sc.DEFAULT_FOLDERS for p in sc.measured(folder, variants)]
    assert [p.label for p in found] == ["reference12", "shape7b-1"]
    return {p.label: p for p in found}


@pytest.fixture(scope="module")
def rendered(tpl) -> str:
    return sc.render(sc.DEFAULT_FOLDERS, tpl)


def _item_seconds(folder: Path) -> dict[tuple[str, str], float]:
    stages = pd.read_parquet(folder / "run_stages.parquet")
    return {(r.stage, r.item): (r.completed_at - r.started_at).total_seconds() for r in stages.itertuples()}


@pytest.mark.parametrize("folder", [REFERENCE, SHAPE_7B], ids=lambda f: f.name)
def test_measured_rows_are_the_tables_figures(points, variants, folder):
    point = points[folder.name]
    stages = pd.read_parquet(folder / "run_stages.parquet")
    items = _item_seconds(folder)
    base = pd.read_parquet(folder / "run_variants.parquet").query("role == 'base'").variant_uid.item()
    for v in variants:
        assert point.seconds[f"quantize {v}"] == pytest.approx(items[("quantize", v)], abs=1e-3)
    assert point.seconds["evaluate base"] == pytest.approx(items[("evaluate", base)], abs=1e-3)
    assert point.seconds["download"] == pytest.approx(next(s for (st, _), s in items.items() if st == "download"))
    run = pd.read_parquet(folder / "runs.parquet").iloc[0]
    assert point.seconds["wall"] == pytest.approx((run.finished_at - run.started_at).total_seconds(), abs=1e-3)
    bench = stages.query("stage == 'benchmark'")
    assert point.seconds["benchmark"] == pytest.approx(
        (bench.completed_at.max() - bench.started_at.min()).total_seconds(), abs=1e-3)
    model = pd.read_parquet(folder / "models.parquet").iloc[0]
    assert point.parameters == model.num_parameters
    assert point.random_weights == (folder == SHAPE_7B)
    speed = pd.read_parquet(folder / "speed_results.parquet").query("variant_uid == @base and status == 'ok'")
    for engine in ("vllm", "transformers"):
        assert point.peaks[f"{engine} engine"] == speed.query("engine == @engine").nvml_peak_bytes.max()
    windows = [json.loads(d) for d in speed.details]
    measured_s = sum((pd.Timestamp(w["measured_to"]) - pd.Timestamp(w["measured_from"])).total_seconds()
                     for w in windows if "measured_from" in w)
    assert point.seconds["windows, base"] == pytest.approx(measured_s, abs=1e-3)


def test_the_reference_run_has_every_stage_and_its_build_peaks(points, variants):
    point = points["reference12"]
    builds = pd.read_parquet(REFERENCE / "variants.parquet").set_index("name")
    for v in variants:
        assert point.peaks[f"quantize {v}"] == builds.loc[v, "peak_memory_bytes"]
    items = _item_seconds(REFERENCE)
    assert point.seconds["evaluate variants"] == pytest.approx(
        max(s for (stage, item), s in items.items() if stage == "evaluate" and not item.endswith(":base")), abs=1e-3)
    assert point.seconds["kl"] is not None and point.seconds["probe"] is None


def test_the_7b_point_says_what_it_did_not_measure(points, rendered):
    point = points["shape7b-1"]
    # Its builds were rejected by the logit check: no variant was evaluated, compared or measured.
    assert point.seconds["evaluate variants"] is point.seconds["kl"] is point.seconds["windows, variants"] is None
    assert all(point.peaks[f"quantize {v}"] is None for v in ("awq-w4a16-g128", "fp8-dynamic"))  # no variants table
    assert "shape7b-1 measured no evaluate variants, no kl: those lines stand on the other points." in rendered


def test_a_line_through_two_points_meets_both(points, variants):
    for column in ("download", *(f"quantize {v}" for v in variants), "evaluate base", "windows, base"):
        line = sc.fit(list(points.values()), column)
        for p in points.values():
            assert line.at(p.parameters) == pytest.approx(p.seconds[column]), column
    # A stage one point measured: in proportion to parameters from it; the decision does not grow.
    kl = sc.fit(list(points.values()), "kl")
    assert kl.intercept == 0 and kl.at(2 * points["reference12"].parameters) == pytest.approx(
        2 * points["reference12"].seconds["kl"])
    assert sc.fit(list(points.values()), "decide").slope == 0


def test_the_wall_floor_runs_jobs_as_the_pool_would():
    assert sc.makespan([5, 3, 3, 3], 4) == 5
    assert sc.makespan([5, 3, 3, 3], 1) == 14
    assert sc.makespan([5, 3, 3, 3], 2) == 8  # 5 | 3 + 3, then the last 3 where 5 ends


def test_predicted_memory_for_the_7b_shape_is_model_memorys(tpl):
    sized = sc.sizing("qwen2.5-7b-instruct", QWEN25_7B_INSTRUCT, 1, tpl)
    suite = tpl.cat.suites[tpl.spec.suite]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(QWEN25_7B_INSTRUCT))
        plan = mm.plan_run(tmp, tpl.variants, backend="vllm", words=task_words(suite), hf_batch=suite.batch_size,
                           kl_window=WINDOW_TOKENS, gpu_bytes=sc.H200_BYTES)
        vllm = sized.needs["vllm engine"]
        opts = engine_options(tpl.cat.scenarios["ref-offline"], "cuda")
        opts = sized_kv_cache(opts, tmp, [tpl.cat.scenarios[n] for n in ("ref-offline", "ref-offline-sampled",
                                                                        "ref-latency")])
        admitted = start_memory_bytes(opts, tmp, "vllm")
    stages = {s.stage: s.bytes for job in plan.jobs for s in job} | {s.stage: s.bytes for s in plan.alone}
    for v, _ in tpl.variants:
        assert sized.needs[f"quantize {v.name}"].bytes == stages[f"quantize {v.name}"]
    assert sized.needs["evaluate base"].bytes == stages["evaluate base"]
    assert sized.needs["kl"].bytes == stages["kl"]
    assert sized.slots == plan.jobs_per_gpu(sc.H200_BYTES) == 4
    # The speed engine is what its start is admitted by, and its KV cache what shape7b-1's engine held.
    assert vllm.bytes == admitted and vllm.parts["KV cache"] == 13_762_560_000
    assert sized.parameters == pd.read_parquet(SHAPE_7B / "models.parquet").num_parameters.item()
    assert sized.stops is None and sized.problems == ()


def test_a_70b_model_on_one_h200_stops_where_the_runtime_would(tpl, rendered):
    one = sc.sizing("llama-3.1-70b-instruct", LLAMA31_70B_INSTRUCT, 1, tpl)
    assert one.stops.startswith("llama-3.1-70b-instruct: evaluate base needs 143.9 GiB of GPU memory (weights 131.4")
    assert "\n" not in one.stops and one.stops.endswith("(and 1 more stage)")  # and KL
    assert f"`{one.stops}`" in rendered
    row = next(line for line in rendered.splitlines()
               if line.startswith("| predicted | llama-3.1-70b-instruct |") and "| 1 × H200 |" in line)
    assert row.endswith("| does not start |")
    # On two, tensor parallel 2, each GPU holds half the weights and KV cache: every stage fits.
    two = sc.sizing("llama-3.1-70b-instruct", LLAMA31_70B_INSTRUCT, 2, tpl)
    assert two.stops is None and two.problems == ()
    half = two.needs["evaluate base"].parts
    assert half["weights"] == math.ceil(one.needs["evaluate base"].parts["weights"] / 2)


def test_every_row_is_labelled_measured_or_predicted(rendered):
    rows = [line for line in rendered.splitlines() if line.startswith("| ") and not line.startswith("|  |")]
    labels = [line.split(" | ")[0].removeprefix("| ") for line in rows]
    per_table = len(sc.PREDICTED) * len(sc.GPU_COUNTS)
    assert labels.count("predicted") == 2 * per_table
    assert sorted(set(labels) - {"predicted"}) == ["measured (reference12)", "measured (shape7b-1)"]
    assert "### The prediction: a model, not a measurement" in rendered


def test_the_h200s_size_is_what_nvidia_smi_said():
    log = (sc.RESULTS / "suite7-crosscheck" / "log.txt").read_text()
    mib = int(re.search(r"NVIDIA H200, (\d+) MiB", log).group(1))
    assert sc.H200_BYTES == mib << 20


def test_the_docs_show_what_the_script_prints(rendered):
    doc = sc.PAGE.read_text()
    section = doc[doc.index(sc.BEGIN) + len(sc.BEGIN):doc.index(sc.END)]
    assert section == "\n" + rendered, "stale: run python benchmarks/size_curve.py --write"
    assert "python benchmarks/size_curve.py" in doc and "quantgate run shape:qwen2.5-7b-instruct --tokenizer DIR" in doc
