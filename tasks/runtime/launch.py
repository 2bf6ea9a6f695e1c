"""Where work runs: in a fresh process (optionally seeing only some GPUs), in lanes (one per GPU), or several
jobs at once on a shared device. The one place that owns process isolation for flows, and for a speed
measurement (in_process_group: a fresh process leading its own group, killed with all it started).

Measured work (speed) takes a lane, so two measurements never share a GPU; work whose time is not measured
(quantization, lm-eval, KL, an engine's start) may share one, up to `shared_slots` jobs at a time. On one GPU a
`GpuClock` says when: engines start beside the unmeasured work and each measures once it has the GPU alone
(`measuring`), so that the run waits for engine starts only where nothing else was left to do.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from quantgate.catalog.errors import QuantgateError, one_line
from quantgate.catalog.settings import settings
from quantgate.tasks.runtime import processes
from quantgate.tasks.runtime.telemetry import GpuHolder, device_memory, gpu_holders, visible_gpu

T = TypeVar("T")
R = TypeVar("R")

# An engine's start beside other work leaves this share of the GPU's memory free for the unmeasured work that starts
# after it: an lm-eval engine asks vLLM for what it takes free at its start (tasks/adapters/model_memory.eval_engine),
# a build a few GiB. Without it the engines loaded early took the GPU to 7 GiB free, and later starts failed vLLM's
# free-memory check (results/h200/reference7).
START_HEADROOM = 0.15
# Free memory moves without notice (other processes load and end): how often a start waiting for it looks again,
# and how long it waits at most. Then it starts anyway where the GPU has what it needs free (what is promised to
# other work is only held back, not taken), and else fails naming who holds the memory (GpuMemoryError).
MEMORY_POLL_S = 0.5
MEMORY_WAIT_S = 900.0
# The processes a GpuMemoryError names, the largest first: enough to find a stray engine, a line still.
HOLDERS_NAMED = 4


class LaunchError(QuantgateError, RuntimeError):
    """Work in a process of its own that did not answer; the message is one line."""


class GpuMemoryError(QuantgateError, RuntimeError):
    """An engine start that waited MEMORY_WAIT_S and still finds less GPU memory free than it needs; one line: what
    is free, what it needs, and the processes holding the GPU's memory (NVML), rather than the engine's own error
    from inside vLLM."""


def short_of_memory(what: str, need_bytes: int, free: int, total: int, holders: Sequence[GpuHolder]) -> str:
    """GpuMemoryError's line: "GPU 0 has 3.0 GiB free of 80.0 GiB, vllm's engine on m needs 20.0 GiB after waiting
    900 s: held by pid 123 (python3, 40.1 GiB), ..."."""
    named = [f"pid {h.pid} ({h.name}, {'memory not reported' if h.used_bytes is None else _gib(h.used_bytes)})"
             for h in holders[:HOLDERS_NAMED]]
    if len(holders) > HOLDERS_NAMED:
        named.append(f"{len(holders) - HOLDERS_NAMED} more")
    # No process listed: the memory is another PID namespace's or NVML does not show it (a MIG instance).
    held = f"held by {', '.join(named)}" if named else "NVML lists no process holding it"
    return (f"GPU {visible_gpu()} has {_gib(free)} free of {_gib(total)}, {what} needs {_gib(need_bytes)}"
            f" after waiting {MEMORY_WAIT_S:g} s: {held}")


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 30):.1f} GiB"


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


# An engine's start shares the machine with the builds and evaluations the run waits for: at a lower CPU priority
# (its compile workers too) it takes what they leave. Its measurement runs at normal priority again, which only
# root may restore, so elsewhere starts keep normal priority.
START_NICENESS = 10


def start_niceness() -> int:
    """The niceness an engine starts at beside unmeasured work: START_NICENESS where it can be undone (root)."""
    return START_NICENESS if os.geteuid() == 0 else 0


def at_normal_priority(pgid: int = 0) -> None:
    """Every process of group `pgid` (0: this process's) back at niceness 0, for its measurement."""
    if start_niceness():
        os.setpriority(os.PRIO_PGRP, pgid, 0)


class GpuClock:
    """One GPU's time and memory between the jobs of a run: work whose time is not measured (a build, an
    evaluation, KL, an engine's start) shares the GPU; a speed measurement has it alone. A measurement waits until
    nothing shares the GPU and no other measurement runs; shared work waits while a measurement runs. An engine's
    start also says the memory it will take (`share(need_bytes, rank)`), and waits until the GPU has that much free
    beside what is promised to other starts and to work yet to start, plus START_HEADROOM while other work shares
    the GPU, and until no start of a lower rank waits (a run's checkpoints in order: the engines measured first
    load first, and what starts last is what was measured last); it waits holding no share, so measurements go on
    meanwhile and free what their engines held. A start that waited MEMORY_WAIT_S goes where the GPU has its memory
    free, else fails with GpuMemoryError naming the processes that hold it. `abort` (an interrupt) wakes every
    waiter with LaunchError. `memory`: the GPU's free and total bytes (None: not known, no wait); `holders`: the
    processes holding its memory (telemetry.gpu_holders)."""

    def __init__(self, memory: Callable[[], tuple[int, int] | None] = device_memory,
                 holders: Callable[[], list[GpuHolder]] = gpu_holders) -> None:
        self._cond = threading.Condition()
        self._sharing = 0
        self._alone = False
        self._aborted: str | None = None
        self._waiting: list[int] = []  # ranks of the measurements waiting
        self._starting: list[int] = []  # ranks of the starts waiting for memory
        self._held = threading.local()  # shares held by the calling thread
        self._memory = memory
        self._holders = holders
        # Bytes held for starts under way and for unmeasured work yet to start, not yet (all) taken from the GPU.
        self._promised = 0

    def share(self, need_bytes: int = 0, rank: int = 0, what: str = "an engine's start") -> float:
        """Share the GPU; with `need_bytes`, once that much memory is free for it and no start of a lower `rank`
        waits. Returns the seconds waited for memory; GpuMemoryError, naming `what` needs it, where the GPU does
        not have it free after MEMORY_WAIT_S."""
        began = time.monotonic()
        with self._cond:
            if need_bytes > 0:
                self._starting.append(rank)
            try:
                while True:
                    self._cond.wait_for(lambda: not self._alone or self._aborted)
                    self._raise_if_aborted()
                    if need_bytes <= 0:
                        break
                    if time.monotonic() - began >= MEMORY_WAIT_S:
                        self._raise_if_short(need_bytes, what)
                        break
                    if rank == min(self._starting) and self._room_for(need_bytes):
                        break
                    self._cond.wait(MEMORY_POLL_S)
            finally:
                if need_bytes > 0:
                    self._starting.remove(rank)
                    self._cond.notify_all()
            self._sharing += 1
            self._promised += need_bytes
        self._held.shares = getattr(self._held, "shares", 0) + 1
        self._held.waited_s = self.waited_s() + time.monotonic() - began
        if need_bytes <= 0:
            return 0.0
        self._held.memory_wait_s = time.monotonic() - began
        return self._held.memory_wait_s

    def memory_wait_s(self) -> float:
        """The seconds the calling thread's last start waited for memory."""
        return getattr(self._held, "memory_wait_s", 0.0)

    def waited_s(self) -> float:
        """The seconds the calling thread has waited on this clock in all (to share the GPU, for its memory, for
        it alone)."""
        return getattr(self._held, "waited_s", 0.0)

    def unshare(self, need_bytes: int = 0) -> None:
        """The end of a share; `need_bytes` as given to its share (an engine that has started holds its memory)."""
        self._held.shares -= 1
        with self._cond:
            self._sharing -= 1
            self._promised -= need_bytes
            self._cond.notify_all()

    def promise(self, n_bytes: int) -> None:
        """Hold `n_bytes` of the free memory for work that has yet to take it (engine starts wait beside it)."""
        with self._cond:
            self._promised += n_bytes

    def settle(self, n_bytes: int) -> None:
        """The work `promise` held memory for has taken it (or will not): the hold ends."""
        with self._cond:
            self._promised -= n_bytes
            self._cond.notify_all()

    def _raise_if_short(self, need_bytes: int, what: str) -> None:
        """GpuMemoryError where the GPU has less than `need_bytes` free: the engine would fail inside vLLM. What is
        promised to other work and the headroom beside it are not counted: they are held back, not taken."""
        memory = self._memory()
        if memory is None:
            return
        free, total = memory
        if free < need_bytes <= total:  # more than the GPU has: the engine says so (no wait either)
            raise GpuMemoryError(short_of_memory(what, need_bytes, free, total, self._holders()))

    def _room_for(self, need_bytes: int) -> bool:
        memory = self._memory()
        if memory is None:
            return True
        free, total = memory
        if need_bytes > total:  # never: let the engine say so
            return True
        headroom = int(START_HEADROOM * total) if self._sharing else 0
        return free - self._promised - headroom >= need_bytes

    def take(self, rank: int = 0) -> float:
        """Wait for the GPU alone and hold it; returns the seconds waited. Of the measurements waiting, the lowest
        `rank` goes first (a run's checkpoints in order, so that each one's rows are complete, and stored, before
        the next one's measurements begin)."""
        if getattr(self._held, "shares", 0):
            raise LaunchError("a measurement asked for the GPU alone from work that shares it: it would wait for itself")
        began = time.monotonic()
        with self._cond:
            self._waiting.append(rank)
            try:
                self._cond.wait_for(lambda: (not self._alone and not self._sharing and rank == min(self._waiting))
                                    or self._aborted)
            finally:
                self._waiting.remove(rank)
            self._raise_if_aborted()
            self._alone = True
        waited = time.monotonic() - began
        self._held.waited_s = self.waited_s() + waited
        return waited

    def give(self) -> None:
        with self._cond:
            self._alone = False
            self._cond.notify_all()

    def abort(self, why: str) -> None:
        with self._cond:
            self._aborted = why
            self._cond.notify_all()

    def _raise_if_aborted(self) -> None:
        if self._aborted:
            raise LaunchError(f"stopped while waiting for the GPU: {self._aborted}")


@dataclass(frozen=True)
class GpuWindow:
    """A measurement's time with the GPU alone: how long it waited for it, when it began (UTC), and how long its
    engine's start waited for GPU memory (where that start ran in this thread)."""

    waited_s: float
    began_at: datetime
    memory_wait_s: float = 0.0

    def details(self, since: datetime | None = None) -> dict[str, Any]:
        """What a speed row records of it: the waits, and when its measurement began (`since`, default the
        window's start) and ended (now)."""
        memory = {"memory_wait_s": round(self.memory_wait_s, 3)} if self.memory_wait_s else {}
        return {"gpu_wait_s": round(self.waited_s, 3), **memory, "measured_from": (since or self.began_at).isoformat(),
                "measured_to": datetime.now(timezone.utc).isoformat()}


_CLOCK: contextvars.ContextVar[GpuClock | None] = contextvars.ContextVar("quantgate_gpu_clock", default=None)
# The rank of what the calling job measures (GpuClock.take): its checkpoint's place in the run.
_RANK: contextvars.ContextVar[int] = contextvars.ContextVar("quantgate_measure_rank", default=0)
_CLOCKS: set[GpuClock] = set()
# In a process started by in_process_group: its pipes to the parent, which holds the clock.
_GATE: tuple[Any, Any] | None = None


@contextmanager
def gpu_clock(memory: Callable[[], tuple[int, int] | None] = device_memory,
              holders: Callable[[], list[GpuHolder]] = gpu_holders) -> Iterator[GpuClock]:
    """A clock for one GPU, for the jobs started inside (threads that copy this context, as `jobs` does); `memory`
    reads the GPU's free and total bytes, `holders` the processes holding them (GpuClock)."""
    clock = GpuClock(memory, holders)
    token = _CLOCK.set(clock)
    with _SPAWNING:
        _CLOCKS.add(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)
        with _SPAWNING:
            _CLOCKS.discard(clock)


def current_clock() -> GpuClock | None:
    """The GPU clock of the jobs running in this context, if any (gpu_clock)."""
    return _CLOCK.get()


class Deadline:
    """A time limit for an engine's own work (its start, its passes): every wait of the calling thread for the GPU
    (memory for the start, the GPU alone for the passes) moves it by its length. At 7B an engine that waited 634 s
    for memory beside the builds was left 1 s for its start (results/h100/shape7b-variants-1)."""

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds
        self._waited = waited_s()

    def left(self) -> float:
        """Seconds left, at least 1 (what a start or a pass is given once the limit has passed)."""
        return max(1.0, self.at() - time.monotonic())

    def at(self) -> float:
        """The limit as a monotonic time, moved by the waits so far."""
        return self._end + waited_s() - self._waited

    def passed(self) -> bool:
        return time.monotonic() >= self.at()


def waited_s() -> float:
    """The seconds this thread has waited on its GPU clock in all; 0 without a clock."""
    clock = _CLOCK.get()
    return clock.waited_s() if clock is not None else 0.0


def memory_wait_s() -> float:
    """How long the last engine start of this thread waited for GPU memory (GpuClock.share); 0 without a clock."""
    clock = _CLOCK.get()
    return clock.memory_wait_s() if clock is not None else 0.0


def starts_beside() -> bool:
    """Whether engines started here share the GPU with other work until they measure (a GPU clock is set)."""
    return _CLOCK.get() is not None


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


@contextmanager
def ranked(rank: int) -> Iterator[None]:
    """Measurements made inside wait their turn by `rank` (GpuClock.take)."""
    token = _RANK.set(rank)
    try:
        yield
    finally:
        _RANK.reset(token)


@contextmanager
def sharing(need_bytes: int = 0, what: str = "an engine's start") -> Iterator[None]:
    """What runs inside shares the GPU (unmeasured work); it waits while a measurement runs, and for `need_bytes`
    of free memory (an engine's start, `what`: GpuClock, whose GpuMemoryError it raises). No clock: no wait."""
    clock = _CLOCK.get()
    if clock is None:
        yield
        return
    clock.share(need_bytes, _RANK.get(), what)
    try:
        yield
    finally:
        clock.unshare(need_bytes)


@contextmanager
def measuring() -> Iterator[GpuWindow]:
    """What runs inside has the GPU alone: nothing that shares it runs meanwhile, nor another measurement. In a
    process started by in_process_group the parent is asked, and holds the GPU until this process has ended
    (an engine's teardown included). No clock: at once."""
    if _GATE is not None:
        answers, go = _GATE
        answers.send(("ready", None))
        waited = go.recv()
        at_normal_priority()  # the engine core, which inherited the start's niceness, too
        freeze_heap()  # a process of its own, loaded: what it holds now stays out of its passes' collections
        yield GpuWindow(waited, datetime.now(timezone.utc))
        return
    clock = _CLOCK.get()
    waited = clock.take(_RANK.get()) if clock is not None else 0.0
    try:
        yield GpuWindow(waited, datetime.now(timezone.utc), memory_wait_s())
    finally:
        if clock is not None:
            clock.give()


def freeze_heap() -> int:
    """Collect once, then leave everything this process holds now out of every later collection (gc.freeze), as vLLM
    does for its server and engine core after start-up: a measuring process holds Prefect, pydantic, a tokenizer and
    its prompts, which each full collection during a pass would walk again. For a process that ends after its
    measurement (in_process_group's): what is frozen is never freed. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def on_gpus(gpus: str | None, timeout_s: float | None, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a fresh spawned process that sees only `gpus` (CUDA_VISIBLE_DEVICES, e.g. "1"; None: the
    same GPUs as this process). Everything it starts (engines, servers) inherits that view, and NVML readings
    follow it (tasks/runtime/telemetry.py). A spawned process takes the environment as it is when it starts, so the
    variable is set for that moment only, under a lock. An exception in the child comes back as LaunchError
    with its one-line reason; SIGINT to this process reaches the child, whose `finally` blocks stop what it
    started, before it is killed. Should this process die without doing so (`kill -9`), the child gets SIGTERM,
    which does the same (_from_parent)."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    where = f"GPU {gpus}" if gpus is not None else "worker"
    # Not a daemon: the engines it runs start processes of their own.
    proc = ctx.Process(target=_answer, args=(os.getpid(), sender, fn, args), name=f"quantgate-{where.replace(' ', '')}")
    with _SPAWNING:
        before = os.environ.pop("CUDA_VISIBLE_DEVICES", None) if gpus is not None else None
        if gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus
        try:
            proc.start()
        finally:
            if gpus is not None and before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            elif gpus is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = before
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
        for clock in _CLOCKS:
            clock.abort("the run was interrupted")


_SPAWNING = threading.Lock()
_RUNNING: set[multiprocessing.process.BaseProcess] = set()


def _from_parent(parent_pid: int) -> None:
    """First thing in a spawned worker: SIGTERM when its parent dies, even by `kill -9` (the thread that starts it
    waits for its end), and SIGTERM raises SystemExit, so that the worker's `finally` blocks end the engines and
    servers it started before it ends (processes.die_with_parent, processes.exit_on_sigterm)."""
    processes.exit_on_sigterm()
    processes.die_with_parent(parent_pid)


def _answer(parent_pid: int, sender: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    _from_parent(parent_pid)
    try:
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
    start_alone: bool = False, memory_bytes: int = 0, what: str = "an engine's start",
) -> tuple[str, Any]:
    """fn(*args) in a fresh spawned process that leads its own process group, its output (and that of what it
    starts) to `log`: ("ok", what it returned), or ("failed", a one-line reason) when it raised, died, or did
    not answer within `timeout_s` (the time it waits for the GPU not counted). The whole group is killed
    afterwards, so a hung run cannot keep holding the GPU; should this process die first (`kill -9`), the child gets
    SIGTERM and ends what it started (_from_parent). This is how a speed measurement runs: an engine never
    shares a CUDA context or allocator state.

    Under a GPU clock the process shares the GPU until it enters `measuring()`, and has it alone from then until
    it has ended (`measuring` is entered once per process); it starts once the GPU has `memory_bytes` free for it
    (GpuClock.share: ("failed", GpuMemoryError's line) where it never has, `what` naming the start); `start_alone`
    holds the GPU alone from the start (a retry after running out of memory)."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    go_in, go_out = ctx.Pipe(duplex=False)
    # Not a daemon: vLLM starts its own engine-core process, which daemons may not do.
    proc = ctx.Process(
        target=_lead_group,
        args=(os.getpid(), sender, go_in, fn, args, str(log) if log else None),
        name=name,
    )
    clock = _CLOCK.get()
    shared = alone = False
    waited = 0.0
    if clock is not None:
        if start_alone:
            waited, alone = clock.take(_RANK.get()), True
        else:
            try:
                clock.share(memory_bytes, _RANK.get(), what)
            except GpuMemoryError as e:  # nothing started yet
                return "failed", str(e)
            shared = True
    began = time.monotonic()
    proc.start()
    sender.close()  # so the receiver sees EOF if the child dies without answering
    go_in.close()
    try:
        answer = _answer_within(receiver, proc, timeout_s)
        if answer is not None and answer[0] == "ready":  # loaded: it measures with the GPU alone
            if shared:
                clock.unshare(memory_bytes)  # type: ignore[union-attr]
                shared = False
            if clock is not None and not alone:
                waited, alone = clock.take(_RANK.get()), True
            go_out.send(waited)
            answer = _answer_within(receiver, proc, max(1.0, timeout_s - (time.monotonic() - began)))
        if answer is None:
            return "failed", f"timed out after {timeout_s:g} s"
        proc.join(timeout=60)  # time for the engine to tear down
        return answer
    finally:
        _kill_group(proc)
        receiver.close()
        go_out.close()
        if shared:
            clock.unshare(memory_bytes)  # type: ignore[union-attr]
        if alone:
            clock.give()  # type: ignore[union-attr]


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
    global _GATE
    _from_parent(parent_pid)
    # Its own process group, so the parent can also end what the engine started (vLLM's engine core).
    os.setpgrp()
    _GATE = (sender, go)
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

