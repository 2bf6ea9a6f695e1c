"""An interrupt's clean-up (processes.stop_started) spares the services the process started (Prefect's temporary
API server) and stops every other session; a service that has ended does not protect a later session given its id
(process ids are reused)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import psutil

from quantgate.tasks.runtime import processes

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_running_service_is_spared_and_a_session_reusing_an_ended_ones_id_is_not():
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    service = processes.spawn_session(SLEEP, None, None, service=True)
    work = processes.spawn_session(SLEEP, None, None)
    # As if an ended service's id had been given to `work`'s session: the service the record names started earlier.
    processes._services[work.pid] = psutil.Process(work.pid).create_time() - 60
    try:
        processes.stop_started(me, before, 5.0)
        assert work.wait(10) == -signal.SIGTERM and work.pid not in processes._services
        assert service.poll() is None and service.pid in processes._services  # still serving
    finally:
        for proc in (service, work):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            processes._services.pop(proc.pid, None)
