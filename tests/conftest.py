from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from quantgate.catalog import settings
from tests.shared_data import TINY_MODEL

# Hubs are unreachable here; make every library fail fast instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Prefect's ephemeral API keeps its SQLite database here, not in the user's ~/.prefect.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="quantgate-prefect-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# GPU tests under pytest-xdist (benchmarks/gpu/run_tests.sh): worker i gets GPU i mod count of QUANTGATE_TEST_GPUS,
# set here before anything touches CUDA; with more workers than GPUs, workers share one (QG_TEST_WORKERS_PER_GPU).
if (gpus := os.environ.get("QUANTGATE_TEST_GPUS")) and (worker := os.environ.get("PYTEST_XDIST_WORKER")):
    ids = gpus.split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(worker.removeprefix("gw")) % len(ids)]


def _then_read_again(method):
    def changed(self, *args, **kwargs):
        method(self, *args, **kwargs)
        settings.settings.cache_clear()

    return changed


# quantgate reads its settings from the environment once per process (catalog/settings.py); tests change the
# environment through monkeypatch between and within tests, so the next read after each change, or its undo, is new.
for _method in ("setenv", "delenv", "undo"):
    setattr(pytest.MonkeyPatch, _method, _then_read_again(getattr(pytest.MonkeyPatch, _method)))


@pytest.fixture(autouse=True)
def _settings_read_anew_for_each_test():
    settings.settings.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def _temporary_prefect_server_stops_with_the_session():
    """Flows run here start Prefect's temporary API server, which Prefect stops at interpreter exit and logs
    it, by then to a stream pytest has closed ("--- Logging error ---" after the summary). Stop it first."""
    yield
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    # As prefect_test_harness does: send what is queued for the API while it is up, then stop it quietly.
    APILogWorker.drain_all()
    EventsWorker.drain_all()
    with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
        SubprocessASGIServer().stop()


@pytest.fixture(autouse=True)
def _warehouses_detached_after_each_test():
    """This process keeps each warehouse it opened attached (quantgate.warehouse.sessions); a test's warehouse goes
    with its tmp_path, and the next test starts as a new process would."""
    yield
    from quantgate.warehouse import sessions

    sessions.close_all()


@pytest.fixture
def tiny_model() -> Path:
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    return TINY_MODEL


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect server (its database under PREFECT_HOME) for `quantgate` subprocesses. Without one,
    each CLI process starts a temporary server of its own, which a SIGKILLed process would leave behind."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prefect server did not start (exit {server.poll()})") from None
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's builds and model loads: on a small shared CPU box, torch's spinning worker
    threads made AWQ's grid search 10x slower (41 s instead of 4 s) when other processes competed for the cores.
    Modules ask for it with `pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
