"""SIGINT and SIGTERM during a run: stop what the run started, fail its row with the stage, exit 130 / 143.

One handler for both signals, installed around the flow's stages. It raises `Interrupted`, a
BaseException, so that neither Prefect's task retries nor a variant's `except Exception` swallows it;
the `finally` blocks on the way out end the engine and server sessions they own, and `guard` then ends
whatever process the run started that is still alive, by process group.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import psutil

from quantgate.flows import progress
from quantgate.tasks.runtime import processes

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 10.0


class Interrupted(BaseException):
    """The run got SIGINT or SIGTERM; the message is the run row's error."""

    def __init__(self, signum: int, stages: str) -> None:
        self.signum = signum
        super().__init__(f"interrupted ({signal.Signals(signum).name}) during {stages}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def exit_code(e: BaseException) -> int | None:
    """The shell's code for a run ended by a signal (130 SIGINT, 143 SIGTERM), None for anything else."""
    if isinstance(e, Interrupted):
        return e.exit_code
    if isinstance(e, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if type(e).__name__ == "TerminationSignal":  # Prefect's SIGTERM bridge, outside our guard
        return 128 + getattr(e, "signal", signal.SIGTERM)
    return None


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """Turn SIGINT/SIGTERM into `Interrupted` naming the stages in flight; on the way out, end the processes
    started inside and still running. Only in the main thread (elsewhere signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # e.g. Prefect's temporary API server: not ours
    fired: list[int] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        if fired:  # already unwinding: a second Ctrl-C must not cut the cleanup short
            return
        fired.append(signum)
        raise Interrupted(signum, ", ".join(progress.stages()) or "startup")

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        yield
    finally:
        try:
            if fired:
                processes.stop_started(me, before, GRACE_S)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
