"""The one out-of-memory retry of an engine start (an offline engine, `vllm serve`, `vllm bench`): the options
are tried in order (fallback_options) while a start runs out of GPU memory and time is left; each failed try
is recorded."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from quantgate.tasks.adapters import engines
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.speed.vllm_cli import looks_like_oom, looks_like_profiling_race, read_log, root_cause
from quantgate.tasks.runtime import launch

T = TypeVar("T")


def fallback_options(options: EngineOptions, engine_name: str, needed_len: int) -> list[EngineOptions]:
    """The options to try in order when an engine start runs out of GPU memory: as asked, then (an engine that
    reserves a share of the GPU: vLLM) a smaller gpu_memory_utilization, then also the smallest max_model_len the
    scenarios need; with a sized KV cache, or an engine that takes only what it loads (Transformers), the same
    options once more."""
    tries = [options]
    if not engines.kind(engine_name).reserves_gpu_share or options.kv_cache_memory_bytes:
        # What it asks for is what it needs: the retry is the same start, made with the GPU alone
        # (tasks/runtime/launch.measuring), when no other job is loading beside it. On the H100 the 7B base's
        # Transformers engine ran out beside vLLM engines loading, and was not tried again
        # (results/h100/shape7b-variants-1). A CPU has no other job loading beside it.
        return [options, options] if options.device == "cuda" else tries
    lower = round(max(0.3, options.gpu_memory_utilization - 0.2), 2)
    if lower < options.gpu_memory_utilization:
        tries.append(dataclasses.replace(options, gpu_memory_utilization=lower))
    if options.max_model_len and options.max_model_len > needed_len:
        tries.append(dataclasses.replace(tries[-1], max_model_len=needed_len))
    return tries


@dataclass(frozen=True)
class Failure:
    """An engine start that did not work: its one-line reason, and its log, where the root cause may be."""

    reason: str
    log: Path | None = None


@dataclass
class Retried(Generic[T]):
    """What came of the tries: the last try's value (None when it failed), its options, why it failed (with
    the root cause its log names), and the tries that ran out of memory and were tried again with less."""

    value: T | None
    used: EngineOptions
    error: str | None
    attempts: list[dict[str, Any]]
    exhausted: bool = False  # every option ran out of memory
    log: Path | None = None  # the log of the last try, when it failed short of running out of options

    @property
    def engine_starts(self) -> int:
        return len(self.attempts) + (0 if self.exhausted else 1)


def with_cause(reason: str, log_text: str) -> str:
    cause = root_cause(log_text)
    return f"{reason} (cause: {cause})" if cause and cause not in reason else reason


def retry_on_oom(
    options: Sequence[EngineOptions], deadline: launch.Deadline, start: Callable[[EngineOptions, int], T | Failure]
) -> Retried[T]:
    """start(options, number of tries so far) for each options in turn, until one returns a value, or a
    Failure that is not out of memory (in its reason or its log), or the `deadline` has passed. A start
    upset by another process freeing memory while vLLM profiled is tried once more with the same options: smaller
    ones would not have helped."""
    attempts: list[dict[str, Any]] = []
    tries, raced = list(options), False
    for i, used in enumerate(tries):
        got = start(used, len(attempts))
        if not isinstance(got, Failure):
            return Retried(got, used, None, attempts)
        log_text = read_log(got.log) if got.log else ""
        reason = with_cause(got.reason, log_text)
        if not (looks_like_oom(reason) or looks_like_oom(log_text)) or deadline.passed():
            return Retried(None, used, reason, attempts, log=got.log)
        attempts.append({"gpu_memory_utilization": used.gpu_memory_utilization,
                         "max_model_len": used.max_model_len, "error": reason})
        if not raced and (looks_like_profiling_race(reason) or looks_like_profiling_race(log_text)):
            tries.insert(i + 1, used)
            raced = True
    return Retried(None, used, attempts[-1]["error"], attempts, exhausted=True)
