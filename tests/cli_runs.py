"""Helpers for tests that run `quantgate` as a real subprocess and compare warehouse contents."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from quantgate.warehouse import lake, sessions

CLI = [sys.executable, "-m", "quantgate.flows.cli"]
# How the small catalogs written by hand start: one build that needs no calibration (RTN W8A16) and a suite of two
# simple_stories documents (bits per byte, scored without answers), so that a run of one takes seconds on a CPU.
CATALOG_HEAD = """version: 1
variants:
  int8-w8a16: {method: rtn, scheme: W8A16, group_size: null}
suites:
  stories:
    tasks: [{name: qg_simple_stories, limit: 2}]
"""


def run_cli(args: list[str], prefect_api: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`quantgate ARGS` in its own session; whatever it leaves running (e.g. after a SIGKILL) is ended after."""
    full_env = {**os.environ, **(env or {})}
    if prefect_api:
        full_env["PREFECT_API_URL"] = prefect_api
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def tables(path: str | Path) -> dict[str, list[tuple]]:
    """Every base table of a warehouse: its rows, as text, sorted (a read-only connection of its own, which
    reads a warehouse of any schema version)."""
    con = lake.open_lake(sessions.address(path), read_only=True)
    try:
        names = [n for (n,) in con.execute("SELECT table_name FROM information_schema.tables WHERE table_catalog ="
                                           " current_database() AND table_type = 'BASE TABLE' ORDER BY 1").fetchall()]
        return {n: sorted(tuple(map(str, r)) for r in con.execute(f'SELECT * FROM "{n}"').fetchall()) for n in names}
    finally:
        con.close()


def copy_warehouse(src: str | Path, dst: str | Path) -> None:
    """A warehouse (file catalog) copied as it stands: its catalog through SQLite's backup (a writer of this
    process may hold it open, with pages still in its WAL) and its data files."""
    import shutil
    import sqlite3

    with sqlite3.connect(src) as source, sqlite3.connect(dst) as target:
        source.backup(target)
    if Path(f"{src}.files").exists():
        shutil.copytree(f"{src}.files", f"{dst}.files")


def checksums(contents: dict[str, list[tuple]]) -> dict[str, str]:
    return {t: hashlib.sha256(repr(rows).encode()).hexdigest() for t, rows in contents.items()}


def quantgate(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_cli(list(args), env=env, timeout=timeout)


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def run_log(result: subprocess.CompletedProcess) -> str:
    """The log file of a `quantgate run` (its path is the first line on stderr), empty if it printed none."""
    path = next((line.removeprefix("log: ") for line in result.stderr.splitlines() if line.startswith("log: ")), None)
    return Path(path).read_text(errors="replace") if path and Path(path).exists() else ""


def tiny_catalog(tmp: Path, model: Path, variants: dict[str, str], *, limit: int = 3, min_recovery: float = 0.95,
                 calibration: str | None = None) -> Path:
    """A catalog of one model (`tiny`, the folder `model`) with `variants` (name -> inline spec), a perplexity suite
    of `limit` documents, one micro Transformers scenario on the CPU and a policy on bits per byte: each run of
    it takes seconds. `calibration` is the model's inline calibration block, if any."""
    path = tmp / "catalog.yaml"
    specs = "\n".join(f"  {name}: {spec}" for name, spec in variants.items())
    calib = f"\n    calibration: {calibration}" if calibration else ""
    path.write_text(f"""version: 1
variants:
{specs}
suites:
  stories:
    tasks: [{{name: qg_simple_stories, limit: {limit}}}]
    batch_size: 8
scenarios:
  # Transformers is the one engine a CPU has: its timing of the compressed-tensors builds it decompresses is asked
  # for, so that the speed plumbing (rows, speedups, reuse) runs for every checkpoint.
  micro: {{kind: offline, engines: [transformers], device: cpu, num_prompts: 2, input_len: 8, output_len: 4,
          batch_size: 2, repetitions: 1, warmup: 0, transformers_decompressed: true}}
models:
  - id: tiny
    source: {{kind: local, path: {model}}}
    variants: [{", ".join(variants)}]
    suite: stories
    scenarios: [micro]{calib}
policy:
  version: 1
  quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: {min_recovery}, higher_is_better: false}}]
  speed: {{engine: transformers, scenario: micro, min_speedup: 0.01}}
  max_size_ratio: 1.0
""")
    return path
