"""The whole GPU suite flow on the device, on a small Qwen2 shape: every step kind runs and lands in the views."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.shapes import SMALL_QWEN
from quantgate.flows.gpu_suite import gpu_suite
from quantgate.warehouse import reads, sessions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vllm and a CUDA GPU"),
]

# No gpu_memory_utilization: each vLLM start gets a KV cache sized to its load
# (tasks/adapters/speed/options.sized_kv_cache), which skips vLLM's memory profiling, so the other test workers' engines
# starting and stopping on the same GPU cannot upset it (they did, with 0.3 of the GPU each:
# gpu-tests/call-s11-2-all.txt).
# transformers_decompressed: the suite's Transformers step on the W4A16 build is timed (as catalog/gpu.yaml asks).
COMMON = {"device": "cuda", "dtype": "bfloat16", "weights": "dummy", "max_model_len": 256, "enforce_eager": True,
          "num_prompts": 16, "input_len": 64, "output_len": 32,
          "warmup": 1, "repetitions": 1, "transformers_decompressed": True}


def suite_file(tmp_path):
    offline = {**COMMON, "kind": "offline", "engines": ["transformers", "vllm"]}
    latency = {**offline, "kind": "latency", "num_prompts": 2}
    suite = {
        "version": 1,
        "shapes": {"small": {"preset": "qwen2.5-7b-instruct", "overrides": SMALL_QWEN}},
        "builds": {"bf16": {}, "w4a16-g128": {"quant": "w4a16", "group_size": 128}},
        "base_build": "bf16",
        "scenarios": {
            "offline": offline,
            "offline-sampled": {**offline, "engines": ["vllm"], "temperature": 1.0, "prompt_input": "text"},
            "latency": latency,
            "latency-ngram": {**latency, "engines": ["vllm"], "speculative": "ngram"},
            "latency-compile": {**latency, "engines": ["transformers"], "transformers_compile": True},
            "serving": {**offline, "kind": "serving", "engines": ["vllm"], "concurrency": [1, 4], "rounds": 2,
                        "request_rates": [20], "num_prompts": 8, "slo": {"ttft_ms": 10_000, "tpot_ms": 1_000}},
        },
        "steps": [
            {"part": "offline", "engine": "vllm", "build": "bf16", "scenarios": ["offline", "latency", "offline-sampled"]},
            {"part": "offline", "engine": "vllm", "build": "w4a16-g128", "scenarios": ["offline", "latency"]},
            {"part": "offline", "engine": "vllm-bench", "build": "bf16", "scenarios": ["offline-sampled"]},
            {"part": "transformers", "engine": "transformers", "build": "bf16", "scenarios": ["offline", "latency"]},
            {"part": "transformers", "engine": "transformers", "build": "w4a16-g128", "scenarios": ["offline"]},
            {"part": "serving", "engine": "vllm-serve", "build": "bf16", "scenarios": ["serving"]},
            {"part": "levers", "engine": "vllm", "build": "bf16", "scenarios": ["latency-ngram"]},
            {"part": "levers", "engine": "transformers", "build": "bf16", "scenarios": ["latency-compile"]},
        ],
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def _run(tmp_path: Path, part: str) -> Path:
    wh = tmp_path / "w.ducklake"
    steps = gpu_suite(warehouse=str(wh), workdir=str(tmp_path / "work"), shape="small", suite=str(suite_file(tmp_path)),
                      parts=[part], deadline_s=1200, grace_s=300)
    assert steps and all(s["status"] == "ok" for s in steps), [(s["engine"], s["build"], s["reason"]) for s in steps]
    return wh


def _speed(con) -> dict:
    return {(r["engine"], r["scenario"], r["variant_uid"].rsplit("-", 1)[-1]): r
            for r in reads.rows(con, "SELECT * FROM speed_results")}


# One test per part, so that pytest-xdist spreads them over the GPUs (benchmarks/gpu/run_tests.sh).
def test_vllm_offline_latency_roofline_and_the_bench_crosscheck(tmp_path):
    with sessions.session(_run(tmp_path, "offline"), read_only=True) as con:
        speed = _speed(con)
        for build in ("bf16", "g128"):
            offline = speed[("vllm", "offline", build)]
            assert offline["output_tokens"] == 16 * 32 and offline["kv_cache_tokens"] > 0 and offline["kv_cache_bytes"] > 0
            lat = speed[("vllm", "latency", build)]
            assert lat["bandwidth_gbps"] > 1000 and lat["weight_bytes_per_token"] > 0
            assert 0 < lat["roofline_fraction"] < 1.2
        (cc,) = reads.rows(con, "SELECT * FROM vllm_crosscheck")
        assert cc["scenario"] == "offline-sampled" and speed[("vllm", "offline-sampled", "bf16")]["output_tokens"] == 16 * 32
        assert cc["bench_output_tokens_per_s"] > 0 and abs(cc["output_gap_pct"]) < 90
        # Ours took the bench's text prompts: their tokens as vLLM counted them, within the bench dataset's
        # re-encoding slack of input_len each.
        sampled_in = speed[("vllm", "offline-sampled", "bf16")]["input_tokens"]
        assert abs(sampled_in - 16 * COMMON["input_len"]) <= 0.01 * 16 * COMMON["input_len"]


def test_transformers_bf16_and_w4a16_with_allocator_and_nvml_peaks(tmp_path):
    with sessions.session(_run(tmp_path, "transformers"), read_only=True) as con:
        speed = _speed(con)
        hf = speed[("transformers", "latency", "bf16")]
        assert hf["torch_peak_bytes"] > 0 and hf["nvml_peak_bytes"] > 0 and 0 < hf["roofline_fraction"] < 1.2
        assert speed[("transformers", "offline", "g128")]["output_tokens"] == 16 * 32


def test_vllm_serve_percentiles_and_goodput(tmp_path):
    with sessions.session(_run(tmp_path, "serving"), read_only=True) as con:
        pct = {r["load"]: r for r in reads.rows(con, "SELECT * FROM latency_percentiles")}
        assert set(pct) == {"c=1", "c=4", "rate=20"}
        assert all(r["completed"] == r["requests"] and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 for r in pct.values())
        good = reads.rows(con, "SELECT * FROM serving_goodput")
        assert all(g["good_requests"] == g["completed"] for g in good)
        assert _speed(con)[("vllm", "serving", "bf16")]["kv_cache_tokens"] > 0


def test_levers_ngram_speculation_and_transformers_compile(tmp_path):
    with sessions.session(_run(tmp_path, "levers"), read_only=True) as con:
        speed = _speed(con)
        assert speed[("transformers", "latency-compile", "bf16")]["tpot_ms"] > 0
        assert "spec_decode" in json.loads(speed[("vllm", "latency-ngram", "bf16")]["details"])
