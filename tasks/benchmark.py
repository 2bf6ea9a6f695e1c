"""Speed benchmark of one checkpoint: engine × scenario, each run in a fresh spawned process.

A fresh process per run means engines never share a CUDA context or allocator state, and a crash,
an out-of-memory kill or a hang costs that one result ("failed", with a one-line reason), not the flow.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import multiprocessing
import os
import random
import signal
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from prefect import task

from quantgate.catalog.schema import ScenarioSpec
from quantgate.tasks import engines
from quantgate.tasks.engines import Engine, EngineOptions, RequestTiming
from quantgate.tasks.records import SpeedResult
from quantgate.tasks.telemetry import Telemetry, device_name


class BenchmarkError(RuntimeError):
    """A benchmark that cannot run as configured; the message is one line."""


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_options(scenario: ScenarioSpec, device: str, overrides: Mapping[str, Any] | None = None) -> EngineOptions:
    dtype = scenario.dtype if scenario.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    options = EngineOptions(
        device=device,  # type: ignore[arg-type]
        dtype=dtype,
        seed=scenario.seed,
        enable_prefix_caching=scenario.enable_prefix_caching,
        max_model_len=scenario.input_len + scenario.output_len,
    )
    known = [f.name for f in dataclasses.fields(EngineOptions)]
    if unknown := sorted(set(overrides or {}) - set(known)):
        raise BenchmarkError(f"unknown engine option(s) {unknown}; known: {known}")
    return dataclasses.replace(options, **(overrides or {}))


def make_prompts(scenario: ScenarioSpec, tokenizer_path: str) -> list[list[int]]:
    """num_prompts prompts of exactly input_len token ids, the same for every engine and variant.

    Without a prompts_file: uniform random ids from the vocabulary minus special and added tokens, seeded
    by scenario.seed. With one: prompt i is the first input_len tokens of the text starting at its
    (i mod lines)-th non-empty line, continuing into the next lines when that line is too short.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if scenario.prompts_file:
        return _file_prompts(Path(scenario.prompts_file), tokenizer, scenario.num_prompts, scenario.input_len)
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    pool = [i for i in range(len(tokenizer)) if i not in excluded]
    rng = random.Random(scenario.seed)
    return [[rng.choice(pool) for _ in range(scenario.input_len)] for _ in range(scenario.num_prompts)]


def _file_prompts(path: Path, tokenizer: Any, num_prompts: int, input_len: int) -> list[list[int]]:
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise BenchmarkError(f"prompts_file {path}: {e.strerror or e}") from None
    if not lines:
        raise BenchmarkError(f"prompts_file {path}: no non-empty lines")
    encoded: dict[int, list[int]] = {}

    def tokens(j: int) -> list[int]:
        if j not in encoded:
            encoded[j] = tokenizer(lines[j], add_special_tokens=False)["input_ids"]
        return encoded[j]

    prompts = []
    for i in range(num_prompts):
        ids: list[int] = []
        for step in range(len(lines)):
            ids += tokens((i + step) % len(lines))
            if len(ids) >= input_len:
                break
        if len(ids) < input_len:
            raise BenchmarkError(f"prompts_file {path}: the whole file has fewer than input_len={input_len} tokens")
        prompts.append(ids[:input_len])
    return prompts


def run_scenario(
    model_path: str,
    engine_name: str,
    scenario_name: str,
    scenario: ScenarioSpec,
    *,
    isolate: bool = True,
    timeout_s: float = 3600.0,
    options: Mapping[str, Any] | None = None,
) -> SpeedResult:
    """Measure one engine on one scenario. Never raises for engine trouble: the result says skipped or failed.

    `options` overrides EngineOptions fields (e.g. gpu_memory_utilization, enforce_eager).
    isolate=False runs in this process (debugging only: no timeout, and memory readings include the caller).
    """
    device = resolve_device(scenario.device)
    opts = engine_options(scenario, device, options)
    config = {**scenario.model_dump(mode="json"), "engine_options": dataclasses.asdict(opts)}

    def result(status: Literal["ok", "skipped", "failed"], reason: str | None, **measured: Any) -> SpeedResult:
        return SpeedResult(engine_name, scenario_name, status, reason, config, **measured)

    if (why := engines.availability(engine_name, device)) is not None:
        return result("skipped", why)
    if not Path(model_path).is_dir():
        return result("failed", f"no model folder at {model_path}")
    if isolate:
        status, payload = _in_fresh_process(model_path, engine_name, scenario, opts, timeout_s)
    else:
        try:
            status, payload = "ok", _measure(model_path, engine_name, scenario, opts)
        except Exception as e:
            status, payload = "failed", _one_line(e)
    if status == "ok":
        return result("ok", None, **payload)
    return result("failed", payload)


def _in_fresh_process(
    model_path: str, engine_name: str, scenario: ScenarioSpec, opts: EngineOptions, timeout_s: float
) -> tuple[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    # Not a daemon: vLLM starts its own engine-core process, which daemons may not do.
    proc = ctx.Process(
        target=_child, args=(sender, model_path, engine_name, scenario, opts), name=f"quantgate-bench-{engine_name}"
    )
    proc.start()
    sender.close()  # so the receiver sees EOF if the child dies without answering
    try:
        if not receiver.poll(timeout_s):
            return "failed", f"timed out after {timeout_s:g} s"
        try:
            answer = receiver.recv()
        except EOFError:
            proc.join()
            return "failed", _exit_reason(proc.exitcode)
        proc.join(timeout=60)  # time for the engine to tear down
        return answer
    finally:
        _kill_group(proc)
        receiver.close()


def _child(sender: Any, model_path: str, engine_name: str, scenario: ScenarioSpec, opts: EngineOptions) -> None:
    # Its own process group, so the parent can also end what the engine started (vLLM's engine core).
    os.setpgrp()
    try:
        sender.send(("ok", _measure(model_path, engine_name, scenario, opts)))
    except BaseException as e:  # report whatever stops the run, then let the process end
        sender.send(("failed", _one_line(e)))
    finally:
        sender.close()


def _kill_group(proc: multiprocessing.process.BaseProcess) -> None:
    """End the child and anything left in its process group: a hung run must not keep holding the GPU."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
    except (ProcessLookupError, PermissionError):  # already gone, or killed before it made its group
        if proc.is_alive():
            proc.kill()
    proc.join()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (often the out-of-memory killer)" if name == "SIGKILL" else ""
        return f"engine process was killed by {name}{hint} before reporting"
    return f"engine process exited with code {exitcode} before reporting"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    message = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return message if len(message) <= 300 else message[:297] + "..."


def _measure(model_path: str, engine_name: str, scenario: ScenarioSpec, opts: EngineOptions) -> dict[str, Any]:
    prompts = make_prompts(scenario, model_path)
    engine = engines.create(engine_name)
    with Telemetry(opts.device) as telemetry:
        engine.load(model_path, opts)
        try:
            for _ in range(scenario.warmup):
                _workload(engine, prompts, scenario)
            reps = [_repetition(engine, prompts, scenario, telemetry) for _ in range(scenario.repetitions)]
        finally:
            engine.close()
    per_token_j = [r["energy_j"] / r["output_tokens"] if r["energy_j"] is not None else None for r in reps]
    return {
        "device": device_name(opts.device),
        "num_requests": len(prompts),
        "input_tokens": sum(len(p) for p in prompts),
        "output_tokens": _median([r["output_tokens"] for r in reps]),
        "tokens_per_s": _median([r["tokens_per_s"] for r in reps]),
        "requests_per_s": _median([r["requests_per_s"] for r in reps]),
        "ttft_ms": _median([r["ttft_ms"] for r in reps]),
        "tpot_ms": _median([r["tpot_ms"] for r in reps]),
        "e2el_ms": _median([r["e2el_ms"] for r in reps]),
        "peak_memory_bytes": telemetry.peak_memory_bytes,
        "energy_j_per_token": _median(per_token_j),
        "repetitions": reps,
        "versions": _versions(engine_name, opts.device),
    }


def _workload(engine: Engine, prompts: list[list[int]], scenario: ScenarioSpec) -> tuple[float, list[RequestTiming]]:
    """All prompts once: in batches of batch_size ("offline") or one at a time ("latency").
    Each request is timed from the start of its own generate call."""
    size = 1 if scenario.kind == "latency" else scenario.batch_size
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        generation = engine.generate(prompts[i : i + size], scenario.output_len)
        got = generation.output_tokens
        if any(n != scenario.output_len for n in got):
            raise BenchmarkError(f"{engine.name} generated {got} tokens per sequence, expected {scenario.output_len}")
        timings += generation.requests
    return time.perf_counter() - start, timings


def _repetition(
    engine: Engine, prompts: list[list[int]], scenario: ScenarioSpec, telemetry: Telemetry
) -> dict[str, Any]:
    before = telemetry.energy_mj()
    wall, timings = _workload(engine, prompts, scenario)
    after = telemetry.energy_mj()
    out = sum(t.output_tokens for t in timings)
    # A counter that did not move over a very short run says nothing, so it is not reported as 0 J.
    energy_j = (after - before) / 1000 if before is not None and after is not None and after > before else None
    return {
        "wall_s": wall,
        "output_tokens": out,
        "tokens_per_s": out / wall,
        "requests_per_s": len(timings) / wall,
        "ttft_ms": _ms(_median([t.ttft_s for t in timings])),
        "tpot_ms": _ms(_median([t.tpot_s for t in timings])),
        "e2el_ms": _ms(_median([t.e2el_s for t in timings])),
        "energy_j": energy_j,
    }


def _median(values: list[Any]) -> Any:
    if not values or any(v is None for v in values):
        return None
    return statistics.median(values)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _versions(engine_name: str, device: str) -> dict[str, str]:
    names = ["torch", "transformers", "compressed-tensors"] + (["vllm"] if engine_name == "vllm" else [])
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if device == "cuda":
        import torch

        versions["cuda"] = str(torch.version.cuda)
    return versions


benchmark_task = task(run_scenario, name="benchmark", tags=["benchmark"])
