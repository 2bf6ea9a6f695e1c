"""Prefect's real scheduler, as a team's server runs it: `prefect server start` with its scheduler on (SQLite, and
PostgreSQL where the PostgreSQL tests run), `quantgate deploy`, then the SCHEDULED runs of every cron deployment of
prefect.yaml and a server log without an ERROR; and a deployment given a schedule due within the minute, whose run
the scheduler creates, a worker takes, and which ends Completed with its row in the warehouse.

Prefect 3.7's scheduler failed every loop on SQLAlchemy 2.1 ("Can't evaluate bulk DML statement"), so no cron run
was ever created; pyproject.toml caps SQLAlchemy below 2.1 for that."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from prefect.settings import PREFECT_WORKER_PREFETCH_SECONDS

from quantgate.warehouse import reads, sessions
from tests import postgres, prefect_server
from tests.shared_data import REPO, TINY_MODEL
from tests.test_deployment import CATALOG, EVALUATE, client, deployment_runs, wait_final

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "quantgate.flows.cli"]
PG_URL = "PREFECT_API_DATABASE_CONNECTION_URL"


@pytest.fixture(params=["sqlite", "postgresql"])
def prefect_database(request) -> Iterator[dict[str, str]]:
    """The server's database, as the settings that choose it: SQLite is Prefect's default (none), PostgreSQL a server
    of the test's own (tests/postgres.py), stopped after the Prefect server the test stops in its own `finally`."""
    if request.param == "sqlite":
        yield {}
        return
    if postgres.server_bin() is None:
        pytest.skip("PostgreSQL's server is not installed (apt-get install postgresql; .ci/run does)")
    with postgres.postgres_server() as conninfo:
        yield {PG_URL: postgres.database(conninfo, "prefect")}


def cron_deployments() -> dict[str, str]:
    """{"name/name": cron} of every deployment prefect.yaml schedules."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return {f"{d['name']}/{d['name']}": s["cron"] for d in spec["deployments"] for s in d.get("schedules") or []}


def deploy(tmp: Path, extra: dict[str, str]):
    """A fresh server with its scheduler on and `quantgate deploy` done on it: (url, env, server log)."""
    home = tmp / "prefect-home"
    server = prefect_server.server(home, {"QUANTGATE_REPO": str(REPO), **extra})
    url, env = server.__enter__()
    done = subprocess.run([*CLI, "deploy"], env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    return server, url, env, home / "server.log"


def scheduled(c, name: str) -> list:
    return [r for r in deployment_runs(c, name) if r.state and r.state.is_scheduled()]


def test_every_cron_deployment_gets_scheduled_runs_and_the_server_logs_no_error(tmp_path, prefect_database):
    extra = {sessions.ENV_VAR: str(tmp_path / "w.ducklake"), **prefect_database}
    crons = cron_deployments()
    assert set(crons) == {"nightly/nightly", "watch-releases/watch-releases",
                          "warehouse-maintenance/warehouse-maintenance"}
    server, url, _, log = deploy(tmp_path, extra)
    try:
        with client(url) as c:
            deadline = time.monotonic() + 180
            while not all(scheduled(c, n) for n in crons) and time.monotonic() < deadline:
                time.sleep(2)
            runs = {n: sorted(scheduled(c, n), key=lambda r: r.expected_start_time) for n in crons}
        assert all(runs.values()), {n: len(r) for n, r in runs.items()}
        for name, cron in crons.items():
            minute, hour = cron.split()[:2]
            first = runs[name][0]
            assert first.auto_scheduled and first.expected_start_time > datetime.now(timezone.utc)
            assert first.expected_start_time.minute == int(minute)
            assert hour == "*" or first.expected_start_time.astimezone(timezone.utc).hour == int(hour)
        errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
        assert errors == []
    finally:
        server.__exit__(None, None, None)


def test_a_schedule_due_within_the_minute_runs_on_a_worker_to_completed_with_its_warehouse_row(tmp_path,
                                                                                               prefect_database):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(CATALOG.format(model=TINY_MODEL, suite="quick"))
    warehouse = str(tmp_path / "w.ducklake")
    extra = {sessions.ENV_VAR: warehouse, "QUANTGATE_HOME": str(tmp_path / "work"), "HF_HUB_OFFLINE": "1",
             "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PREFECT_WORKER_QUERY_SECONDS": "2",
             **prefect_database}
    server, url, env, log = deploy(tmp_path, extra)
    worker = None
    try:
        # Due at a minute the scheduler's next pass (every 60 s, Prefect's default) comes before: a once-a-day cron.
        due = (datetime.now(timezone.utc) + timedelta(seconds=130)).replace(second=0, microsecond=0)
        from prefect.client.schemas.schedules import CronSchedule

        with client(url) as c:
            dep = c.read_deployment_by_name(EVALUATE)
            c.create_deployment_schedules(dep.id, [(CronSchedule(cron=f"{due.minute} {due.hour} * * *",
                                                                 timezone="UTC"), True)],
                                          parameters={"catalog": str(catalog), "model": "stories260k"})
            worker = prefect_server.start(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", "quantgate-gpu", "--type", "process",
                 "--limit", "1", "--name", "host-s"], {**env, "QUANTGATE_HOST": "host-s"},
                tmp_path / "worker.log", cwd=tmp_path)
            deadline = time.monotonic() + (due - datetime.now(timezone.utc)).total_seconds()
            while not (mine := [r for r in deployment_runs(c, EVALUATE) if r.expected_start_time == due]):
                assert time.monotonic() < deadline, "the scheduler created no run for the new schedule"
                time.sleep(2)
            assert len(mine) == 1 and mine[0].auto_scheduled and mine[0].parameters["model"] == "stories260k"
            final = wait_final(c, [mine[0].id], timeout_s=600)[str(mine[0].id)]
        assert final.state.is_completed(), (final.state, (tmp_path / "worker.log").read_text()[-3000:])
        # A worker takes a run up to its prefetch window (Prefect's default 10 s) before it is due.
        assert final.start_time >= due - timedelta(seconds=PREFECT_WORKER_PREFETCH_SECONDS.value())
        with sessions.session(warehouse, read_only=True) as con:
            rows = reads.rows(con, "SELECT r.model_id, r.status FROM runs r JOIN run_attempts a USING (run_id)"
                                   " WHERE a.attempt_id = ?", [str(final.id)])
        assert rows == [{"model_id": "stories260k", "status": "completed"}]
        errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
        # On SQLite, the worker's polls while the run writes its states and logs meet "database is locked" now and
        # then (Prefect's server on SQLite is for one machine; docs/deployment.md): none of them the scheduler's.
        assert [e for e in errors if "schedule" in e] == []
        assert PG_URL not in prefect_database or errors == []
    finally:
        if worker is not None:
            prefect_server.stop(worker)
        server.__exit__(None, None, None)
