"""A warehouse from the first minute: `quantgate warehouse init` (and `quantgate deploy`, through the same code)
creates the warehouse with its schema and views, so `quantgate sql` answers before any run wrote; running it again
is harmless; a read of a warehouse that was never created says so in one line and names the command that creates
it. Real DuckDB and DuckLake, the real `quantgate` entry point as a subprocess; the team's case on a real
PostgreSQL (tests/postgres.py) and a real `prefect server` (tests/prefect_server.py)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from quantgate.warehouse import sessions
from tests import postgres, prefect_server
from tests.cli_runs import error_lines, run_cli, tables

COUNT_RUNS = "select count(*) as n from runs"
VERSION = max(v for v, _, _ in sessions.known_migrations())


def not_created(label: str) -> str:
    return f"error: no warehouse at {label}: create it with 'quantgate warehouse init' (or 'quantgate deploy')"


def count_runs(warehouse: str, env: dict[str, str] | None = None) -> list[dict]:
    done = run_cli(["sql", COUNT_RUNS, "-w", warehouse, "-f", "json"], env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_init_creates_a_warehouse_that_answers_before_any_run(tmp_path):
    wh = tmp_path / "team" / "w.ducklake"
    # Never created: every read says so in one line, names the command, and creates nothing.
    for args in (["sql", COUNT_RUNS], ["report"], ["checks", "some-model"], ["export", str(tmp_path / "out")]):
        read = run_cli([*args, "-w", str(wh)], timeout=120)
        assert read.returncode == 1 and "Traceback" not in read.stdout + read.stderr
        assert read.stderr.strip() == not_created(str(wh))  # the one line, nothing else
    assert not wh.exists() and not wh.parent.exists()

    made = run_cli(["warehouse", "init", "-w", str(wh)], timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"{wh}: warehouse created (schema version {VERSION})"
    assert count_runs(str(wh)) == [{"n": 0}]
    views = run_cli(["sql", "select count(*) as n from variant_scorecard", "-w", str(wh), "-f", "csv"], timeout=120)
    assert views.returncode == 0 and views.stdout == "n\n0\n", views.stderr

    before = tables(wh)
    again = run_cli(["warehouse", "init"], env={sessions.ENV_VAR: str(wh)}, timeout=120)  # the env var names it too
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (f"{wh}: warehouse exists and is up to date"
                                    f" (schema version {VERSION})")
    assert tables(wh) == before  # nothing applied twice
    assert count_runs(str(wh)) == [{"n": 0}]


def test_an_empty_catalog_file_is_a_warehouse_never_created(tmp_path):
    wh = tmp_path / "w.ducklake"
    wh.touch()  # e.g. made by a tool before quantgate wrote anything
    read = run_cli(["sql", "select 1", "-w", str(wh)], timeout=120)
    assert read.returncode == 1 and error_lines(read.stderr) == [not_created(str(wh))], read.stderr
    made = run_cli(["warehouse", "init", "-w", str(wh)], timeout=120)
    assert made.returncode == 0 and made.stdout.strip() == f"{wh}: warehouse created (schema version {VERSION})"
    assert count_runs(str(wh)) == [{"n": 0}]


def test_init_brings_an_older_warehouse_up_to_date(tmp_path, monkeypatch):
    """A warehouse of an earlier quantgate: init applies the migrations it lacks, then the views that changed (a
    newer quantgate is a migration and a view more here, in a new process)."""
    path = tmp_path / "w.ducklake"
    assert sessions.init(path) == f"{path}: warehouse created (schema version {VERSION})"
    sessions.close_all()  # a process migrates at its first writable session
    newer = tmp_path / "migrations"
    shutil.copytree(sessions.MIGRATIONS, newer)
    (newer / f"{VERSION + 1:04d}_extra.sql").write_text("CREATE TABLE extra_table (x INTEGER);")
    monkeypatch.setattr(sessions, "MIGRATIONS", newer)
    assert sessions.init(path) == f"{path}: warehouse exists; migrated from schema version {VERSION} to {VERSION + 1}"
    sessions.close_all()
    views = tmp_path / "views"
    shutil.copytree(sessions.VIEWS, views)
    (views / "99_extra.sql").write_text("CREATE OR REPLACE VIEW extra_view AS SELECT 42 AS answer;")
    monkeypatch.setattr(sessions, "VIEWS", views)
    assert sessions.init(path) == f"{path}: warehouse exists (schema version {VERSION + 1}); its views were updated"
    sessions.close_all()
    assert sessions.init(path) == f"{path}: warehouse exists and is up to date (schema version {VERSION + 1})"
    with sessions.session(path, read_only=True) as con:
        assert con.execute("SELECT answer FROM extra_view").fetchone() == (42,)
        assert con.execute("SELECT count(*) FROM extra_table").fetchone() == (0,)
    sessions.close_all()


@pytest.fixture(scope="module")
def pg_conninfo():
    if postgres.server_bin() is None:
        pytest.skip("PostgreSQL's server is not installed (apt-get install postgresql; .ci/run does)")
    with postgres.postgres_server() as conninfo:
        yield conninfo


def test_init_on_a_postgresql_catalog(pg_conninfo, tmp_path):
    wh = f"postgres:{pg_conninfo}"
    no_data = {k: v for k, v in os.environ.items() if k != sessions.DATA_ENV_VAR}
    read = run_cli(["sql", COUNT_RUNS, "-w", wh], env=no_data, timeout=120)  # DuckLake: "creating ... is disabled"
    assert read.returncode == 1 and error_lines(read.stderr) == [not_created(wh)], read.stderr

    # The data files of a team's warehouse go where every writer reaches: it must be named when it is created.
    refused = run_cli(["warehouse", "init", "-w", wh], env=no_data, timeout=120)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert error_lines(refused.stderr) == [f"error: {wh}: a new warehouse needs a folder for its data files every"
                                           " writer reaches: set QUANTGATE_WAREHOUSE_DATA (e.g. /shared/quantgate-lake/"
                                           " or s3://...)"], refused.stderr
    assert error_lines(run_cli(["sql", COUNT_RUNS, "-w", wh], env=no_data, timeout=120).stderr) == [not_created(wh)]

    data = {sessions.DATA_ENV_VAR: str(tmp_path / "lake") + "/"}
    made = run_cli(["warehouse", "init", "-w", wh], env=data, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == f"{wh}: warehouse created (schema version {VERSION})"
    assert count_runs(wh, env=no_data) == [{"n": 0}]  # a reader needs no data path: the catalog holds it
    again = run_cli(["warehouse", "init", "-w", wh], env=no_data, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "warehouse exists and is up to date" in again.stdout


@pytest.mark.slow
def test_deploy_creates_the_warehouse(tmp_path):
    wh = tmp_path / "w.ducklake"
    # No Prefect server: one line, and no warehouse made for deployments that do not exist.
    nowhere = run_cli(["deploy", "-w", str(wh)], env={"PREFECT_API_URL": "", "PREFECT_HOME": str(tmp_path / "ph")},
                      timeout=120)
    assert nowhere.returncode == 1 and error_lines(nowhere.stderr)[0].startswith("error: no Prefect server"), \
        nowhere.stderr
    assert not wh.exists()
    with prefect_server.server(tmp_path / "prefect-home") as (url, env):
        done = run_cli(["deploy"], env={**env, sessions.ENV_VAR: str(wh)}, timeout=300)
        assert done.returncode == 0, done.stderr + done.stdout
    assert f"{wh}: warehouse created" in done.stdout
    assert "evaluate-model/evaluate-model" in done.stdout
    assert "--limit 1 on a host without GPUs" in done.stdout
    assert count_runs(str(wh)) == [{"n": 0}]
    assert Path(f"{wh}.files").is_dir()
