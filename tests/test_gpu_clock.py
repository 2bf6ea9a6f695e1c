"""The GPU clock on a CPU: unmeasured work shares the GPU, a measurement has it alone. Real threads and real
spawned processes (tasks/runtime/launch.in_process_group) whose "load" and "measurement" are timed sleeps written to
files; what they would do on a GPU is not run here (the device run is benchmarks/gpu/run_reference.sh, whose
speed rows carry the same windows)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from quantgate.catalog.scenarios import LatencyScenario, OfflineScenario, ServingScenario
from quantgate.tasks.adapters.engines import EngineOptions
from quantgate.tasks.adapters.model_memory import engine_overhead_bytes
from quantgate.tasks.adapters.speed.options import SIZED_GPU_MEMORY_UTILIZATION, sized_kv_cache, start_memory_bytes
from quantgate.tasks.adapters.speed.retry import fallback_options
from quantgate.tasks.runtime import launch
from tests.engine_process import EngineProcess


def _span(clock_cm, log: list, name: str, seconds: float) -> None:
    with clock_cm():
        began = time.monotonic()
        time.sleep(seconds)
        log.append((name, began, time.monotonic()))


def _overlap(a: tuple, b: tuple) -> bool:
    return a[1] < b[2] and b[1] < a[2]


def test_a_measurement_waits_for_shared_work_and_shared_work_waits_for_it():
    log: list = []
    with launch.gpu_clock():
        import contextvars

        def go(cm, name, seconds, delay=0.0):
            time.sleep(delay)
            _span(cm, log, name, seconds)

        threads = [threading.Thread(target=contextvars.copy_context().run, args=args) for args in [
            (go, launch.sharing, "build", 0.6),
            (go, launch.sharing, "eval", 0.4),
            (go, launch.measuring, "measure-a", 0.3, 0.05),
            (go, launch.measuring, "measure-b", 0.3, 0.05),
            (go, launch.sharing, "late-eval", 0.2, 0.75),  # asks while a measurement holds the GPU
        ]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    spans = {name: (name, a, b) for name, a, b in log}
    shared = [spans["build"], spans["eval"], spans["late-eval"]]
    measured = [spans["measure-a"], spans["measure-b"]]
    assert len(log) == 5
    assert not _overlap(*measured)
    assert not any(_overlap(m, s) for m in measured for s in shared)
    assert _overlap(spans["build"], spans["eval"])  # shared work runs side by side
    # Both measurements asked before the builds ended and waited for them.
    assert min(m[1] for m in measured) >= spans["build"][2]


def test_a_measurement_from_work_that_shares_the_gpu_is_refused_not_deadlocked():
    with launch.gpu_clock(), launch.sharing():
        with pytest.raises(launch.LaunchError, match="would wait for itself"):
            with launch.measuring():
                pass


def test_an_interrupt_wakes_jobs_waiting_for_the_gpu():
    errors: list[str] = []
    with launch.gpu_clock():
        import contextvars

        def wait_alone() -> None:
            try:
                with launch.measuring():
                    pass
            except launch.LaunchError as e:
                errors.append(str(e))

        with launch.sharing():
            t = threading.Thread(target=contextvars.copy_context().run, args=(wait_alone,))
            t.start()
            time.sleep(0.2)
            launch.interrupt_children()
            t.join(5)
    assert not t.is_alive()
    assert errors == ["stopped while waiting for the GPU: the run was interrupted"]


def load_then_measure(out: str, load_s: float, measure_s: float) -> float:
    """An engine's life in its own process: it loads (sharing the GPU), then measures (alone)."""
    began = time.time()
    time.sleep(load_s)
    loaded = time.time()
    with launch.measuring() as window:
        start = time.time()
        time.sleep(measure_s)
        Path(out).write_text(json.dumps({"load": [began, loaded], "measure": [start, time.time()],
                                         "waited": window.waited_s}))
    return window.waited_s


def test_engines_load_beside_shared_work_and_measure_one_at_a_time(tmp_path):
    import contextvars

    answers: dict[str, tuple] = {}
    shared: list = []
    with launch.gpu_clock():
        def engine(name: str) -> None:
            answers[name] = launch.in_process_group(load_then_measure, (str(tmp_path / f"{name}.json"), 0.2, 0.5), 60)

        threads = [threading.Thread(target=contextvars.copy_context().run, args=(engine, n)) for n in ("a", "b")]
        threads.append(threading.Thread(target=contextvars.copy_context().run,
                                        args=(_span, launch.sharing, shared, "eval", 3.0)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [answers[n][0] for n in ("a", "b")] == ["ok", "ok"], answers
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b"))
    (_, eval_began, eval_ended), = shared
    eval_ended_wall = time.time() - (time.monotonic() - eval_ended)
    # Both loaded while the evaluation ran; each measured after it, and not at the same time as the other.
    assert a["load"][1] < eval_ended_wall and b["load"][1] < eval_ended_wall
    assert min(a["measure"][0], b["measure"][0]) >= eval_ended_wall - 0.05
    assert a["measure"][1] <= b["measure"][0] or b["measure"][1] <= a["measure"][0]
    # Each waited at least from its load's end to the evaluation's, and its wait is what the parent measured and
    # sent back.
    assert all(e["waited"] >= eval_ended_wall - e["load"][1] - 0.05 for e in (a, b))
    assert answers["a"][1] == pytest.approx(a["waited"])


def test_without_a_clock_a_process_measures_at_once(tmp_path):
    status, waited = launch.in_process_group(load_then_measure, (str(tmp_path / "x.json"), 0.0, 0.0), 60)
    assert (status, waited) == ("ok", 0.0)


QWEN_1_5B = {"num_attention_heads": 12, "num_key_value_heads": 2, "hidden_size": 1536, "num_hidden_layers": 28}


def test_the_kv_cache_is_sized_to_the_scenarios_whole_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_1_5B))
    offline = OfflineScenario(engines=["vllm"], num_prompts=1000, input_len=256, output_len=128,
                           max_model_len=1024, device="cuda")
    latency = LatencyScenario(engines=["vllm"], num_prompts=4, input_len=512, output_len=128, max_model_len=1024,
                              device="cuda")
    serving = ServingScenario(engines=["vllm"], num_prompts=64, input_len=256, output_len=128,
                           concurrency=[8, 64], rounds=2, max_model_len=1024, device="cuda")
    opts = EngineOptions("cuda", "bfloat16", max_model_len=1024)
    per_token = 28 * 2 * 2 * 128 * 2  # layers × (K, V) × KV heads × head dim × bf16
    sized = sized_kv_cache(opts, tmp_path, [offline, latency])
    # 1,000 sequences of 384 tokens in flight at most, with 25% room; the latency scenario asks less.
    assert sized.kv_cache_memory_bytes == int(1000 * 384 * per_token * 1.25)
    assert sized.gpu_memory_utilization == SIZED_GPU_MEMORY_UTILIZATION
    # Serving: the highest concurrency (64) at full length, over the 1 GiB floor only when it needs more.
    assert sized_kv_cache(opts, tmp_path, [serving]).kv_cache_memory_bytes == 1 << 30
    assert serving.most_in_flight() == 64 and latency.most_in_flight() == 1
    # A scenario that sets its memory share keeps it; a CPU engine has no KV cache to size.
    assert sized_kv_cache(opts, tmp_path, [offline.model_copy(update={"gpu_memory_utilization": 0.5})]) == opts
    assert sized_kv_cache(EngineOptions("cpu", "float32"), tmp_path, [offline]).kv_cache_memory_bytes is None
    # Its retry after running out of memory is the same start, made with the GPU alone.
    assert fallback_options(sized, "vllm", 384) == [sized, sized]
    # The memory its start is admitted for: the weights as stored, the KV cache, the engine's overhead for the
    # model's widths (3 GiB and its profile run's activations; tests/test_memory_plan.py holds it to measured
    # peaks). vLLM's free-memory share at start needs NVML, which this machine lacks: there the larger counts.
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1024, 1024, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    overhead = engine_overhead_bytes(QWEN_1_5B)
    assert overhead == (3 << 30) + 16_384 * (2 * 4 * 1536 + 4 * 1536) * 2  # no intermediate_size: 4 x hidden
    assert start_memory_bytes(sized, tmp_path, "vllm") == 2 * 1024 * 1024 + sized.kv_cache_memory_bytes + overhead
    assert start_memory_bytes(EngineOptions("cpu", "float32"), tmp_path, "transformers") == 0


def test_a_server_started_beside_other_work_runs_at_the_niceness_asked(tmp_path):
    import os
    import sys

    from quantgate.tasks.runtime.processes import spawn_session

    log = tmp_path / "nice.log"
    proc = spawn_session([sys.executable, "-c", "import os; print(os.nice(0), os.getpgrp() == os.getpid())"], log,
                         None, niceness=5)
    proc.wait(30)
    # nice(1) execs the command: it is the session leader, at its parent's niceness plus 5.
    assert log.read_text().split() == [str(os.nice(0) + 5), "True"]
    # Where it could not be undone for the measurement (not root), an engine's start keeps normal priority.
    assert launch.start_niceness() == (launch.START_NICENESS if os.geteuid() == 0 else 0)


def test_waiting_measurements_go_in_the_order_of_their_checkpoints():
    import contextvars

    order: list[int] = []
    with launch.gpu_clock():
        def measure(rank: int) -> None:
            with launch.ranked(rank), launch.measuring():
                order.append(rank)
                time.sleep(0.05)

        with launch.sharing():  # all three are waiting when the GPU frees
            threads = [threading.Thread(target=contextvars.copy_context().run, args=(measure, r)) for r in (2, 0, 1)]
            for t in threads:
                t.start()
            time.sleep(0.3)
        for t in threads:
            t.join(5)
    assert order == [0, 1, 2]


class _GpuMemory:
    """The memory a GPU would report (NVML, which a CPU machine lacks): 100 GiB, less what the holders hold."""

    total = 100 << 30

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, name: str, gib: int) -> None:
        with self._lock:
            self.held[name] = gib << 30

    def free(self, name: str) -> None:
        with self._lock:
            self.held.pop(name, None)

    def read(self) -> tuple[int, int]:
        with self._lock:
            return self.total - sum(self.held.values()), self.total


def test_an_engine_start_waits_for_its_memory_while_measurements_go_on_and_free_it():
    """An engine loaded earlier holds 75 GiB and waits to measure; a start that needs 30 GiB (25 free) waits, holding
    no share, so the loaded engine measures when the unmeasured work ends, frees its memory, and the start goes.
    Real threads and the real clock; the GPU's memory is the stand-in above."""
    import contextvars

    memory = _GpuMemory()
    memory.take("loaded", 75)
    events: list[str] = []
    waited: list[float] = []
    with launch.gpu_clock(memory.read):
        def start() -> None:
            with launch.sharing(30 << 30):
                events.append("start")
                memory.take("started", 30)
            with launch.measuring() as window:  # its measurement's row says how long its start waited for memory
                waited.append(window.details().get("memory_wait_s", 0.0))

        def measure_loaded() -> None:
            with launch.measuring():
                events.append("measure")
                time.sleep(0.2)
                memory.free("loaded")  # its process ends with its measurement
            events.append("measured")

        threads = [threading.Thread(target=contextvars.copy_context().run, args=(fn,)) for fn in (start, measure_loaded)]
        with launch.sharing():  # the unmeasured work
            for t in threads:
                t.start()
            time.sleep(0.3)
            assert events == []  # the start waits for memory, the measurement for the unmeasured work
        for t in threads:
            t.join(10)
    assert events == ["measure", "measured", "start"]
    assert memory.held == {"started": 30 << 30}
    assert waited[0] >= 0.4  # the shared work's 0.3 s and the measurement's 0.2 s, at least


def test_beside_unmeasured_work_a_start_leaves_room_for_it():
    """60 GiB held, 40 free, a start of 30: while unmeasured work shares the GPU, 15 % of it (15 GiB) stays free for
    that work's own starts, so the start waits; when that work has ended it goes, with 40 free."""
    import contextvars

    memory = _GpuMemory()
    memory.take("loaded", 60)
    started = threading.Event()
    with launch.gpu_clock(memory.read):
        def start() -> None:
            with launch.sharing(30 << 30):
                started.set()

        thread = threading.Thread(target=contextvars.copy_context().run, args=(start,))
        with launch.sharing():  # the unmeasured work
            thread.start()
            assert not started.wait(0.5)
        assert started.wait(5)
        thread.join(5)


def test_two_starts_are_not_promised_the_same_free_memory_and_the_headroom_applies_only_beside_other_work():
    """70 GiB free and two starts of 40 GiB each, nothing else sharing: the first is let in and the second waits
    until the first has its memory and the engine the first started ends; a start of more than the GPU holds does
    not wait (the engine will say what is missing), nor one whose GPU memory is not known."""
    import contextvars

    memory = _GpuMemory()
    memory.take("other", 30)
    began: dict[str, float] = {}
    with launch.gpu_clock(memory.read):
        def start(name: str) -> None:
            with launch.sharing(40 << 30):
                began[name] = time.monotonic()
                memory.take(name, 40)
                time.sleep(0.3)  # loading: its 40 GiB promised and taken at once here
            time.sleep(0.2)  # loaded, then ended
            memory.free(name)

        threads = [threading.Thread(target=contextvars.copy_context().run, args=(start, n)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        first, second = sorted(began.values())
        assert second - first >= 0.45  # the second started once the first's engine had ended
        with launch.sharing(200 << 30):  # more than the GPU has: no wait
            pass
    with launch.gpu_clock(lambda: None), launch.sharing(200 << 30):  # memory not known: no wait
        pass


def test_starts_waiting_for_memory_go_in_the_order_of_their_checkpoints():
    """Nothing fits at first; a small start of checkpoint 2 asks before a large one of checkpoint 0. When 40 GiB
    free up, the large one goes first (its checkpoint is measured first) and the small one after it, though it
    would have fit alone."""
    import contextvars

    memory = _GpuMemory()
    memory.take("loaded", 97)
    order: list[str] = []
    with launch.gpu_clock(memory.read):
        def start(name: str, rank: int, gib: int, delay: float) -> None:
            time.sleep(delay)
            with launch.ranked(rank), launch.sharing(gib << 30):
                order.append(name)
                memory.take(name, gib)

        threads = [threading.Thread(target=contextvars.copy_context().run, args=(start, *args))
                   for args in (("small", 2, 5, 0.0), ("large", 0, 30, 0.2))]
        for t in threads:
            t.start()
        time.sleep(0.6)
        assert order == []
        memory.free("loaded")
        memory.take("loaded", 60)
        for t in threads:
            t.join(10)
    assert order == ["large", "small"]


def test_an_engines_time_limit_does_not_count_its_waits_for_the_gpu():
    """launch.Deadline moves by each wait of its thread on the clock: for memory to start (share) and for the GPU
    alone (take). On the H100 a vLLM bench start that had waited 634 s for memory beside the builds was given 1 s
    to reach its first pass, because its limit had run while it waited (results/h100/shape7b-variants-1)."""
    free = [0]
    other_thread_started = threading.Event()

    def hold_then_free() -> None:
        clock.share()
        other_thread_started.set()
        time.sleep(0.6)
        free[0] = 100
        clock.unshare()

    with launch.gpu_clock(memory=lambda: (free[0], 100)) as clock:
        deadline = launch.Deadline(0.5)
        threading.Thread(target=hold_then_free).start()
        other_thread_started.wait()
        waited = clock.share(need_bytes=50)  # waits ~0.6 s for the memory: longer than the whole limit
        assert waited >= 0.5 and not deadline.passed() and deadline.left() > 0.3
        clock.unshare(50)
        time.sleep(0.5)
        assert deadline.passed() and deadline.left() == 1.0  # passed: a start or a pass still gets a second


def test_launch_exports_the_clock_it_does_not_define():
    """The clock lives in tasks/runtime/gpu_clock.py; launch.X reaches the very same objects (a context variable
    defined twice would be two clocks: jobs set one and in_process_group would read the other)."""
    import contextvars

    from quantgate.tasks.runtime import gpu_clock

    assert all(hasattr(launch, name) for name in launch.__all__)
    for name in launch.__all__:
        if hasattr(gpu_clock, name):
            assert getattr(launch, name) is getattr(gpu_clock, name), name
    assert not [name for name, value in vars(launch).items() if isinstance(value, contextvars.ContextVar)]
    with launch.gpu_clock() as clock:
        assert gpu_clock.current_clock() is clock and launch.starts_beside()


def _sleeper(niceness: int) -> EngineProcess:
    """An engine process as start_then_measure sees one, doing nothing."""
    return EngineProcess(["sleep", "60"], niceness)


def test_an_engine_process_starts_beside_shared_work_and_measures_alone_at_normal_priority():
    """start_then_measure, the order every engine process a backend starts keeps: its start (at the niceness of
    starts) while a build shares the GPU, its measurement only once the build is done, back at niceness 0; a retry's
    slot holds the GPU alone before its start. Stopped before the GPU is given back."""
    log: list = []
    seen: dict = {}
    with launch.gpu_clock():
        import contextvars

        def measure(started: EngineProcess, window: launch.GpuWindow) -> str:
            log.append(("measure", time.monotonic()))
            seen["niceness"] = os.getpriority(os.PRIO_PROCESS, started.pid)
            seen["alive"] = started.proc.poll() is None
            return "measured"

        def start(niceness: int) -> EngineProcess:
            log.append(("start", time.monotonic()))
            seen["started_at"] = niceness
            return _sleeper(niceness)

        build = threading.Thread(target=contextvars.copy_context().run, args=(_span, launch.sharing, log, "build", 0.6))
        build.start()
        time.sleep(0.1)
        assert launch.start_then_measure(launch.Slot("a test's engine", 1 << 20), start, measure) == "measured"
        build.join(10)
        alone: list = []
        retry = launch.Slot.for_try("a test's engine", 1 << 20, tried=1)
        assert retry.alone_from_start and retry.memory_bytes == 0
        assert launch.start_then_measure(retry, lambda n: alone.append(n) or _sleeper(n), lambda s, w: "again") == "again"
    [(_, b0, b1)] = [e for e in log if e[0] == "build"]
    (started,), (measured,) = [e[1] for e in log if e[0] == "start"], [e[1] for e in log if e[0] == "measure"]
    assert b0 < started < b1 < measured  # started beside the build, measured after it
    assert seen["started_at"] == launch.start_niceness() and seen["niceness"] == 0 and seen["alive"]
    assert alone == [0]  # a retry starts alone, at normal priority
