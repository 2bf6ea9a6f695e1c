"""The tuned serving config on the device: the GPU suite's vllm-serve step runs a W4A16 sweep of three points
(vLLM's defaults, an FP8 KV cache, the Marlin kernel forced), each a real `vllm serve` driven through its
loads; the views pick the best point and price every point. Small Qwen2 shape, eager, ~1-2 min on an H200.
An endpoint run against one of those vLLM servers is in tests/test_endpoint.py's CPU form only."""

from __future__ import annotations

import importlib.util
import json

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


def test_w4a16_sweep_picks_a_tuned_config_and_prices_it(tmp_path):
    sweep = {"kind": "serving", "engines": ["vllm"], "device": "cuda", "dtype": "bfloat16", "weights": "dummy",
             "max_model_len": 256, "enforce_eager": True, "gpu_memory_utilization": 0.3, "input_len": 64,
             "output_len": 32, "concurrency": [1, 8], "rounds": 2, "num_prompts": 16, "warmup": 1,
             "slo": {"ttft_ms": 10_000, "tpot_ms": 1_000},
             "sweep": {"kv_cache_dtype": ["fp8"], "kernel": ["MarlinLinearKernel"]}}
    suite = {"version": 1, "shapes": {"small": {"preset": "qwen2.5-7b-instruct", "overrides": SMALL_QWEN}},
             "builds": {"bf16": {}, "w4a16-g128": {"quant": "w4a16", "group_size": 128}}, "base_build": "bf16",
             "scenarios": {"sw": sweep}, "gpu_prices": {"NVIDIA": 3.0},
             "steps": [{"part": "sweep", "engine": "vllm-serve", "build": "w4a16-g128", "scenarios": ["sw"],
                        "timeout_s": 600}]}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    wh = tmp_path / "w.ducklake"

    (step,) = gpu_suite(warehouse=str(wh), workdir=str(tmp_path / "work"), shape="small", suite=str(path),
                        deadline_s=600, grace_s=60)

    assert step["status"] == "ok", step["reason"]
    with sessions.session(wh, read_only=True) as con:
        points = {r["point"]: r for r in reads.rows(con, "SELECT * FROM serving_sweep")}
        (tuned,) = reads.rows(con, "SELECT * FROM tuned_serving_config")
        cost = reads.rows(con, "SELECT * FROM variant_cost WHERE scenario LIKE 'sw@%'")
        loads = reads.rows(con, "SELECT scenario, load, completed FROM serving_loads ORDER BY scenario, load")
        marlin = reads.rows(con, "SELECT details FROM speed_results WHERE scenario = 'sw@kernel=MarlinLinearKernel'")
    assert set(points) == {"default", "kv_cache_dtype=fp8", "kernel=MarlinLinearKernel"}
    # The defaults' KV cache (0.3 of the GPU) holds the highest load whole and meets the SLO: an FP8 KV cache cannot
    # change the outcome, so that point is skipped with the reason (tasks/adapters/speed/sweep.py's moot rule).
    measured = {k: p for k, p in points.items() if k != "kv_cache_dtype=fp8"}
    assert all(p["status"] == "ok" and p["goodput_requests_per_s"] > 0 for p in measured.values()), \
        {k: (p["status"], p["reason"]) for k, p in points.items()}
    assert points["kv_cache_dtype=fp8"]["status"] == "skipped", points["kv_cache_dtype=fp8"]
    # The measured points' loads stay in the warehouse: 2 loads × 2 points, every request answered.
    assert len(loads) == 4 and all(ld["completed"] == (2 if ld["load"] == "c=1" else 16) for ld in loads)
    assert tuned["points_ok"] == 2 and tuned["default_goodput"] > 0 and tuned["gain_pct"] >= 0
    # The forced kernel is the one vLLM says it used.
    assert json.loads(marlin[0]["details"])["kernel"] == "MarlinLinearKernel"
    # Every point is priced with the suite's table (the "NVIDIA" prefix matches the H200's NVML name).
    assert len(cost) == 2 and all(c["usd_per_million_output_tokens_at_slo"] > 0 for c in cost)
