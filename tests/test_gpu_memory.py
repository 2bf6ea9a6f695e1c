"""Memory promised to unmeasured work on the GPU clock (tasks/runtime/gpu_memory.py): engine starts beside it wait while
a promise holds what they would need, and go once the promised job's engine has loaded. The clock, the threads, the
lm-eval process and its "loaded" signal are real; the GPU's memory is a stand-in (NVML, which reports it on the
device, is not on a CPU machine). What a promise protects on the device, an evaluation's vLLM start finding its
share free, is the reference run's (benchmarks/gpu/run_reference.sh)."""

from __future__ import annotations

import contextvars
import threading
import time

from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.tasks.runtime import gpu_memory, launch
from quantgate.tasks.steps.evaluate import evaluate_variant
from tests.test_evaluate import MODEL, PIQA_LIMIT
from tests.test_gpu_clock import _GpuMemory

GIB = 1 << 30


def _start_beside(need_gib: int, started: list[float]) -> threading.Thread:
    def start() -> None:
        with launch.sharing(need_gib * GIB):
            started.append(time.monotonic())

    thread = threading.Thread(target=contextvars.copy_context().run, args=(start,))
    thread.start()
    return thread


def test_a_promise_holds_memory_from_starts_until_each_job_settles_its_unit():
    """80 GiB free (no other work shares the GPU, so no headroom): two jobs are promised 30 GiB each, so a 30 GiB
    start waits (20 left); when one job's engine has loaded it goes; the other job ends without loading (its
    build failed) and its unit is settled with the promise."""
    memory = _GpuMemory()
    memory.take("other", 20)
    started: list[float] = []
    with launch.gpu_clock(memory.read):
        with gpu_memory.promised_memory(2, 30 * GIB) as promise:
            thread = _start_beside(30, started)
            time.sleep(0.3)
            assert started == []
            with gpu_memory.settles_on_load(promise):
                gpu_memory.engine_loaded()
                gpu_memory.engine_loaded()  # said twice, settled once
                thread.join(5)
                assert len(started) == 1
            late: list[float] = []
            second = _start_beside(60, late)  # 50 free beside the unit still promised: no room for 60
            time.sleep(0.3)
            assert late == []
        second.join(5)  # the promise's end settled the last unit
        assert len(late) == 1
    with gpu_memory.promised_memory(3, 30 * GIB):  # no clock: nothing held, nothing to settle
        pass


def test_an_evaluation_settles_its_unit_once_its_model_has_loaded_not_when_it_ends():
    """A real lm-eval process on stories260k (CPU, hf backend) under a promise of one unit that leaves no room for a
    start: the start goes once the evaluation's process says its model has loaded, before the evaluation ends."""
    memory = _GpuMemory()
    memory.take("other", 20)
    started: list[float] = []
    suite = SuiteSpec(tasks=(LocalTask(name="qg_piqa", limit=PIQA_LIMIT),), batch_size=8)
    with launch.gpu_clock(memory.read), gpu_memory.promised_memory(1, 60 * GIB) as promise:
        thread = _start_beside(30, started)
        with gpu_memory.settles_on_load(promise):
            report = evaluate_variant(str(MODEL), suite)
        ended = time.monotonic()
        thread.join(5)
    assert report.status == "ok", report.error
    assert len(started) == 1 and started[0] < ended
