"""One entry for every speed measurement (tasks/steps/measure.py): the backend chosen by engine and scenario kind,
every registered backend importable, rows handed on as they come in. On this CPU machine the session backend
measures for real (Transformers on stories260k, in a process of its own); the bench and server backends run up to
the point where they find no GPU and say so in their rows. Their GPU paths run in tests/gpu/."""

from __future__ import annotations

import importlib
import inspect
import socket
import subprocess
import sys

import pytest
import torch

from quantgate.catalog.scenarios import OfflineScenario, ServingScenario
from quantgate.tasks.adapters.endpoint import Target
from quantgate.tasks.adapters.speed.errors import BenchmarkError
from quantgate.tasks.steps.measure import (
    BACKENDS, DEFAULT_BACKEND, Backend, BackendKind, backend_name, backend_of, measure,
)
from tests.engine_process import EngineProcess
from tests.shared_data import TINY_MODEL

SESSION = OfflineScenario(num_prompts=2, input_len=8, output_len=4, batch_size=2, repetitions=1, device="cpu")
SAMPLED = OfflineScenario(engines=["vllm", "vllm-bench"], num_prompts=4, input_len=8, output_len=4, temperature=1.0)
SERVING = ServingScenario(engines=["vllm"], num_prompts=4, input_len=8, output_len=4, concurrency=[1])
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the backends say on a machine without a GPU")


def test_each_engine_and_kind_has_its_backend():
    assert backend_name("transformers", [("a", SESSION)]) == "session"
    assert backend_name("vllm", [("a", SESSION), ("b", SESSION)]) == "session"
    assert backend_name("vllm-bench", [("x", SAMPLED)]) == "vllm-bench"
    assert backend_name("vllm", [("s", SERVING)]) == backend_name("vllm-serve", [("s", SERVING)]) == "vllm-serve"
    assert backend_name("endpoint", [("s", SERVING), ("t", SERVING)]) == "endpoint"
    with pytest.raises(BenchmarkError, match="a serving scenario is measured alone"):
        backend_name("vllm", [("a", SESSION), ("s", SERVING)])
    with pytest.raises(BenchmarkError, match="an endpoint runs serving scenarios only"):
        backend_name("endpoint", [("a", SESSION)])


def test_a_backend_is_chosen_by_what_the_registry_declares_not_by_name(monkeypatch):
    """A backend registered with the engines and kinds it claims is chosen for them, its rules held, with no name
    written into backend_name (issue 41)."""
    mine = BackendKind("tests.test_measure:nothing", engines=frozenset({"my-engine"}),
                       runs_kinds=frozenset({"offline"}), one_scenario=True, rule="mine runs one")
    monkeypatch.setitem(BACKENDS, "mine", mine)
    assert backend_name("my-engine", [("a", SESSION)]) == "mine"
    assert backend_of("my-engine", [("a", SESSION)]) is mine
    with pytest.raises(BenchmarkError, match=r"a\+b: mine runs one"):
        backend_name("my-engine", [("a", SESSION), ("b", SESSION)])
    with pytest.raises(BenchmarkError, match="mine runs one"):
        backend_name("my-engine", [("s", SERVING)])
    assert backend_name("vllm", [("a", SESSION)]) == DEFAULT_BACKEND == "session"


def test_every_registered_backend_imports_with_the_backends_signature():
    # The first parameter is what is measured, passed by position: a checkpoint's path, or an endpoint's Target.
    wanted = list(inspect.signature(Backend.__call__).parameters)[2:]
    assert set(BACKENDS) == {"session", "vllm-bench", "vllm-serve", "endpoint"}
    for name, kind in BACKENDS.items():
        module, _, function = kind.path.partition(":")
        backend = getattr(importlib.import_module(module), function)
        assert list(inspect.signature(backend).parameters)[1:] == wanted, name


def test_an_endpoint_nobody_answers_is_one_failed_row_handed_on(tmp_path):
    """The endpoint backend through `measure`, against a loopback port nothing listens on (a server that answers:
    tests/test_endpoint.py, through bench-endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the block ends: refused from then on
    seen = []
    ((row, loads),) = measure(Target(url=f"http://127.0.0.1:{port}/v1", model="m"), "endpoint", [("s", SERVING)],
                              work_dir=tmp_path, timeout_s=30, on_point=lambda r, ls: seen.append(r.scenario))
    assert (row.engine, row.status, seen) == ("endpoint", "failed", ["s"])
    assert "\n" not in row.reason and "no request succeeded" in row.reason and "connect" in row.reason.lower()
    assert loads and not any(r.success for load in loads for r in load.records)
    assert "endpoint" in row.details  # what it asked the server, and that nothing answered
    assert list(tmp_path.iterdir()) == []


def test_a_session_measures_here_and_hands_each_row_on(tmp_path):
    seen = []
    measured = measure(str(TINY_MODEL), "transformers", [("one", SESSION), ("two", SESSION)], work_dir=tmp_path,
                       on_point=lambda result, loads: seen.append((result.scenario, loads)))
    assert [(r.scenario, r.status, loads) for r, loads in measured] == [("one", "ok", []), ("two", "ok", [])]
    assert seen == [("one", []), ("two", [])]
    assert measured[0][0].details["engine_starts"] == 1  # one engine start for the session's two scenarios


@no_gpu
def test_the_bench_and_the_server_say_why_they_cannot_run_here(tmp_path):
    ((bench, _),) = measure(str(TINY_MODEL), "vllm-bench", [("x", SAMPLED)], work_dir=tmp_path)
    ((served, loads),) = measure(str(TINY_MODEL), "vllm", [("s", SERVING)], work_dir=tmp_path)
    assert (bench.engine, bench.status) == ("vllm-bench", "skipped") and "vllm" in bench.reason
    assert (served.engine, served.status, loads) == ("vllm", "skipped", []) and "vllm" in served.reason


# --- a new backend, written from docs/architecture.md ("A speed backend", "How its engine gets the GPU") alone -----


class _CountingEngine(EngineProcess):
    """The fixture backend's engine: a process of its own session that counts as fast as it can once told to, and
    says how far it got."""

    SCRIPT = ("import sys,time\nsys.stdin.readline()\nn,t=0,time.perf_counter()\n"
              "while time.perf_counter()-t<0.2: n+=1\nprint(n, flush=True)\nsys.stdin.readline()\n")

    def __init__(self, niceness: int) -> None:
        super().__init__([sys.executable, "-c", self.SCRIPT], niceness, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)

    def count(self) -> int:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())


def counting_backend(source, engine, scenarios, *, work_dir, timeout_s, pair_with, on_point):
    """The Backend signature; its engine's start declares a Slot and measures through launch.start_then_measure."""
    from quantgate.catalog.records import SpeedResult
    from quantgate.tasks.runtime import launch

    out = []
    for name, scenario in scenarios:
        def measure(engine_process: _CountingEngine, window: launch.GpuWindow) -> SpeedResult:
            counted = engine_process.count()
            return SpeedResult(engine, name, "ok", None, {}, tokens_per_s=counted / 0.2, details=window.details())

        row = launch.start_then_measure(launch.Slot(f"{engine} on {source}", 1 << 20), _CountingEngine, measure)
        if on_point:
            on_point(row, [])
        out.append((row, []))
    return out


def test_a_backend_written_from_the_docs_measures_alone_through_measure(monkeypatch, tmp_path):
    """Issue 41's check of the backend contract: a backend registered in BACKENDS, whose engine process starts
    through launch.start_then_measure with its Slot, is chosen by `measure`, loads beside a build that shares the GPU
    clock and measures only once the build is done, with its wait in the row; nothing in tasks/runtime/ knows it."""
    import contextvars
    import threading
    import time

    from quantgate.tasks.runtime import launch

    monkeypatch.setitem(BACKENDS, "counting", BackendKind("tests.test_measure:counting_backend",
                                                          engines=frozenset({"counting"})))
    build: dict = {}

    def a_build() -> None:
        with launch.sharing():
            build["from"] = time.monotonic()
            time.sleep(1.0)
            build["to"] = time.monotonic()

    with launch.gpu_clock():
        thread = threading.Thread(target=contextvars.copy_context().run, args=(a_build,))
        thread.start()
        time.sleep(0.2)
        ((row, loads),) = measure(str(tmp_path), "counting", [("c", SESSION)], work_dir=tmp_path)
        measured_at = time.monotonic()
        thread.join(10)
    assert (row.engine, row.scenario, row.status, loads) == ("counting", "c", "ok", [])
    assert row.tokens_per_s > 0
    assert build["to"] <= measured_at and row.details["gpu_wait_s"] >= 0.5  # it waited for the build to end
