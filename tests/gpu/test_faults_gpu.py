"""Faults on the GPU (issue 44, items 1-3): a real `quantgate run` of stories260k (the smallest real model the GPU
tests use) with one FP8 build, its evaluations through lm-eval's vLLM backend and its speed session on vLLM,
interrupted, killed outright, and robbed of an engine core, each while the GPU holds what the stage took.

QUANTGATE_FAULT=<point>=pause (tasks/runtime/faults.py) holds a process of the run where its GPU memory is taken:
`build` (the build's own process, its checkpoint written), `evaluate:loaded` (an lm-eval process, its vLLM engine
loaded) and `measure:loaded` (a speed engine's process, loaded, with the GPU alone, before its passes). The fault
comes from here, to the `quantgate` process, as a user's Ctrl-C, a supervisor's SIGTERM or the out-of-memory killer
would send it; an engine core is killed with SIGKILL and its engine then let go on to measure.

Each case asserts the exit status, the run's failed row (or the failed speed row and its `not_measured` check), that
every process the run started is gone and none is on the GPU (NVML's process list) within 30 s, with the GPU's
memory back to what it was before the run, and a rerun that resumes the same run and decides, every key once.

The run's processes are the `quantgate` process and every descendant seen while it ran (polled, so that a process
the run put in a session of its own counts too). The GPU's memory is compared less what NVML lists for processes not
of the run: benchmarks/gpu/run_tests.sh may run other tests' engines on the same GPU. The checks need NVML to list
the run's processes by their pids here (a container sharing the host's PID namespace, as on the device): each case
first asserts that it does, while the stage holds the GPU."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from quantgate.tasks.runtime.telemetry import device_memory, gpu_holders
from quantgate.warehouse import reads, sessions
from tests.cli_runs import CLI, error_lines
from tests.shared_data import TINY_MODEL
from tests.test_crash_resume import RESULTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                       reason="needs vllm and a CUDA GPU"),
]

# The issue's bound: the run's exit after a signal, its processes' end after a kill, the GPU's memory back.
SETTLE_S = 30.0
# What the driver's own share of the GPU's memory moves by as other processes' contexts come and go.
MEMORY_SLACK = 512 << 20
# A run of the tiny model reaches any of its stages within this on an H200 (vLLM's starts are most of it).
REACH_S = 600.0
VARIANT = "fp8-dynamic"


def _catalog(tmp: Path) -> Path:
    """The tiny model with one data-free build vLLM serves at hidden size 64 (FP8; W8A16's kernels need wider
    layers), a short perplexity suite, and one eager vLLM scenario the speed gate reads."""
    path = tmp / "catalog.yaml"
    path.write_text(f"""version: 1
variants:
  {VARIANT}: {{method: fp8, scheme: FP8_DYNAMIC, group_size: null}}
suites:
  stories:
    tasks: [{{name: qg_simple_stories, limit: 8}}]
    batch_size: 8
scenarios:
  gpu-tiny: {{kind: offline, engines: [vllm], device: cuda, num_prompts: 16, input_len: 32, output_len: 16,
             max_model_len: 64, enforce_eager: true, warmup: 1, repetitions: 3}}
models:
  - id: tiny
    source: {{kind: local, path: {TINY_MODEL}}}
    variants: [{VARIANT}]
    suite: stories
    scenarios: [gpu-tiny]
policy:
  version: 1
  quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.5, higher_is_better: false}}]
  speed: {{engine: vllm, scenario: gpu-tiny, min_speedup: 0.01}}
  max_size_ratio: 1.0
""")
    return path


@dataclass(frozen=True)
class Setup:
    args: list[str]
    warehouse: Path
    tmp: Path
    prefect_api: str


@pytest.fixture
def setup(tmp_path: Path, prefect_api: str) -> Setup:
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    wh = tmp_path / "w.ducklake"
    args = ["run", "tiny", "-c", str(_catalog(tmp_path)), "-w", str(wh), "--workdir", str(tmp_path / "work")]
    return Setup(args, wh, tmp_path, prefect_api)


# --- the GPU and the run's processes ------------------------------------------------------------------------------


def _on_gpu() -> dict[int, int]:
    """NVML's processes on the visible GPU and the memory each holds."""
    return {h.pid: h.used_bytes or 0 for h in gpu_holders()}


def _memory_of(run: set[int]) -> int:
    """The GPU's used memory less what NVML lists for processes not of `run`: the driver's own share, and whatever
    the run still holds."""
    memory = device_memory()
    assert memory is not None, "NVML reads no GPU"
    free, total = memory
    return total - free - sum(used for pid, used in _on_gpu().items() if pid not in run)


def _alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:  # a zombie holds nothing: it has ended
                left.add(pid)
    return left


def _wait_for(holds: Callable[[], bool], within_s: float, missing: Callable[[], str]) -> None:
    """Until `holds()`, or fail after `within_s` saying what is `missing` then."""
    deadline = time.monotonic() + within_s
    while not holds():
        assert time.monotonic() < deadline, f"not within {within_s:g} s: {missing()}"
        time.sleep(0.5)


class _Tree:
    """The pids of a process and of every descendant it has had, polled from a thread while it runs: a process
    reparented after its parent's death is still the run's."""

    def __init__(self, root: int) -> None:
        self.pids = {root}
        self._root = root
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="run-tree", daemon=True)
        self._thread.start()

    def look(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.pids |= {p.pid for p in psutil.Process(self._root).children(recursive=True)}

    def stop(self) -> None:
        self.look()
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            self.look()


def _gpu_left_clean(run: set[int], baseline: int) -> None:
    """Within SETTLE_S: none of the run's processes alive, none on NVML's list, the GPU's memory back."""
    _wait_for(lambda: not _alive(run), SETTLE_S,
              lambda: f"processes of the run still running: {[_described(p) for p in sorted(_alive(run))]}")
    _wait_for(lambda: not set(_on_gpu()) & run, SETTLE_S,
              lambda: f"NVML still lists processes of the run: {sorted(set(_on_gpu()) & run)}")
    _wait_for(lambda: _memory_of(run) <= baseline + MEMORY_SLACK, SETTLE_S,
              lambda: f"the GPU's memory at {_memory_of(run) >> 20} MiB, {baseline >> 20} MiB before the run")


def _described(pid: int) -> str:
    with contextlib.suppress(psutil.NoSuchProcess):
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}"
    return f"{pid} (gone)"


# --- a run and its fault ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Paused:
    pid: int
    where: str  # the checkpoint or build the paused process works on

    @property
    def on_variant(self) -> bool:
        return Path(self.where).parent.name == "variants"


@dataclass
class Run:
    """A `quantgate run` in a session of its own, its output in files (vLLM's logs would fill a pipe)."""

    proc: subprocess.Popen
    tree: _Tree
    paused_file: Path
    stderr: Path
    seen: int = 0

    def next_paused(self) -> Paused | None:
        """The next process of the run that reached its fault point; None once the run has ended."""
        deadline = time.monotonic() + REACH_S
        while True:
            lines = self.paused_file.read_text().splitlines() if self.paused_file.exists() else []
            if len(lines) > self.seen:
                _, pid, *where = lines[self.seen].split(maxsplit=2)  # the point, its pid, where it is
                self.seen += 1
                return Paused(int(pid), where[0] if where else "")
            if self.proc.poll() is not None:
                return None
            assert time.monotonic() < deadline, f"no fault point reached within {REACH_S:g} s"
            time.sleep(0.2)

    def paused(self) -> Paused:
        """The first process of the run held at its fault point, while the run goes on."""
        paused = self.next_paused()
        assert paused is not None, f"the run ended before its fault point: {self.errors()[-3000:]}"
        return paused

    def go_on(self, paused: Paused) -> None:
        (self.paused_file.parent / f"{self.paused_file.name}.{paused.pid}.go").touch()

    def wait(self, timeout_s: float) -> int:
        """Its exit code; still running after `timeout_s`: a failure with where its threads are (SIGUSR1 makes
        the CLI print them) and the end of its stderr."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            raise AssertionError(f"still running {timeout_s:g} s on; its stderr ends:\n{self.errors()[-8000:]}") from None
        finally:
            self.tree.stop()

    def errors(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr.exists() else ""


@contextlib.contextmanager
def running(setup: Setup, fault: str, name: str) -> Iterator[Run]:
    """`quantgate run` with QUANTGATE_FAULT=`fault`; whatever of it is left at the end is killed, so that a failed
    assertion leaves nothing on the GPU for the next test."""
    paused = setup.tmp / f"paused-{name}"
    env = {**os.environ, "PREFECT_API_URL": setup.prefect_api, "QUANTGATE_FAULT": fault,
           "QUANTGATE_FAULT_PAUSED": str(paused)}
    out, err = setup.tmp / f"{name}.out", setup.tmp / f"{name}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([*CLI, *setup.args], stdout=stdout, stderr=stderr, env=env, start_new_session=True)
    run = Run(proc, _Tree(proc.pid), paused, err)
    try:
        yield run
    finally:
        run.tree.stop()
        for pid in _alive(run.tree.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def _holding_gpu(run: Run) -> None:
    """The stage holds GPU memory in processes of the run, and NVML names them by the pids seen here."""
    run.tree.look()
    _wait_for(lambda: bool(set(_on_gpu()) & run.tree.pids), 10,
              lambda: f"NVML lists none of the run's processes, only {sorted(_on_gpu())} (another PID namespace?)")


def _completed(setup: Setup, name: str) -> None:
    """The rerun without a fault: it ends the run."""
    with running(setup, "", name) as run:
        assert run.wait(REACH_S) == 0, run.errors()[-3000:]


# --- what the warehouse holds -------------------------------------------------------------------------------------


def _runs(wh: Path) -> list[dict]:
    with sessions.session(wh, read_only=True) as con:
        return reads.rows(con, "SELECT run_id, status, error FROM runs")


def _decided_once(wh: Path) -> str:
    """One run, completed, and every key once: each stage mark, result row, evaluation, speed row and decision.
    Returns the run's id."""
    with sessions.session(wh, read_only=True) as con:
        (run,) = reads.rows(con, "SELECT run_id, status FROM runs")
        assert run["status"] == "completed"
        for table in (*RESULTS, "runs"):
            (n, distinct) = con.execute(f"SELECT count(*), count(DISTINCT t) FROM {table} t").fetchone()
            assert n == distinct, f"{table} has duplicate rows"
        for table, key in (("run_stages", "stage, item"), ("quality_evals", "variant_uid, eval_key"),
                           ("speed_results", "variant_uid, engine, scenario"), ("decisions", "variant_uid")):
            twice = con.execute(f"SELECT {key} FROM {table} WHERE run_id = ? GROUP BY ALL HAVING count(*) > 1",
                                [run["run_id"]]).fetchall()
            assert not twice, f"{table}: stored more than once: {twice}"
        assert con.execute("SELECT count(*) FROM speed_results WHERE run_id = ?", [run["run_id"]]).fetchone()[0] == 2
        decided = reads.rows(con, "SELECT v.name FROM decisions d JOIN variants v USING (variant_uid)"
                                  " WHERE d.run_id = ?", [run["run_id"]])
    assert [d["name"] for d in decided] == [VARIANT]
    return run["run_id"]


# --- the cases ----------------------------------------------------------------------------------------------------

# (fault point the run is held at, the stage its row names, signal): a build on the GPU, an evaluation on vLLM (with
# the other checkpoint's evaluation and the speed engines loading beside it), a speed session's engine measuring.
SIGNALLED = [("build", "quantize", signal.SIGINT), ("build", "quantize", signal.SIGTERM),
             ("evaluate:loaded", "evaluate", signal.SIGINT), ("evaluate:loaded", "evaluate", signal.SIGTERM),
             ("measure:loaded", "benchmark", signal.SIGINT), ("measure:loaded", "benchmark", signal.SIGTERM)]


def test_sigint_and_sigterm_in_gpu_stages_end_everything_and_the_rerun_decides(setup):
    """Each signal while a stage holds the GPU: exit 130 / 143 within 30 s, one error line naming the signal and
    the stage, the run row failed with it, nothing of the run left on the GPU; the runs chain, each resuming the
    one before, and the last decides."""
    run_ids = set()
    for point, stage, sig in SIGNALLED:
        name = signal.Signals(sig).name
        baseline = _memory_of(set())
        with running(setup, f"{point}=pause", f"{point}-{name}") as run:
            run.paused()
            _holding_gpu(run)
            run.proc.send_signal(sig)
            sent = time.monotonic()
            code = run.wait(120)
            took = time.monotonic() - sent
            assert code == 128 + sig, run.errors()[-3000:]
            assert took <= SETTLE_S, f"{name} during {stage}: exited after {took:.0f} s"
            (line,) = error_lines(run.errors())
            prefix = f"error: interrupted ({name}) during "
            assert line.startswith(prefix) and stage in line.removeprefix(prefix).split(", "), line
            _gpu_left_clean(run.tree.pids, baseline)
            errors = run.errors()
        (row,) = _runs(setup.warehouse)
        # A run that exited only through its watchdog (interrupts.exit_if_stuck) left its row running, and its
        # stderr holds the stacks of what hung.
        assert (row["status"], row["error"]) == ("failed", line.removeprefix("error: ")), errors[-6000:]
        run_ids.add(row["run_id"])
    assert len(run_ids) == 1  # every rerun resumed the interrupted run

    _completed(setup, "rerun")
    assert _decided_once(setup.warehouse) == run_ids.pop()
    with sessions.session(setup.warehouse, read_only=True) as con:
        attempts = [s for (s,) in con.execute("SELECT status FROM run_attempts ORDER BY started_at").fetchall()]
    assert attempts == ["failed"] * len(SIGNALLED) + ["completed"]


def test_a_run_killed_outright_leaves_the_gpu_by_itself_and_the_rerun_resumes(setup):
    """`kill -9` of the `quantgate` process while an evaluation's engine holds the GPU (a build and speed engines
    beside it), then again while a speed engine measures: whatever it started (workers, lm-eval and its engine core,
    engine processes and theirs) ends by itself within 30 s (parent-death signals) and frees the GPU; the rerun
    resumes the run, abandoned twice, and decides."""
    for point in ("evaluate:loaded", "measure:loaded"):
        baseline = _memory_of(set())
        with running(setup, f"{point}=pause", f"kill-{point}") as run:
            run.paused()
            _holding_gpu(run)
            run.proc.kill()
            assert run.wait(10) == -signal.SIGKILL
            _gpu_left_clean(run.tree.pids, baseline)
        assert [r["status"] for r in _runs(setup.warehouse)] == ["running"]  # nobody was left to fail it

    _completed(setup, "rerun")
    _decided_once(setup.warehouse)
    with sessions.session(setup.warehouse, read_only=True) as con:
        attempts = [s for (s,) in con.execute("SELECT status FROM run_attempts ORDER BY started_at").fetchall()]
    assert attempts == ["abandoned", "abandoned", "completed"]


def _engine_core(paused: Paused) -> list[int]:
    """The processes the paused engine process started that hold GPU memory: vLLM's engine core."""
    children = {p.pid for p in psutil.Process(paused.pid).children(recursive=True)}
    return sorted(children & set(_on_gpu()))


def test_an_engine_core_killed_before_its_passes_fails_its_rows_and_the_run_decides_without_it(setup):
    """The variant's speed engine loaded, with the GPU alone: its vLLM engine core gets SIGKILL, then the engine
    measures. Its speed row fails with the engine's error, the run goes on (the base's speed session measures as
    usual, before or after it) and decides: the speed check `not_measured`, with why. Nothing is left on the GPU
    afterwards."""
    baseline = _memory_of(set())
    with running(setup, "measure:loaded=pause", "engine-core") as run:
        killed = False
        # Each engine process is held in turn, as it gets the GPU alone; the base's measures as it would.
        while (paused := run.next_paused()) is not None:
            if paused.on_variant:
                cores = _engine_core(paused)
                assert cores, f"no process of the variant's engine {paused.pid} holds GPU memory (vLLM in-process?)"
                for pid in cores:
                    os.kill(pid, signal.SIGKILL)
                _wait_for(lambda: not set(_on_gpu()) & set(cores), SETTLE_S, lambda: f"{cores} still on the GPU")
                killed = True
            run.go_on(paused)
        assert run.wait(REACH_S) == 0, run.errors()[-3000:]
        assert killed, "the variant's engine never reached its passes"
        _gpu_left_clean(run.tree.pids, baseline)

    _decided_once(setup.warehouse)
    with sessions.session(setup.warehouse, read_only=True) as con:
        speed = {r["name"]: r for r in reads.rows(con, "SELECT v.name, s.status, s.reason FROM speed_results s"
                                                       " JOIN variants v USING (variant_uid)")}
        (check,) = reads.rows(con, "SELECT outcome, note FROM decision_checks WHERE kind = 'speed'")
    assert speed["base"]["status"] == "ok", speed["base"]
    # The reason is vLLM's own (its front end's error once the core is gone): one line, whatever its words.
    failed = speed[VARIANT]
    assert failed["status"] == "failed" and failed["reason"] and "\n" not in failed["reason"], failed
    assert check["outcome"] == "not_measured" and failed["reason"][:60] in check["note"], (check, failed)
