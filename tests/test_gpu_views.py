"""GPU tables and views on seeded rows: latency percentiles, goodput, the vLLM cross-check, the engine
comparison, the dummy-weights column, the Parquet export and the markdown summary."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import duckdb
import numpy as np
import pytest

from quantgate.catalog.records import ModelArtifact, RequestRecord, ServingLoad, Slo, SpeedResult, VariantArtifact
from quantgate.warehouse import ledger, reads, sessions, transfer, writers

REPO = Path(__file__).resolve().parents[1]
RUN = "run-1"
BASE, W4 = "m@abc:dummy-bf16", "m@abc:dummy-w4a16"


def _summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", REPO / "benchmarks" / "gpu" / "summary.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _request(
    i: int, ttft_ms: float, tpot_ms: float | None, itl_ms: list[float], n: int = 8, ok: bool = True
) -> RequestRecord:
    e2el = None if not ok else (ttft_ms + sum(itl_ms)) / 1000
    return RequestRecord(index=i, success=ok, error=None if ok else "HTTP 500: boom", prompt_len=16,
                         output_tokens=n if ok else 0, ttft_s=ttft_ms / 1000 if ok else None,
                         itl_s=[g / 1000 for g in itl_ms], e2el_s=e2el,
                         tpot_s=None if tpot_ms is None else tpot_ms / 1000, arrival_offset_s=0.1 * i,
                         start_offset_s=0.1 * i)


def _variant(uid: str, name: str, method: str) -> VariantArtifact:
    return VariantArtifact(uid=uid, model_uid="m@abc", name=name, method=method, scheme=None, bits=None,
                           group_size=None, path=f"/x/{name}", recipe=None, recipe_hash=None, weights="dummy")


def _speed(
    engine: str, scenario: str, tps: float | None, total: float | None = None, status: str = "ok", **kw
) -> SpeedResult:
    return SpeedResult(engine=engine, scenario=scenario, status=status, reason=None if status == "ok" else "why",
                       config={}, tokens_per_s=tps, total_tokens_per_s=total, **kw)


@pytest.fixture
def con(tmp_path):
    with sessions.session(tmp_path / "w.ducklake") as con:
        ledger.start_run(con, RUN, "gpu-suite", "qwen-7b", "gpu.yaml", "h", "host", {"vllm": "0.26.0"})
        writers.record_model(con, RUN, ModelArtifact("qwen-7b", "/m", "local", None, "abc" * 10))
        writers.record_variant(con, RUN, _variant(BASE, "bf16", "base"), "base")
        writers.record_variant(con, RUN, _variant(W4, "w4a16", "dummy"), "variant")
        writers.record_speed(con, RUN, BASE, [
            _speed("vllm", "offline", 1000.0, 3000.0, device="NVIDIA H200",
                   repetitions=[{"tokens_per_s": t, "wall_s": 1.0, "other_cpu_s": o, "steal_s": 0.0}
                                for t, o in ((900.0, 3.0), (1000.0, 0.5), (1200.0, 0.25))]),
            _speed("vllm-bench", "offline", 1100.0, 3300.0),
            _speed("transformers", "offline", 250.0, 750.0),
            _speed("vllm", "latency", 140.0, tpot_ms=7.0, decode_tokens_per_s=1000 / 7.0, bandwidth_gbps=4300.0,
                   weight_bytes_per_token=14_141_245_440, roofline_fraction=0.46),
            _speed("vllm", "latency-eager", 70.0, tpot_ms=14.0, decode_tokens_per_s=1000 / 14.0),
            _speed("vllm", "serving", 5000.0, kv_cache_tokens=1000, kv_cache_bytes=57_344_000),
        ])
        writers.record_speed(con, RUN, W4, [
            _speed("vllm", "offline", 1500.0, 4500.0), _speed("transformers", "offline", None, status="failed"),
        ])
        loads = [
            ServingLoad("c=2", 2, None, [
                _request(0, 10, 5, [5.0] * 7), _request(1, 20, 6, [6.0] * 7),
                _request(2, 30, 7, [7.0] * 7), _request(3, 40, 100, [100.0] * 7),
            ], duration_s=2.0, energy_j=64.0),
            ServingLoad("rate=4", None, 4.0, [_request(0, 12, 5, [5.0, 5.0], n=3), _request(1, 0, None, [], ok=False)],
                        duration_s=1.0, energy_j=None),
        ]
        writers.record_serving(con, RUN, BASE, "vllm", "serving", loads, Slo(ttft_ms=35, tpot_ms=50))
        yield con


def test_latency_percentiles_match_numpy_linear_interpolation(con):
    rows = {r["load"]: r for r in reads.rows(con, "SELECT * FROM latency_percentiles")}

    c2 = rows["c=2"]
    assert (c2["requests"], c2["completed"], c2["max_concurrency"], c2["duration_s"]) == (4, 4, 2, 2.0)
    ttft = [10, 20, 30, 40]
    for p in (50, 90, 99):
        assert c2[f"ttft_p{p}_ms"] == pytest.approx(np.percentile(ttft, p))
        assert c2[f"tpot_p{p}_ms"] == pytest.approx(np.percentile([5, 6, 7, 100], p))
    itl = [5.0] * 7 + [6.0] * 7 + [7.0] * 7 + [100.0] * 7  # every gap of every request
    assert c2["itl_p99_ms"] == pytest.approx(np.percentile(itl, 99))
    assert c2["itl_mean_ms"] == pytest.approx(np.mean(itl))
    assert c2["e2el_p50_ms"] == pytest.approx(np.percentile([10 + 35, 20 + 42, 30 + 49, 40 + 700], 50))
    # The failed request counts as sent, not in the percentiles.
    rate = rows["rate=4"]
    assert (rate["requests"], rate["completed"], rate["request_rate"], rate["ttft_p99_ms"]) == (2, 1, 4.0, 12.0)


def test_goodput_counts_requests_within_the_slo_per_second(con):
    rows = {r["load"]: r for r in reads.rows(con, "SELECT * FROM serving_goodput")}

    c2 = rows["c=2"]
    # TTFT <= 35 ms and TPOT <= 50 ms: requests 0, 1 and 2; request 3 misses both limits.
    assert c2["good_requests"] == 3
    assert c2["goodput_requests_per_s"] == pytest.approx(1.5)
    assert c2["requests_per_s"] == pytest.approx(2.0) and c2["output_tokens_per_s"] == pytest.approx(32 / 2.0)
    assert c2["energy_j_per_token"] == pytest.approx(64.0 / 32)
    rate = rows["rate=4"]
    assert (rate["good_requests"], rate["failed"], rate["good_fraction"]) == (1, 1, 0.5)
    assert rate["energy_j_per_token"] is None


def test_serving_rows_are_replaced_not_duplicated(con):
    load = ServingLoad("c=1", 1, None, [_request(0, 10, 5, [5.0])], duration_s=1.0)
    writers.record_serving(con, RUN, BASE, "vllm", "serving", [load], None)

    assert con.execute("SELECT list(load) FROM serving_loads").fetchone()[0] == ["c=1"]
    assert con.execute("SELECT count(*), any_value(itl_ms) FROM serving_requests").fetchone() == (1, [5.0])
    assert reads.rows(con, "SELECT good_requests FROM serving_goodput")[0]["good_requests"] == 1  # no SLO: all good


def test_crosscheck_compares_like_for_like_and_engines_side_by_side(con):
    (cc,) = reads.rows(con, "SELECT * FROM vllm_crosscheck")
    assert (cc["variant_uid"], cc["scenario"]) == (BASE, "offline")
    assert cc["output_gap_pct"] == pytest.approx(100 * (1000 - 1100) / 1100)
    assert cc["total_gap_pct"] == pytest.approx(100 * (3000 - 3300) / 3300)
    # Each side's passes: ours three; a bench row of before its passes were repeated is its one pass.
    assert (cc["ours_passes"], cc["ours_slowest_pass"], cc["ours_fastest_pass"]) == (3, 900.0, 1200.0)
    assert (cc["bench_passes"], cc["bench_slowest_pass"], cc["bench_fastest_pass"]) == (1, 1100.0, 1100.0)
    # The CPU others took during each side's passes: ours the median of its three; the bench row has no such readings.
    assert (cc["ours_other_cpu_s"], cc["ours_steal_s"]) == (0.5, 0.0)
    assert (cc["bench_other_cpu_s"], cc["bench_steal_s"]) == (None, None)
    # Agreement over passes, not the medians' point gap: every pairing spans -18% to +9%.
    assert cc["output_gap_low_pct"] == pytest.approx(100 * (900 / 1100 - 1))
    assert cc["output_gap_high_pct"] == pytest.approx(100 * (1200 / 1100 - 1))
    assert cc["agreement"] == "passes too spread to resolve 3% (every pairing: -18.2% to +9.1%)"

    (cmp,) = reads.rows(con, "SELECT * FROM engine_comparison")
    assert (cmp["variant"], cmp["weights"], cmp["vllm_over_transformers"]) == ("bf16", "dummy", 4.0)
    speedups = {(r["engine"], r["scenario"]): r["speedup"] for r in reads.rows(con, "SELECT * FROM variant_speedup")}
    assert speedups[("vllm", "offline")] == pytest.approx(1.5)


def test_dummy_variants_and_new_columns_are_stored(con):
    assert con.execute("SELECT list(DISTINCT weights) FROM variants").fetchone()[0] == ["dummy"]
    row = reads.rows(con, "SELECT * FROM speed_results WHERE scenario = 'latency'")[0]
    assert (row["bandwidth_gbps"], row["weight_bytes_per_token"], row["roofline_fraction"]) == (4300.0, 14_141_245_440, 0.46)
    # A variant recorded without saying so is real.
    real = VariantArtifact(uid="r", model_uid="m@abc", name="real", method="gptq", scheme="W4A16", bits=4,
                           group_size=128, path="/r", recipe="x", recipe_hash="h")
    writers.record_variant(con, RUN, real, "variant")
    assert con.execute("SELECT weights FROM variants WHERE variant_uid = 'r'").fetchone()[0] == "real"


def test_export_and_summary(con, tmp_path):
    files = transfer.export_parquet(con, tmp_path / "pq")
    names = {f.stem for f in files}
    assert {"speed_results", "serving_requests", "suite_steps", "runs"} <= names
    assert not names & {"latency_percentiles", "vllm_crosscheck", "variant_scorecard"}  # views are derived
    with_views = {f.stem for f in transfer.export_parquet(con, tmp_path / "all", views=True)}
    assert {"latency_percentiles", "vllm_crosscheck"} <= with_views and names < with_views
    assert duckdb.sql(f"SELECT count(*) FROM '{tmp_path / 'pq' / 'serving_requests.parquet'}'").fetchone()[0] == 6

    writers.record_prices(con, RUN, {"NVIDIA H200": 3.6})
    text = _summary_module().render(con)
    assert text.startswith("# GPU suite: qwen-7b on NVIDIA H200")
    # 3.6 US$/h ÷ (1,000 tok/s × 3,600 s) × 1e6 = 1 US$ per million output tokens.
    assert "| bf16 | vllm | offline | 3.60 | 1 | 1,000 | 1.0000 | — | — |" in text
    assert "| bf16 | 250 | 1,000 | 4.00 | — |" in text  # offline: Transformers, vLLM, ratio, note
    assert "| bf16 | offline | 1,000 | 1,100 | -9.1 |" in text  # the cross-check gap
    assert "46.0%" in text  # roofline
    assert "| bf16 | serving | c=2 | 4 | 25.0 | 39.7 |" in text  # TTFT p50 and p99 of the c=2 load
    assert "| bf16 | CUDA graphs off | vllm | latency | latency-eager | tpot_ms | 7.00 | 14.00 | 2.00× |" in text


def test_speedup_carries_the_range_its_passes_allow(tmp_path):
    def passes(*tps: float) -> list[dict]:
        return [{"tokens_per_s": t, "wall_s": 1.0} for t in tps]

    with sessions.session(tmp_path / "r.ducklake") as con:
        ledger.start_run(con, RUN, "evaluate-model", "qwen-7b", "models.yaml", "h", "host", {})
        writers.record_model(con, RUN, ModelArtifact("qwen-7b", "/m", "local", None, "abc" * 10))
        writers.record_variant(con, RUN, _variant(BASE, "bf16", "base"), "base")
        writers.record_variant(con, RUN, _variant(W4, "w4a16", "dummy"), "variant")
        # reference5's FP8 on ref-offline, and a scenario with one pass a side (no range).
        writers.record_speed(con, RUN, BASE, [_speed("vllm", "offline", 20491.0, repetitions=passes(20609, 20458, 20491)),
                                              _speed("vllm", "one", 100.0, repetitions=passes(100))])
        writers.record_speed(con, RUN, W4, [_speed("vllm", "offline", 20896.0, repetitions=passes(20896, 19976, 20991)),
                                            _speed("vllm", "one", 120.0, repetitions=passes(120))])
        rows = {r["scenario"]: r for r in reads.rows(con, "SELECT * FROM variant_speedup")}
    off = rows["offline"]
    assert off["speedup"] == pytest.approx(20896 / 20491)
    assert off["speedup_low"] == pytest.approx(19976 / 20609) and off["speedup_high"] == pytest.approx(20991 / 20458)
    assert (off["passes"], off["base_passes"]) == (3, 3)
    one = rows["one"]
    assert one["speedup_low"] == one["speedup_high"] == pytest.approx(1.2) and one["passes"] == 1


def test_crosscheck_agreement_and_host_bound_rows_from_their_passes(tmp_path):
    def clocked(tps, busy):
        """Passes of 1 s whose engine core (the group less this process) was on a CPU `busy` of the time."""
        return [{"tokens_per_s": t, "wall_s": 1.0, "cpu_s": 0.1 + busy, "front_cpu_s": 0.1} for t in tps]

    with sessions.session(tmp_path / "h.ducklake") as con:
        ledger.start_run(con, RUN, "evaluate-model", "qwen-1.5b", "models.yaml", "h", "host", {})
        writers.record_model(con, RUN, ModelArtifact("qwen-1.5b", "/m", "local", None, "abc" * 10))
        writers.record_variant(con, RUN, _variant(BASE, "bf16", "base"), "base")
        writers.record_variant(con, RUN, _variant(W4, "w4a16", "dummy"), "variant")
        # Weights of 3.087 GB over 4,200 GB/s: a 0.735 ms floor per decode step (reference9's base on the H200).
        latency = dict(tpot_ms=2.7, bandwidth_gbps=4200.0, weight_bytes_per_token=3_087_431_680)
        writers.record_speed(con, RUN, BASE, [
            _speed("vllm", "latency", 370.0, repetitions=clocked([370, 371], 0.97), **latency),
            _speed("vllm", "offline", 1000.0, tpot_ms=5.1, repetitions=clocked([990, 1000, 1010], 0.97)),
            _speed("vllm-bench", "offline", 1000.0, repetitions=[{"tokens_per_s": t} for t in (995, 1000, 1005)]),
            _speed("vllm", "far", 1105.0, tpot_ms=5.1, repetitions=clocked([1100, 1110], 0.5)),
            _speed("vllm-bench", "far", 1000.0, repetitions=[{"tokens_per_s": t} for t in (1000, 1010)]),
        ])
        writers.record_speed(con, RUN, W4, [
            _speed("vllm", "latency", 400.0, repetitions=clocked([400, 401], 0.4), **latency),
            _speed("vllm", "offline", 1100.0, tpot_ms=1.5, repetitions=clocked([1100, 1100], 0.97)),
        ])
        checks = {r["scenario"]: r for r in reads.rows(con, "SELECT * FROM vllm_crosscheck")}
        passes = {(r["variant_uid"], r["scenario"]): r
                  for r in reads.rows(con, "SELECT * FROM stg_speed_passes WHERE engine = 'vllm'")}
        speedups = {r["scenario"]: r for r in reads.rows(con, "SELECT * FROM variant_speedup")}
    assert checks["offline"]["agreement"] == "within 3% (every pairing of passes: -1.5% to +1.5%)"
    assert checks["far"]["agreement"] == "differs by +10.5% (every pairing of passes: +8.9% to +11.0%)"
    # The base's offline row: its engine core on a CPU 97% of each pass, steps of 5.1 ms against a 0.735 ms floor.
    base = passes[(BASE, "offline")]
    assert base["host_busy_share"] == pytest.approx(0.97) and base["memory_floor_ms"] == pytest.approx(0.735, abs=1e-3)
    assert base["host_bound"] is True
    # Busy, but steps near the floor: the GPU set the pace. A CPU mostly idle: the GPU again.
    assert passes[(W4, "offline")]["host_bound"] is False and passes[(BASE, "far")]["host_bound"] is False
    assert passes[(W4, "latency")]["host_bound"] is False
    # A ratio with a host-bound side is labelled host-bound.
    assert speedups["offline"]["host_bound"] is True and speedups["offline"]["host_busy_share"] == pytest.approx(0.97)
