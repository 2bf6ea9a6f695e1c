"""What every inference engine offers the benchmark: load a checkpoint, generate from prompts, close."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.scenarios import GREEDY, Sampling


class EngineError(QuantgateError, RuntimeError):
    """An engine that cannot load or run; the message is one line."""


@dataclass(frozen=True)
class EngineOptions:
    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "bfloat16", "float16"]
    seed: int = 0
    enable_prefix_caching: bool = False
    max_model_len: int | None = None
    # vLLM only: share of GPU memory it may take (weights + KV cache), and CUDA graphs off.
    gpu_memory_utilization: float = 0.8
    enforce_eager: bool = False
    trust_remote_code: bool = False
    # Random weights instead of loading a checkpoint (a folder that has none): vLLM's load_format
    # "dummy", Transformers' from_config on the device.
    dummy_weights: bool = False
    # vLLM only: SpeculativeConfig fields, tensor parallelism, the largest batch captured as a CUDA graph.
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    max_cudagraph_capture_size: int | None = None
    # vLLM only: a fixed KV cache instead of a share of free memory (tasks/adapters/speed/options.sized_kv_cache: an
    # engine that starts beside other jobs; vLLM's compile cache key leaves memory settings out).
    kv_cache_memory_bytes: int | None = None
    # Transformers only: a static KV cache, which makes generate() torch.compile its decoding step.
    compile: bool = False


@dataclass(frozen=True)
class RequestTiming:
    """One request, timed from the moment its generate call started, with its prompt's tokens as the engine
    counted them (a text prompt's are the engine's tokenizer's)."""

    output_tokens: int
    ttft_s: float | None
    e2el_s: float
    prompt_tokens: int

    @property
    def tpot_s(self) -> float | None:
        # vLLM's definition: the first token is paid by TTFT, the rest share the remaining time.
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Generation:
    """The result of one generate call: exactly the tokens each sequence produced, never padding."""

    token_ids: list[list[int]]
    wall_s: float
    ttft_s: float | None
    requests: list[RequestTiming]

    @property
    def output_tokens(self) -> list[int]:
        return [len(t) for t in self.token_ids]


class Engine(Protocol):
    name: str
    # True: the engine schedules requests itself, so an offline run hands it every prompt at once.
    continuous_batching: bool

    def load(self, model_path: str, options: EngineOptions) -> None: ...

    def generate(self, prompts: list[list[int]] | list[str], max_new_tokens: int, *, ignore_eos: bool = True,
                 sampling: Sampling = GREEDY) -> Generation:
        """Greedy at temperature 0, else sampled at `sampling`'s temperature, top-p and top-k. Prompts are
        token ids, or text that the engine tokenizes inside the call (vLLM only)."""
        ...

    def stats(self) -> dict[str, Any]:
        """What the loaded engine reports about itself: KV-cache budget, cumulative counters."""
        ...

    def close(self) -> None: ...
