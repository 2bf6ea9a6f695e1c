"""The tuned-serving-config sweep (its plan, vLLM flags and time sharing) and the cost views, on CPU.

The sweep's serving runs need vLLM on a GPU (tests/gpu/test_sweep_gpu.py runs three real points); here the
serve function handed to serve_sweep is a recorder, so what is tested is the plan: which points, in which
order, named how, with which flags, environment and time. The views are fed through the warehouse's own writers
with requests whose timings are chosen, so the picks (best point, load at the SLO, price) are known."""

from __future__ import annotations

import json
from html import unescape

import pytest
import yaml

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.gpu_suite import load_gpu_suite
from quantgate.catalog.policy import Policy
from quantgate.catalog.records import RequestRecord, ServingLoad, Slo, SpeedResult, VariantArtifact
from quantgate.catalog.scenarios import ServingScenario, SweepSpec, sweep_label
from quantgate.tasks.adapters.speed.checkpoint import has_weight_only_int_layers
from quantgate.tasks.adapters.speed.serving import measured_from_dict, measured_to_dict
from quantgate.tasks.adapters.speed.sweep import serve_sweep
from quantgate.tasks.adapters.speed.vllm_cli import sweep_settings
from quantgate.tasks.steps.decide import decide
from quantgate.warehouse import ledger, reads, report, sessions, writers


def test_one_at_a_time_and_grid_points():
    sweep = SweepSpec(max_num_seqs=[None, 64], enforce_eager=[False, True], kv_cache_dtype=["fp8"],
                      kernel=["auto", "MarlinLinearKernel"])
    labels = [sweep_label(p) for p in sweep.points()]
    # vLLM's own values (null, false, auto) are the default point, not points of their own.
    assert labels == ["default", "max_num_seqs=64", "enforce_eager=True", "kv_cache_dtype=fp8", "kernel=MarlinLinearKernel"]
    grid = sweep.model_copy(update={"mode": "grid"}).points()
    assert len(grid) == 16 and grid[0] == {} and {"max_num_seqs": 64, "enforce_eager": True,
                                                   "kv_cache_dtype": "fp8", "kernel": "MarlinLinearKernel"} in grid
    with pytest.raises(ValueError, match="unknown kernel"):
        SweepSpec(kernel=["FastestKernel"])


def test_sweep_settings_become_vllm_flags_and_environment():
    options, args, env = sweep_settings({"max_num_seqs": 32, "kv_cache_dtype": "fp8", "enforce_eager": True,
                                         "kernel": "MarlinLinearKernel"})
    assert options == {"enforce_eager": True}
    assert args == ["--kv-cache-dtype", "fp8", "--max-num-seqs", "32"]
    disabled = env["VLLM_DISABLED_KERNELS"].split(",")
    assert "MarlinLinearKernel" not in disabled and "MacheteLinearKernel" in disabled
    assert sweep_settings({}) == ({}, [], {})


def test_a_sweep_is_rejected_outside_serving_steps(tmp_path):
    suite = yaml.safe_load(open("catalog/gpu.yaml"))
    suite["steps"] = [{"part": "x", "engine": "vllm", "build": "w4a16-g128", "scenarios": ["serving-sweep"]}]
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(CatalogError):
        load_gpu_suite(path)
    # The packaged suite has the W4A16 sweep as a part of its own.
    spec = load_gpu_suite("catalog/gpu.yaml")
    (step,) = [s for s in spec.steps if s.part == "sweep-w4a16"]
    assert step.engine == "vllm-serve" and step.build == "w4a16-g128"


def test_the_first_point_may_use_all_but_a_minimum_kept_for_each_later_one(tmp_path):
    scenario = ServingScenario(engines=["vllm"], concurrency=[4], sweep={"max_num_seqs": [16, 32]})
    now = [0.0]
    budgets = []

    def serve(model_path, name, sc, *, work_dir, timeout_s, options, extra_args, env):
        budgets.append(timeout_s)
        now[0] += 50
        return SpeedResult("vllm", name, "ok", None, {}), []

    serve_sweep("/m", "sw", scenario, work_dir=tmp_path, timeout_s=400, serve=serve, clock=lambda: now[0], min_point_s=60)
    # 400 - 2 × 60 for the first (its start compiles); then 350 - 60; the last gets all that is left.
    assert budgets == [280.0, 290.0, 300.0]


def test_serve_sweep_runs_every_point_in_order_and_shares_the_time(tmp_path):
    scenario = ServingScenario(engines=["vllm"], concurrency=[4], slo={"ttft_ms": 100},
                            sweep={"max_num_seqs": [16], "kernel": ["MarlinLinearKernel"]})
    now = [0.0]
    calls = []

    def serve(model_path, name, sc, *, work_dir, timeout_s, options, extra_args, env):
        calls.append((name, sc.sweep, timeout_s, options, list(extra_args), env))
        now[0] += 60  # each point takes 60 s
        return SpeedResult("vllm", name, "ok", None, {"kind": sc.kind}), []

    done = []
    runs = serve_sweep("/m", "sw", scenario, work_dir=tmp_path, timeout_s=120, serve=serve, clock=lambda: now[0],
                       on_point=lambda result, loads: done.append((result.scenario, len(calls))))
    names = [r.scenario for r, _ in runs]
    # Each point is handed on as soon as it is done (before the next one starts), skipped ones too.
    assert done == [("sw@default", 1), ("sw@max_num_seqs=16", 2), ("sw@kernel=MarlinLinearKernel", 2)]
    assert names == ["sw@default", "sw@max_num_seqs=16", "sw@kernel=MarlinLinearKernel"]
    # Each point is a plain serving run (no nested sweep), given at least an even share of what is left.
    assert [c[1] for c in calls] == [None, None] and [c[2] for c in calls] == [40.0, 30.0]
    assert calls[1][4] == ["--max-num-seqs", "16"]
    # All 120 s were gone when the third point was due: it is recorded as skipped, not run.
    assert runs[2][0].status == "skipped" and len(calls) == 2
    assert [r.config["sweep"]["point"] for r, _ in runs] == ["default", "max_num_seqs=16", "kernel=MarlinLinearKernel"]
    assert runs[1][0].config["sweep"] == {"scenario": "sw", "point": "max_num_seqs=16", "settings": {"max_num_seqs": 16},
                                          "min_gain_pct": 3.0}


def _checkpoint(folder, quantization_config=None):
    folder.mkdir()
    config = {"model_type": "llama"} | ({"quantization_config": quantization_config} if quantization_config else {})
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _group(weights_type, activations=None):
    return {"config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations,
                                          "weights": {"num_bits": 4 if weights_type == "int" else 8, "type": weights_type}}},
            "quant_method": "compressed-tensors"}


def test_a_forced_kernel_is_skipped_on_a_checkpoint_without_weight_only_layers(tmp_path):
    scenario = ServingScenario(engines=["vllm"], concurrency=[4],
                            sweep={"max_num_seqs": [16], "kernel": ["MarlinLinearKernel"]})
    w4a16 = _checkpoint(tmp_path / "w4a16", _group("int"))
    fp8 = _checkpoint(tmp_path / "fp8", _group("float", {"num_bits": 8, "type": "float", "dynamic": True}))
    base = _checkpoint(tmp_path / "base")
    assert has_weight_only_int_layers(w4a16) is True
    assert has_weight_only_int_layers(_checkpoint(tmp_path / "gptq", {"quant_method": "gptq", "bits": 4})) is True
    assert has_weight_only_int_layers(fp8) is False and has_weight_only_int_layers(base) is False
    assert has_weight_only_int_layers(tmp_path / "absent") is None
    ran = {}

    def serve(model_path, name, sc, *, work_dir, timeout_s, options, extra_args, env):
        ran.setdefault(model_path, []).append((name, timeout_s))
        return SpeedResult("vllm", name, "ok", None, {}), []

    for path in (w4a16, fp8, base, str(tmp_path / "absent")):
        runs = serve_sweep(path, "sw", scenario, work_dir=tmp_path / "work", timeout_s=300, serve=serve,
                           clock=lambda: 0.0, min_point_s=60)
        assert [r.scenario for r, _ in runs] == ["sw@default", "sw@max_num_seqs=16", "sw@kernel=MarlinLinearKernel"]
        kernel = runs[2][0]
        if path in (fp8, base):
            # The defaults served again under another name: not run, one vLLM start saved, and the time it would
            # have kept goes to the points that run.
            assert kernel.status == "skipped" and "has none" in kernel.reason
            assert kernel.config["sweep"]["point"] == "kernel=MarlinLinearKernel"
            assert [n for n, _ in ran[path]] == ["sw@default", "sw@max_num_seqs=16"] and ran[path][0][1] == 240.0
        else:
            # Weight-only layers, or a config that cannot be read: the point runs.
            assert kernel.status == "ok" and len(ran[path]) == 3 and ran[path][0][1] == 180.0


def test_forcing_the_kernel_the_defaults_chose_for_every_layer_is_skipped(tmp_path):
    from quantgate.tasks.adapters.speed.vllm_cli import kernel_from_log

    scenario = ServingScenario(engines=["vllm"], concurrency=[4], sweep={"kernel": ["MarlinLinearKernel"]})
    w4a16 = _checkpoint(tmp_path / "w4a16", _group("int"))
    logs = {"marlin": "Using MarlinLinearKernel for CompressedTensorsWNA16\n" * 3,
            "mixed": "Using MarlinLinearKernel for CompressedTensorsWNA16\nUsing MacheteLinearKernel for X\n"}
    for name, text in logs.items():
        (tmp_path / f"{name}.log").write_text(text)
    assert kernel_from_log(tmp_path / "marlin.log") == "MarlinLinearKernel"
    assert kernel_from_log(tmp_path / "mixed.log") == "MarlinLinearKernel+MacheteLinearKernel"
    for name, runs_again in (("marlin", False), ("mixed", True)):
        ran = []

        def serve(model_path, point, sc, *, work_dir, timeout_s, options, extra_args, env, name=name):
            ran.append(point)
            return SpeedResult("vllm", point, "ok", None, {}, details={"kernel": kernel_from_log(tmp_path / f"{name}.log")}), []

        runs = serve_sweep(w4a16, "sw", scenario, work_dir=tmp_path / "work", timeout_s=300, serve=serve,
                           clock=lambda: 0.0)
        forced = runs[1][0]
        assert (forced.status == "ok") is runs_again and len(ran) == 1 + runs_again
        if not runs_again:
            assert "already ran every mixed-precision layer with MarlinLinearKernel" in forced.reason


def test_beside_other_work_a_forced_kernel_starts_with_the_defaults(tmp_path):
    import threading
    import time

    from quantgate.tasks.runtime import launch

    scenario = ServingScenario(engines=["vllm"], concurrency=[4],
                            sweep={"max_num_seqs": [16], "kernel": ["MarlinLinearKernel"]})
    w4a16 = _checkpoint(tmp_path / "w4a16", _group("int"))
    spans: dict[str, tuple[float, float]] = {}
    lock = threading.Lock()

    def serve(model_path, name, sc, *, work_dir, timeout_s, options, extra_args, env):
        began = time.monotonic()
        time.sleep(0.3)
        with lock:
            spans[name] = (began, time.monotonic())
        return SpeedResult("vllm", name, "ok", None, {}), []

    with launch.gpu_clock():
        runs = serve_sweep(w4a16, "sw", scenario, work_dir=tmp_path / "work", timeout_s=300, serve=serve)
    assert [r.scenario for r, _ in runs] == ["sw@default", "sw@max_num_seqs=16", "sw@kernel=MarlinLinearKernel"]
    assert all(r.status == "ok" for r, _ in runs)
    # The kernel point ran beside the defaults; max_num_seqs, which reads the defaults' figures, after them.
    assert spans["sw@kernel=MarlinLinearKernel"][0] < spans["sw@default"][1]
    assert spans["sw@max_num_seqs=16"][0] >= spans["sw@default"][1]
    # Without a clock (nothing shares the GPU) every point runs after the one before it.
    spans.clear()
    serve_sweep(w4a16, "sw", scenario, work_dir=tmp_path / "work2", timeout_s=300, serve=serve)
    assert spans["sw@kernel=MarlinLinearKernel"][0] >= spans["sw@max_num_seqs=16"][1]


# --- the views ---------------------------------------------------------------------------------


def _requests(n: int, ttft_s: float, tokens: int = 16, tpot_s: float = 0.01, start: int = 0) -> list[RequestRecord]:
    return [RequestRecord(i, True, None, 32, tokens, ttft_s, [tpot_s] * (tokens - 1), ttft_s + (tokens - 1) * tpot_s,
                          tpot_s, 0.0, 0.0) for i in range(start, start + n)]


def _variant(uid: str) -> VariantArtifact:
    return VariantArtifact(uid=uid, model_uid="m@1", name=uid, method="dummy", scheme="W4A16", bits=4, group_size=128,
                           path=None, recipe=None, recipe_hash=None, weights="dummy")


def _serving_row(con, run_id, uid, name, loads, slo, config=None, device="NVIDIA H200", status="ok"):
    tps = max((sum(r.output_tokens for r in ld.records) / ld.duration_s for ld in loads), default=None)
    writers.record_serving(con, run_id, uid, "vllm", name, loads, slo)
    writers.record_speed(con, run_id, uid, [SpeedResult("vllm", name, status, None, config or {}, device=device,
                                                        tokens_per_s=tps)])


@pytest.fixture
def warehouse(tmp_path):
    path = tmp_path / "w.ducklake"
    slo = Slo(ttft_ms=100)
    with sessions.session(path) as con:
        ledger.start_run(con, "r1", "gpu-suite", "m", "gpu.yaml", "h", "host", {})
        writers.record_prices(con, "r1", {"NVIDIA H200": 3.6, "NVIDIA H": 99.0, "cpu": 0.1}, "h")
        writers.record_variant(con, "r1", _variant("w4"), "variant")
        writers.record_variant(con, "r1", _variant("w4b"), "variant")
        # The default point: good up to c=8 (16 req/s of goodput); c=32 breaks the TTFT limit.
        sweep = lambda p, s: {"kind": "serving", "engine_options": {"tensor_parallel_size": 1},  # noqa: E731
                              "sweep": {"scenario": "sw", "point": p, "settings": s}}
        _serving_row(con, "r1", "w4", "sw@default", [
            ServingLoad("c=8", 8, None, _requests(16, 0.05), 1.0),
            ServingLoad("c=32", 32, None, _requests(8, 0.05) + _requests(24, 0.5, start=8), 1.0)], slo, sweep("default", {}))
        # max_num_seqs=64 meets the SLO at c=32 too: 32 req/s, the tuned config (+100%).
        _serving_row(con, "r1", "w4", "sw@max_num_seqs=64", [
            ServingLoad("c=8", 8, None, _requests(16, 0.05), 1.0),
            ServingLoad("c=32", 32, None, _requests(32, 0.06), 1.0)], slo, sweep("max_num_seqs=64", {"max_num_seqs": 64}))
        # Variant w4b: the defaults win; the only other point loses 25%.
        _serving_row(con, "r1", "w4b", "sw@default", [ServingLoad("c=8", 8, None, _requests(8, 0.05), 1.0)], slo,
                     sweep("default", {}))
        _serving_row(con, "r1", "w4b", "sw@enforce_eager=True", [ServingLoad("c=8", 8, None, _requests(6, 0.05), 1.0)],
                     slo, sweep("enforce_eager=True", {"enforce_eager": True}))
        # Variant w4c, written with the 3% margin: fp8 KV gains 2.5%, within run-to-run noise, so the defaults stay.
        writers.record_variant(con, "r1", _variant("w4c"), "variant")
        margin = lambda p, s: {**sweep(p, s), "sweep": {**sweep(p, s)["sweep"], "min_gain_pct": 3.0}}  # noqa: E731
        _serving_row(con, "r1", "w4c", "sw@default", [ServingLoad("c=8", 8, None, _requests(40, 0.05), 1.0)], slo,
                     margin("default", {}))
        _serving_row(con, "r1", "w4c", "sw@kv_cache_dtype=fp8", [ServingLoad("c=8", 8, None, _requests(41, 0.05), 1.0)],
                     slo, margin("kv_cache_dtype=fp8", {"kv_cache_dtype": "fp8"}))
        # An offline row on two GPUs (tensor parallel): twice the device-hours per token.
        writers.record_speed(con, "r1", "w4", [SpeedResult("vllm", "offline-tp2", "ok", None,
                                                           {"engine_options": {"tensor_parallel_size": 2}},
                                                           device="NVIDIA H200", tokens_per_s=2000.0)])
        ledger.finish_run(con, "r1")
        # A later run on the same device with a new price: r1's cost must not move.
        ledger.start_run(con, "r2", "gpu-suite", "m", "gpu.yaml", "h2", "host", {})
        writers.record_prices(con, "r2", {"NVIDIA H200": 7.2}, "h2")
        writers.record_variant(con, "r2", _variant("w4"), "variant")
        writers.record_speed(con, "r2", "w4", [SpeedResult("vllm", "offline-tp2", "ok", None,
                                                           {"engine_options": {"tensor_parallel_size": 2}},
                                                           device="NVIDIA H200", tokens_per_s=2000.0)])
        ledger.finish_run(con, "r2")
    return path


def test_tuned_config_beats_or_loses_to_the_defaults(warehouse):
    with sessions.session(warehouse, read_only=True) as con:
        tuned = {r["variant"]: r for r in reads.rows(con, "SELECT * FROM tuned_serving_config")}
    w4 = tuned["w4"]
    assert w4["best_point"] == "max_num_seqs=64" and w4["best_load"] == "c=32" and w4["points"] == 2
    assert w4["default_goodput"] == pytest.approx(16.0) and w4["best_goodput"] == pytest.approx(32.0)
    assert w4["gain_pct"] == pytest.approx(100.0)
    w4b = tuned["w4b"]
    assert w4b["best_point"] == "default" and w4b["gain_pct"] == 0
    assert w4b["best_other_point"] == "enforce_eager=True" and w4b["best_other_gain_pct"] == pytest.approx(-25.0)
    # Rows written before the margin existed were judged without one (w4: +100% either way).
    assert w4["min_gain_pct"] == 0


def test_a_gain_within_the_margin_keeps_the_defaults(warehouse):
    with sessions.session(warehouse, read_only=True) as con:
        (w4c,) = reads.rows(con, "SELECT * FROM tuned_serving_config WHERE variant = 'w4c'")
        (judged,) = reads.rows(con, "SELECT * FROM variant_serving WHERE variant_uid = 'w4c'")
        html = unescape(report.render(con))
    assert w4c["best_point"] == "default" and w4c["gain_pct"] == 0 and w4c["min_gain_pct"] == 3.0
    assert w4c["best_other_point"] == "kv_cache_dtype=fp8" and w4c["best_other_gain_pct"] == pytest.approx(2.5)
    # The decision's serving evidence is the same pick.
    assert judged["point"] == "default" and judged["goodput_requests_per_s"] == pytest.approx(40.0)
    assert "vLLM's defaults kept; kv_cache_dtype=fp8 gained only 2.5%, under the 3% margin" in html
    # With a 2% margin the same rows make fp8 KV the tuned config.
    with sessions.session(warehouse) as con:
        con.execute("UPDATE speed_results SET config = json_merge_patch(config, '{\"sweep\": {\"min_gain_pct\": 2}}')"
                    " WHERE variant_uid = 'w4c'")
        (w4c,) = reads.rows(con, "SELECT * FROM tuned_serving_config WHERE variant = 'w4c'")
        (judged,) = reads.rows(con, "SELECT * FROM variant_serving WHERE variant_uid = 'w4c'")
    assert w4c["best_point"] == "kv_cache_dtype=fp8" and w4c["gain_pct"] == pytest.approx(2.5)
    assert judged["point"] == "kv_cache_dtype=fp8"


def test_cost_per_million_tokens_at_peak_and_at_the_slo(warehouse):
    with sessions.session(warehouse, read_only=True) as con:
        cost = {(r["run_id"], r["variant_uid"], r["scenario"]): r for r in reads.rows(con, "SELECT * FROM variant_cost")}
    # Offline, TP=2 at 2000 tok/s and $3.60/h per GPU: 2 × 3.6 / (2000 × 3600) × 1e6 = $1.00 per million.
    tp2 = cost[("r1", "w4", "offline-tp2")]
    assert tp2["num_devices"] == 2 and tp2["price_key"] == "NVIDIA H200"  # the longest matching key, not "NVIDIA H"
    assert tp2["usd_per_million_output_tokens"] == pytest.approx(1.0)
    assert tp2["slo_load"] is None and not tp2["serving"]
    # The same figure priced later at twice the rate: the old run keeps its price.
    assert cost[("r2", "w4", "offline-tp2")]["usd_per_million_output_tokens"] == pytest.approx(2.0)
    # Serving defaults: c=32 is faster (512 tok/s) but only 25% of its requests meet the SLO; c=8 (256 tok/s) does.
    d = cost[("r1", "w4", "sw@default")]
    assert d["tokens_per_s"] == pytest.approx(512.0) and d["slo_load"] == "c=8"
    assert d["usd_per_million_output_tokens"] == pytest.approx(3.6 / (512 * 3600) * 1e6)
    assert d["usd_per_million_output_tokens_at_slo"] == pytest.approx(3.6 / (256 * 3600) * 1e6)


def test_the_slo_attainment_says_which_loads_meet_it(warehouse):
    # The defaults' loads again, under a scenario whose SLO asks only a quarter of the requests to be good:
    # c=32 (8 of 32 good) now meets it, and the cost at the SLO is priced there.
    loads = [ServingLoad("c=8", 8, None, _requests(16, 0.05), 1.0),
             ServingLoad("c=32", 32, None, _requests(8, 0.05) + _requests(24, 0.5, start=8), 1.0)]
    with sessions.session(warehouse) as con:
        _serving_row(con, "r1", "w4", "lenient", loads, Slo(ttft_ms=100, attainment=0.25),
                     {"slo": ServingScenario(engines=["vllm"], concurrency=[8], slo={"ttft_ms": 100, "attainment": 0.25}).slo.model_dump()})
        cost = {r["scenario"]: r for r in reads.rows(con, "SELECT * FROM variant_cost WHERE variant_uid = 'w4'")}
    assert cost["lenient"]["slo_load"] == "c=32" and cost["sw@default"]["slo_load"] == "c=8"
    with pytest.raises(ValueError, match="attainment"):
        ServingScenario(engines=["vllm"], concurrency=[8], slo={"ttft_ms": 100, "attainment": 1.5})


def test_report_shows_cost_and_the_tuned_config(warehouse):
    with sessions.session(warehouse, read_only=True) as con:
        html = unescape(report.render(con))
    assert "<h2>Cost per million output tokens" in html and "<h2>Tuned serving config" in html
    assert "max_num_seqs=64" in html and "beat vLLM's defaults by 100%" in html
    assert "vLLM's defaults won; the best other point (enforce_eager=True) lost by 25%" in html


def test_variant_serving_compares_tuned_configs_with_the_base(tmp_path):
    path = tmp_path / "w.ducklake"
    slo = Slo(ttft_ms=100)
    point = lambda p, s: {"kind": "serving", "slo": {"ttft_ms": 100},  # noqa: E731
                          "sweep": {"scenario": "gpu-serving", "point": p, "settings": s}}
    with sessions.session(path) as con:
        ledger.start_run(con, "r", "evaluate-model", "m", "catalog", "h", "host", {})
        writers.record_variant(con, "r", _variant("base"), "base")
        writers.record_variant(con, "r", _variant("w4"), "variant")
        writers.record_variant(con, "r", _variant("w8"), "variant")
        # The base: 16 good req/s with vLLM's defaults; fp8 KV cache does no better.
        _serving_row(con, "r", "base", "gpu-serving@default", [ServingLoad("c=8", 8, None, _requests(16, 0.05), 1.0)],
                     slo, point("default", {}))
        _serving_row(con, "r", "base", "gpu-serving@kv_cache_dtype=fp8",
                     [ServingLoad("c=8", 8, None, _requests(12, 0.05), 1.0)], slo, point("kv_cache_dtype=fp8", {}))
        # w4: its tuned config (Marlin) meets the SLO at c=32 with 24 req/s, 1.5x the base's best.
        _serving_row(con, "r", "w4", "gpu-serving@default", [ServingLoad("c=8", 8, None, _requests(16, 0.05), 1.0)],
                     slo, point("default", {}))
        _serving_row(con, "r", "w4", "gpu-serving@kernel=MarlinLinearKernel", [
            ServingLoad("c=8", 8, None, _requests(16, 0.05), 1.0),
            ServingLoad("c=32", 32, None, _requests(24, 0.05) + _requests(8, 0.5, start=24), 1.0)],
            slo, point("kernel=MarlinLinearKernel", {"kernel": "MarlinLinearKernel"}))
        # w8: a serving run without a sweep that failed to start: no goodput, the reason kept.
        writers.record_speed(con, "r", "w8", [SpeedResult("vllm", "gpu-serving", "failed", "vllm serve exited (1)",
                                                          {"kind": "serving"})])
        rows = {r["variant_uid"]: r for r in reads.rows(con, "SELECT * FROM variant_serving")}
        # The decision keeps the tuned config it judged; the scorecard reads it back.
        policy = Policy.model_validate({"version": 1, "quality": [],
                                        "serving": {"scenario": "gpu-serving", "min_goodput_ratio": 1.0}})
        built = {"variant_uid": "w4", "status": "built", "error": None, "size_bytes": 1}
        writers.record_decisions(con, "r", [decide(built, 2, [], [], policy, serving=[rows["w4"]])],
                                 policy.model_dump(mode="json"))
        (judged,) = reads.rows(con, "SELECT * FROM decision_serving")
    assert judged == {"run_id": "r", "variant_uid": "w4", "serving_goodput_ratio": 1.5,
                      "serving_config": "kernel=MarlinLinearKernel"}
    assert set(rows) == {"w4", "w8"}  # variants only, each against the base
    w4 = rows["w4"]
    assert (w4["scenario"], w4["point"], w4["load"], w4["points"], w4["points_ok"]) == (
        "gpu-serving", "kernel=MarlinLinearKernel", "c=32", 2, 2)
    assert w4["goodput_requests_per_s"] == pytest.approx(24.0) and w4["base_goodput_requests_per_s"] == pytest.approx(16.0)
    assert w4["base_point"] == "default" and w4["goodput_ratio"] == pytest.approx(1.5)
    w8 = rows["w8"]
    assert (w8["status"], w8["reason"], w8["goodput_requests_per_s"], w8["point"]) == (
        "failed", "vllm serve exited (1)", None, "default")


def test_a_serving_run_and_its_loads_travel_as_json():
    loads = [ServingLoad("c=8", 8, None, _requests(2, 0.05), 1.5, 12.0, {"server": "vllm"})]
    result = SpeedResult("vllm", "gpu-serving@default", "ok", None, {"kind": "serving"}, tokens_per_s=10.0)
    data = json.loads(json.dumps(measured_to_dict(result, loads)))
    assert measured_from_dict(data) == (result, loads)
