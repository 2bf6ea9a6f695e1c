"""Engines that start beside unmeasured work and measure with the GPU alone, on the device: two vLLM engine
sessions of the tiny model load while a job holds a share of the GPU (a real matmul load in its own process)
and each measures only once that job and the other measurement are done. Their KV caches are sized to the
scenario's load and their memory is read per process group (tests/test_gpu_clock.py covers the clock itself on
a CPU)."""

from __future__ import annotations

import contextvars
import threading
import time
from datetime import datetime

import pytest

from quantgate.catalog.scenarios import OfflineScenario
from quantgate.tasks.runtime import launch
from quantgate.tasks.steps.benchmark import run_scenario
from tests.shared_data import TINY_MODEL

pytestmark = [pytest.mark.gpu]

SCENARIO = OfflineScenario(engines=["vllm"], num_prompts=16, input_len=32, output_len=16, warmup=1,
                        repetitions=1, max_model_len=64, enforce_eager=True, device="cuda")


def _busy_gpu(seconds: float) -> None:
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        x = (x @ x).clamp_(-1, 1)
    torch.cuda.synchronize()


def test_two_engines_load_beside_a_gpu_job_and_measure_one_at_a_time():
    pytest.importorskip("vllm", reason="vllm is not installed")
    results: dict[str, object] = {}
    busy: list[datetime] = []

    def engine(name: str) -> None:
        results[name] = run_scenario(str(TINY_MODEL), "vllm", name, SCENARIO)

    def job() -> None:
        with launch.sharing():
            launch.on_gpus(None, 300, _busy_gpu, 45.0)
            busy.append(datetime.utcnow())

    with launch.gpu_clock():
        threads = [threading.Thread(target=contextvars.copy_context().run, args=(fn, *args))
                   for fn, args in [(job, ()), (engine, ("a",)), (engine, ("b",))]]
        for t in threads:
            t.start()
            time.sleep(1)  # the job takes its share first
        for t in threads:
            t.join(600)
    a, b = results["a"], results["b"]
    assert a.status == "ok" and b.status == "ok", (a.reason, b.reason)
    windows = sorted((datetime.fromisoformat(r.details["measured_from"]).replace(tzinfo=None),
                      datetime.fromisoformat(r.details["measured_to"]).replace(tzinfo=None)) for r in (a, b))
    assert windows[0][0] >= busy[0], "a measurement began while the GPU job still ran"
    assert windows[0][1] <= windows[1][0], "two measurements overlapped"
    assert max(a.details["gpu_wait_s"], b.details["gpu_wait_s"]) > 0
    for r in (a, b):
        # A KV cache sized to 16 sequences of 48 tokens rounds up to the 1 GiB floor; memory is the engine's own.
        assert r.config["engine_options"]["kv_cache_memory_bytes"] == 1 << 30
        assert r.nvml_peak_bytes is not None, "NVML lists no process of the engine's group (PID namespace?)"
        assert 1 << 30 < r.nvml_peak_bytes < 20 << 30
