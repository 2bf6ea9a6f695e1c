"""Offline generation with vLLM (GPU only). The one module that imports vllm, and only inside methods."""

from __future__ import annotations

import gc
import time
from typing import Any

from quantgate.catalog.scenarios import GREEDY, Sampling
from quantgate.tasks.adapters.engines.base import EngineError, EngineOptions, Generation, RequestTiming

# Cumulative speculative-decoding counters of vLLM's metrics (Prometheus names without _total).
_SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "spec_decode_drafts",
    "vllm:spec_decode_num_draft_tokens": "spec_decode_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "spec_decode_accepted_tokens",
}


class VllmEngine:
    name = "vllm"
    continuous_batching = True

    def __init__(self) -> None:
        self._llm: Any = None
        self._speculative = False

    def load(self, model_path: str, options: EngineOptions) -> None:
        if options.device != "cuda":
            raise EngineError("vllm engine runs on a CUDA GPU only")
        try:
            from vllm import LLM
        except ImportError as e:
            raise EngineError(f"vllm is not importable: {e}") from None
        from quantgate.tasks.adapters.loadtime import LoadTimeError, vllm_args

        try:
            # A load-time (bitsandbytes) variant: the base folder, quantized in flight by vLLM.
            model_path, extra = vllm_args(model_path)
        except LoadTimeError as e:
            raise EngineError(str(e)) from None
        if options.dummy_weights:
            extra["load_format"] = "dummy"
        if options.speculative_config:
            extra["speculative_config"] = dict(options.speculative_config)
        if options.max_cudagraph_capture_size:
            extra["max_cudagraph_capture_size"] = options.max_cudagraph_capture_size
        if options.kv_cache_memory_bytes:
            extra["kv_cache_memory_bytes"] = options.kv_cache_memory_bytes
        self._llm = LLM(
            model=model_path,
            dtype=options.dtype,
            seed=options.seed,
            enable_prefix_caching=options.enable_prefix_caching,
            gpu_memory_utilization=options.gpu_memory_utilization,
            max_model_len=options.max_model_len,
            enforce_eager=options.enforce_eager,
            trust_remote_code=options.trust_remote_code,
            tensor_parallel_size=options.tensor_parallel_size,
            # LLM turns stats off by default; without them RequestOutput.metrics is None (no TTFT).
            disable_log_stats=False,
            **extra,
        )
        self._speculative = bool(options.speculative_config)

    def generate(self, prompts: list[list[int]] | list[str], max_new_tokens: int, *, ignore_eos: bool = True,
                 sampling: Sampling = GREEDY) -> Generation:
        if self._llm is None:
            raise EngineError("vllm engine: generate() before load()")
        from vllm import SamplingParams, TextPrompt, TokensPrompt

        params = SamplingParams(
            max_tokens=max_new_tokens,
            # min_tokens masks EOS out of the logits like transformers' min_new_tokens, so greedy picks
            # the same tokens in both engines; ignore_eos alone would let EOS be chosen and carried on. Sampled
            # runs are held against `vllm bench throughput`, whose sampler has no such mask (one more logits
            # processor each step), and their lengths are fixed by ignore_eos alone.
            min_tokens=max_new_tokens if ignore_eos and sampling.temperature == 0 else 0,
            ignore_eos=ignore_eos,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0: every token, as in Transformers
            detokenize=False,
        )
        inputs = [TextPrompt(prompt=p) if isinstance(p, str) else TokensPrompt(prompt_token_ids=p) for p in prompts]
        start_wall = time.time()
        start = time.perf_counter()
        outputs = self._llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        requests = [_timing(o.metrics, len(o.prompt_token_ids or ()), len(t), start_wall, wall)
                    for o, t in zip(outputs, token_ids)]
        ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
        return Generation(token_ids=token_ids, wall_s=wall, ttft_s=min(ttfts) if ttfts else None, requests=requests)

    def stats(self) -> dict[str, Any]:
        """The KV-cache budget the engine core settled on (synced back to this process's config after
        start-up) and, with speculative decoding, its cumulative draft/acceptance counters."""
        if self._llm is None:
            return {}
        config = self._llm.llm_engine.vllm_config
        blocks, block_size = config.cache_config.num_gpu_blocks, config.cache_config.block_size
        out: dict[str, Any] = {"kv_cache_tokens": blocks * block_size if blocks and block_size else None}
        if self._speculative:
            counts = dict.fromkeys(_SPEC_COUNTERS.values(), 0)
            for metric in self._llm.get_metrics():
                if metric.name in _SPEC_COUNTERS:
                    counts[_SPEC_COUNTERS[metric.name]] += int(getattr(metric, "value", 0))
            out.update(counts)
        return out

    def close(self) -> None:
        # Dropping the last reference lets vLLM's finalizers stop its engine-core process.
        self._llm = None
        gc.collect()


def _timing(metrics: Any, n_prompt: int, n_out: int, start_wall: float, wall: float) -> RequestTiming:
    """Per-request times from vLLM's RequestStateStats: arrival_time is wall clock, first_token_latency is
    measured from arrival, first/last_token_ts are engine-core monotonic stamps of the first and last token."""
    latency = getattr(metrics, "first_token_latency", None)
    arrival = getattr(metrics, "arrival_time", None)
    first_ts = getattr(metrics, "first_token_ts", None)
    last_ts = getattr(metrics, "last_token_ts", None)
    if not latency or arrival is None or not first_ts or not last_ts:
        return RequestTiming(output_tokens=n_out, ttft_s=None, e2el_s=wall, prompt_tokens=n_prompt)
    ttft = (arrival - start_wall) + latency
    return RequestTiming(output_tokens=n_out, ttft_s=ttft, e2el_s=ttft + (last_ts - first_ts), prompt_tokens=n_prompt)
