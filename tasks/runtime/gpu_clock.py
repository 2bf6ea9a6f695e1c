"""The GPU clock: one GPU's time and memory between the jobs of a run. Work whose time is not measured (a build,
an evaluation, KL, an engine's start) shares the GPU (`sharing`); a speed measurement has it alone (`measuring`), so
that engines start beside the unmeasured work and each measures once it has the GPU alone, and the run waits for
engine starts only where nothing else was left to do. The clock is ambient: `gpu_clock` sets it for the jobs started
inside (threads that copy the context), `ranked` orders their measurements, and a process started by
tasks/runtime/launch.in_process_group measures through its parent, which holds the clock for it (ProcessHold, the
gate). Deadline, waited_s and memory_wait_s tell an engine's own time limit what its thread waited on the clock.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol, TypeVar

from quantgate.catalog.errors import QuantgateError
from quantgate.tasks.runtime.telemetry import GpuHolder, device_memory, gpu_holders, visible_gpu

R = TypeVar("R")
S = TypeVar("S", bound="Started")


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
    """Work in a process of its own that did not answer, or a wait for the GPU that was stopped (an interrupt) or
    would wait for itself; the message is one line. Defined beside the clock, which raises it; tasks/runtime/launch.py
    raises it for its processes and exports it."""


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


_CLOCK: ContextVar[GpuClock | None] = ContextVar("quantgate_gpu_clock", default=None)
# The rank of what the calling job measures (GpuClock.take): its checkpoint's place in the run.
_RANK: ContextVar[int] = ContextVar("quantgate_measure_rank", default=0)
# Every clock set now, for an interrupt to stop their waits (abort_clocks).
_CLOCKS: set[GpuClock] = set()
_CLOCKS_LOCK = threading.Lock()
# In a process started by in_process_group: its pipes to the parent, which holds the clock (set_gate).
_GATE: tuple[Any, Any] | None = None


@contextmanager
def gpu_clock(memory: Callable[[], tuple[int, int] | None] = device_memory,
              holders: Callable[[], list[GpuHolder]] = gpu_holders) -> Iterator[GpuClock]:
    """A clock for one GPU, for the jobs started inside (threads that copy this context, as `jobs` does); `memory`
    reads the GPU's free and total bytes, `holders` the processes holding them (GpuClock)."""
    clock = GpuClock(memory, holders)
    token = _CLOCK.set(clock)
    with _CLOCKS_LOCK:
        _CLOCKS.add(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)
        with _CLOCKS_LOCK:
            _CLOCKS.discard(clock)


def current_clock() -> GpuClock | None:
    """The GPU clock of the jobs running in this context, if any (gpu_clock)."""
    return _CLOCK.get()


def abort_clocks(why: str) -> None:
    """Every job waiting on a clock set now stops waiting, with LaunchError naming `why` (an interrupt)."""
    with _CLOCKS_LOCK:
        for clock in _CLOCKS:
            clock.abort(why)


class Deadline:
    """A time limit for an engine's own work (its start, its passes): every wait of the calling thread for the GPU
    (memory for the start, the GPU alone for the passes) moves it by its length. On the H100 the 7B cross-check's
    `vllm bench`, whose limit had run while the builds, evaluations and the base's other engines went first, was
    left 1 s for its start (results/h100/shape7b-variants-1). `clock`: the time it is read on (a test's own)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._end = clock() + seconds
        self._waited = waited_s()

    def remaining(self) -> float:
        """Seconds left, negative once the limit has passed."""
        return self.at() - self._clock()

    def left(self) -> float:
        """Seconds left, at least 1 (what a start or a pass is given once the limit has passed)."""
        return max(1.0, self.remaining())

    def at(self) -> float:
        """The limit on its clock, moved by the waits so far."""
        return self._end + waited_s() - self._waited

    def passed(self) -> bool:
        return self.remaining() <= 0


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


def set_gate(answers: Any, go: Any) -> None:
    """In a process started by in_process_group: `measuring` asks its parent, which holds the clock, for the GPU
    alone: ("ready", None) sent on `answers`, then the seconds the parent waited for it read from `go`."""
    global _GATE
    _GATE = (answers, go)


@dataclass(frozen=True)
class Slot:
    """What one engine start of a speed job asks of its GPU clock: the memory its start takes, which it waits for
    beside unmeasured work before it starts (`what` names it in a GpuMemoryError), or, with `alone_from_start`, the
    GPU alone from before its start (a retry after it ran out of memory: nothing else loads beside it). Its
    measurement then has the GPU alone in either case (`measuring`)."""

    what: str
    memory_bytes: int = 0
    alone_from_start: bool = False

    @classmethod
    def for_try(cls, what: str, memory_bytes: int, tried: int) -> Slot:
        """The slot of an out-of-memory retry's try `tried` (0 first): the first shares the GPU while it loads,
        a retry has it alone from the start."""
        return cls(what, 0 if tried else memory_bytes, alone_from_start=tried > 0)


class Started(Protocol):
    """An engine process started for a measurement (a `vllm bench`, a `vllm serve`): its pid leads its process
    group; leaving it stops it."""

    pid: int

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...


def start_then_measure(slot: Slot, start: Callable[[int], S], measure: Callable[[S, GpuWindow], R]) -> R:
    """The one way an engine process started here measures: started at the CPU niceness of starts
    (`start(niceness)`), beside unmeasured work once its slot's memory is free, or with the GPU alone from the start;
    then, loaded, with the GPU alone and back at normal priority, `measure(started, window)`; stopped (its
    context's exit) before the GPU is given back. An engine in a process of our own (in_process_group) follows the
    same order through ProcessHold and the gate."""
    if slot.alone_from_start:
        with measuring() as window, start(0) as started:
            return measure(started, window)
    with sharing(slot.memory_bytes, slot.what):
        started = start(start_niceness())
    with started, measuring() as window:
        at_normal_priority(started.pid)
        return measure(started, window)


class ProcessHold:
    """What a parent holds of its GPU clock for a process it started (in_process_group), which measures through
    the gate: a share of the GPU, with the memory its slot's start needs, until the process has loaded
    (`measuring`), then the GPU alone until it has ended. No clock: nothing held, no wait."""

    def __init__(self, slot: Slot) -> None:
        self._clock = _CLOCK.get()
        self._slot = slot
        self._shared = self._alone = False
        self._waited = 0.0

    def begin(self) -> None:
        """Before the process starts: share the GPU once it has the slot's memory free (GpuClock.share:
        GpuMemoryError, naming the slot, where it never has), or hold it alone from the start."""
        if self._clock is None:
            return
        if self._slot.alone_from_start:
            self._waited, self._alone = self._clock.take(_RANK.get()), True
        else:
            self._clock.share(self._slot.memory_bytes, _RANK.get(), self._slot.what)
            self._shared = True

    def alone(self) -> float:
        """The process has loaded: its share ends, and it has the GPU alone once nothing shares it and no
        measurement of a lower rank waits. Returns the seconds waited for it, which its `measuring` reports."""
        if self._shared:
            self._clock.unshare(self._slot.memory_bytes)  # type: ignore[union-attr]
            self._shared = False
        if self._clock is not None and not self._alone:
            self._waited, self._alone = self._clock.take(_RANK.get()), True
        return self._waited

    def release(self) -> None:
        """The process has ended (its engine's teardown included): what it held is free for other jobs."""
        if self._shared:
            self._clock.unshare(self._slot.memory_bytes)  # type: ignore[union-attr]
            self._shared = False
        if self._alone:
            self._clock.give()  # type: ignore[union-attr]
            self._alone = False
