"""The stage a run is at: a small record the flow updates as it enters each step, read by the live view
and by the interrupt handler (never parsed from logs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Step:
    stage: str  # download, quantize, evaluate, kl, benchmark, decide
    checkpoint: str = ""
    index: int = 1  # 1-based: step `index` of `total` of this stage
    total: int = 1
    started: float = field(default_factory=time.monotonic)

    def label(self) -> str:
        where = f" {self.checkpoint}" if self.checkpoint else ""
        return f"{self.stage}{where} ({self.index}/{self.total})"


Listener = Callable[[Step | None, Step | None], None]  # (finished step or None, next step or None)
_current: Step | None = None
_listeners: list[Listener] = []


def current() -> Step | None:
    return _current


def enter(stage: str, checkpoint: str = "", index: int = 1, total: int = 1) -> None:
    """The run starts this step; the previous one is complete."""
    _move(Step(stage, checkpoint, index, total))


def finish() -> None:
    """The run's last step is complete."""
    _move(None)


def _move(step: Step | None) -> None:
    global _current
    done, _current = _current, step
    for listener in _listeners:
        listener(done, step)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    global _current
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)
        _current = None
