"""GPU memory held for unmeasured work that has yet to start, on the GPU clock of tasks/runtime/gpu_clock.py: engines
started beside that work (GpuClock.share with the memory they need) take only what is neither free for it nor promised
to it. An evaluation engine asks vLLM to find its share of the GPU free at start; without the promise, speed
engines loaded early left 7 GiB free and later starts failed (results/h200/reference7)."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from quantgate.tasks.runtime.gpu_clock import GpuClock, current_clock


class MemoryPromise:
    """Memory held on a GPU clock for unmeasured jobs that have yet to start (an evaluation engine asks vLLM for
    its share of the GPU free at start, and speed engines started beside would otherwise take it): `units` jobs of
    `unit_bytes` each. A job settles its unit once its engine has loaded (`engine_loaded`) or, at the latest, when
    it ends (`settles_on_load`); what is left is settled with the promise."""

    def __init__(self, clock: GpuClock | None, units: int, unit_bytes: int) -> None:
        self._clock, self.unit_bytes = clock, unit_bytes
        self._left = units if clock is not None and unit_bytes > 0 else 0
        self._lock = threading.Lock()
        if self._left:
            clock.promise(self._left * unit_bytes)  # type: ignore[union-attr]

    def settle_one(self) -> None:
        with self._lock:
            if self._left == 0:
                return
            self._left -= 1
        self._clock.settle(self.unit_bytes)  # type: ignore[union-attr]

    def settle_all(self) -> None:
        with self._lock:
            left, self._left = self._left, 0
        if left:
            self._clock.settle(left * self.unit_bytes)  # type: ignore[union-attr]


# What the job running in this context does when its engine has loaded (engine_loaded): settle its promised unit.
_ON_LOADED: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("quantgate_on_loaded",
                                                                                      default=None)


@contextmanager
def promised_memory(units: int, unit_bytes: int) -> Iterator[MemoryPromise]:
    """`units` × `unit_bytes` of the current GPU clock's free memory held for unmeasured jobs yet to start, until
    each settles its unit or the block ends. No clock: nothing held."""
    promise = MemoryPromise(current_clock(), units, unit_bytes)
    try:
        yield promise
    finally:
        promise.settle_all()


@contextmanager
def settles_on_load(promise: MemoryPromise) -> Iterator[None]:
    """The job inside settles one unit of `promise` when its engine has loaded (engine_loaded), else as it ends."""
    settled = threading.Event()

    def settle() -> None:
        if not settled.is_set():
            settled.set()
            promise.settle_one()

    token = _ON_LOADED.set(settle)
    try:
        yield
    finally:
        _ON_LOADED.reset(token)
        settle()


def engine_loaded() -> None:
    """Said by a job whose engine has loaded (its memory now taken): the memory promised to it is free for others."""
    if (settle := _ON_LOADED.get()) is not None:
        settle()
