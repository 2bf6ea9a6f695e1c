"""A person reads the warehouse while a run writes it: the `duckdb` CLI, opened as docs/warehouse.md says, holds a read
transaction open the whole time, and `quantgate run` still decides every variant; the reader's snapshot stays
as it began until it commits, then sees the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from quantgate.warehouse import sessions
from tests.cli_runs import run_cli, tiny_catalog
from tests.shared_data import TINY_MODEL

pytestmark = pytest.mark.slow
DUCKDB_CLI = Path(sys.executable).with_name("duckdb")


@pytest.mark.skipif(not DUCKDB_CLI.exists(), reason="the duckdb CLI (duckdb-cli wheel) is not installed")
def test_a_duckdb_cli_session_held_open_during_a_run_does_not_stop_it(tmp_path, prefect_api):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    cat = tiny_catalog(tmp_path, TINY_MODEL, {"rtn-w8a16": "{method: rtn, scheme: W8A16, group_size: null}"})
    wh, work = tmp_path / "w.ducklake", tmp_path / "work"
    with sessions.session(wh):
        pass  # the warehouse exists before the reader opens it, as it does for anyone reading a team's
    init = run_cli(["warehouse", "init-sql", "-w", str(wh)])
    assert init.returncode == 0, init.stderr
    reader = subprocess.Popen([str(DUCKDB_CLI), "-cmd", init.stdout, "-csv", "-noheader"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        reader.stdin.write("BEGIN TRANSACTION;\nSELECT 'before', count(*) FROM runs;\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "before,0"
        result = run_cli(["run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(work)], prefect_api,
                         {"QUANTGATE_LOCK_WAIT_S": "10"})
        assert result.returncode == 0, result.stderr[-2000:]
        reader.stdin.write("SELECT 'held', count(*) FROM runs;\nCOMMIT;\n"
                           "SELECT 'after', count(*) FROM decisions WHERE decision IN ('accept', 'reject', 'inconclusive');\n")
        reader.stdin.close()
        out, err = reader.stdout.read(), reader.stderr.read()
        reader.wait(timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, err
    assert out.split() == ["held,0", "after,1"]
