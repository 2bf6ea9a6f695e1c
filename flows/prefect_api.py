"""Prefect's API for a run in this process. With no PREFECT_API_URL, Prefect starts a temporary server (a
subprocess that imports Prefect's server: seconds) when the first flow begins; started here instead, ahead of
the flow, it boots on another core while this process imports the pipeline and checks its input."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable


def start_temporary_server() -> Callable[[], None]:
    """Begin starting Prefect's temporary server unless a server is configured; returns a wait that returns once
    it answers. The server is Prefect's own (the one its first flow would start, and stop at exit); one that fails
    to start is left to that flow, whose own start reports why."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        return lambda: None
    from prefect.server.api.server import SubprocessASGIServer

    def start() -> None:
        with contextlib.suppress(Exception):
            SubprocessASGIServer().start()

    # Prefect's settings may be a context variable (temporary_settings): the thread sees this context's.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(start,), name="prefect-server-start",
                              daemon=True)
    thread.start()
    return thread.join
