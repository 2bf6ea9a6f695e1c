"""Scenario kinds and levers, and the GPU suite file that orders them."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.gpu_suite import load_gpu_suite
from quantgate.catalog.paths import CATALOG_DIR
from quantgate.catalog.scenarios import OfflineScenario, ServingScenario, SpeculativeSpec, bench_mismatch, scenario_from
from quantgate.flows.gpu_suite import GpuSuiteError, check_steps
from quantgate.tasks.adapters.speed.options import engine_options


def _error(**fields) -> str:
    with pytest.raises(ValidationError) as info:
        scenario_from(fields)
    return info.value.errors()[0]["msg"]


def test_serving_scenario_lists_its_loads_in_order():
    s = ServingScenario(engines=["vllm"], concurrency=[1, 8], request_rates=[4, 0.5], rounds=3,
                     num_prompts=10, slo={"ttft_ms": 500, "tpot_ms": 50})

    assert s.load_sizes() == [("c=1", 1, None, 3), ("c=8", 8, None, 24), ("rate=4", None, 4.0, 10),
                              ("rate=0.5", None, 0.5, 10)]
    assert ServingScenario(engines=["vllm"], concurrency=[2], num_prompts=7).load_sizes() == [
        ("c=2", 2, None, 7)]
    assert s.slo.ttft_ms == 500 and s.slo.e2el_ms is None


def test_inconsistent_scenarios_are_refused_with_a_reason():
    assert "needs concurrency levels or request_rates" in _error(kind="serving", engines=["vllm"])
    assert "runs on vllm alone" in _error(kind="serving", engines=["transformers", "vllm"], concurrency=[1])
    assert scenario_from({"kind": "serving", "concurrency": [1]}).engines == ("vllm",)  # its one engine, unsaid
    with pytest.raises(ValidationError) as info:  # a field of another kind is not one of this kind's
        scenario_from({"kind": "offline", "concurrency": [1]})
    assert [(e["loc"], e["type"]) for e in info.value.errors()] == [(("offline", "concurrency"), "extra_forbidden")]
    assert "has no bench" in _error(kind="latency", engines=["vllm", "vllm-bench"])
    assert scenario_from({"input_len": 8}).kind == "offline"  # a scenario without a kind is offline, as before
    assert "shared_prefix_len 64 must be shorter than input_len 64" in _error(input_len=64, shared_prefix_len=64)
    assert "max_model_len 90 is below input_len + output_len (96)" in _error(max_model_len=90)
    assert "transformers_compile needs the transformers engine" in _error(engines=["vllm"], transformers_compile=True)
    assert "speculative is a vllm lever" in _error(engines=["transformers"], speculative="ngram")
    assert "tensor_parallel_size is a vllm lever" in _error(engines=["transformers"], tensor_parallel_size=2)
    assert "greater than 0" in _error(kind="serving", engines=["vllm"], request_rates=[0])
    assert "prompt_lookup_min 5 exceeds" in _error(speculative={"prompt_lookup_min": 5, "prompt_lookup_max": 4})
    assert "transformers takes token ids" in _error(prompt_input="text")
    assert "no prompts_file or shared_prefix_len" in _error(engines=["vllm"], prompt_input="text", input_len=64,
                                                           shared_prefix_len=8)


def test_a_cross_check_times_the_benchs_work_or_is_refused_with_why():
    sampled = {"engines": ["vllm", "vllm-bench"], "temperature": 1.0}
    assert bench_mismatch(scenario_from({**sampled, "prompt_input": "text"})) is None
    assert "tokenizes its random dataset's text prompts inside each timed pass" in bench_mismatch(scenario_from(sampled))
    assert "temperature" in bench_mismatch(scenario_from({**sampled, "temperature": 0.0, "prompt_input": "text"}))


def test_levers_become_engine_options():
    s = OfflineScenario(engines=["vllm"], speculative="ngram", enforce_eager=True, enable_prefix_caching=True,
                     max_model_len=1024, gpu_memory_utilization=0.5, max_cudagraph_capture_size=64)
    opts = engine_options(s, "cuda", dummy_weights=True)

    assert s.speculative == SpeculativeSpec()
    assert opts.speculative_config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2}
    assert (opts.enforce_eager, opts.enable_prefix_caching, opts.dummy_weights) == (True, True, True)
    assert (opts.max_model_len, opts.gpu_memory_utilization, opts.max_cudagraph_capture_size) == (1024, 0.5, 64)
    assert opts.dtype == "bfloat16" and not opts.compile
    # Unset: the defaults, and max_model_len just fits the scenario.
    plain = engine_options(OfflineScenario(input_len=10, output_len=6), "cpu")
    assert (plain.max_model_len, plain.gpu_memory_utilization, plain.speculative_config) == (16, 0.8, None)


def test_packaged_gpu_suite_validates_and_each_step_needs_one_engine_start():
    suite = load_gpu_suite(CATALOG_DIR / "gpu.yaml")
    check_steps(suite)

    assert suite.base_build == "bf16" and suite.builds["w4a16-g128"].quant == "w4a16"
    # Most important first: offline throughput of both builds on vLLM before anything else.
    assert [(s.engine, s.build) for s in suite.steps[:2]] == [("vllm", "bf16"), ("vllm", "w4a16-g128")]
    assert [s.part for s in suite.steps[-3:]] == ["compile", "tp2", "sweep-w4a16"]
    merged = suite.scenarios["prefix-on"]
    assert (merged.kind, merged.shared_prefix_len, merged.enable_prefix_caching, merged.max_model_len) == (
        "offline", 192, True, 512)
    assert suite.scenarios["serving"].load_sizes()[0] == ("c=1", 1, None, 4)
    # Each cross-check runs `vllm bench throughput`'s sampler, on a scenario our vLLM also runs in the same part.
    for bench in (s for s in suite.steps if s.engine == "vllm-bench"):
        (name,) = bench.scenarios
        assert suite.scenarios[name].temperature == 1.0 and suite.scenarios["offline"].temperature == 0
        ours = [s for s in suite.steps if s.engine == "vllm" and s.build == bench.build and name in s.scenarios]
        assert ours and ours[0].part.startswith("offline")


def test_broken_suites_are_one_line_errors(tmp_path):
    raw = yaml.safe_load((CATALOG_DIR / "gpu.yaml").read_text())

    def write(mutate) -> str:
        data = yaml.safe_load(yaml.safe_dump(raw))
        mutate(data)
        path = tmp_path / "suite.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)

    with pytest.raises(CatalogError, match=r"steps.0.scenarios: unknown scenario 'nope'"):
        load_gpu_suite(write(lambda d: d["steps"][0].update(scenarios=["nope"])))
    with pytest.raises(CatalogError, match=r"engine vllm-serve runs serving scenarios, 'offline' is offline"):
        load_gpu_suite(write(lambda d: d["steps"][0].update(engine="vllm-serve", scenarios=["offline"])))
    with pytest.raises(CatalogError, match=r"scenario 'latency-compile' does not list engine 'vllm'"):
        load_gpu_suite(write(lambda d: d["steps"][0].update(scenarios=["latency-compile"])))
    with pytest.raises(CatalogError, match=r"steps.2: vllm bench throughput samples at temperature 1 \(top-p 1, no "
                                           r"top-k\), the scenario at 0 \(top-p 1, top-k off\): cross-check a twin"
                                           r" of it with temperature: 1 and neither"):
        load_gpu_suite(write(lambda d: d["steps"][2].update(scenarios=["offline"])))
    with pytest.raises(CatalogError, match=r"temperature"):
        load_gpu_suite(write(lambda d: d["scenarios"]["offline"].update(temperature=-1)))
    with pytest.raises(CatalogError, match=r"unknown build 'fp8'"):
        load_gpu_suite(write(lambda d: d["steps"][0].update(build="fp8")))
    mixed = load_gpu_suite(write(lambda d: d["steps"][0].update(scenarios=["offline", "prefix-on"])))
    with pytest.raises(GpuSuiteError, match=r"'offline' and 'prefix-on' need different engine options"):
        check_steps(mixed)
