"""A `vllm serve` process (or any command serving the OpenAI API, for tests): started in its own session,
ready once GET /health answers 200, stopped with every process it spawned."""

from __future__ import annotations

import functools
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.runtime.processes import end_group, log_tail, spawn_session
from quantgate.tasks.adapters.speed.vllm_cli import QUIET_ENV, vllm_serve_command


@dataclass
class ServerHandle:
    """A server started by `start_server`, in its own process group so that stopping it also ends
    the children it spawned (vLLM's engine-core and workers)."""

    pid: int
    base_url: str
    model: str | None
    log_path: Path
    command: list[str]
    process: subprocess.Popen = field(repr=False)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the group, SIGKILL what is left after `grace_s`; returns the leader's exit code."""
        end_group(self.process, grace_s)
        return self.process.returncode

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(
    model_path: str,
    *,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    served_model_name: str = "model",
    log_path: str | Path | None = None,
    ready_timeout_s: float = 900.0,
    command: Sequence[str] | None = None,
    niceness: int = 0,
) -> ServerHandle:
    """Start `vllm serve` (or `command`, for tests) and wait until GET /health answers 200.

    `port`: None picks a free one, and another when the one picked is taken before the server binds it (engines
    that start beside it bind ephemeral ports of their own, torch.distributed's and ZMQ's), up to PORT_TRIES
    ports; a port given, which `command` needs, is refused when taken. `env` is added to the current
    environment. The log (stdout and stderr) goes to `log_path`. `niceness`: the server's CPU priority, its
    children's too (launch.at_normal_priority restores it). On a timeout or an early exit the process group is
    ended and ServingError names the log's tail.
    """
    start = functools.partial(_start_on, model_path=model_path, extra_args=extra_args, env=env, host=host,
                              served_model_name=served_model_name, log_path=log_path,
                              ready_timeout_s=ready_timeout_s, command=command, niceness=niceness)
    if port is not None:
        return start(port)
    if command is not None:
        raise ValueError("start_server: a command of its own needs the port it serves on")
    for _ in range(PORT_TRIES - 1):
        try:
            return start(free_port(host))
        except PortTaken:
            continue
    return start(free_port(host))


PORT_TRIES = 5


class PortTaken(ServingError):
    """The server's port was in use, before it started or when it bound it."""


def _start_on(port: int, *, model_path: str, extra_args: Sequence[str], env: dict[str, str] | None, host: str,
              served_model_name: str, log_path: str | Path | None, ready_timeout_s: float,
              command: Sequence[str] | None, niceness: int) -> ServerHandle:
    cmd = (
        list(command)
        if command is not None
        else vllm_serve_command(
            model_path, host=host, port=port, served_model_name=served_model_name, extra_args=extra_args
        )
    )
    if not _port_free(host, port):
        raise PortTaken(f"port {port} on {host} is already in use; pick another (free_port() finds one)")
    log = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"vllm-serve-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    written_before = log.stat().st_size if log.exists() else 0
    proc = spawn_session(cmd, log, env, append=True, niceness=niceness, defaults=QUIET_ENV)
    handle = ServerHandle(
        pid=proc.pid,
        base_url=f"http://{host}:{port}",
        model=served_model_name if command is None else None,
        log_path=log,
        command=cmd,
        process=proc,
    )
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            if proc.poll() is not None:
                end_group(proc, grace_s=5)  # children it left behind
                error = ServingError if not _said_port_taken(log, written_before) else PortTaken
                raise error(f"server exited with code {proc.returncode} before it was ready: {log_tail(log)}")
            if _healthy(handle.base_url):
                return handle
            if time.monotonic() > deadline:
                raise ServingError(f"server not ready after {ready_timeout_s:.0f}s (log {log}): {log_tail(log)}")
            time.sleep(0.5)
    except BaseException:  # an interrupt while it starts too: the server must not outlive its caller
        handle.stop(grace_s=5)
        raise


def _said_port_taken(log: Path, offset: int) -> bool:
    """Whether this start's part of the log (from `offset`) says its address was in use (errno 98, as
    Python's socket and uvicorn word it)."""
    with log.open("rb") as f:
        f.seek(offset)
        return b"address already in use" in f.read().lower()


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As uvicorn binds: connections lingering in TIME_WAIT do not count, a listener does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# No proxy: the server is on loopback, and an http_proxy in the environment must not catch the probe.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(base_url: str) -> bool:
    try:
        with _DIRECT.open(f"{base_url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False

