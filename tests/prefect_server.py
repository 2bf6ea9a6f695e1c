"""A real `prefect server` on loopback for tests, with its own PREFECT_HOME; processes stopped by their pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """A process in its own session (so its children can be stopped with it), output to `log`."""
    out = open(log, "ab")  # noqa: SIM115 - closed by the child's exit; kept open for its lifetime
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM to the process group this test started (its pid is the group id), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    raise RuntimeError(f"prefect server not healthy after {timeout_s:.0f}s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def server(home: Path, extra_env: dict[str, str] | None = None) -> Iterator[tuple[str, dict[str, str]]]:
    """(api url, env for clients and workers) of a fresh server; stopped on exit."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        # The scheduler runs, as on a team's server (tests/test_scheduler.py): what it schedules runs only where a test
        # starts a worker of that pool. Its "recent deployments" pass every 2 s instead of 5.
        "PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "2",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "DO_NOT_TRACK": "1",
        **(extra_env or {}),
    }
    log = home / "server.log"
    proc = start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                 env, log)
    try:
        wait_healthy(url, proc, log)
        yield url, env
    finally:
        stop(proc)
