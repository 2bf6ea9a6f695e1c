"""Each known failure, through the real `quantgate` command in its own process: a non-zero exit, at most two
lines on the terminal (the run's log path and the error), no traceback, and the warehouse unchanged but for
a failed run row where a run had begun. What a Prefect task logs of the failure goes to the run's log file.

Not covered here: vLLM out of GPU memory after its retries (no GPU; tests/test_faults.py runs the ladder)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from quantgate.warehouse import sessions
from tests.cli_runs import copy_warehouse, run_cli, run_log, tables
from tests.shared_data import TINY_MODEL
from tests.test_bad_input import encoder_only, not_a_model, unchanged_but_the_failed_run, write_catalog
from tests.test_download import FakeHub
from tests.test_warehouse import seed_run

pytestmark = pytest.mark.slow


def no_weights(tmp: Path) -> Path:
    folder = tmp / "config-only"
    folder.mkdir()
    shutil.copy(TINY_MODEL / "config.json", folder)
    return folder


def nan_outputs(tmp: Path) -> Path:
    """Finite weights whose outputs overflow: a final norm scale of 1e38."""
    folder = tmp / "overflowing"
    shutil.copytree(TINY_MODEL, folder)
    folder.chmod(0o755)
    weights = folder / "model.safetensors"
    weights.chmod(0o644)
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].clone().fill_(1e38)
    save_file(tensors, weights, metadata={"format": "pt"})
    return folder


def write(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp / name


# id, arguments from (tmp, catalog), environment, expected text of the error line, whether a failed run is recorded
CASES = [
    ("bad catalog", lambda tmp, cat: ["-c", str(write(tmp, "bad.yaml", "models: [\n  - id: x\n")), "tiny"], {},
     "bad.yaml: line", False),
    ("unknown variant", lambda tmp, cat: ["-c", str(cat), "tiny", "--variants", "hqq"], {},
     "unknown variant or method 'hqq'", False),
    ("not a model folder", lambda tmp, cat: ["-c", str(cat), str(not_a_model(tmp))], {},
     "is not a model folder (no config.json)", True),
    ("no weights", lambda tmp, cat: ["-c", str(cat), str(no_weights(tmp))], {},
     "is not a model folder (no *.safetensors", True),
    ("unsupported architecture", lambda tmp, cat: ["-c", str(cat), str(encoder_only(tmp))], {},
     "architecture BertModel is not supported", True),
    ("hub id not cached offline", lambda tmp, cat: ["-c", str(cat), "org/tiny"], {"HF_HUB_OFFLINE": "1"},
     "org/tiny@main: not in the local cache and offline mode is on (HF_HUB_OFFLINE=1)", True),
    # Download and quantize completed before the base's evaluation found it: their rows stay, for a rerun to resume.
    ("NaN outputs", lambda tmp, cat: ["-c", str(cat), str(nan_outputs(tmp))], {},
     "the base model's outputs are not finite (qg_simple_stories/", "after its builds"),
]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("seed") / "w.ducklake"
    with sessions.session(path) as con:
        seed_run(con, "r1")
    return path


def terminal_lines(result: subprocess.CompletedProcess) -> list[str]:
    """What the terminal shows of the failure: steps that had finished before it ("done …") are progress."""
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip() and not line.startswith("done ")]


def assert_one_failure(result: subprocess.CompletedProcess, expected: str) -> str:
    lines = terminal_lines(result)
    assert result.returncode == 1, lines
    assert len(lines) <= 2 and "Traceback" not in result.stdout + result.stderr, lines
    assert lines[-1].startswith("error: ") and expected in lines[-1], lines
    return lines[-1].removeprefix("error: ")


@pytest.mark.parametrize(("args", "env", "expected", "makes_run"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_known_failure_is_one_line(args, env, expected, makes_run, seeded, tmp_path, prefect_api):
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    before = tables(wh)
    result = run_cli(["run", *args(tmp_path, write_catalog(tmp_path)), "-w", str(wh), "--workdir", str(tmp_path / "work")],
                     prefect_api, {"HF_HOME": str(tmp_path / "hf"), **env})
    message = assert_one_failure(result, expected)
    after = tables(wh)
    if makes_run == "after its builds":
        _kept_but_no_results(before, after, message)
    else:
        unchanged_but_the_failed_run(before, after, message if makes_run else None)
    if makes_run:  # the task's own report of it, traceback included, is in the run's log
        assert expected in run_log(result)


def _kept_but_no_results(before: dict, after: dict, message: str) -> None:
    [run] = sorted(set(after["runs"]) - set(before["runs"]))
    assert run[5] == "failed" and run[6] == message
    for table, rows in before.items():
        assert set(rows) <= set(after[table]), table
    for table in ("quality_results", "speed_results", "decisions"):
        assert after[table] == before[table], table


def test_a_gated_repo_without_a_token(seeded, tmp_path, prefect_api):
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    before = tables(wh)
    hub = FakeHub(403, "GatedRepo")
    try:
        result = run_cli(["run", "-c", str(write_catalog(tmp_path)), "org/tiny", "-w", str(wh), "--workdir",
                          str(tmp_path / "work")], prefect_api,
                         {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_TOKEN": ""})
    finally:
        hub.close()
    message = assert_one_failure(result, "org/tiny@main: gated repository: accept its terms")
    unchanged_but_the_failed_run(before, tables(wh), message)


def test_a_foreign_warehouse_file(tmp_path, prefect_api):
    junk = tmp_path / "notes.ducklake"
    junk.write_text("meeting notes, not a database\n" * 200)
    digest = hashlib.sha256(junk.read_bytes()).hexdigest()
    result = run_cli(["run", "-c", str(write_catalog(tmp_path)), "tiny", "-w", str(junk)], prefect_api)
    assert_one_failure(result, f"{junk}: not a quantgate warehouse")
    assert hashlib.sha256(junk.read_bytes()).hexdigest() == digest


def test_a_locked_warehouse(seeded, tmp_path, prefect_api):
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    before = tables(wh)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from quantgate.warehouse import sessions
        with sessions.session({str(wh)!r}) as con:
            print("locked", flush=True)
            sys.stdin.readline()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = run_cli(["run", "-c", str(write_catalog(tmp_path)), "tiny", "-w", str(wh)], prefect_api,
                         {"QUANTGATE_LOCK_WAIT_S": "1"})
    finally:
        holder.kill()
        holder.wait()
    assert_one_failure(result, f"{wh}: another writer held the warehouse for more than 1s")
    unchanged_but_the_failed_run(before, tables(wh), None)
