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
