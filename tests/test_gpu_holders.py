"""GPU memory as a checked resource (issue 44, item 5): an engine start that has waited MEMORY_WAIT_S and still finds
less memory free than it needs fails in one line naming the processes that hold the GPU, instead of starting and
failing inside vLLM.

Covered here: the real GpuClock, its waiting, the line, and what the speed paths make of it (in_process_group's
answer, the out-of-memory retry's verdict), in real threads and a real process; the process names read from this
host's /proc. Not covered: NVML itself (tasks/runtime/telemetry.gpu_holders' query of the GPU's compute processes),
which needs a driver; the GPU's memory and its holders are stand-ins here (tests/test_gpu_clock._GpuMemory and a
fixed list), injected as the clock takes them. On the device, tests/gpu/test_faults_gpu.py reads NVML's list."""

from __future__ import annotations

import contextvars
import os
import threading
import time
from pathlib import Path

import pytest

from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.speed.retry import Failure, retry_on_oom
from quantgate.tasks.runtime import gpu_clock, launch
from quantgate.tasks.runtime.telemetry import GpuHolder, device_memory, gpu_holders, process_name
from tests.test_gpu_clock import _GpuMemory

GIB = 1 << 30
WAIT_S = 0.3
HOLDERS = [GpuHolder(4242, "python3", 40 * GIB + GIB // 10), GpuHolder(4343, "VLLM::EngineCor", 30 * GIB),
           GpuHolder(4444, "pt_main_thread", None)]


class _Holders:
    """The processes on the GPU, as gpu_holders would list them; counts its readings."""

    def __init__(self, holders: list[GpuHolder]) -> None:
        self.holders, self.reads = holders, 0

    def __call__(self) -> list[GpuHolder]:
        self.reads += 1
        return self.holders


@pytest.fixture(autouse=True)
def _short_wait(monkeypatch):
    """The wait for memory in a fraction of a second rather than the 15 minutes a run gives it (set where the clock
    reads it: launch only exports the name)."""
    monkeypatch.setattr(gpu_clock, "MEMORY_WAIT_S", WAIT_S)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")


def _gpu(held_gib: int) -> _GpuMemory:
    memory = _GpuMemory()  # 100 GiB
    memory.take("others", held_gib)
    return memory


def test_a_start_the_gpu_cannot_hold_after_the_wait_fails_naming_who_holds_the_memory():
    """90 GiB held by three processes, a start of 30: it waits MEMORY_WAIT_S as before, then fails in one line
    (largest holder first, a process whose memory NVML does not report says so), and holds nothing afterwards:
    a small start goes at once and a measurement has the GPU."""
    holders = _Holders(HOLDERS)
    with launch.gpu_clock(_gpu(90).read, holders) as clock:
        began = time.monotonic()
        with pytest.raises(launch.GpuMemoryError) as failed:
            with launch.sharing(30 * GIB, "vllm serve on qwen-0.5b"):
                pytest.fail("the start went on without its memory")
        assert time.monotonic() - began >= WAIT_S
        assert str(failed.value) == (
            "GPU 0 has 10.0 GiB free of 100.0 GiB, vllm serve on qwen-0.5b needs 30.0 GiB after waiting 0.3 s:"
            " held by pid 4242 (python3, 40.1 GiB), pid 4343 (VLLM::EngineCor, 30.0 GiB),"
            " pid 4444 (pt_main_thread, memory not reported)")
        assert holders.reads == 1  # asked once, when the wait has ended, not at every look
        with launch.sharing(5 * GIB):
            pass
        assert clock.take() < 1.0
        clock.give()


def test_many_holders_are_cut_to_the_largest_and_none_listed_says_so(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5a1e,GPU-77")
    many = [GpuHolder(100 + i, f"p{i}", (10 - i) * GIB) for i in range(6)]
    with launch.gpu_clock(_gpu(90).read, _Holders(many)), pytest.raises(launch.GpuMemoryError) as failed:
        with launch.sharing(30 * GIB):
            pass
    assert str(failed.value).startswith("GPU GPU-5a1e has 10.0 GiB free of 100.0 GiB, an engine's start needs 30.0")
    assert str(failed.value).endswith("held by pid 100 (p0, 10.0 GiB), pid 101 (p1, 9.0 GiB), pid 102 (p2, 8.0 GiB),"
                                      " pid 103 (p3, 7.0 GiB), 2 more")
    with launch.gpu_clock(_gpu(90).read, _Holders([])), pytest.raises(launch.GpuMemoryError, match="NVML lists no"):
        with launch.sharing(30 * GIB):
            pass


def test_where_the_memory_is_free_but_promised_the_start_goes_after_the_wait_as_before():
    """40 GiB free, 20 of them promised to evaluations yet to start: a start of 30 waits for the promise, and when
    the wait ends it starts anyway (a promise holds memory back; it takes none), naming nobody."""
    holders = _Holders(HOLDERS)
    with launch.gpu_clock(_gpu(60).read, holders) as clock:
        clock.promise(20 * GIB)
        with launch.sharing(30 * GIB):
            assert launch.memory_wait_s() >= WAIT_S
    assert holders.reads == 0


def test_memory_freed_during_the_wait_lets_the_start_go_naming_nobody():
    """Normal contention: a start waits for an engine of the run that frees its memory within the wait."""
    holders = _Holders(HOLDERS)
    memory = _gpu(90)
    started = threading.Event()
    with launch.gpu_clock(memory.read, holders):
        def start() -> None:
            with launch.sharing(30 * GIB):
                started.set()

        thread = threading.Thread(target=contextvars.copy_context().run, args=(start,))
        thread.start()
        assert not started.wait(0.1)
        memory.free("others")
        assert started.wait(5)
        thread.join(5)
    assert holders.reads == 0


def _engine(out: str) -> str:
    """A speed engine's process: it would write `out` had it started."""
    Path(out).write_text("started")
    return "measured"


def test_a_speed_engine_short_of_memory_answers_failed_without_starting(tmp_path):
    """in_process_group (a speed session's engine process) answers ("failed", the line): no process starts."""
    out = tmp_path / "engine.txt"
    with launch.gpu_clock(_gpu(90).read, _Holders(HOLDERS[:1])):
        status, why = launch.in_process_group(_engine, (str(out),), 60,
                                              slot=launch.Slot("vllm's engine on qwen-0.5b", 30 * GIB))
    assert status == "failed"
    assert why.startswith("GPU 0 has 10.0 GiB free of 100.0 GiB, vllm's engine on qwen-0.5b needs 30.0 GiB")
    assert not out.exists()


def test_the_out_of_memory_retry_reports_the_line_and_does_not_start_again():
    """A start that failed for want of memory after the wait is no engine that ran out of memory: the retry, which
    starts again with the GPU alone, is not made, and the line is the verdict (a speed row's reason)."""
    tries: list[int] = []
    opts = EngineOptions("cuda", "bfloat16", kv_cache_memory_bytes=GIB)

    def start(used: EngineOptions, tried: int) -> str | Failure:
        tries.append(tried)
        try:
            with launch.sharing(30 * GIB, "vllm bench on qwen-0.5b"):
                return "started"
        except launch.GpuMemoryError as e:
            return Failure(str(e))

    with launch.gpu_clock(_gpu(90).read, _Holders(HOLDERS[:1])):
        tried = retry_on_oom([opts, opts], launch.Deadline(60), start)
    assert tries == [0]
    assert tried.value is None and tried.attempts == []
    assert tried.error.endswith("held by pid 4242 (python3, 40.1 GiB)")


def test_a_process_is_named_by_its_command_and_an_unknown_pid_by_a_question_mark():
    assert process_name(os.getpid()) == Path("/proc/self/comm").read_text().strip()
    assert process_name(2**22 + 1) == "?"  # above Linux's pid_max


@pytest.mark.skipif(device_memory() is not None, reason="a GPU is visible: NVML lists its processes")
def test_without_a_gpu_nobody_holds_gpu_memory():
    assert gpu_holders() == []
