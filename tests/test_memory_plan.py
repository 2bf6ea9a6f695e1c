"""Every stage sized by the model (tasks/adapters/model_memory.py), on a CPU: the sizing held to what the H200 measured
for the reference model (1.5B) and the 7B shape, a 128K-context model's evaluation engine, a 70B model that says it
cannot fit before anything starts, the paired passes' fallback, the disk check before a build. The GPU's size is a
parameter here (an H100's and an H200's NVML totals), as NVML would read it on the device."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quantgate.catalog.shapes import QWEN25_7B_INSTRUCT, QWEN25_14B_INSTRUCT
from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.catalog.variants import EvalHoldoutCalibration, HoldoutSlice, TextCalibration, VariantSpec
from quantgate.tasks.adapters import model_memory as mm
from quantgate.tasks.adapters.dummy_weights import layout
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.evaluators.engine import engine_plan
from quantgate.tasks.adapters.evaluators.lm_eval import task_words
from quantgate.tasks.adapters.speed import options
from quantgate.tasks.runtime import launch
from tests.shared_data import TINY_MODEL

H100 = 81_559 << 20  # NVML's total of an H100 80GB HBM3, as nvidia-smi shows it
H200 = 143_771 << 20  # and of an H200
GIB = 1 << 30

# Qwen2.5-Coder-1.5B-Instruct, the reference model, as its GGUF was dequantized: its output head stored apart from
# the embedding table (1,777,088,000 parameters, benchmarks/results/h200/reference12/models.parquet).
QWEN_1_5B = {**QWEN25_7B_INSTRUCT, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12,
             "num_key_value_heads": 2, "max_window_layers": 21, "vocab_size": 151936}
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128009}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
             "num_hidden_layers": 80}

AWQ = VariantSpec(name="awq-w4a16-g128", method="awq", scheme="W4A16", group_size=128)
GPTQ = VariantSpec(name="gptq-w4a16-g128", method="gptq", scheme="W4A16", group_size=128)
FP8 = VariantSpec(name="fp8-dynamic", method="fp8", scheme="FP8_DYNAMIC", group_size=None)
# The reference model's calibration: 256 samples of 512 tokens (catalog/models.yaml).
CALIBRATION = EvalHoldoutCalibration(samples=256, seq_len=512, items=(HoldoutSlice(dataset="gsm8k", start=810),))
# The gpu-reference suite's passkey: 6,000-word documents.
REFERENCE_WORDS = [6000]


@pytest.fixture(scope="module")
def qwen_1_5b():
    return layout(QWEN_1_5B)


@pytest.fixture(scope="module")
def qwen_7b():
    return layout(QWEN25_7B_INSTRUCT)


def _shape(folder: Path, config: dict) -> Path:
    """A model's shape as a run on it has it: a folder with its config and no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_weights_and_builds_are_predicted_from_the_base_as_the_reference_stored_them(qwen_1_5b):
    # benchmarks/results/h200/reference12/variants.parquet: size_bytes of the base and its builds (file sizes, so
    # with the safetensors headers' few KB).
    assert mm.loaded_weight_bytes(qwen_1_5b) == pytest.approx(3_554_214_752, rel=1e-4)
    assert mm.variant_weight_bytes(qwen_1_5b, GPTQ) == pytest.approx(1_609_439_848, rel=1e-4)
    assert mm.variant_weight_bytes(qwen_1_5b, AWQ) == mm.variant_weight_bytes(qwen_1_5b, GPTQ)
    assert mm.variant_weight_bytes(qwen_1_5b, FP8) == pytest.approx(2_245_332_464, rel=1e-4)
    # A float32 checkpoint loads in bf16 at half its size; packed int4 codes stay as stored.
    assert mm.loaded_weight_bytes({"a.weight": ((8, 8), 256), "b.weight_packed": ((8, 1), 32)}) == 128 + 32


@pytest.mark.parametrize(("what", "weights", "kv_cache", "measured"), [
    # reference12/speed_results.parquet: each vLLM engine of the ref-latency session (CUDA graphs to batch 512),
    # NVML's peak, its sized KV cache and the checkpoint's weights.
    ("1.5B base", 3_554_214_752, 6_881_280_000, 14_189_330_432),
    ("1.5B fp8-dynamic", 2_245_332_464, 1_761_607_680, 8_174_698_496),
    ("1.5B gptq-w4a16-g128", 1_609_439_848, 1_761_607_680, 7_560_232_960),
])
def test_an_engine_is_sized_like_the_reference_engines_measured(what, weights, kv_cache, measured):
    predicted = weights + kv_cache + mm.engine_overhead_bytes(QWEN_1_5B)
    assert predicted == pytest.approx(measured, rel=0.03), what


@pytest.mark.parametrize(("where", "measured"), [
    # benchmarks/results/h200/suite7-crosscheck/summary.json: the 7B shape's bf16 engine (graphs to batch 128).
    ("H200, before stages were sized", 23_632_805_888),
    # benchmarks/results/h100/suite-7b-offline/speed_results.parquet (nvml_peak_bytes): the same engine on an H100
    # with this sizing in place (commit 3c82d93), the first GPU run of it.
    ("H100, sized", 23_630_708_736),
])
def test_an_engine_is_sized_like_the_7b_shape_measured(qwen_7b, where, measured):
    # Both with a 3,523,215,360-byte KV cache (61,440 tokens); the weights as the shape lays them out.
    predicted = mm.loaded_weight_bytes(qwen_7b) + 3_523_215_360 + mm.engine_overhead_bytes(QWEN25_7B_INSTRUCT)
    assert predicted == pytest.approx(measured, rel=0.03), where


@pytest.mark.parametrize(("spec", "measured"), [
    # reference12/variants.parquet: peak_memory_bytes, torch's allocator in each build's process.
    (AWQ, 7_398_523_904), (GPTQ, 2_578_736_640), (FP8, 3_592_838_144),
])
def test_a_build_is_sized_at_or_a_little_above_what_the_reference_build_took(qwen_1_5b, spec, measured):
    need = mm.build_need(qwen_1_5b, QWEN_1_5B, spec, CALIBRATION)
    allocated = need.bytes - need.parts["process"]  # the CUDA context is not the allocator's
    assert measured <= allocated <= 1.2 * measured, need.parts


def test_an_evaluation_engine_is_sized_by_the_model_not_a_fixed_share(qwen_1_5b, qwen_7b):
    small = mm.eval_engine(mm.loaded_weight_bytes(qwen_1_5b), QWEN_1_5B,
                           mm.eval_max_model_len(QWEN_1_5B, REFERENCE_WORDS), H200)
    # The reference's evaluations keep about the tokens they had (8 GiB: 299,593 at 28 KiB a token).
    assert small.kv_cache_bytes == mm.EVAL_KV_TOKENS * 28 * 1024
    # 6,000 words and a request beside them, within the model's 32,768.
    assert small.max_model_len == 6000 * 3 + 4096
    big = mm.eval_engine(mm.loaded_weight_bytes(qwen_7b), QWEN25_7B_INSTRUCT,
                         mm.eval_max_model_len(QWEN25_7B_INSTRUCT, REFERENCE_WORDS), H200)
    assert big.kv_cache_bytes == 8 * GIB  # fewer tokens, not a larger cache
    need = big.need("evaluate base").bytes
    assert 25 * GIB < need < 30 * GIB and need > 0.12 * H200  # more than the fixed share it was promised
    # vLLM checks that what it takes is free at its start.
    assert big.gpu_memory_utilization * H200 >= need > (big.gpu_memory_utilization - 0.01) * H200
    assert big.args() == {"max_model_len": 22096, "kv_cache_memory_bytes": 8 * GIB,
                          "gpu_memory_utilization": big.gpu_memory_utilization}


def test_a_128k_context_model_gets_an_evaluation_engine_that_starts():
    weights = mm.loaded_weight_bytes(layout(LLAMA_8B))
    per_token = 32 * 2 * 8 * 128 * 2
    # Before: a fixed 8 GiB KV cache and no max_model_len, so vLLM took the config's 131,072 tokens, whose one
    # sequence needs 16 GiB of cache: the engine did not start.
    assert 131072 * per_token > 8 * GIB
    assert mm.model_context(LLAMA_8B) == 131072
    # Now: what the suite needs (built-in tasks: the model's own, up to 32,768), and a cache that holds it.
    for words, length in ((REFERENCE_WORDS, 22096), (None, 32768), ([], 4096)):
        engine = mm.eval_engine(weights, LLAMA_8B, mm.eval_max_model_len(LLAMA_8B, words), H100)
        assert engine.max_model_len == length
        assert engine.kv_cache_bytes >= (length + 16) * per_token  # one whole sequence, in whole blocks
        assert engine.need("evaluate base").over(H100) is None and engine.gpu_memory_utilization <= 1.0


@pytest.mark.parametrize("gpu", [H100, H200])
def test_a_70b_model_says_which_stage_cannot_fit_before_anything_starts(tmp_path, gpu):
    shape = _shape(tmp_path / "llama-70b", LLAMA_70B)
    plan = mm.plan_run(shape, [(AWQ, CALIBRATION), (FP8, None)], backend="vllm", words=REFERENCE_WORDS, hf_batch=16,
                       kl_window=256, gpu_bytes=gpu)
    assert plan is not None
    with pytest.raises(mm.CapacityError) as raised:
        plan.check(gpu, "llama-3.1-70b")
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith("llama-3.1-70b: evaluate base needs 14")
    assert "GiB of GPU memory (weights 131.4 + KV cache" in line
    assert f"the GPU has {gpu / GIB:.1f} GiB, {0.95 * gpu / GIB:.1f} of it usable" in line
    # KL (both models at once) too; on the H100 also the FP8 build (the whole model in bf16) and its evaluation.
    assert line.endswith("(and 1 more stage)" if gpu == H200 else "(and 3 more stages)")


def test_7b_and_14b_shapes_fit_one_h200_and_share_it_by_memory(tmp_path):
    variants = [(AWQ, CALIBRATION), (GPTQ, CALIBRATION), (FP8, None)]
    plans = {name: mm.plan_run(_shape(tmp_path / name, config), variants, backend="vllm", words=REFERENCE_WORDS,
                               hf_batch=16, kl_window=256, gpu_bytes=H200)
             for name, config in (("7b", QWEN25_7B_INSTRUCT), ("14b", QWEN25_14B_INSTRUCT))}
    for name, plan in plans.items():
        plan.check(H200, name)  # nothing raised
    # The base's evaluation is a 7B run's largest job: four at once, each evaluation promised what its engine takes.
    assert plans["7b"].jobs_per_gpu(H200) == 4 and 25 * GIB < plans["7b"].eval_bytes < 30 * GIB
    assert plans["14b"].jobs_per_gpu(H200) == 3
    assert plans["7b"].jobs_per_gpu(None) is None  # no NVML: the setting decides
    # The run's pool: what fits, at most QUANTGATE_SHARED_JOBS_PER_GPU (6) per lane; one on a CPU.
    assert launch.shared_slots([None], True, 4) == 4
    assert launch.shared_slots([None], True, None) == launch.shared_slots([None], True, 9) == 6
    assert launch.shared_slots([None], False, 4) == 1


def test_the_reference_run_still_shares_its_h200_six_ways(tmp_path):
    shape = _shape(tmp_path / "qwen-1.5b", QWEN_1_5B)
    plan = mm.plan_run(shape, [(AWQ, CALIBRATION), (GPTQ, CALIBRATION), (FP8, None)], backend="vllm",
                       words=REFERENCE_WORDS, hf_batch=16, kl_window=256, gpu_bytes=H200)
    assert plan.jobs_per_gpu(H200) >= 6
    assert plan.alone[0].stage == "kl" and plan.alone[0].bytes < 10 * GIB


def test_paired_passes_fall_back_to_one_engine_at_a_time_when_two_do_not_fit(tmp_path, monkeypatch):
    base = _shape(tmp_path / "base", QWEN25_14B_INSTRUCT)
    variant = _shape(tmp_path / "variant", QWEN25_14B_INSTRUCT)
    opts = EngineOptions("cuda", "bfloat16", kv_cache_memory_bytes=12 * GIB, gpu_memory_utilization=0.05)
    # The GPU's size as NVML reads it on the device (this machine has none).
    monkeypatch.setattr(mm, "gpu_bytes", lambda: H100)
    need, too_big, unpaired = options.engine_fit(opts, variant, "vllm", (str(base), opts))
    assert need == mm.loaded_weight_bytes(layout(QWEN25_14B_INSTRUCT)) + 12 * GIB + mm.engine_overhead_bytes(
        QWEN25_14B_INSTRUCT)
    assert too_big is None
    assert unpaired.startswith("the base's engine and the variant's need 44.0 + 44.0 GiB together, more than the"
                               " GPU's 75.7 usable GiB: each timed in its own process") and "\n" not in unpaired
    monkeypatch.setattr(mm, "gpu_bytes", lambda: H200)
    assert options.engine_fit(opts, variant, "vllm", (str(base), opts))[1:] == (None, None)
    # One engine larger than the GPU does not start at all, and says so in one line.
    huge = EngineOptions("cuda", "bfloat16", kv_cache_memory_bytes=200 * GIB, gpu_memory_utilization=0.05)
    why = options.engine_fit(huge, variant, "vllm", None)[1]
    assert why == "vllm's engine on variant needs 232.0 GiB of GPU memory; the GPU has 140.4 GiB, 133.4 of it usable"


def test_the_suites_tasks_size_the_evaluation_context():
    assert task_words(SuiteSpec(tasks=(LocalTask(name="qg_passkey", metadata={"context_words": 6000}),
                                       LocalTask(name="qg_piqa")))) == [6000]
    assert task_words(SuiteSpec(tasks=(LocalTask(name="qg_passkey"),))) == [150]  # the task YAML's own
    assert task_words(SuiteSpec(tasks=(LocalTask(name="qg_piqa"), LocalTask(name="hellaswag")))) is None  # built-in


@pytest.mark.skipif(not TINY_MODEL.is_dir(), reason="needs ../shared/data")
def test_an_evaluation_engine_plan_reads_the_checkpoint_folder():
    engine = engine_plan(TINY_MODEL, [150])
    config = json.loads((TINY_MODEL / "config.json").read_text())
    assert engine.max_model_len == min(config["max_position_embeddings"], 150 * 3 + 4096)
    # No NVML here: vLLM is asked for little at start, the engine's size is counted for its admission.
    assert engine.gpu_memory_utilization == mm.EVAL_UNSIZED_UTILIZATION


def test_disk_for_builds_is_held_until_they_have_written(tmp_path):
    writing, other = tmp_path / "a.tmp", tmp_path / "b.tmp"
    writing.mkdir()
    other.mkdir()
    free = shutil.disk_usage(tmp_path).free
    with mm.disk_reserved(writing, free - 4 * GIB, "its build"):
        # What the build under way has yet to write is not free for another.
        with pytest.raises(mm.CapacityError) as raised:
            with mm.disk_reserved(other, 8 * GIB, "its build"):
                pass
        line = str(raised.value)
        assert line.startswith(f"its build needs 8.0 GiB of disk under {tmp_path}; ") and "GiB free (" in line
        assert "more held for builds under way)" in line and "\n" not in line
    with mm.disk_reserved(other, 8 * GIB, "its build"):  # the first one done: room again
        pass


@pytest.mark.skipif(not TINY_MODEL.is_dir(), reason="needs ../shared/data")
def test_a_build_short_of_disk_fails_in_one_line_before_it_starts(tmp_path):
    from quantgate.catalog.records import ModelArtifact
    from quantgate.tasks.steps.quantize import build_variant

    model = ModelArtifact(model_id="tiny", path=str(TINY_MODEL), source="local", revision=None, sha="disk-test")
    spec = VariantSpec(name="int8-w8a16", method="rtn", scheme="W8A16", group_size=None)
    out = tmp_path / "variants"
    out.mkdir()
    held = tmp_path / "held"
    held.mkdir()
    # Another build under way here holds all but 64 MiB of the disk.
    with mm.disk_reserved(held, shutil.disk_usage(tmp_path).free - (64 << 20), "its build"):
        built = build_variant(model, spec, TextCalibration(), out)  # data-free: the calibration is not read
    assert built.status == "failed" and built.path is None
    assert built.error.startswith("int8-w8a16: its build needs 0.3 GiB of disk under ") and "\n" not in built.error
    assert not list(out.glob(".*.tmp"))  # its temporary folder is gone
