"""Prefect's API for a run in this process. With no PREFECT_API_URL, Prefect starts a temporary server (a
subprocess that imports Prefect's server: seconds) when the first flow begins; started here instead, ahead of
the flow, it boots on another core while this process imports the pipeline and checks its input.

Started here, it is also started in a session of its own and stopped once the flow has ended. A terminal's Ctrl-C,
like coreutils `timeout`, signals the whole process group: started by Prefect, in ours, the server died with that
signal while the run still had to tell it that the flow crashed and send it the events queued for it, and Prefect's
client retried the refused connections for minutes, then exited 1 with the connection's error instead of the
interrupt's 130 (issue 44). Out of the group's reach, it serves the run to its end; it still gets SIGTERM should this
process die without stopping it (`kill -9`: tasks/runtime/processes.py's die_with_parent).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

from quantgate.tasks.runtime import processes

# What Prefect's queued events and logs get to reach the server once the flow has ended: with the server up,
# a fraction of a second; the bound is for a server that went away.
DRAIN_S = 5.0
STOP_GRACE_S = 5.0
RESTARTS = 3
WATCH_S = 0.5

log = logging.getLogger("quantgate.prefect_api")


@contextlib.contextmanager
def temporary_server() -> Iterator[Callable[[float | None], bool]]:
    """Begin starting Prefect's temporary server unless a server is configured (or this process has one already);
    yields a wait for it to answer (Event.wait's: up to a timeout, whether it is done), and stops it on the way out,
    after what Prefect queued for it was sent. The server is Prefect's own (its command, and the instance its clients
    find); one that fails to start is left to the flow, whose own start reports why. One that exits before the flow
    has ended (killed by hand, by the out-of-memory killer) is started again on its port and database, up to
    RESTARTS times: Prefect's client retries what it was sending, instead of failing the run's end with a refused
    connection minutes later."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        yield lambda timeout=None: True
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()  # the instance every Prefect client of this process asks for its address
    if server.running:
        yield lambda timeout=None: True
        return
    server._run_uvicorn_command = functools.partial(_command_in_own_session, server)  # type: ignore[method-assign]
    answered, done, lock = threading.Event(), threading.Event(), threading.Lock()

    def keep() -> None:
        # The kernel's parent-death signal is tied to the thread that started the process: this thread starts the
        # server (and starts it again), and lives until it has been stopped.
        try:
            with contextlib.suppress(Exception):
                server.start()
        finally:
            answered.set()
        for _ in range(RESTARTS):
            proc = server.server_process
            if proc is None or not server.running:  # it never answered: left to the flow
                break
            while proc.poll() is None and not done.wait(WATCH_S):
                pass
            with lock:
                if done.is_set():
                    return
                log.warning("Prefect's temporary server on %s exited (%s); starting it again", server.address,
                            proc.returncode)
                server.server_process = server._run_uvicorn_command()
        done.wait()

    # Prefect's settings may be a context variable (temporary_settings): the thread sees this context's.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(keep,), name="prefect-server",
                              daemon=True)
    thread.start()
    try:
        yield answered.wait
    finally:
        try:
            _drain()
        finally:
            with lock:
                done.set()
            if (proc := server.server_process) is not None:
                processes.end_group(proc, STOP_GRACE_S)
                server.stop()  # Prefect's bookkeeping (and its "Stopping temporary server" line); the process is gone


def _drain() -> None:
    """Send what Prefect queued for the server (events, logs), DRAIN_S at most each."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(Exception):
        EventsWorker.drain_all(timeout=DRAIN_S)
    with contextlib.suppress(Exception):
        APILogWorker.drain_all(timeout=DRAIN_S)


def _command_in_own_session(server) -> subprocess.Popen:
    """Prefect's command for its temporary server (SubprocessASGIServer._run_uvicorn_command, Prefect 3.7), in a
    session of its own (processes.spawn_session), its output where this process's goes; a service, which an
    interrupt's cleanup (flows/interrupts.py) leaves running for the flow's crash report."""
    import prefect
    from prefect.settings import get_current_settings

    cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
           "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(server.port),
           "--log-level", "error", "--lifespan", "on"]
    env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **get_current_settings().to_environment_variables(exclude_unset=True)}
    return processes.spawn_session(cmd, None, env, service=True)
