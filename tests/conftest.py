from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.shared_data import TINY_MODEL

# Hubs are unreachable here; make every library fail fast instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Prefect's ephemeral API keeps its SQLite database here, not in the user's ~/.prefect.
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="quantgate-prefect-"))
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# GPU tests under pytest-xdist (benchmarks/gpu/run_tests.sh): each worker gets a GPU of its own from
# QUANTGATE_TEST_GPUS, set here before anything touches CUDA, so two vLLM starts never share a device.
if (gpus := os.environ.get("QUANTGATE_TEST_GPUS")) and (worker := os.environ.get("PYTEST_XDIST_WORKER")):
    ids = gpus.split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(worker.removeprefix("gw")) % len(ids)]


@pytest.fixture
def tiny_model() -> Path:
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    return TINY_MODEL
