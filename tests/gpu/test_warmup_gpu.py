"""A compile warm-up on the GPU: started with a small fixed KV cache, it leaves in VLLM_CACHE_ROOT what the
measured engine start then loads instead of compiling (vLLM's "Directly load AOT compilation" line)."""

import pytest
from tests.shared_data import TINY_MODEL

from quantgate.catalog.schema import ScenarioSpec
from quantgate.tasks.benchmark import run_scenarios
from quantgate.tasks.speed.warmup import warm_up, warm_ups

pytestmark = pytest.mark.gpu

SCENARIO = ScenarioSpec(kind="offline", engines=("vllm",), num_prompts=8, input_len=32, output_len=16, warmup=1,
                        repetitions=1, device="cuda", max_model_len=256, max_cudagraph_capture_size=8)


def test_a_warm_up_compiles_what_the_measured_start_then_loads(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vllm is not installed")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))  # spawned engines inherit it
    (warm,) = warm_ups(str(TINY_MODEL), "vllm", [("warm-tiny", SCENARIO)])
    assert warm_up(str(TINY_MODEL), warm, tmp_path / "warm") is None
    (result,) = run_scenarios(str(TINY_MODEL), "vllm", [("warm-tiny", SCENARIO)], log_dir=tmp_path / "measured",
                              options={"gpu_memory_utilization": 0.2})
    assert result.status == "ok", result.reason
    assert result.details["compile_cache"] == "loaded"
