"""The steps a run has in flight: small records the flow updates as each item of a stage begins and as its stage
mark is stored, read by the live view and by the interrupt handler (never parsed from logs). Stages overlap (a
build beside an evaluation beside an engine's measurement), so a step ends by its own mark, not by the next
step's beginning."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    stage: str  # a catalog/stages.Stage: download, quantize, evaluate, kl, benchmark, probe, decide
    checkpoint: str = ""
    index: int = 1  # 1-based: step `index` of `total` of this stage
    total: int = 1
    started: float = field(default_factory=time.monotonic)

    def label(self) -> str:
        where = f" {self.checkpoint}" if self.checkpoint else ""
        return f"{self.stage}{where} ({self.index}/{self.total})"


Listener = Callable[[Step | None, Step | None], None]  # (step just completed or None, latest step in flight)
_in_flight: dict[tuple[str, str], Step] = {}  # by (stage, item), in the order begun
_listeners: list[Listener] = []
# Reentrant: the interrupt handler reads the stages in flight (stages()) in the main thread, which the signal may
# have stopped inside this lock.
_lock = threading.RLock()


def current() -> Step | None:
    """The latest step begun of those in flight."""
    with _lock:
        return next(reversed(_in_flight.values()), None)


def stages(wait_s: float = -1) -> list[str]:
    """The stages in flight, each once, in the order their first step in flight began; after `wait_s` seconds
    without the lock (another thread may hold it forever: the interrupt watchdog asks), none."""
    if not _lock.acquire(timeout=wait_s):
        return []
    try:
        return list(dict.fromkeys(step.stage for step in _in_flight.values()))
    finally:
        _lock.release()


def begin(stage: str, item: str, checkpoint: str = "", index: int = 1, total: int = 1) -> None:
    """Item `item` of `stage` begins; it is in flight until `end`."""
    with _lock:
        _in_flight[(stage, item)] = Step(stage, checkpoint, index, total)
    _tell(None)


def end(stage: str, item: str, completed: bool = True) -> None:
    """Item `item` of `stage` is over: completed (its mark is stored), or not (it failed); an item never begun
    (reused as it was stored) is no step."""
    with _lock:
        step = _in_flight.pop((stage, item), None)
    if step is not None:
        _tell(step if completed else None)


def finish() -> None:
    """The run is over: nothing is in flight."""
    with _lock:
        _in_flight.clear()
    _tell(None)


def _tell(done: Step | None) -> None:
    latest = current()
    for listener in _listeners:
        listener(done, latest)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
        with _lock:
            _in_flight.clear()
