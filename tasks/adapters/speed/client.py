"""The streaming load client of any OpenAI-compatible server: Completions requests sent on a schedule, each
timed from its stream, as vLLM's serving benchmark does (see metrics.py for the definitions)."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import itertools
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from quantgate.catalog.records import LoadRun, RequestRecord
from quantgate.catalog.scenarios import GREEDY, Sampling
from quantgate.tasks.adapters.speed.errors import ServingError


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times of n requests: all at 0 for an infinite rate, else a Poisson process whose gaps are
    rescaled so the last arrival is at n / rate, as vLLM's benchmark does to steady the rate across seeds."""
    if request_rate <= 0:
        raise ServingError(f"request_rate must be > 0 (inf sends all at once), got {request_rate}")
    if math.isinf(request_rate) or n == 0:
        return [0.0] * n
    rng = random.Random(seed)
    offsets = list(itertools.accumulate(rng.expovariate(request_rate) for _ in range(n)))
    scale = (n / request_rate) / offsets[-1]
    return [o * scale for o in offsets]


def run_load(
    base_url: str,
    prompts: Sequence[list[int] | str],
    output_len: int,
    *,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
    seed: int = 0,
    model: str | None = None,
    ignore_eos: bool = True,
    warmup: int = 0,
    timeout_s: float = 6 * 3600,
    extra_body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    vllm_extras: bool = True,
    sampling: Sampling = GREEDY,
) -> LoadRun:
    """Send every prompt (token ids, or text for servers that take only text) to
    {base_url}/v1/completions, streaming, greedy (or as `sampling` says), exactly `output_len` tokens each when
    `ignore_eos`.
    `warmup` requests go first and are not recorded. `headers` go with every request (an
    Authorization header for a hosted API). Without `vllm_extras` the body keeps to the OpenAI
    Completions fields: no `ignore_eos` / `min_tokens` (servers that reject unknown fields), so a
    request may stop early at EOS; its output tokens are then the usage chunk's count."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ServingError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
    if output_len < 1:
        raise ServingError(f"output_len must be >= 1, got {output_len}")
    return asyncio.run(
        _run_load(
            base_url.rstrip("/"),
            prompts,
            output_len,
            max_concurrency=max_concurrency,
            request_rate=request_rate,
            seed=seed,
            model=model,
            ignore_eos=ignore_eos,
            warmup=warmup,
            timeout_s=timeout_s,
            extra_body=extra_body or {},
            headers=headers or {},
            vllm_extras=vllm_extras,
            sampling=sampling,
        )
    )


async def _run_load(
    base_url: str,
    prompts: Sequence[list[int] | str],
    output_len: int,
    *,
    max_concurrency: int | None,
    request_rate: float,
    seed: int,
    model: str | None,
    ignore_eos: bool,
    warmup: int,
    timeout_s: float,
    extra_body: dict[str, Any],
    headers: dict[str, str],
    vllm_extras: bool,
    sampling: Sampling,
) -> LoadRun:
    import aiohttp

    offsets = arrival_offsets(len(prompts), request_rate, seed)
    # aiohttp caps a session at 100 connections by default; 0 lifts the cap so only the semaphore limits.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, limit_per_host=max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    seen: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        model = model or await _first_model(session, base_url)
        url = f"{base_url}/v1/completions"
        body = {**_payload(output_len, ignore_eos, vllm_extras, sampling), **extra_body, "model": model}
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

        async def warm(i: int) -> None:
            async with slots:
                await _stream_one(session, url, body, prompts[i % len(prompts)], i, time.perf_counter(), seen)

        await asyncio.gather(*(warm(i) for i in range(warmup)))

        start = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            async with slots:
                record = await _stream_one(session, url, body, prompts[i], i, start, seen)
            record.arrival_offset_s = offsets[i]
            return record

        records = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - start
    config = _load_config(output_len, len(prompts), max_concurrency=max_concurrency, request_rate=request_rate,
                          seed=seed, sampling=sampling, ignore_eos=ignore_eos, vllm_extras=vllm_extras, warmup=warmup)
    return LoadRun(records=list(records), duration_s=duration, model=model, config=config, server_info=seen)


def _load_config(
    output_len: int, num_prompts: int, *, max_concurrency: int | None, request_rate: float, seed: int,
    sampling: Sampling, ignore_eos: bool, vllm_extras: bool, warmup: int,
) -> dict[str, Any]:
    """How the load was sent, as the run records it."""
    return {
        "output_len": output_len,
        "num_prompts": num_prompts,
        "max_concurrency": max_concurrency,
        "request_rate": None if math.isinf(request_rate) else request_rate,
        "seed": seed,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "ignore_eos": ignore_eos,
        "vllm_extras": vllm_extras,
        "warmup": warmup,
    }


def _payload(output_len: int, ignore_eos: bool, vllm_extras: bool = True,
             sampling: Sampling = GREEDY) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": output_len,
        "temperature": sampling.temperature,
        **({"top_p": sampling.top_p} if sampling.temperature > 0 else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if vllm_extras:
        # min_tokens masks EOS like the offline engines do, so every request yields exactly output_len.
        body["min_tokens"] = output_len if ignore_eos else 0
        body["ignore_eos"] = ignore_eos
        if sampling.temperature > 0 and sampling.top_k:
            body["top_k"] = sampling.top_k  # not an OpenAI Completions field: vLLM's (and SGLang's) extra
    return body


# Response headers that name the server or its version, kept with the results (never request headers,
# which carry the API key).
_IDENTITY_HEADERS = ("server", "x-powered-by", "openai-version", "openai-model", "x-model-id", "x-served-by")


async def _first_model(session: Any, base_url: str) -> str:
    try:
        async with session.get(f"{base_url}/v1/models") as r:
            r.raise_for_status()
            data = await r.json()
        return data["data"][0]["id"]
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the caller
        raise ServingError(f"cannot list models at {base_url}/v1/models: {type(e).__name__}: {e}") from None


async def _stream_one(
    session: Any, url: str, body: dict[str, Any], prompt: list[int] | str, index: int, run_start: float,
    seen: dict[str, Any] | None = None,
) -> RequestRecord:
    """One request sent and timed from its stream; a failure is recorded in the record, never raised."""
    record = _blank_record(index, prompt)
    st = time.perf_counter()
    record.start_offset_s = st - run_start
    stream = _Stream(start=st, last=st)
    try:
        async with session.post(url, json={**body, "prompt": prompt}) as response:
            if response.status != 200:
                text = (await response.text())[:200].replace("\n", " ")
                record.error = f"HTTP {response.status}: {text}"
                return record
            stream.identity = {f"header.{h}": response.headers[h] for h in _IDENTITY_HEADERS if h in response.headers}
            record.error = await _read_events(response, stream, record)
            if record.error is not None:
                return record
    except Exception as e:  # noqa: BLE001 - recorded per request, the run goes on
        record.error = f"{type(e).__name__}: {e}"
        return record
    return _finished(record, stream, seen)


def _blank_record(index: int, prompt: list[int] | str) -> RequestRecord:
    return RequestRecord(
        index=index,
        success=False,
        error=None,
        # A text prompt's token count is the server's to say (usage.prompt_tokens).
        prompt_len=0 if isinstance(prompt, str) else len(prompt),
        output_tokens=0,
        ttft_s=None,
        itl_s=[],
        e2el_s=None,
        tpot_s=None,
        arrival_offset_s=0.0,
        start_offset_s=0.0,
    )


@dataclass
class _Stream:
    """What one request's stream has shown so far: when it started, its last token chunk, how many."""

    start: float
    last: float
    chunks: int = 0
    usage_tokens: int | None = None
    identity: dict[str, Any] = field(default_factory=dict)

    def take(self, data: dict[str, Any], now: float, record: RequestRecord) -> str | None:
        """One event folded into the stream and the record; the error an error event carries."""
        if "error" in data:
            err = data["error"]
            return f"server error: {err.get('message', err) if isinstance(err, dict) else err}"
        for key in ("model", "system_fingerprint"):
            if data.get(key) and key not in self.identity:
                self.identity[key] = data[key]
        if _carries_token(data):
            if self.chunks == 0:
                record.ttft_s = now - self.start
            else:
                record.itl_s.append(now - self.last)
            self.last = now
            self.chunks += 1
        if usage := data.get("usage"):
            self.usage_tokens = usage.get("completion_tokens")
            record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
            record.server_metrics = data.get("metrics")
        return None


async def _read_events(response: Any, stream: _Stream, record: RequestRecord) -> str | None:
    """The response's server-sent events, each timed as it arrives; the error an error event carries."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buffer = ""
    async for raw in response.content.iter_any():
        now = time.perf_counter()
        buffer += decoder.decode(raw)
        *lines, buffer = buffer.split("\n")
        for line in lines:
            data = _sse_data(line)
            if data is not None and (error := stream.take(data, now, record)) is not None:
                return error
    return None


def _finished(record: RequestRecord, stream: _Stream, seen: dict[str, Any] | None) -> RequestRecord:
    """The record of a stream that ended without error: successful when it carried a token."""
    if stream.chunks == 0:
        record.error = "the stream carried no token chunk"
        return record
    record.success = True
    if seen is not None and not seen:
        seen.update(stream.identity)
    record.e2el_s = stream.last - stream.start
    # Without a usage chunk, count chunks: exact only when each chunk carries one token.
    record.output_tokens = stream.usage_tokens if stream.usage_tokens is not None else stream.chunks
    if record.output_tokens > 1:
        record.tpot_s = (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)
    return record


def _carries_token(data: dict[str, Any]) -> bool:
    """Whether a chunk with choices streams output. vLLM sends usage in a chunk of its own with no
    choices; other servers (transformers serve) put it on a closing chunk whose choice has empty text
    and only a finish_reason: that closing chunk is no token and must not add an ITL gap."""
    choices = data.get("choices")
    if not choices:
        return False
    choice = choices[0]
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    return not (text == "" and (choice.get("finish_reason") or data.get("usage")))


def _sse_data(line: str) -> dict[str, Any] | None:
    """The JSON of one `data:` line of a server-sent event stream; None for anything else."""
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separators, ": ping" comments, event/id fields
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    return json.loads(payload)

