"""Static-batch greedy generation with Hugging Face Transformers, on CPU or CUDA."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from quantgate.catalog.scenarios import GREEDY, Sampling
from quantgate.tasks.adapters.engines.base import EngineError, EngineOptions, Generation, RequestTiming
from quantgate.tasks.adapters.loadtime import descriptor, load_model


class _FirstTokenClock(BaseStreamer):
    """Timestamps the first generated step. generate() puts the prompt first, then each step's tokens
    as a host copy, so the second put happens once the device has produced the first token."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersEngine:
    name = "transformers"
    continuous_batching = False

    def __init__(self) -> None:
        self._model: Any = None
        self._tokenizer: Any = None
        self._device = torch.device("cpu")
        self._compile = False

    def load(self, model_path: str, options: EngineOptions) -> None:
        if options.device == "cuda" and not torch.cuda.is_available():
            raise EngineError("transformers engine: cuda requested but no CUDA GPU is visible")
        torch.manual_seed(options.seed)
        self._device = torch.device(options.device)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=options.trust_remote_code)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        dtype = getattr(torch, options.dtype)
        if options.dummy_weights and descriptor(model_path) is not None:
            raise EngineError("transformers engine: a load-time (bitsandbytes) variant has no dummy-weights mode")
        if options.dummy_weights:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=options.trust_remote_code)
            # Built on the device: random init there takes seconds where a 7B model on the CPU takes minutes.
            with self._device:
                model = AutoModelForCausalLM.from_config(
                    config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=options.trust_remote_code
                )
        elif descriptor(model_path) is not None:
            # A load-time (bitsandbytes) variant: the base quantized on load, placed by Transformers.
            model = load_model(model_path, device=options.device, dtype=dtype, attn_implementation="sdpa",
                               trust_remote_code=options.trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                model_path,
                dtype=dtype,
                attn_implementation="sdpa",
                trust_remote_code=options.trust_remote_code,
                # Straight onto the GPU: a compressed checkpoint then also decompresses there.
                device_map=options.device if options.device == "cuda" else None,
            )
        # bitsandbytes modules cannot be moved once loaded (Transformers placed them already).
        self._model = (model if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
                       else model.to(self._device)).eval()
        self._tokenizer = tokenizer
        self._compile = options.compile

    def generate(self, prompts: list[list[int]] | list[str], max_new_tokens: int, *, ignore_eos: bool = True,
                 sampling: Sampling = GREEDY) -> Generation:
        if self._model is None:
            raise EngineError("transformers engine: generate() before load()")
        if any(isinstance(p, str) for p in prompts):
            raise EngineError("transformers engine: prompts are token ids (text prompts are for vllm)")
        batch = self._tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt").to(self._device)
        clock = _FirstTokenClock()
        self._sync()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self._model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                # Forbidding EOS until max_new_tokens makes every sequence exactly that long.
                min_new_tokens=max_new_tokens if ignore_eos else None,
                **({"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                    "top_k": sampling.top_k} if sampling.temperature > 0 else {"do_sample": False}),
                pad_token_id=self._tokenizer.pad_token_id,
                streamer=clock,
                # A static cache lets generate() compile the decoding step (CUDA graphs, on a GPU);
                # the first call of a new shape pays the compilation.
                **({"cache_implementation": "static"} if self._compile else {}),
            )
        self._sync()
        wall = time.perf_counter() - start
        rows = out[:, batch["input_ids"].shape[1] :].tolist()
        token_ids = rows if ignore_eos else [self._until_eos(r) for r in rows]
        ttft = None if clock.first_token_at is None else clock.first_token_at - start
        # A static batch answers every request at once: they share its TTFT and end-to-end latency.
        return Generation(
            token_ids=token_ids,
            wall_s=wall,
            ttft_s=ttft,
            requests=[RequestTiming(output_tokens=len(t), ttft_s=ttft, e2el_s=wall, prompt_tokens=len(p))
                      for p, t in zip(prompts, token_ids)],
        )

    def stats(self) -> dict[str, Any]:
        return {"compiled": self._compile}

    def close(self) -> None:
        self._model = None
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _until_eos(self, row: list[int]) -> list[int]:
        # Once a sequence emits EOS, generate() fills the rest of its row with the pad token.
        eos = self._model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        for i, token in enumerate(row):
            if token in eos_ids:
                return row[: i + 1]
        return row

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
