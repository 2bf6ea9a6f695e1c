"""bitsandbytes variants on a CUDA GPU (the tiny model, under a minute): the build on cuda, KL on cuda,
the Transformers benchmark on cuda, vLLM's in-flight NF4, and vLLM skipping int8 with its reason."""

import pytest

from quantgate.catalog.records import ModelArtifact
from quantgate.catalog.scenarios import OfflineScenario
from quantgate.catalog.variants import VariantSpec
from quantgate.tasks.steps import quantize
from quantgate.tasks.steps.benchmark import run_scenario
from quantgate.tasks.steps.divergence import kl_divergence
from tests.shared_data import SHARED, TINY_MODEL

pytestmark = pytest.mark.gpu
pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (its wheel is not in the devkit?)")

SCENARIO = OfflineScenario(num_prompts=8, input_len=32, output_len=16, batch_size=8, warmup=1, repetitions=3,
                        device="cuda")
TEXT = str(SHARED / "eval" / "simple_stories" / "simple_stories.txt")


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    model = ModelArtifact("stories260k", str(TINY_MODEL), "local", None, "0" * 64)
    out = tmp_path_factory.mktemp("bnb")
    built = {s: quantize.build_variant(model, VariantSpec(name=f"bnb-{s}", method="bnb", scheme=s), None, out)
             for s in ("int8", "nf4")}
    for v in built.values():
        assert v.status == "built", v.error
    return built


def test_build_on_cuda_measures_gpu_memory_and_size(variants):
    for v in variants.values():
        assert v.size_bytes > 0 and v.peak_memory_bytes > 0
    assert variants["nf4"].size_bytes < variants["int8"].size_bytes < quantize.weights_bytes(TINY_MODEL)


def test_kl_and_transformers_benchmark_on_cuda(variants):
    for v in variants.values():
        metric, _ = kl_divergence(str(TINY_MODEL), v.path, TEXT, max_tokens=512, device="cuda", dtype="bfloat16")
        assert 0 < metric.value < 1
        r = run_scenario(v.path, "transformers", "gpu-tiny", SCENARIO)
        assert r.status == "ok", r.reason
        assert r.output_tokens == 8 * 16 and r.tokens_per_s > 0 and "cuda" in r.versions


def test_vllm_quantizes_nf4_in_flight_and_skips_int8(variants):
    pytest.importorskip("vllm", reason="vllm is not installed")
    int8 = run_scenario(variants["int8"].path, "vllm", "gpu-tiny", SCENARIO)
    assert int8.status == "skipped" and "NF4 only" in int8.reason
    nf4 = run_scenario(variants["nf4"].path, "vllm", "gpu-tiny", SCENARIO, options={"gpu_memory_utilization": 0.2})
    assert nf4.status == "ok", nf4.reason
    assert nf4.output_tokens == 8 * 16 and nf4.tokens_per_s > 0
