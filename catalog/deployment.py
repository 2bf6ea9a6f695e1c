"""Deployment extras: hub authors the release watcher follows (`watch:`) and endpoints benchmarked by URL
(`endpoints:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from quantgate.catalog.spec import Strict


class WatchSpec(Strict):
    """Hub models the release watcher lists: one author (org), optionally narrowed by a search string
    (a family, e.g. 'Qwen2.5'). New releases are evaluated like `template` (a catalog model id: its
    variants, suite, scenarios, calibration and policy) unless `variants` names others."""

    author: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    search: str | None = None
    template: str
    variants: tuple[str, ...] | None = None
    # The newest `limit` models of the author (by last modification) are compared with the warehouse.
    limit: int = Field(default=20, ge=1, le=1000)


class EndpointSpec(Strict):
    """An OpenAI-compatible server benchmarked by URL (`quantgate bench-endpoint NAME`): vllm serve,
    SGLang, Ollama, TensorRT-LLM's server, a hosted API. Its serving scenarios' loads, lengths, seed and
    SLO apply; their vLLM engine levers do not (the server is configured where it runs).

    api_key_env names the environment variable that holds the API key; the key itself is never written
    anywhere. Prompts are text unless prompt_format is 'tokens' (token ids, as vLLM and SGLang accept):
    the tokenizer folder's random ids decoded, or seeded words when there is no tokenizer.
    vllm_extras sends ignore_eos/min_tokens for exact output lengths (servers that reject unknown fields
    must leave it off; outputs may then stop early at EOS). device and num_devices price its tokens."""

    url: str = Field(pattern=r"^https?://")
    model: str
    api_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    scenarios: tuple[str, ...] = ()
    prompt_format: Literal["text", "tokens"] = "text"
    tokenizer: str | None = None
    vllm_extras: bool = False
    device: str | None = None
    num_devices: int = Field(default=1, ge=1)
