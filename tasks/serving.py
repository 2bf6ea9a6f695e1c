"""Online serving benchmark: a `vllm serve` process, a streaming load client, and vLLM's own
`vllm bench throughput` run beside it as a cross-check; serve_scenario and bench_scenario run a
catalog scenario through them.

Metric definitions follow vLLM's serving benchmark (vllm/benchmarks/lib/endpoint_request_func.py and
vllm/benchmarks/serve.py, vLLM 0.26): TTFT is the time to the first streamed chunk that carries a
choice; ITL is the gap between consecutive such chunks (one per chunk, so a chunk that carries several
tokens gives one gap); E2EL ends at the last such chunk; the output token count comes from the final
usage chunk and TPOT = (E2EL - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task
from prefect.cache_policies import NO_CACHE

from quantgate.catalog.schema import ScenarioSpec, bench_mismatch
from quantgate.tasks import engines
from quantgate.tasks.benchmark import (
    checkpoint_config,
    engine_options,
    fallback_options,
    looks_like_oom,
    make_prompts,
    root_cause,
    text_config,
    wants_random_weights,
)
from quantgate.tasks.engines import EngineOptions
from quantgate.tasks.records import SpeedResult
from quantgate.tasks.roofline import kv_bytes_per_token
from quantgate.tasks.telemetry import Telemetry, nvml_device_name

# `python -m vllm.entrypoints.cli.main` is what the `vllm` console script runs, without relying on PATH.
VLLM_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")
# The device has no route to the hubs or to usage collection; fail fast instead of retrying.
_QUIET_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class ServingError(RuntimeError):
    """A server or benchmark run that cannot start or finish; the message is one line."""


# --- the server process -------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A server started by `start_server`, in its own process group so that stopping it also ends
    the children it spawned (vLLM's engine-core and workers)."""

    pid: int
    base_url: str
    model: str | None
    log_path: Path
    command: list[str]
    process: subprocess.Popen = field(repr=False)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the group, SIGKILL what is left after `grace_s`; returns the leader's exit code."""
        _end_group(self.process, grace_s)
        return self.process.returncode

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_serve_command(
    model_path: str, *, host: str, port: int, served_model_name: str, extra_args: Sequence[str] = ()
) -> list[str]:
    return [
        *VLLM_CLI,
        "serve",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        # Request logging is off by default in 0.26 (--enable-log-requests turns it on); the access log
        # would add one line per request.
        "--disable-uvicorn-access-log",
        *extra_args,
    ]


def _spawn_session(cmd: Sequence[str], log: Path, env: dict[str, str] | None, append: bool = False) -> subprocess.Popen:
    """Start `cmd` in its own session (so its whole group can be ended by id), output to `log`."""
    with log.open("ab" if append else "wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            env=_environment(env), start_new_session=True,
        )
    _note_session(proc.pid)
    return proc


def start_server(
    model_path: str,
    *,
    port: int,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    served_model_name: str = "model",
    log_path: str | Path | None = None,
    ready_timeout_s: float = 900.0,
    command: Sequence[str] | None = None,
) -> ServerHandle:
    """Start `vllm serve` (or `command`, for tests) and wait until GET /health answers 200.

    `env` is added to the current environment. The log (stdout and stderr) goes to `log_path`.
    On a timeout or an early exit the process group is ended and ServingError names the log's tail.
    """
    cmd = (
        list(command)
        if command is not None
        else vllm_serve_command(
            model_path, host=host, port=port, served_model_name=served_model_name, extra_args=extra_args
        )
    )
    if not _port_free(host, port):
        raise ServingError(f"port {port} on {host} is already in use; pick another (free_port() finds one)")
    log = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"vllm-serve-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = _spawn_session(cmd, log, env, append=True)
    handle = ServerHandle(
        pid=proc.pid,
        base_url=f"http://{host}:{port}",
        model=served_model_name if command is None else None,
        log_path=log,
        command=cmd,
        process=proc,
    )
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            _end_group(proc, grace_s=5)  # children it left behind
            raise ServingError(f"server exited with code {proc.returncode} before it was ready: {_tail(log)}")
        if _healthy(handle.base_url):
            return handle
        if time.monotonic() > deadline:
            handle.stop()
            raise ServingError(f"server not ready after {ready_timeout_s:.0f}s (log {log}): {_tail(log)}")
        time.sleep(0.5)


# A file to which every session this module starts appends its id (= the leader's pid), so that a
# wrapper that must stop a run abruptly can still end those sessions by id (benchmarks/gpu/run_suite.sh).
PIDFILE_ENV = "QUANTGATE_PIDFILE"


def _note_session(pid: int) -> None:
    if path := os.environ.get(PIDFILE_ENV):
        with open(path, "a") as f:
            f.write(f"{pid}\n")


def _environment(extra: dict[str, str] | None) -> dict[str, str]:
    env = {**_QUIET_ENV, **os.environ}
    env.update(extra or {})
    return env


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As uvicorn binds: connections lingering in TIME_WAIT do not count, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# No proxy: the server is on loopback, and an http_proxy in the environment must not catch the probe.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(base_url: str) -> bool:
    try:
        with _DIRECT.open(f"{base_url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _end_group(proc: subprocess.Popen, grace_s: float) -> None:
    # start_new_session made the child a group leader: its pid is the group id.
    pgid = proc.pid
    if proc.poll() is not None and not _group_alive(pgid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    # The leader may be gone while children it spawned still run in the group.
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty log)"


# --- the streaming client -----------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request of a load run. Offsets are seconds from the start of the run."""

    index: int
    success: bool
    error: str | None
    prompt_len: int
    output_tokens: int
    ttft_s: float | None
    itl_s: list[float]
    e2el_s: float | None
    tpot_s: float | None
    arrival_offset_s: float  # when the request was due (Poisson schedule, or 0)
    start_offset_s: float  # when it was sent, after waiting for a concurrency slot
    server_metrics: dict[str, Any] | None = None  # vLLM's per-request timings, with --enable-per-request-metrics


@dataclass
class LoadRun:
    records: list[RequestRecord]
    duration_s: float
    model: str
    config: dict[str, Any]
    # What the server said about itself while answering: response headers (server, ...) and the
    # stream's `model` and `system_fingerprint` fields, from the first successful request.
    server_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Slo:
    """Service-level objective for goodput; a request is good when it meets every limit given."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    attainment: float = 0.9  # share of a load's requests that must be good for the load to meet it


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
    temperature: float = 0.0,
) -> LoadRun:
    """Send every prompt (token ids, or text for servers that take only text) to
    {base_url}/v1/completions, streaming, greedy (or sampled at `temperature`), exactly `output_len` tokens each when `ignore_eos`.
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
            temperature=temperature,
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
    temperature: float,
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
        body = {**_payload(output_len, ignore_eos, vllm_extras, temperature), **extra_body, "model": model}
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
    config = {
        "output_len": output_len,
        "num_prompts": len(prompts),
        "max_concurrency": max_concurrency,
        "request_rate": None if math.isinf(request_rate) else request_rate,
        "seed": seed,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "vllm_extras": vllm_extras,
        "warmup": warmup,
    }
    return LoadRun(records=list(records), duration_s=duration, model=model, config=config, server_info=seen)


def _payload(output_len: int, ignore_eos: bool, vllm_extras: bool = True, temperature: float = 0.0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": output_len,
        "temperature": temperature,
        **({"top_p": 1.0} if temperature > 0 else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if vllm_extras:
        # min_tokens masks EOS like the offline engines do, so every request yields exactly output_len.
        body["min_tokens"] = output_len if ignore_eos else 0
        body["ignore_eos"] = ignore_eos
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
    record = RequestRecord(
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
    st = time.perf_counter()
    record.start_offset_s = st - run_start
    last = st
    chunks = 0
    usage_tokens: int | None = None
    stream_identity: dict[str, Any] = {}
    try:
        async with session.post(url, json={**body, "prompt": prompt}) as response:
            if response.status != 200:
                text = (await response.text())[:200].replace("\n", " ")
                record.error = f"HTTP {response.status}: {text}"
                return record
            stream_identity = {f"header.{h}": response.headers[h] for h in _IDENTITY_HEADERS if h in response.headers}
            decoder = codecs.getincrementaldecoder("utf-8")()
            buffer = ""
            async for raw in response.content.iter_any():
                now = time.perf_counter()
                buffer += decoder.decode(raw)
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    data = _sse_data(line)
                    if data is None:
                        continue
                    if "error" in data:
                        err = data["error"]
                        record.error = f"server error: {err.get('message', err) if isinstance(err, dict) else err}"
                        return record
                    for key in ("model", "system_fingerprint"):
                        if data.get(key) and key not in stream_identity:
                            stream_identity[key] = data[key]
                    if _carries_token(data):
                        if chunks == 0:
                            record.ttft_s = now - st
                        else:
                            record.itl_s.append(now - last)
                        last = now
                        chunks += 1
                    if usage := data.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
                        record.prompt_len = usage.get("prompt_tokens") or record.prompt_len
                        record.server_metrics = data.get("metrics")
    except Exception as e:  # noqa: BLE001 - recorded per request, the run goes on
        record.error = f"{type(e).__name__}: {e}"
        return record
    if chunks == 0:
        record.error = "the stream carried no token chunk"
        return record
    record.success = True
    if seen is not None and not seen:
        seen.update(stream_identity)
    record.e2el_s = last - st
    # Without a usage chunk, count chunks: exact only when each chunk carries one token.
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
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


# --- summary --------------------------------------------------------------------------------------

PERCENTILES = (50, 90, 99)


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo | None = None) -> dict[str, Any]:
    """Throughput and latency percentiles of one load run, in vLLM's definitions (milliseconds)."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": out_tokens / duration_s,
        "total_tokens_per_s": (in_tokens + out_tokens) / duration_s,
    }
    series = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok],
    }
    for name, values in series.items():
        ms = np.asarray(values, dtype=float) * 1000
        summary[f"{name}_ms_mean"] = float(ms.mean()) if ms.size else None
        for p in PERCENTILES:
            summary[f"{name}_ms_p{p}"] = float(np.percentile(ms, p)) if ms.size else None
    if slo is not None:
        good = sum(1 for r in ok if _meets(r, slo))
        summary["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms}
        summary["good_requests"] = good
        summary["goodput_requests_per_s"] = good / duration_s
    return summary


def _meets(r: RequestRecord, slo: Slo) -> bool:
    # As in vLLM: a request with one output token has TPOT 0 for goodput.
    checks = ((slo.ttft_ms, r.ttft_s), (slo.tpot_ms, r.tpot_s or 0.0), (slo.e2el_ms, r.e2el_s))
    return all(limit is None or value * 1000 <= limit for limit, value in checks)


# --- vllm bench throughput, beside our numbers ---------------------------------------------------

_THROUGHPUT_LINE = re.compile(
    r"Throughput:\s*([\d.]+)\s*requests/s,\s*([\d.]+)\s*total tokens/s,\s*([\d.]+)\s*output tokens/s"
)


def vllm_bench_throughput(
    model_path: str,
    *,
    input_len: int,
    output_len: int,
    num_prompts: int,
    work_dir: str | Path,
    seed: int = 0,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout_s: float = 1800.0,
    cli: Sequence[str] = VLLM_CLI,
) -> dict[str, Any]:
    """Run `vllm bench throughput` on the random dataset (EOS ignored, fixed lengths) and return its
    numbers. vLLM's JSON has requests/s and total (prompt + output) tokens/s; output tokens/s comes
    from its printed summary line. Engine flags (--dtype, --max-model-len, --load-format dummy ...)
    go in `extra_args`."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out_json = work / "vllm_bench_throughput.json"
    log = work / "vllm_bench_throughput.log"
    out_json.unlink(missing_ok=True)
    cmd = [
        *cli,
        "bench",
        "throughput",
        "--model",
        str(model_path),
        "--dataset-name",
        "random",
        # The random dataset prefers its own --random-*-len (defaults 1024 / 128) over --input-len/--output-len.
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--output-json",
        str(out_json),
        *extra_args,
    ]
    proc = _spawn_session(cmd, log, env)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_group(proc, grace_s=10)
        raise ServingError(f"vllm bench throughput ran past {timeout_s:.0f}s (log {log})") from None
    finally:
        if _group_alive(proc.pid):
            _end_group(proc, grace_s=10)
    if proc.returncode != 0 or not out_json.exists():
        raise ServingError(f"vllm bench throughput failed (exit {proc.returncode}): {_tail(log)}")
    data = json.loads(out_json.read_text())
    match = _THROUGHPUT_LINE.search(log.read_text(errors="replace"))
    output_tps = float(match.group(3)) if match else num_prompts * output_len / data["elapsed_time"]
    return {
        "requests_per_s": data["requests_per_second"],
        "total_tokens_per_s": data["tokens_per_second"],
        "output_tokens_per_s": output_tps,
        "elapsed_s": data["elapsed_time"],
        "num_requests": data["num_requests"],
        "total_num_tokens": data["total_num_tokens"],
        "command": cmd,
    }


# --- scenarios on vLLM processes: a served scenario's loads, and the bench cross-check -------------


@dataclass
class ServingLoad:
    """One load of a serving scenario (a concurrency level or a request rate) and its requests."""

    label: str
    max_concurrency: int | None
    request_rate: float | None
    records: list[RequestRecord]
    duration_s: float
    energy_j: float | None = None
    server_info: dict[str, Any] = field(default_factory=dict)


_KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def kv_cache_tokens_from_log(path: str | Path) -> int | None:
    """The KV-cache budget vLLM logs once its engine core has sized the cache."""
    try:
        match = _KV_TOKENS.search(Path(path).read_text(errors="replace"))
    except OSError:
        return None
    return int(match.group(1).replace(",", "")) if match else None


def vllm_cli_args(opts: EngineOptions) -> list[str]:
    """Engine flags of `vllm serve` and `vllm bench throughput` for the options the offline engine
    takes, so that all three run the same engine configuration. (The seed is left to the caller.)"""
    args = [
        "--dtype", opts.dtype,
        "--gpu-memory-utilization", str(opts.gpu_memory_utilization),
        "--tensor-parallel-size", str(opts.tensor_parallel_size),
        # Explicit either way: the CLI's default turns prefix caching on.
        "--enable-prefix-caching" if opts.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if opts.max_model_len:
        args += ["--max-model-len", str(opts.max_model_len)]
    if opts.enforce_eager:
        args.append("--enforce-eager")
    if opts.dummy_weights:
        args += ["--load-format", "dummy"]
    if opts.speculative_config:
        args += ["--speculative-config", json.dumps(opts.speculative_config, sort_keys=True)]
    if opts.max_cudagraph_capture_size:
        args += ["--max-cudagraph-capture-size", str(opts.max_cudagraph_capture_size)]
    if opts.trust_remote_code:
        args.append("--trust-remote-code")
    return args


def _preflight(
    engine: str, model_path: str, scenario_name: str, scenario: ScenarioSpec, options: dict[str, Any] | None
) -> tuple[EngineOptions, Callable[..., SpeedResult], SpeedResult | None]:
    """Options, a result builder for `engine`'s rows, and the skipped/failed row when it cannot run at all."""
    device = "cuda"
    opts = engine_options(scenario, device, options, dummy_weights=wants_random_weights(model_path, scenario))

    def result(status: str, reason: str | None, used: EngineOptions, **measured: Any) -> SpeedResult:
        config = {**scenario.model_dump(mode="json"), "engine_options": dataclasses.asdict(used)}
        return SpeedResult(engine, scenario_name, status, reason, config, **measured)  # type: ignore[arg-type]

    if (why := engines.availability("vllm", device)) is not None:
        return opts, result, result("skipped", why, opts)
    if not Path(model_path).is_dir():
        return opts, result, result("failed", f"no model folder at {model_path}", opts)
    from quantgate.tasks.loadtime import descriptor

    if descriptor(model_path) is not None:
        why = "a load-time (bitsandbytes) variant is measured by the offline engines only, not with vllm serve/bench"
        return opts, result, result("skipped", why, opts)
    return opts, result, None


def serve_scenario(
    model_path: str,
    scenario_name: str,
    scenario: ScenarioSpec,
    *,
    work_dir: str | Path,
    timeout_s: float = 900.0,
    options: dict[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> tuple[SpeedResult, list[ServingLoad]]:
    """Start one `vllm serve` for the scenario, drive it through every load in order, stop it (its
    process group, by PID). Never raises for server trouble: the result says skipped or failed.

    The SpeedResult sums the loads: tokens_per_s is the best load's output tokens/s, energy per token
    is over all loads; repetitions holds each load's summary. Per-request rows are in the loads.
    """
    opts, result, early = _preflight("vllm", model_path, scenario_name, scenario, options)
    if early is not None:
        return early, []
    sizes = scenario.load_sizes()
    prompts = make_prompts(scenario.model_copy(update={"num_prompts": max(n for *_, n in sizes)}), model_path)
    slo = Slo(**scenario.slo.model_dump()) if scenario.slo else None
    work = Path(work_dir)
    deadline = time.monotonic() + timeout_s
    attempts: list[dict[str, Any]] = []
    for used in fallback_options(opts, "vllm", scenario.input_len + scenario.output_len):
        log = work / f"serve-{scenario_name}-{len(attempts)}.log"
        try:
            with Telemetry("cuda") as telemetry:
                server = start_server(
                    model_path,
                    port=free_port(),
                    extra_args=[*vllm_cli_args(used), "--seed", str(used.seed), *extra_args],
                    env=env,
                    log_path=log,
                    ready_timeout_s=max(1.0, deadline - time.monotonic()),
                )
                with server:
                    loads = drive_loads(server, scenario, sizes, prompts, telemetry, deadline)
                peak = telemetry.peak_memory_bytes
                nvml_peak = telemetry.nvml_peak_bytes
            break
        except ServingError as e:
            reason = _with_cause(str(e), log)
            if not (looks_like_oom(reason) or looks_like_oom(_read(log))) or time.monotonic() >= deadline:
                return result("failed", reason, used, details={"attempts": attempts, "log": str(log),
                                                               "engine_starts": len(attempts) + 1}), []
            attempts.append({"gpu_memory_utilization": used.gpu_memory_utilization,
                             "max_model_len": used.max_model_len, "error": reason})
    else:
        return result("failed", attempts[-1]["error"], used,
                      details={"attempts": attempts, "engine_starts": len(attempts)}), []

    summaries = [{"load": load.label, **summarize(load.records, load.duration_s, slo)} for load in loads]
    ok = [r for load in loads for r in load.records if r.success]
    if not loads:
        return result("failed", "the time was up before the first load", used,
                      details={"engine_starts": len(attempts) + 1}), loads
    if not ok:
        first_error = next((r.error for load in loads for r in load.records if r.error), None)
        return result("failed", f"no request succeeded: {first_error}", used, repetitions=summaries,
                      details={"engine_starts": len(attempts) + 1}), loads
    best = max(summaries, key=lambda s: s["output_tokens_per_s"])
    energies = [load.energy_j for load in loads]
    out_tokens = sum(r.output_tokens for r in ok)
    kv_tokens = kv_cache_tokens_from_log(log)
    config = text_config(model_path)
    details: dict[str, Any] = {"best_load": best["load"], "log": str(log), "engine_starts": len(attempts) + 1}
    if extra_args or env:
        details["serve_args"] = list(extra_args)
        details["serve_env"] = dict(env or {})
    if kernel := kernel_from_log(log):
        details["kernel"] = kernel
    if attempts:
        details["attempts"] = attempts
    if len(loads) < len(sizes):
        details["loads_not_run"] = [label for label, *_ in sizes[len(loads) :]]
    return result(
        "ok",
        None,
        used,
        device=nvml_device_name(),
        num_requests=sum(len(load.records) for load in loads),
        input_tokens=sum(r.prompt_len for r in ok),
        output_tokens=out_tokens,
        tokens_per_s=best["output_tokens_per_s"],
        total_tokens_per_s=best["total_tokens_per_s"],
        requests_per_s=best["requests_per_s"],
        peak_memory_bytes=peak,
        nvml_peak_bytes=nvml_peak,
        energy_j_per_token=sum(energies) / out_tokens if None not in energies and out_tokens else None,
        kv_cache_tokens=kv_tokens,
        kv_cache_bytes=kv_tokens * kv_bytes_per_token(config, 4 if used.dtype == "float32" else 2)
        if kv_tokens and config else None,
        repetitions=summaries,
        versions=_vllm_versions(),
        details=details,
    ), loads


# --- the tuned serving config: a sweep of vLLM settings, each point a normal serving run ----------------

# vLLM logs the mixed-precision kernel it picked for a quantized linear layer ("Using MacheteLinearKernel
# for CompressedTensorsWNA16").
_KERNEL = re.compile(r"Using (\w+LinearKernel)\b")


def kernel_from_log(path: str | Path) -> str | None:
    match = _KERNEL.search(_read(Path(path)))
    return match.group(1) if match else None


def has_weight_only_int_layers(model_path: str | Path) -> bool | None:
    """Whether the checkpoint has weight-only integer layers (W4A16, W8A16: GPTQ, AWQ, compressed-tensors
    WNA16), the only layers vLLM runs on a mixed-precision kernel; None when its config.json cannot be read."""
    if (config := checkpoint_config(model_path)) is None:
        return None
    quant = config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin", "marlin"):
        return True
    if method == "compressed-tensors":
        return any((g.get("weights") or {}).get("type") == "int" and not g.get("input_activations")
                   for g in (quant.get("config_groups") or {}).values())
    return False


def sweep_settings(point: dict[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """A sweep point as (engine option overrides, extra `vllm serve` flags, environment). A forced kernel
    disables every other mixed-precision kernel through VLLM_DISABLED_KERNELS."""
    from quantgate.catalog.schema import MP_KERNELS

    options: dict[str, Any] = {}
    args: list[str] = []
    env: dict[str, str] = {}
    for key, value in sorted(point.items()):
        if key == "enforce_eager":
            options["enforce_eager"] = bool(value)
        elif key == "max_num_seqs":
            args += ["--max-num-seqs", str(int(value))]
        elif key == "kv_cache_dtype":
            args += ["--kv-cache-dtype", str(value)]
        elif key == "kernel":
            env["VLLM_DISABLED_KERNELS"] = ",".join(k for k in MP_KERNELS if k != value)
        else:
            raise ServingError(f"unknown sweep setting {key!r}")
    return options, args, env


def moot_point(point: dict[str, Any], scenario: ScenarioSpec, defaults: SpeedResult) -> str | None:
    """Why a sweep point cannot beat vLLM's defaults, as measured at the sweep's first point, or None.

    When the defaults' KV cache holds every request of the highest load at once, nothing is preempted or
    queued for cache room: an FP8 KV cache only adds room nobody needs, and a lower max_num_seqs can only
    queue requests the defaults ran at once, which lowers goodput unless the defaults missed the SLO somewhere
    (a smaller batch decodes each sequence faster). A cap at or above the highest concurrency changes nothing.
    """
    if defaults.status != "ok" or not defaults.kv_cache_tokens:
        return None
    sizes = scenario.load_sizes()
    in_flight = max(n if rate is not None else min(c or n, n) for _, c, rate, n in sizes)
    demand = in_flight * (scenario.input_len + scenario.output_len)
    kv_whole = defaults.kv_cache_tokens >= demand
    room = f"the defaults' KV cache ({defaults.kv_cache_tokens:,} tokens) held the highest load whole ({demand:,})"
    if "max_num_seqs" in point and int(point["max_num_seqs"]) >= in_flight:
        return f"max_num_seqs={point['max_num_seqs']} is at or above the most requests in flight ({in_flight})"
    if set(point) - {"kv_cache_dtype", "max_num_seqs"} or not kv_whole:
        return None
    if "max_num_seqs" in point:
        missed = [r["load"] for r in defaults.repetitions or []
                  if r.get("good_requests") is not None and r["good_requests"] < r["completed"]]
        if missed:
            return None
        return f"{room} and met the SLO at every load"
    return room


def sweep_row_name(scenario_name: str, point: dict[str, Any]) -> str:
    from quantgate.catalog.schema import sweep_label

    return f"{scenario_name}@{sweep_label(point)}"


def serve_sweep(
    model_path: str,
    scenario_name: str,
    scenario: ScenarioSpec,
    *,
    work_dir: str | Path,
    timeout_s: float = 900.0,
    options: dict[str, Any] | None = None,
    serve: Callable[..., tuple[SpeedResult, list[ServingLoad]]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_point: Callable[[SpeedResult, list[ServingLoad]], None] | None = None,
    min_point_s: float = 60.0,
) -> list[tuple[SpeedResult, list[ServingLoad]]]:
    """Every point of the scenario's sweep as its own serving run (vLLM's defaults first), each named
    `<scenario>@<point>` with config.sweep = {scenario, point, settings, min_gain_pct}. Points the time does
    not reach, and forced kernels on a checkpoint that has no layer for them, get a skipped row. `on_point`
    gets each point as soon as it is done, so that a sweep cut short keeps the points it finished."""
    from quantgate.catalog.schema import sweep_label

    if scenario.sweep is None:
        raise ServingError(f"scenario {scenario_name!r} has no sweep")
    serve = serve or serve_scenario
    points = scenario.sweep.points()
    plain = scenario.model_copy(update={"sweep": None})
    # A forced kernel changes nothing on a checkpoint without mixed-precision layers: it would be the
    # defaults served again, one more vLLM start.
    no_kernels = has_weight_only_int_layers(model_path) is False
    runs = [not ("kernel" in point and no_kernels) for point in points]
    deadline = clock() + timeout_s
    out: list[tuple[SpeedResult, list[ServingLoad]]] = []
    for i, point in enumerate(points):
        name = sweep_row_name(scenario_name, point)
        tag = {"scenario": scenario_name, "point": sweep_label(point), "settings": point,
               "min_gain_pct": scenario.sweep.min_gain_pct}
        remaining = deadline - clock()
        skip = None
        if remaining <= 1:
            skip = "sweep: the time was up before this point"
        elif not runs[i]:
            skip = (f"sweep: {sweep_label(point)} applies to weight-only quantized layers (W4A16-style);"
                    " this checkpoint has none")
        elif out and (why := moot_point(point, plain, out[0][0])):
            skip = f"sweep: {sweep_label(point)} cannot change the outcome: {why}"
            runs[i] = False
        if skip:
            config = {**plain.model_dump(mode="json"), "sweep": tag}
            out.append((SpeedResult("vllm", name, "skipped", skip, config), []))
            if on_point:
                on_point(*out[-1])
            continue
        overrides, args, env = sweep_settings(point)
        # A point may use what is left beyond a minimum kept for each later one (the first start compiles and
        # is the slowest), and never less than an even share.
        left = sum(runs[i:])
        budget = max(remaining / left, remaining - (left - 1) * min_point_s)
        result, loads = serve(model_path, name, plain, work_dir=Path(work_dir) / f"point{i:02d}",
                              timeout_s=budget, options={**(options or {}), **overrides},
                              extra_args=args, env=env)
        out.append((dataclasses.replace(result, config={**result.config, "sweep": tag}), loads))
        if on_point:
            on_point(*out[-1])
    return out


def serve_variant(
    model_path: str,
    scenario_name: str,
    scenario: ScenarioSpec,
    *,
    work_dir: str | Path,
    timeout_s: float = 1800.0,
    on_point: Callable[[SpeedResult, list[ServingLoad]], None] | None = None,
) -> list[tuple[SpeedResult, list[ServingLoad]]]:
    """A serving scenario on one checkpoint: one `vllm serve` run, or one per point of its sweep (the rows
    the tuned serving config is picked from). `on_point` gets each run as soon as it is done."""
    if scenario.sweep is not None:
        return serve_sweep(model_path, scenario_name, scenario, work_dir=work_dir, timeout_s=timeout_s,
                           on_point=on_point)
    run = serve_scenario(model_path, scenario_name, scenario, work_dir=work_dir, timeout_s=timeout_s)
    if on_point:
        on_point(*run)
    return [run]


def measured_to_dict(result: SpeedResult, loads: list[ServingLoad]) -> dict[str, Any]:
    """A speed row and its serving loads (none for an engine run) as JSON-ready data, for a GPU step's result file."""
    return {"result": result.as_dict(), "loads": [dataclasses.asdict(load) for load in loads]}


def measured_from_dict(data: dict[str, Any]) -> tuple[SpeedResult, list[ServingLoad]]:
    loads = [ServingLoad(**{**load, "records": [RequestRecord(**r) for r in load["records"]]}) for load in data["loads"]]
    return SpeedResult(**data["result"]), loads


def drive_loads(
    server: ServerHandle,
    scenario: ScenarioSpec,
    sizes: list[tuple[str, int | None, float | None, int]],
    prompts: Sequence[list[int] | str],
    telemetry: Telemetry,
    deadline: float,
) -> list[ServingLoad]:
    """Run the loads in order until the time is up; those not started are left out."""
    if deadline <= time.monotonic():
        return []
    return run_loads(server.base_url, server.model, scenario, sizes, prompts, telemetry, deadline)


def run_loads(
    base_url: str,
    model: str | None,
    scenario: ScenarioSpec,
    sizes: list[tuple[str, int | None, float | None, int]],
    prompts: Sequence[list[int] | str],
    telemetry: Telemetry | None,
    deadline: float,
    **client: Any,
) -> list[ServingLoad]:
    """The loads of a serving scenario against any OpenAI-compatible server at `base_url`, in order,
    until the time is up; `client` goes to run_load (headers, vllm_extras)."""
    loads = []
    for label, concurrency, rate, n in sizes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        before = telemetry.energy_mj() if telemetry else None
        run = run_load(
            base_url,
            list(prompts[:n]),
            scenario.output_len,
            max_concurrency=concurrency,
            request_rate=rate or math.inf,
            seed=scenario.seed,
            model=model,
            warmup=scenario.warmup,
            timeout_s=remaining,
            temperature=scenario.temperature,
            **client,
        )
        after = telemetry.energy_mj() if telemetry else None
        energy = (after - before) / 1000 if before is not None and after is not None and after > before else None
        loads.append(ServingLoad(label, concurrency, rate, run.records, run.duration_s, energy, run.server_info))
    return loads


def bench_scenario(
    model_path: str,
    scenario_name: str,
    scenario: ScenarioSpec,
    *,
    work_dir: str | Path,
    timeout_s: float = 900.0,
    options: dict[str, Any] | None = None,
) -> SpeedResult:
    """`vllm bench throughput` on an offline scenario's config (same model, lengths, prompt count,
    engine flags, warm-up of one full pass, sampler: the scenario must sample at the bench's fixed
    temperature, else the row is skipped with why), as a SpeedResult of engine "vllm-bench": tokens_per_s is
    its output tokens/s and total_tokens_per_s its (prompt + output) tokens/s, like ours."""
    opts, result, early = _preflight("vllm-bench", model_path, scenario_name, scenario, options)
    if early is not None:
        return early
    if (why := bench_mismatch(scenario)) is not None:
        return result("skipped", why, opts)
    deadline = time.monotonic() + timeout_s
    attempts: list[dict[str, Any]] = []
    for used in fallback_options(opts, "vllm", scenario.input_len + scenario.output_len):
        extra = [*vllm_cli_args(used), "--disable-detokenize"]
        if scenario.warmup:
            extra += ["--num-warmups", str(scenario.num_prompts)]
        bench_dir = Path(work_dir) / f"bench-{scenario_name}-{len(attempts)}"
        try:
            res = vllm_bench_throughput(
                model_path,
                input_len=scenario.input_len,
                output_len=scenario.output_len,
                num_prompts=scenario.num_prompts,
                work_dir=bench_dir,
                seed=used.seed,
                extra_args=extra,
                timeout_s=max(1.0, deadline - time.monotonic()),
            )
            break
        except ServingError as e:
            log = bench_dir / "vllm_bench_throughput.log"
            reason = _with_cause(str(e), log)
            if not (looks_like_oom(reason) or looks_like_oom(_read(log))) or time.monotonic() >= deadline:
                return result("failed", reason, used, details={"attempts": attempts})
            attempts.append({"gpu_memory_utilization": used.gpu_memory_utilization,
                             "max_model_len": used.max_model_len, "error": reason})
    else:
        return result("failed", attempts[-1]["error"], used, details={"attempts": attempts})
    return result(
        "ok",
        None,
        used,
        device=nvml_device_name(),
        num_requests=res["num_requests"],
        input_tokens=scenario.num_prompts * scenario.input_len,
        output_tokens=scenario.num_prompts * scenario.output_len,
        tokens_per_s=res["output_tokens_per_s"],
        total_tokens_per_s=res["total_tokens_per_s"],
        requests_per_s=res["requests_per_s"],
        versions=_vllm_versions(),
        details={"command": res["command"], "elapsed_s": res["elapsed_s"], "engine_starts": len(attempts) + 1,
                 "total_num_tokens": res["total_num_tokens"], **({"attempts": attempts} if attempts else {})},
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _with_cause(reason: str, log: Path) -> str:
    cause = root_cause(_read(log))
    return f"{reason} (cause: {cause})" if cause and cause not in reason else reason


def _vllm_versions() -> dict[str, str]:
    import importlib.metadata

    out = {}
    for name in ("vllm", "torch", "transformers", "compressed-tensors"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


serving_task = task(serve_variant, name="serve", tags=["benchmark"], cache_policy=NO_CACHE)
bench_task = task(bench_scenario, name="vllm-bench", tags=["benchmark"], cache_policy=NO_CACHE)
