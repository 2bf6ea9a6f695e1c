"""Which vLLM starts a run warms before it measures (tasks/speed/warmup.py, flows/speed_plan.py), on the
reference model's scenarios. Planning only: the warm-up starts themselves need a GPU and vLLM
(tests/gpu/test_warmup_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.catalog.schema import load_catalog
from quantgate.flows.speed_plan import SpeedPlan
from quantgate.tasks.records import VariantArtifact
from quantgate.tasks.speed.warmup import WARMUP_GPU_MEMORY_UTILIZATION, WARMUP_KV_CACHE_BYTES, warm_ups
from quantgate.tasks.speed.vllm_cli import serve_engine_args

W4A16 = {"quant_method": "compressed-tensors", "config_groups": {
    "group_0": {"weights": {"type": "int", "num_bits": 4, "group_size": 128}, "input_activations": None}}}


def _checkpoint(folder: Path, method: str, quant: dict | None) -> VariantArtifact:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 1536, **({"quantization_config": quant} if quant else {})}))
    return VariantArtifact(uid=method, model_uid="m", name=method, method=method, scheme=None, bits=None,
                           group_size=None, path=str(folder), recipe=None, recipe_hash=None)


def test_the_reference_run_warms_each_vllm_start_it_will_measure(tmp_path):
    cat = load_catalog()
    spec = next(m for m in cat.models if m.id == "qwen2.5-coder-1.5b-instruct")
    plan = SpeedPlan(spec, cat, None)
    base = plan.warm_ups(_checkpoint(tmp_path / "base", "base", None))
    # One engine session (offline, sampled, latency), the bench cross-check, and `vllm serve` at the defaults:
    # the forced Marlin kernel has no weight-only layer to run on, and an FP8 KV cache or a lower max_num_seqs
    # are points the defaults' measurement may show moot, so they are not warmed. Transformers compiles nothing.
    assert sorted(w.kind for w in base) == ["bench", "offline", "serve"]
    awq = plan.warm_ups(_checkpoint(tmp_path / "awq", "awq", W4A16))
    assert sorted((w.kind, dict(w.env).get("VLLM_DISABLED_KERNELS", "") != "") for w in awq) == [
        ("offline", False), ("serve", False), ("serve", True)]
    for w in base + awq:
        # The engine as measured, but with a small fixed KV cache: vLLM's compile key leaves memory settings out.
        assert (w.options.kv_cache_memory_bytes, w.options.gpu_memory_utilization) == (
            WARMUP_KV_CACHE_BYTES, WARMUP_GPU_MEMORY_UTILIZATION)
        assert w.options.max_model_len == 1024 and not w.options.enforce_eager
    serve = next(w for w in awq if w.kind == "serve")
    args = serve_engine_args(serve.options, serve.serve_args)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(WARMUP_KV_CACHE_BYTES)
    assert args[args.index("--max-cudagraph-capture-size") + 1] == "64"  # the serving scenario's own capture size


def test_transformers_and_cpu_scenarios_have_nothing_to_warm(tmp_path):
    cat = load_catalog()
    path = _checkpoint(tmp_path / "base", "base", None).path or ""
    offline = cat.scenarios["ref-offline"]
    assert warm_ups(path, "transformers", [("ref-offline", offline)]) == []
    assert warm_ups(path, "vllm", [("x", offline.model_copy(update={"device": "cpu"}))]) == []
