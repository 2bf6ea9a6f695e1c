"""SIGINT and SIGTERM during a run: stop what the run started, fail its row with the stage, exit 130 / 143.

One handler for both signals, installed around the flow's stages. It raises `Interrupted`, a
BaseException, so that neither Prefect's task retries nor a variant's `except Exception` swallows it;
the `finally` blocks on the way out end the engine and server sessions they own, and `guard` then ends
whatever process the run started that is still alive, by process group.

A SIGTERM is also how a Prefect worker ends the process of a run cancelled from Prefect (`prefect flow-run
cancel`, the UI). The handler replaces Prefect's own SIGTERM bridge, so Prefect cannot tell that SIGTERM from a
host's shutdown: left to Prefect, the run would be reported Crashed, and `quantgate deploy`'s retry automation
would start it again. `prefect_cancellation` asks the server instead, and `end_cancelled` ends the run as Prefect
ends a cancelled one: Cancelled, process exit 0, nothing to retry.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

import psutil

from quantgate.flows import progress
from quantgate.tasks.runtime import processes

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 10.0
# The promise to a user's Ctrl-C and a supervisor's SIGTERM: the process is gone within 30 s of the signal.
EXIT_WITHIN_S = 25.0


class Interrupted(BaseException):
    """The run got SIGINT or SIGTERM; the message is the run row's error."""

    def __init__(self, signum: int, stages: str) -> None:
        self.signum, self.stages = signum, stages
        super().__init__(f"interrupted ({signal.Signals(signum).name}) during {stages}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_ctrl_c: list[int] = []
_deferring: list[bool] = []
_exit_if_stuck: list[bool] = []
# The signal and stages of the interrupt `guard` is unwinding, from its handler until the next `guard` begins.
_stopping: list[Interrupted] = []


def refuse_results() -> None:
    """Raise the run's interrupt where a stage would store a result after it: once the run is stopping, the processes
    it started are being ended, and a stage's thread that then sees its worker die (read as a failed build, a failed
    evaluation, an engine that died) must not store that as the stage's outcome; the rerun does the stage again. Only
    the run's own row records the interrupt."""
    if _stopping:
        raise Interrupted(_stopping[0].signum, _stopping[0].stages)


def note_ctrl_c() -> None:
    """Outside `guard` (a command's start, before its flow's stages; its end), SIGINT raises KeyboardInterrupt as
    Python's own handler does (inside `ctrl_c_deferred`, at its end), and is noted: a library that turns the
    KeyboardInterrupt into an error of its own (DuckDB's "Query interrupted", a pydantic serialization error) does
    not turn the Ctrl-C into another failure (exit_code). Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        _ctrl_c.append(signum)
        if not _deferring:
            signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, handle)


@contextlib.contextmanager
def exit_if_stuck() -> Iterator[None]:
    """Inside, the process is the run and ends with it (the CLI's `main`; not a process that goes on after a run,
    such as a test calling the flow or `main` in-process): should it not have exited EXIT_WITHIN_S after an interrupt
    (a cleanup waiting on something the interrupt stopped, or a main thread blocked in native code, where Python runs
    no signal handler: seen on the H100, a SIGINT while a speed engine held the GPU alone), every thread's stack goes
    to stderr, what the run started is ended and the process exits with the signal's code; the run's row stays
    running, and the next run takes the attempt as abandoned and resumes it. `kill -USR1 PID` prints every thread's
    stack at any time (faulthandler's own handler, which runs whatever the main thread is in). Left without an
    interrupt, it is off again; after one it stays on, the process being on its way out."""
    _exit_if_stuck.append(True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        yield
    finally:
        if not _stopping:
            _exit_if_stuck.clear()
            faulthandler.unregister(signal.SIGUSR1)


class _Watchdog:
    """guard's watchdog: a thread started with the guard (a signal handler starts no thread: the interrupted main
    thread may hold the lock a thread's start takes) that reads the signals as they land from the C-level signal
    handler's wakeup pipe (signal.set_wakeup_fd), so that it sees a SIGINT or SIGTERM even when the main thread never
    gets back to Python to run the guard's handler. From that signal on, the process has EXIT_WITHIN_S to exit by
    itself. The guard's end without an interrupt writes a zero byte, which ends the thread."""

    def __init__(self, me: psutil.Process, before: set[int]) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # the C handler must never block on a full pipe
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, args=(me, before), name="quantgate-exit", daemon=True)
        self._thread.start()

    def interrupted(self, signum: int) -> None:
        """An interrupt whose signal landed before the guard began (a Ctrl-C held back while the command started)."""
        os.write(self._write, bytes([signum]))

    def close(self) -> None:
        """The guard ended without an interrupt: the wakeup fd back as it was, the thread ended."""
        signal.set_wakeup_fd(self._previous)
        os.write(self._write, b"\0")
        self._thread.join()
        os.close(self._write)

    def _watch(self, me: psutil.Process, before: set[int]) -> None:
        try:
            signum = self._first_interrupt()
        finally:
            os.close(self._read)
        if signum is None:
            return
        time.sleep(EXIT_WITHIN_S)  # the process exits before, as it should, and this thread (a daemon) with it
        # The guard's handler made the interrupt, unless the main thread never got to run it.
        interrupt = _stopping[0] if _stopping else Interrupted(
            signum, ", ".join(progress.stages(wait_s=1.0)) or "startup")
        print(f"quantgate: still stopping {EXIT_WITHIN_S:g} s after {signal.Signals(interrupt.signum).name}; its"
              " threads were at:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        processes.stop_started(me, before, 2.0)
        print(f"error: {interrupt}", file=sys.stderr, flush=True)
        os._exit(interrupt.exit_code)

    def _first_interrupt(self) -> int | None:
        """The first SIGINT or SIGTERM read from the pipe; None at the zero byte of the guard's end."""
        while True:
            for byte in os.read(self._read, 64):
                if byte == 0:
                    return None
                if byte in SIGNALS:
                    return byte

@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """A Ctrl-C inside (once note_ctrl_c is in place) is raised at its end, at a `ctrl_c_now` or as `guard` begins
    (as the flow's interrupt, its stage "startup"), not where it lands: raised inside Python's import machinery (a
    command's start imports for seconds), a KeyboardInterrupt can leave its import lock held, and the next import or
    process start of another thread (the one that starts Prefect's temporary server) waits for it forever, and the
    command with it."""
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    if _ctrl_c:
        raise KeyboardInterrupt


def ctrl_c_now() -> None:
    """Where it is safe to: raise the Ctrl-C `ctrl_c_deferred` held back, if any."""
    if _ctrl_c and _deferring:
        raise KeyboardInterrupt


def exit_code(e: BaseException) -> int | None:
    """The shell's code for a run ended by a signal (130 SIGINT, 143 SIGTERM), None for anything else."""
    if isinstance(e, Interrupted):
        return e.exit_code
    if isinstance(e, KeyboardInterrupt) or _ctrl_c:
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
    before = {p.pid for p in me.children(recursive=True)}  # not the stages' (nor is a service: processes.py)
    fired: list[int] = []
    _stopping.clear()
    watchdog = _Watchdog(me, before) if _exit_if_stuck else None

    def handle(signum: int, frame: FrameType | None) -> None:
        if fired:  # already unwinding: a second Ctrl-C must not cut the cleanup short
            return
        fired.append(signum)
        interrupt = Interrupted(signum, ", ".join(progress.stages()) or "startup")
        _stopping.append(interrupt)  # before the raise: stage threads stop storing at once (refuse_results)
        raise interrupt

    previous = {s: signal.signal(s, handle) for s in SIGNALS}
    try:
        if _ctrl_c and _deferring:  # a Ctrl-C while the command started: the stages do not begin
            if watchdog:  # its signal landed before the wakeup pipe was there
                watchdog.interrupted(signal.SIGINT)
            handle(signal.SIGINT, None)
        yield
    finally:
        try:
            if fired:
                processes.stop_started(me, before, GRACE_S)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            if watchdog and not fired:
                watchdog.close()


def prefect_cancellation() -> str | None:
    """Whether this process's flow run was cancelled from Prefect: its state on the server is Cancelling (or
    already Cancelled). Returns the state's message ("" when it has none), None when it is not cancelled, when
    this process runs no flow run, or when the server cannot say (then the signal is taken as an interrupt)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return None
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run.id).state
    except Exception:
        return None
    if state is None or not (state.is_cancelling() or state.is_cancelled()):
        return None
    return state.message or ""


def end_cancelled(reason: str) -> NoReturn:
    """End this flow run as a cancelled one: its state Cancelled with `reason`, then Prefect's `Abort`, which its
    engine takes as the orchestrator's word to stop (no Crashed state, process exit 0); the worker that sent the
    SIGTERM then confirms the Cancelled state. Call it only when `prefect_cancellation` said so."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import Abort
    from prefect.runtime import flow_run
    from prefect.states import Cancelled

    stop = Abort(reason)
    with contextlib.suppress(Exception):  # the worker sets Cancelled in any case once this process has exited
        with get_client(sync_client=True) as client:
            result = client.set_flow_run_state(flow_run.id, Cancelled(message=reason))
        if result.state is not None:
            stop.state = result.state  # the engine's record of the state the run ended in (its final log line)
    raise stop
