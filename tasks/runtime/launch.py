"""Where work runs: in a fresh process (optionally seeing only some GPUs), in lanes (one per GPU), or several
jobs at once on a shared device. The one place that owns process isolation for flows, and for a speed
measurement (in_process_group: a fresh process leading its own group, killed with all it started).

Measured work (speed) takes a lane, so two measurements never share a GPU; work whose time is not measured
(quantization, lm-eval, KL, an engine's start) may share one, up to `shared_slots` jobs at a time. On one GPU the
clock of tasks/runtime/gpu_clock.py says when; a process started here measures through it (ProcessHold).
"""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, TypeVar

from quantgate.catalog.errors import one_line
from quantgate.catalog.settings import settings
from quantgate.tasks.runtime import processes
# The GPU clock lives in gpu_clock; its names are exported here too, for the callers that reach them as launch.X.
from quantgate.tasks.runtime.gpu_clock import (
    HOLDERS_NAMED,
    MEMORY_POLL_S,
    MEMORY_WAIT_S,
    START_HEADROOM,
    START_NICENESS,
    Deadline,
    GpuClock,
    GpuMemoryError,
    GpuWindow,
    LaunchError,
    ProcessHold,
    Slot,
    Started,
    abort_clocks,
    at_normal_priority,
    current_clock,
    freeze_heap,
    gpu_clock,
    measuring,
    memory_wait_s,
    ranked,
    set_gate,
    sharing,
    short_of_memory,
    start_niceness,
    start_then_measure,
    starts_beside,
    waited_s,
)

__all__ = [
    # What starts work: processes, lanes, jobs.
    "Jobs", "beside", "in_lanes", "in_process_group", "interrupt_children", "jobs", "lanes_from", "on_gpus",
    "shared_slots", "submit", "LaunchError",
    # The GPU clock, which lives in tasks/runtime/gpu_clock.py.
    "HOLDERS_NAMED", "MEMORY_POLL_S", "MEMORY_WAIT_S", "START_HEADROOM", "START_NICENESS", "Deadline", "GpuClock",
    "GpuMemoryError", "GpuWindow", "ProcessHold", "Slot", "Started", "abort_clocks", "at_normal_priority",
    "current_clock",
    "freeze_heap", "gpu_clock", "measuring", "memory_wait_s", "ranked", "set_gate", "sharing", "short_of_memory",
    "start_niceness", "start_then_measure", "starts_beside", "waited_s",
]

T = TypeVar("T")
R = TypeVar("R")


def lanes_from(gpus: str | None) -> list[str | None]:
    """The lanes to run measured work on: the GPU ids given ("0,1"), else those CUDA_VISIBLE_DEVICES shows
    when it shows several, else one lane in this process's own view (None)."""
    ids = gpus if gpus is not None else settings().cuda_visible_devices or ""
    found = [g.strip() for g in ids.split(",") if g.strip()]
    if gpus is None and len(found) < 2:
        return [None]
    return list(found) or [None]


def shared_slots(lanes: Sequence[str | None], on_gpu: bool, fit: int | None = None) -> int:
    """Unmeasured jobs at a time: on a GPU as many as `fit` its memory (each sized by the model:
    tasks/adapters/model_memory.RunPlan.jobs_per_gpu; they all run on the first GPU a process sees), at most
    QUANTGATE_SHARED_JOBS_PER_GPU per lane; one on a CPU, whose cores one job already keeps busy."""
    if not on_gpu:
        return 1
    most = max(1, settings().shared_jobs_per_gpu * len(lanes))
    return max(1, min(most, fit)) if fit else most


def on_gpus(gpus: str | None, timeout_s: float | None, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a fresh spawned process that sees only `gpus` (CUDA_VISIBLE_DEVICES, e.g. "1"; None: the
    same GPUs as this process). Everything it starts (engines, servers) inherits that view, and NVML readings
    follow it (tasks/runtime/telemetry.py). The child sets the variable itself, first thing, and only then unpickles
    `fn` and its arguments (imports that may read the GPUs come after): this process's environment is never
    rewritten, so threads starting other processes meanwhile see it as it is. An exception in the child comes back
    as LaunchError with its one-line reason; SIGINT to this process reaches the child, whose `finally` blocks stop
    what it started, before it is killed. Should this process die without doing so (`kill -9`), the child gets
    SIGTERM, which does the same (_from_parent)."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    where = f"GPU {gpus}" if gpus is not None else "worker"
    work = bytes(ForkingPickler.dumps((fn, args)))
    # Not a daemon: the engines it runs start processes of their own.
    proc = ctx.Process(target=_answer, args=(os.getpid(), gpus, sender, work),
                       name=f"quantgate-{where.replace(' ', '')}")
    with _SPAWNING:
        proc.start()
        _RUNNING.add(proc)
    sender.close()
    try:
        # The work keeps its own time; the margin is for its cleanup (stopping a server, an engine's teardown).
        if timeout_s is not None and not receiver.poll(timeout_s + 120):
            raise LaunchError(f"{where}: no answer within {timeout_s + 120:.0f} s")
        try:
            status, value = receiver.recv()
        except EOFError:
            proc.join()
            raise LaunchError(f"{where}: the process ended without an answer (exit code {proc.exitcode})") from None
        proc.join(60)  # time for what it started to end
        if status != "ok":
            raise LaunchError(f"{where}: {value}")
        return value
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGINT)  # type: ignore[arg-type]
            proc.join(30)
        if proc.is_alive():
            proc.kill()
        proc.join()
        receiver.close()
        with _SPAWNING:
            _RUNNING.discard(proc)


def interrupt_children() -> None:
    """SIGINT to every process started by on_gpus: each stops its servers and engines and answers; jobs waiting
    for the GPU stop waiting."""
    with _SPAWNING:
        for proc in _RUNNING:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGINT)  # type: ignore[arg-type]
    abort_clocks("the run was interrupted")


_SPAWNING = threading.Lock()
_RUNNING: set[multiprocessing.process.BaseProcess] = set()


def _from_parent(parent_pid: int) -> None:
    """First thing in a spawned worker: SIGTERM when its parent dies, even by `kill -9` (the thread that starts it
    waits for its end), and SIGTERM raises SystemExit, so that the worker's `finally` blocks end the engines and
    servers it started before it ends (processes.die_with_parent, processes.exit_on_sigterm)."""
    processes.exit_on_sigterm()
    processes.die_with_parent(parent_pid)


def _answer(parent_pid: int, gpus: str | None, sender: Any, work: bytes) -> None:
    _from_parent(parent_pid)
    if gpus is not None:  # before anything the work imports can look at the GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        fn, args = pickle.loads(work)
        sender.send(("ok", fn(*args)))
    except BaseException as e:  # whatever stops the work, as its one-line reason
        with contextlib.suppress(OSError):  # nobody left to read it: the parent died
            sender.send(("error", one_line(e)))
    finally:
        sender.close()


class Jobs:
    """Jobs, up to `slots` at a time, each in a copy of the caller's context (Prefect then sees its task runs
    inside the flow run). With one slot a job runs at once in the caller's thread, so that a signal interrupts
    it where it is (a CPU runs one job at a time anyway)."""

    def __init__(self, slots: int) -> None:
        self._pool = ThreadPoolExecutor(slots, thread_name_prefix="quantgate-job") if slots > 1 else None

    def submit(self, fn: Callable[..., R], *args: Any) -> Future[R]:
        if self._pool is not None:
            return submit(self._pool, fn, *args)
        done: Future[R] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as e:  # an interrupt (BaseException) goes straight up
            done.set_exception(e)
        return done


@contextmanager
def jobs(slots: int) -> Iterator[Jobs]:
    """A `Jobs` pool. On an exception (an interrupt included) nothing queued starts, what runs in child
    processes is interrupted, and it is raised at once: the caller's cleanup ends the processes the jobs wait
    on, and with them the jobs."""
    pool = Jobs(max(1, slots))
    try:
        yield pool
    except BaseException:
        if pool._pool is not None:
            pool._pool.shutdown(wait=False, cancel_futures=True)
        interrupt_children()
        raise
    if pool._pool is not None:
        pool._pool.shutdown(wait=True)


def submit(pool: ThreadPoolExecutor, fn: Callable[..., R], *args: Any) -> Future[R]:
    return pool.submit(contextvars.copy_context().run, fn, *args)


def beside(fn: Callable[..., R], *args: Any) -> Future[R]:
    """fn(*args) in a thread of its own, now, in a copy of this context (its clock and its rank)."""
    done: Future[R] = Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            done.set_result(context.run(fn, *args))
        except BaseException as e:  # handed to whoever waits on it
            done.set_exception(e)

    threading.Thread(target=run, name="quantgate-beside", daemon=True).start()
    return done


def in_lanes(items: Iterable[T], lanes: Sequence[str | None], work: Callable[[T, str | None], None],
             interrupt: Callable[[], None] = interrupt_children) -> None:
    """work(item, lane) for every item, each lane taking the next item nobody has started, so that items run
    side by side, one per lane; with one lane, in order in this thread. An exception stops the lanes from
    taking more, calls `interrupt` (by default: SIGINT to what runs in child processes), and is raised once the
    lanes have stopped."""
    queue = deque(items)
    if len(lanes) == 1:
        while queue:
            work(queue.popleft(), lanes[0])
        return
    taking = threading.Lock()

    def lane_loop(lane: str | None) -> None:
        while True:
            with taking:
                if not queue:
                    return
                item = queue.popleft()
            work(item, lane)

    pool = ThreadPoolExecutor(len(lanes), thread_name_prefix="quantgate-lane")
    try:
        for future in [submit(pool, lane_loop, lane) for lane in lanes]:
            future.result()
    except BaseException:
        with taking:
            queue.clear()
        interrupt()
        raise
    finally:
        pool.shutdown(wait=True)


def in_process_group(
    fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, log: Path | None = None, name: str = "quantgate",
    slot: Slot = Slot("an engine's start"),
) -> tuple[str, Any]:
    """fn(*args) in a fresh spawned process that leads its own process group, its output (and that of what it
    starts) to `log`: ("ok", what it returned), or ("failed", a one-line reason) when it raised, died, or did
    not answer within `timeout_s` (the time it waits for the GPU not counted). The whole group is killed
    afterwards, so a hung run cannot keep holding the GPU; should this process die first (`kill -9`), the child gets
    SIGTERM and ends what it started (_from_parent). This is how a speed measurement runs: an engine never
    shares a CUDA context or allocator state.

    Under a GPU clock the process shares the GPU until it enters `measuring()`, and has it alone from then until
    it has ended (`measuring` is entered once per process); it starts once the GPU has its `slot`'s memory free
    (GpuClock.share: ("failed", GpuMemoryError's line, naming the slot) where it never has), or holds the GPU alone
    from the start where the slot says so (a retry after running out of memory): start_then_measure's order."""
    hold = ProcessHold(slot)
    try:
        hold.begin()
    except GpuMemoryError as e:  # nothing started yet
        return "failed", str(e)
    try:
        return _run_group(fn, args, timeout_s, log, name, hold)
    finally:
        hold.release()


def _run_group(fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, log: Path | None, name: str,
               hold: ProcessHold) -> tuple[str, Any]:
    """in_process_group's process, started once `hold` has the GPU for it: its answer, its wait for the GPU alone
    once it has loaded (`measuring` in the child), and its group killed at the end."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    go_in, go_out = ctx.Pipe(duplex=False)
    # Not a daemon: vLLM starts its own engine-core process, which daemons may not do.
    proc = ctx.Process(
        target=_lead_group,
        args=(os.getpid(), sender, go_in, fn, args, str(log) if log else None),
        name=name,
    )
    began = time.monotonic()
    proc.start()
    sender.close()  # so the receiver sees EOF if the child dies without answering
    go_in.close()
    try:
        answer = _answer_within(receiver, proc, timeout_s)
        if answer is not None and answer[0] == "ready":  # loaded: it measures with the GPU alone
            go_out.send(hold.alone())
            answer = _answer_within(receiver, proc, max(1.0, timeout_s - (time.monotonic() - began)))
        if answer is None:
            return "failed", f"timed out after {timeout_s:g} s"
        proc.join(timeout=60)  # time for the engine to tear down
        return answer
    finally:
        _kill_group(proc)
        receiver.close()
        go_out.close()


def _answer_within(receiver: Any, proc: multiprocessing.process.BaseProcess,
                   timeout_s: float) -> tuple[str, Any] | None:
    """The child's next message ("ready" once it measures, then its answer), or None when it did not come in time."""
    if not receiver.poll(timeout_s):
        return None
    try:
        return receiver.recv()
    except EOFError:
        proc.join()
        return "failed", _exit_reason(proc.exitcode)


def _lead_group(parent_pid: int, sender: Any, go: Any, fn: Callable[..., Any], args: tuple[Any, ...],
                log: str | None) -> None:
    _from_parent(parent_pid)
    # Its own process group, so the parent can also end what the engine started (vLLM's engine core).
    os.setpgrp()
    set_gate(sender, go)
    os.nice(start_niceness())
    if log:
        # At the descriptor level, so that processes the engine starts write there too.
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        sender.send(("ok", fn(*args)))
    except BaseException as e:  # report whatever stops the run, then let the process end
        with contextlib.suppress(OSError):  # nobody left to read it: the parent died
            sender.send(("failed", one_line(e)))
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
