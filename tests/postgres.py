"""A real PostgreSQL server for tests: Debian's `postgresql` package (.ci/run installs it), a cluster of its own in a
temporary folder, listening on loopback only, stopped by its postmaster's pid."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def server_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a libpq conninfo for a fresh database `quantgate` on a server of its own."""
    bin_dir = server_bin()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL's server is not installed (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="quantgate-pg-"))
    # initdb refuses to run as root: the cluster then belongs to Debian's postgres user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(root, "postgres")
    port = _free_port()
    data = root / "data"
    run = lambda *cmd: subprocess.run([*as_user, *cmd], check=True, capture_output=True, text=True)  # noqa: E731
    run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-t", "60", "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", "start")
    pid = int((data / "postmaster.pid").read_text().split()[0])
    try:
        base = f"host=127.0.0.1 port={port} user=postgres"
        deadline = time.monotonic() + 60
        while True:
            made = subprocess.run(["psql", f"{base} dbname=postgres", "-c", "CREATE DATABASE quantgate"],
                                  capture_output=True, text=True)
            if made.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not answer: {made.stderr.strip()}")
            time.sleep(0.2)
        yield f"{base} dbname=quantgate"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)  # fast shutdown
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def database(conninfo: str, name: str) -> str:
    """A new database `name` on the server of `conninfo`; returns its SQLAlchemy URL for asyncpg (Prefect's server)."""
    fields = dict(part.split("=", 1) for part in conninfo.split())
    server = " ".join(f"{k}={v}" for k, v in fields.items() if k != "dbname")
    subprocess.run(["psql", f"{server} dbname=postgres", "-c", f"CREATE DATABASE {name}"], check=True,
                   capture_output=True, text=True)
    return f"postgresql+asyncpg://{fields['user']}@{fields['host']}:{fields['port']}/{name}"
