import pytest

from quantgate.catalog.scenarios import OfflineScenario
from quantgate.tasks.steps.benchmark import run_scenario
from tests.shared_data import TINY_MODEL

pytestmark = pytest.mark.gpu

TINY = str(TINY_MODEL)
SCENARIO = OfflineScenario(
    num_prompts=8, input_len=32, output_len=16, batch_size=8, warmup=1, repetitions=3, device="cuda"
)
# The tiny model needs almost nothing; a small KV-cache budget keeps vLLM's start quick.
VLLM_OPTIONS = {"gpu_memory_utilization": 0.2}


def _assert_sane(r) -> None:
    assert r.status == "ok", r.reason
    assert r.output_tokens == 8 * 16 and r.input_tokens == 8 * 32
    assert r.tokens_per_s > 0 and r.requests_per_s > 0
    assert 0 < r.ttft_ms < r.e2el_ms and r.tpot_ms > 0
    assert r.peak_memory_bytes > 0
    assert r.energy_j_per_token is None or r.energy_j_per_token > 0
    assert not r.device.startswith("cpu") and "cuda" in r.versions


def test_transformers_on_cuda_defaults_to_bfloat16_and_reads_device_memory():
    r = run_scenario(TINY, "transformers", "gpu-tiny", SCENARIO)

    _assert_sane(r)
    assert r.config["engine_options"]["dtype"] == "bfloat16"


def test_vllm_and_transformers_produce_the_same_token_counts():
    pytest.importorskip("vllm", reason="vllm is not installed")

    hf = run_scenario(TINY, "transformers", "gpu-tiny", SCENARIO)
    vllm = run_scenario(TINY, "vllm", "gpu-tiny", SCENARIO, options=VLLM_OPTIONS)

    _assert_sane(hf)
    _assert_sane(vllm)
    assert vllm.output_tokens == hf.output_tokens
    assert "vllm" in vllm.versions and "vllm" not in hf.versions


def test_vllm_samples_with_the_scenarios_top_k_and_top_p(monkeypatch):
    """vLLM's sampler gets the scenario's top-k and top-p: sampling from the single most likely token (top-k 1,
    or a nucleus too small for a second) is greedy at any temperature, as on Transformers (tests/test_benchmark.py)."""
    pytest.importorskip("vllm", reason="vllm is not installed")
    # In this test's process, where CUDA may be initialised already: vLLM's engine core is spawned, not forked.
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from quantgate.catalog.scenarios import Sampling
    from quantgate.tasks.adapters.engines import EngineOptions, create

    engine = create("vllm")
    engine.load(TINY, EngineOptions(device="cuda", dtype="bfloat16", max_model_len=64, **VLLM_OPTIONS))
    try:
        prompts = [[1, 400 + i, 17, 90 + i] for i in range(4)]
        greedy = engine.generate(prompts, 8).token_ids
        assert engine.generate(prompts, 8, sampling=Sampling(temperature=2.0, top_k=1)).token_ids == greedy
        assert engine.generate(prompts, 8, sampling=Sampling(temperature=2.0, top_p=1e-6)).token_ids == greedy
        assert engine.generate(prompts, 8, sampling=Sampling(temperature=2.0, top_k=50)).token_ids != greedy
    finally:
        engine.close()
