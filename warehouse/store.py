"""The warehouse: sessions on the lake (warehouse/lake.py), versioned migrations, views and transactional writes."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb

from quantgate.catalog.errors import one_line
from quantgate.catalog.records import (
    Decision, MetricResult, ModelArtifact, Provenance, QualityReport, ServingLoad, Slo, SpeedResult, VariantArtifact,
)
from quantgate.catalog.settings import Settings, settings
from quantgate.warehouse import lake
from quantgate.warehouse.lake import WarehouseError

HERE = Path(__file__).resolve().parent
MIGRATIONS = HERE / "migrations"
VIEWS = HERE / "views"
ENV_VAR = "QUANTGATE_WAREHOUSE"
DATA_ENV_VAR = "QUANTGATE_WAREHOUSE_DATA"
DEFAULT_PATH: str = Settings.model_fields["warehouse"].default
# How long a writer waits for the write lock before giving up with a one-line error.
LOCK_WAIT_ENV = "QUANTGATE_LOCK_WAIT_S"

__all__ = ["WarehouseError"]


def default_path() -> str:
    return settings().warehouse


def address(location: str | Path | None = None) -> lake.Address:
    """The warehouse named by `location`, else by $QUANTGATE_WAREHOUSE, else ./quantgate.ducklake; the data path
    of a new one from $QUANTGATE_WAREHOUSE_DATA."""
    return lake.address(location or default_path(), settings().warehouse_data or None)


def now() -> datetime:
    """The warehouse's clock: UTC, naive, as every timestamp column stores it."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def read_migrations(folder: Path) -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of each numbered migration in `folder`, in order."""
    return [(int(f.name.split("_", 1)[0]), f.name, f.read_text()) for f in sorted(folder.glob("*.sql"))]


def _migrations() -> list[tuple[int, str, str]]:
    return read_migrations(MIGRATIONS)


def _checksum(sql: str) -> str:
    return hashlib.sha256(sql.encode()).hexdigest()


def _lock_wait_s() -> float:
    return settings().lock_wait_s


class _Lake:
    """This process's database with one warehouse attached, shared by its sessions (each borrows a cursor, a
    connection of its own, set up once and kept for the next session), and the warehouse's write lock, which
    the outermost writable session of the process holds."""

    def borrow(self) -> duckdb.DuckDBPyConnection:
        with _OPENING:
            if self.idle:
                return self.idle.pop()
        con = self.db.cursor()
        con.execute(f"USE {lake.ALIAS}")  # a cursor starts in DuckDB's own in-memory catalog
        return con

    def give_back(self, con: duckdb.DuckDBPyConnection) -> None:
        with _OPENING:
            self.idle.append(con)

    def __init__(self, where: lake.Address, read_only: bool, sandbox: bool) -> None:
        self.db = lake.open_lake(where, read_only)
        self.db.execute(f"SET disabled_optimizers = '{lake.COSTLY_OPTIMIZERS}'")  # global: every cursor has it
        if sandbox:
            # After the attach: the lake's data files stay readable, nothing else is (its SQLite catalog is read
            # through SQLite's own file layer), and nothing can be set back.
            self.db.execute("SET allowed_directories = ?", [[where.data_path] if where.data_path else []])
            self.db.execute("SET enable_external_access = false")
            self.db.execute("SET lock_configuration = true")
        self.lock = None if read_only else lake.write_lock(where)
        self.depth = 0
        self.checked = self.migrated = False  # schema version read; migrations and views applied
        self.idle: list[duckdb.DuckDBPyConnection] = []


_LAKES: dict[tuple[str, bool, bool, int], _Lake] = {}
_OPENING = threading.Lock()
# Writable sessions of one process take turns (threads of one flow: lanes, builds and evaluations side by side):
# the write lock is the process's, and one migrating or recreating the views would conflict with another at it.
_WRITING = threading.RLock()


def _lake(where: lake.Address, read_only: bool, sandbox: bool) -> _Lake:
    key = (where.catalog, read_only, sandbox, os.getpid())  # a forked child opens its own
    writable = (where.catalog, False, False, os.getpid())
    with _OPENING:
        if read_only and not sandbox and writable in _LAKES:
            return _LAKES[writable]  # the process writes it too: its reads go through the same attach
        if key not in _LAKES:
            _LAKES[key] = _Lake(where, read_only, sandbox)
        return _LAKES[key]


def close_all() -> None:
    """Detach every warehouse this process opened (tests that delete or move one; the next session reopens)."""
    with _OPENING:
        for opened in _LAKES.values():
            opened.db.close()
        _LAKES.clear()


@contextmanager
def session(path: str | Path | None = None, read_only: bool = False,
            sandbox: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
    """A connection to the warehouse for a few statements. A read-only one reads one snapshot throughout and never
    waits. A writable one holds the warehouse's write lock until it ends (waiting for it up to
    $QUANTGATE_LOCK_WAIT_S, 60 s by default), so keep it to the writes of one step, grouped in `transaction`s;
    the first in a process migrates the warehouse. `sandbox` (read-only only) also shuts SQL off from every file
    but the warehouse's."""
    where = address(path)
    opened = _lake(where, read_only, sandbox and read_only)
    if read_only:
        con = opened.borrow()
        try:
            if not opened.checked:
                _check_version(con, where.label)
                opened.checked = True
            # One snapshot for the session: DuckLake looks up the latest snapshot per transaction, which would be
            # each statement's (30 ms of a 40 ms lookup on a SQLite catalog).
            with _read_transaction(con):
                yield con
        finally:
            opened.give_back(con)
        return
    with _WRITING:
        if opened.depth == 0:
            wait_s = _lock_wait_s()
            if not opened.lock.acquire(wait_s):
                raise WarehouseError(f"{where.label}: another writer held the warehouse for more than {wait_s:.0f}s")
        opened.depth += 1
        con = opened.borrow()
        try:
            if not opened.migrated:
                migrate(con, where.label)
                opened.migrated = opened.checked = True
            yield con
        finally:
            opened.give_back(con)
            opened.depth -= 1
            if opened.depth == 0:
                opened.lock.release()


def connect(path: str | Path | None = None) -> duckdb.DuckDBPyConnection:
    """A read-only connection of its own to the warehouse (a script, a notebook); writers use `session`, which
    holds the warehouse's write lock."""
    where = address(path)
    con = lake.open_lake(where, read_only=True)
    _check_version(con, where.label)
    return con


def init(path: str | Path | None = None) -> str:
    """Create the warehouse with its schema and views, or bring an existing one up to date (pending migrations,
    changed views); harmless to repeat. Returns one line saying which it was. `quantgate warehouse init` and
    `quantgate deploy` call it, so that a team's warehouse is there to query before the first run writes."""
    where = address(path)
    before = _state(where)
    with session(path) as con:  # the first writable session of the process migrates and applies the views
        after = _schema_state(con)
    version = after[0]
    if before is None:
        return f"{where.label}: warehouse created (schema version {version})"
    if before == after:
        return f"{where.label}: warehouse exists and is up to date (schema version {version})"
    if before[0] != version:
        return f"{where.label}: warehouse exists; migrated from schema version {before[0]} to {version}"
    return f"{where.label}: warehouse exists (schema version {version}); its views were updated"


def _state(where: lake.Address) -> tuple[int, str | None] | None:
    """(schema version, views checksum) of the warehouse as it stands, or None where it was never created."""
    try:
        con = lake.open_lake(where, read_only=True)
    except lake.NoWarehouse:
        return None
    try:
        return _schema_state(con)
    finally:
        con.close()


def _schema_state(con: duckdb.DuckDBPyConnection) -> tuple[int, str | None]:
    version = views = None
    if _has_table(con, "schema_migrations"):
        (version,) = con.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
    if _has_table(con, "schema_views"):
        views = (con.execute("SELECT max(checksum) FROM schema_views").fetchone() or [None])[0]
    return version or 0, views


def maintain(path: str | Path | None = None, keep_days: int = 7) -> list[tuple[str, float]]:
    """DuckLake's maintenance, holding the write lock: (step, seconds) each."""
    import time

    done = []
    with session(path) as con:
        for statement in lake.MAINTENANCE:
            started = time.monotonic()
            con.execute(statement.format(keep_days=int(keep_days)))
            done.append((statement.split("(", 1)[0].removeprefix("CALL "), time.monotonic() - started))
    return done


def _check_version(con: duckdb.DuckDBPyConnection, label: str) -> None:
    known = max(v for v, _, _ in _migrations())
    try:
        (current,) = con.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
    except duckdb.CatalogException:
        raise WarehouseError(f"{label}: not a quantgate warehouse (no schema_migrations table)") from None
    if current > known:
        raise WarehouseError(f"{label}: schema version {current} is newer than this quantgate knows ({known}); upgrade quantgate")


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database()"
                            " AND schema_name = 'main' AND table_name = ?", [name]).fetchone()[0])


def migrate(con: duckdb.DuckDBPyConnection, label: str = "warehouse") -> None:
    """Apply pending migrations (each once, checksum-verified), then (re)create the views. Works on the lake and on
    a plain DuckDB database alike (benchmarks/summarize.py loads committed results into one in memory)."""
    with transaction(con):
        if not _has_table(con, "schema_migrations"):
            con.execute("CREATE TABLE schema_migrations (version INTEGER NOT NULL, name VARCHAR NOT NULL,"
                        " checksum VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)")
    applied = {v: (n, c) for v, n, c in con.execute("SELECT version, name, checksum FROM schema_migrations").fetchall()}
    known = _migrations()
    if applied and max(applied) > max(v for v, _, _ in known):
        raise WarehouseError(
            f"{label}: schema version {max(applied)} is newer than this quantgate knows ({max(v for v, _, _ in known)}); upgrade quantgate"
        )
    migrated = False
    for version, name, sql in known:
        checksum = _checksum(sql)
        if version in applied:
            if applied[version][1] != checksum:
                raise WarehouseError(f"{label}: migration {name} changed after it was applied; add a new migration instead")
            continue
        migrated = True
        with transaction(con):
            con.execute(sql)
            con.execute("INSERT INTO schema_migrations VALUES (?, ?, ?, ?)", [version, name, checksum, now()])
    apply_views(con, force=migrated)


def apply_views(con: duckdb.DuckDBPyConnection, force: bool = False) -> None:
    """(Re)create the views when their SQL differs from what the warehouse holds (or `force`, after a
    migration): recreating all of them on every writable open would cost each a new snapshot."""
    files = sorted(VIEWS.glob("*.sql"))
    sql = [f.read_text() for f in files]
    checksum = _checksum("\n".join(f"-- {f.name}\n{text}" for f, text in zip(files, sql)))
    held = con.execute("SELECT checksum FROM schema_views").fetchone()
    if held and held[0] == checksum and not force:
        return
    with transaction(con):
        for text in sql:
            con.execute(text)
        _replace(con, "schema_views", {"id": 1}, {"checksum": checksum, "applied_at": now()})


_open_transactions: set[int] = set()


@contextmanager
def transaction(con: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    """One transaction; nested uses join the outer one, so several writes commit (or vanish) together."""
    if id(con) in _open_transactions:
        yield con
        return
    con.execute("BEGIN TRANSACTION")
    _open_transactions.add(id(con))
    try:
        yield con
    except BaseException:
        _open_transactions.discard(id(con))
        con.execute("ROLLBACK")
        raise
    _open_transactions.discard(id(con))
    try:
        con.execute("COMMIT")
    except duckdb.Error as e:
        raise WarehouseError(f"warehouse: the write did not commit ({str(e).splitlines()[0]})") from None


@contextmanager
def _read_transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    con.execute("BEGIN TRANSACTION")
    _open_transactions.add(id(con))
    try:
        yield
    finally:
        _open_transactions.discard(id(con))
        con.execute("ROLLBACK")


def _replace(con, table: str, key: dict[str, Any], values: dict[str, Any]) -> None:
    """The row of `key` in `table` is now `key` + `values` (DuckLake has no keys to upsert on; the write lock
    makes the delete and insert one step)."""
    with transaction(con):
        _delete(con, table, key)
        _insert(con, table, {**key, **values})


def _insert_new(con, table: str, key: dict[str, Any], values: dict[str, Any]) -> bool:
    """Insert the row unless its key is there; whether it was inserted."""
    if _holds(con, table, key):
        return False
    _insert(con, table, {**key, **values})
    return True


def _holds(con, table: str, match: dict[str, Any]) -> bool:
    """Whether `table` has a row with these column values."""
    where = " AND ".join(f'"{c}" = ?' for c in match)
    return con.execute(f"SELECT 1 FROM {table} WHERE {where} LIMIT 1", list(match.values())).fetchone() is not None


def _delete(con, table: str, match: dict[str, Any]) -> None:
    """Delete the rows with these column values, looking first: a DuckLake DELETE costs about three lookups, and
    most rows written are new (a run's own)."""
    if _holds(con, table, match):
        where = " AND ".join(f'"{c}" = ?' for c in match)
        con.execute(f"DELETE FROM {table} WHERE {where}", list(match.values()))


def _insert(con, table: str, row: dict[str, Any]) -> None:
    columns = ", ".join(f'"{c}"' for c in row)
    con.execute(f"INSERT INTO {table} ({columns}) VALUES ({', '.join('?' * len(row))})", list(row.values()))


def _json(obj: Any) -> str | None:
    return None if obj is None else json.dumps(obj, sort_keys=True, default=str)


# --- writes ------------------------------------------------------------------------------------


def start_run(con, run_id: str, flow_name: str, model_id: str | None, catalog_path: str | None,
              catalog_hash: str | None, host: str, versions: dict[str, str]) -> None:
    with transaction(con):
        started = _insert_new(con, "runs", {"run_id": run_id}, {
            "flow_name": flow_name, "model_id": model_id, "started_at": now(), "status": "running",
            "catalog_path": catalog_path, "catalog_hash": catalog_hash, "host": host, "versions": _json(versions)})
        if not started:
            con.execute("UPDATE runs SET status = 'running', error = NULL, finished_at = NULL WHERE run_id = ?", [run_id])


def finish_run(con, run_id: str, error: str | None = None, attempt_id: str | None = None,
               cancelled: bool = False) -> None:
    """The run, and its attempt, over: completed, failed with `error`, or `cancelled` (from Prefect; `error` says
    how). A later run of the same request resumes a failed or cancelled run (`begin_run`)."""
    status = "cancelled" if cancelled else "failed" if error else "completed"
    with transaction(con):
        con.execute("UPDATE runs SET status = ?, error = ?, finished_at = ? WHERE run_id = ?",
                    [status, error, now(), run_id])
        if attempt_id:
            con.execute("UPDATE run_attempts SET status = ?, error = ?, finished_at = ? WHERE attempt_id = ?",
                        [status, error, now(), attempt_id])


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _attempt_may_be_running(host: str | None, pid: int | None, this_host: str) -> bool:
    """Whether a 'running' attempt may still be at work: on this host, when its process is alive; on
    another host we cannot tell, so it may."""
    if host != this_host:
        return True
    return pid != os.getpid() and _pid_alive(pid)


def begin_run(con, attempt_id: str, flow_name: str, model_id: str, resume_key: str, catalog_path: str | None,
              catalog_hash: str | None, host: str, versions: dict[str, str],
              exclusive: bool = False) -> tuple[str, bool]:
    """Start a run for this flow run, or resume an unfinished one: (run_id, resumed).

    The latest run of `model_id` is resumed when it did not finish (failed, or running with no attempt
    that may still be at work), and was asked to do the same thing (`resume_key`). Its attempts that
    died without a word are marked abandoned. A Prefect retry of the same flow run continues its run.
    `exclusive`: the caller holds the model's lock (tasks/runtime/placement.py), so no other attempt of the
    model is at work on any host, whatever its row says; otherwise an attempt on another host may be.
    Otherwise a new run keyed by `attempt_id` starts; unfinished runs of the model whose processes are
    gone are then marked failed ("abandoned"), so that nothing stays 'running' forever.
    """
    with transaction(con):
        mine = con.execute("SELECT run_id FROM run_attempts WHERE attempt_id = ?", [attempt_id]).fetchone()
        if mine or con.execute("SELECT 1 FROM runs WHERE run_id = ?", [attempt_id]).fetchone():
            run_id = mine[0] if mine else attempt_id
            _attempt(con, attempt_id, run_id, host)
            con.execute("UPDATE runs SET status = 'running', error = NULL, finished_at = NULL WHERE run_id = ?", [run_id])
            return run_id, False
        unfinished = rows(con, "SELECT run_id, status, resume_key FROM runs WHERE flow_name = ? AND model_id = ?"
                               " AND status <> 'completed' ORDER BY started_at DESC", [flow_name, model_id])
        latest = con.execute("SELECT run_id FROM runs WHERE flow_name = ? AND model_id = ? ORDER BY started_at DESC"
                             " LIMIT 1", [flow_name, model_id]).fetchone()
        dead = []
        for run in unfinished:
            live = [] if exclusive else [
                a for a in rows(con, "SELECT host, pid FROM run_attempts WHERE run_id = ? AND status = 'running'",
                                [run["run_id"]]) if _attempt_may_be_running(a["host"], a["pid"], host)]
            legacy = not exclusive and run["status"] == "running" and not con.execute(
                "SELECT 1 FROM run_attempts WHERE run_id = ?", [run["run_id"]]).fetchone()
            if not live and not legacy:
                dead.append(run)
        for run in dead:
            con.execute("UPDATE run_attempts SET status = 'abandoned', finished_at = ?,"
                        " error = 'its process ended without finishing' WHERE run_id = ? AND status = 'running'",
                        [now(), run["run_id"]])
        resumable = next((r for r in dead if latest and r["run_id"] == latest[0] and r["resume_key"] == resume_key), None)
        if resumable:
            run_id = resumable["run_id"]
            con.execute("UPDATE runs SET status = 'running', error = NULL, finished_at = NULL WHERE run_id = ?", [run_id])
            _attempt(con, attempt_id, run_id, host)
            return run_id, True
        for run in dead:
            if run["status"] == "running":
                con.execute("UPDATE runs SET status = 'failed', finished_at = ?, error = ? WHERE run_id = ?",
                            [now(), f"abandoned: its process ended without finishing; not resumed by {attempt_id}",
                             run["run_id"]])
        start_run(con, attempt_id, flow_name, model_id, catalog_path, catalog_hash, host, versions)
        con.execute("UPDATE runs SET resume_key = ? WHERE run_id = ?", [resume_key, attempt_id])
        _attempt(con, attempt_id, attempt_id, host)
        return attempt_id, False


def _attempt(con, attempt_id: str, run_id: str, host: str) -> None:
    if not _insert_new(con, "run_attempts", {"attempt_id": attempt_id}, {
            "run_id": run_id, "host": host, "pid": os.getpid(), "started_at": now(), "status": "running"}):
        con.execute("UPDATE run_attempts SET pid = ?, status = 'running', error = NULL, finished_at = NULL"
                    " WHERE attempt_id = ?", [os.getpid(), attempt_id])


def mark_stage(con, run_id: str, stage: str, item: str, detail: str | None, attempt_id: str,
               started_at: datetime | None = None, engine_starts: int = 0, marked_before: bool = True) -> None:
    """Mark a stage of a run complete, with when it began and the engine starts it made; call it inside the
    transaction that writes the stage's rows. `marked_before=False`: the caller knows the run has no mark for
    this item yet (it read the run's marks when it began and is the run's one attempt), sparing the lookup."""
    key = {"run_id": run_id, "stage": stage, "item": item}
    values = {"detail": detail, "attempt_id": attempt_id, "completed_at": now(), "started_at": started_at,
              "engine_starts": engine_starts}
    if marked_before:
        _replace(con, "run_stages", key, values)
    else:
        _insert(con, "run_stages", {**key, **values})


def scorecard(con, run_id: str) -> list[dict[str, Any]]:
    return rows(con, "SELECT * FROM variant_scorecard WHERE run_id = ?", [run_id])


@dataclass(frozen=True)
class DecisionEvidence:
    """What the decisions of a run are made from, each a view's rows for the run's variants."""

    variants: list[dict[str, Any]]
    recovery: list[dict[str, Any]]
    speedup: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    flips: list[dict[str, Any]]
    serving: list[dict[str, Any]]
    formats: list[dict[str, Any]]

    def of(self, variant_uid: str) -> dict[str, list[dict[str, Any]]]:
        """One variant's rows, by the names tasks/steps/decide.decide takes them under."""
        def mine(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [r for r in found if r["variant_uid"] == variant_uid]

        return {"recovery": mine(self.recovery), "speed": mine(self.speedup), "samples": mine(self.samples),
                "flips": mine(self.flips), "serving": mine(self.serving), "formats": mine(self.formats)}


def decision_evidence(con, run_id: str, gated: Sequence[tuple[str, str]]) -> DecisionEvidence:
    def view(name: str) -> list[dict[str, Any]]:
        return rows(con, f"SELECT * FROM {name} WHERE run_id = ?", [run_id])

    # The model's random_weights beside each variant (a run on a model's shape measures no quality), and whether
    # its weights passed through quantization before (its provenance, as verdicts name it).
    variants = rows(con, "SELECT v.*, coalesce(m.random_weights, false) AS random_weights,"
                         " m.prequantized AS base_prequantized, m.provenance AS base_provenance FROM variants v"
                         " JOIN run_variants rv USING (variant_uid) LEFT JOIN models m USING (model_uid)"
                         " WHERE rv.run_id = ? AND rv.role = 'variant'", [run_id])
    return DecisionEvidence(variants, view("variant_recovery"), view("variant_speedup"),
                            paired_samples(con, run_id, list(gated)), view("variant_flips"), view("variant_serving"),
                            view("variant_answer_format"))


def latest_run(con, model_id: str) -> str | None:
    """The model's latest finished evaluate-model run."""
    found = con.execute("SELECT run_id FROM latest_runs WHERE model_id = ?", [model_id]).fetchone()
    return found[0] if found else None


def decision_checks(con, run_id: str, variant: str | None = None) -> list[dict[str, Any]]:
    """Every check behind a run's decisions (or one variant's), in the order the policy applied them."""
    return rows(con, "SELECT v.name AS variant, c.position, c.kind, c.name AS check, c.outcome, c.value, c.lower,"
                     " c.upper, c.threshold, c.items, c.items_to_decide, c.note"
                     " FROM decision_checks c JOIN variants v USING (variant_uid)"
                     " WHERE c.run_id = ? AND (? IS NULL OR v.name = ?) ORDER BY v.name, c.position",
                [run_id, variant, variant])


def stage_summary(con, run_id: str) -> list[dict[str, Any]]:
    """Seconds per stage of a run (from the first start to the last end of its items, which may overlap),
    the longest item, engine starts and how many items were reused, in the order the stages began."""
    return rows(
        con,
        "SELECT stage, count(*) AS checkpoints, round(epoch(max(ended_at) - min(started_at)), 1) AS seconds,"
        " round(max(seconds), 1) AS busiest_s, sum(engine_starts) AS engine_starts,"
        " count(*) FILTER (WHERE reused) AS reused"
        " FROM stage_times WHERE run_id = ? GROUP BY stage ORDER BY min(started_at)",
        [run_id],
    )


def variant_failed(con, variant_uid: str) -> bool:
    found = con.execute("SELECT status = 'failed' FROM variants WHERE variant_uid = ?", [variant_uid]).fetchone()
    return bool(found and found[0])


def speed_source(con, speed_key: str) -> tuple[str, str] | None:
    """(run, checkpoint) of the latest benchmark stage that measured rows with this speed key (a format, its
    scenarios, libraries and device): what a rerun, or another checkpoint of the same format, would measure
    again."""
    found = con.execute(
        "SELECT rv.run_id, rv.variant_uid FROM run_variants rv JOIN run_stages st ON st.run_id = rv.run_id"
        " AND st.stage = 'benchmark' AND st.item = rv.variant_uid"
        " WHERE rv.speed_key = ? AND coalesce(rv.speed_run_id, rv.run_id) = rv.run_id"
        " AND coalesce(rv.speed_variant_uid, rv.variant_uid) = rv.variant_uid"
        " ORDER BY st.completed_at DESC LIMIT 1",
        [speed_key],
    ).fetchone()
    return (found[0], found[1]) if found else None


def link_speed(con, run_id: str, variant_uid: str, speed_key: str, source: tuple[str, str] | None = None) -> None:
    """The run's speed rows for the variant: measured by itself (no source), or those of `source` (run,
    checkpoint): an earlier run's, or another checkpoint's of the same format."""
    source_run, source_uid = source or (run_id, variant_uid)
    con.execute("UPDATE run_variants SET speed_key = ?, speed_run_id = ?, speed_variant_uid = ?"
                " WHERE run_id = ? AND variant_uid = ?",
                [speed_key, source_run, None if source_uid == variant_uid else source_uid, run_id, variant_uid])


def completed_stages(con, run_id: str) -> dict[tuple[str, str], str | None]:
    """{(stage, item): detail} of the stages of a run marked complete."""
    found = con.execute("SELECT stage, item, detail FROM run_stages WHERE run_id = ?", [run_id]).fetchall()
    return {(stage, item): detail for stage, item, detail in found}


def model_of(con, model_uid: str) -> ModelArtifact | None:
    row = con.execute("SELECT model_id, path, source, revision, sha, architecture, num_parameters, size_bytes,"
                      " coalesce(random_weights, false), provenance_detail FROM models WHERE model_uid = ?",
                      [model_uid]).fetchone()
    if row is None:
        return None
    detail = json.loads(row[-1]) if isinstance(row[-1], str) else row[-1]
    return ModelArtifact(*row[:-1], provenance=Provenance(**detail) if detail else None)


def _provenance(model: ModelArtifact) -> dict[str, Any]:
    """A model's provenance columns: a model with none found is not prequantized (stored, unlike NULL: unknown)."""
    p = model.provenance
    return {"prequantized": bool(p and p.quantized), "provenance": p.label if p else None,
            "provenance_detail": _json(asdict(p)) if p else None}


def run_variant(con, run_id: str, variant_uid: str) -> dict[str, Any] | None:
    """A variant's row as a run recorded it (any status), with that run's `reused` flag."""
    found = rows(con, "SELECT v.*, rv.reused FROM variants v JOIN run_variants rv USING (variant_uid)"
                      " WHERE rv.run_id = ? AND v.variant_uid = ?", [run_id, variant_uid])
    return found[0] if found else None


def fail_variant(con, variant_uid: str, error: str) -> None:
    """A built variant that turned out unusable (e.g. NaN/Inf outputs): failed, with the reason."""
    with transaction(con):
        con.execute("UPDATE variants SET status = 'failed', error = ? WHERE variant_uid = ?", [error, variant_uid])


def record_model(con, run_id: str, model: ModelArtifact) -> None:
    with transaction(con):
        _insert_new(con, "models", {"model_uid": model.uid}, {
            "model_id": model.model_id, "source": model.source, "revision": model.revision, "sha": model.sha,
            "path": model.path, "architecture": model.architecture, "num_parameters": model.num_parameters,
            "size_bytes": model.size_bytes, "random_weights": model.random_weights, **_provenance(model),
            "first_run_id": run_id})
        # A row stored before migration 0015 has no provenance: this run's reading of the same checkpoint is it.
        if con.execute("SELECT 1 FROM models WHERE model_uid = ? AND prequantized IS NULL", [model.uid]).fetchone():
            values = _provenance(model)
            con.execute(f"UPDATE models SET {', '.join(f'{c} = ?' for c in values)} WHERE model_uid = ?",
                        [*values.values(), model.uid])


def record_variant(con, run_id: str, v: VariantArtifact, role: str) -> None:
    """Store a build once; a failed (or skipped) build may be replaced by a later successful one of the same uid."""
    with transaction(con):
        existing = con.execute("SELECT status FROM variants WHERE variant_uid = ?", [v.uid]).fetchone()
        if not (existing and (existing[0] == "built" or v.status != "built")):
            if existing:
                con.execute("DELETE FROM variants WHERE variant_uid = ?", [v.uid])
            # A skipped variant is stored as status 'failed' with skipped = true (migration 0007).
            con.execute(
                "INSERT INTO variants (variant_uid, model_uid, name, method, scheme, bits, group_size, path, recipe,"
                " recipe_hash, lib_versions, size_bytes, build_seconds, peak_memory_bytes, status, error,"
                " created_run_id, created_at, weights, skipped)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [v.uid, v.model_uid, v.name, v.method, v.scheme, v.bits, v.group_size, v.path, v.recipe,
                 v.recipe_hash, _json(v.lib_versions), v.size_bytes, v.build_seconds, v.peak_memory_bytes,
                 "failed" if v.status == "skipped" else v.status, v.error, run_id, now(), v.weights,
                 v.status == "skipped"],
            )
        link_variant(con, run_id, v.uid, role, v.reused)


def link_variant(con, run_id: str, variant_uid: str, role: str, reused: bool) -> None:
    """The run looks at this variant (built by it, or reused); a second call updates `reused`."""
    with transaction(con):
        if not _insert_new(con, "run_variants", {"run_id": run_id, "variant_uid": variant_uid},
                           {"role": role, "reused": reused}):
            con.execute("UPDATE run_variants SET reused = ? WHERE run_id = ? AND variant_uid = ?",
                        [reused, run_id, variant_uid])


def find_variant(con, uid: str) -> dict[str, Any] | None:
    row = con.execute("SELECT * FROM variants WHERE variant_uid = ? AND status = 'built'", [uid]).fetchone()
    if row is None:
        return None
    return dict(zip([d[0] for d in con.description], row))


def has_quality(con, variant_uid: str, eval_key: str) -> bool:
    row = con.execute(
        "SELECT 1 FROM quality_evals WHERE variant_uid = ? AND eval_key = ? AND status = 'ok'", [variant_uid, eval_key]
    ).fetchone()
    return row is not None


def quality_metrics(con, variant_uid: str, eval_key: str) -> list[MetricResult]:
    found = con.execute("SELECT task, metric, filter, value, stderr, n_samples, task_version, higher_is_better"
                        " FROM quality_results WHERE variant_uid = ? AND eval_key = ?", [variant_uid, eval_key]).fetchall()
    return [MetricResult(*r) for r in found]


def link_quality(con, run_id: str, variant_uid: str, eval_key: str) -> None:
    with transaction(con):
        con.execute(
            "UPDATE run_variants SET eval_key = ? WHERE run_id = ? AND variant_uid = ?", [eval_key, run_id, variant_uid]
        )


def record_quality(con, run_id: str, variant_uid: str, report: QualityReport, link: bool = True) -> None:
    """Store one evaluation with all its metrics and samples in one transaction, replacing a failed one.

    `link` makes it the run's evaluation of the variant (the suite); side measurements such as the
    KL divergence are stored without moving that link.
    """
    with transaction(con):
        if link:
            con.execute(
                "UPDATE run_variants SET eval_key = ? WHERE run_id = ? AND variant_uid = ?",
                [report.eval_key, run_id, variant_uid],
            )
        if has_quality(con, variant_uid, report.eval_key):
            return
        for table in ("quality_evals", "quality_results", "quality_samples"):
            con.execute(f"DELETE FROM {table} WHERE variant_uid = ? AND eval_key = ?", [variant_uid, report.eval_key])
        con.execute(
            "INSERT INTO quality_evals VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [variant_uid, report.eval_key, run_id, report.evaluator, _json(report.config), report.seconds,
             report.status, report.error, now()],
        )
        if report.metrics:
            con.executemany(
                "INSERT INTO quality_results VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [[variant_uid, report.eval_key, run_id, m.task, m.metric, m.filter, m.value, m.stderr, m.n_samples,
                  m.task_version, m.higher_is_better] for m in report.metrics],
            )
        if report.samples:
            import pandas as pd

            samples = pd.DataFrame(
                {
                    "variant_uid": variant_uid,
                    "eval_key": report.eval_key,
                    "task": [s.task for s in report.samples],
                    "doc_id": [s.doc_id for s in report.samples],
                    "metric": [s.metric for s in report.samples],
                    "filter": [s.filter for s in report.samples],
                    "value": [s.value for s in report.samples],
                    "detail": [_json(s.detail) for s in report.samples],
                }
            )
            con.register("_samples", samples)
            con.execute("INSERT INTO quality_samples SELECT * FROM _samples")
            con.unregister("_samples")


_SPEED_COLUMNS = (
    "engine", "scenario", "status", "reason", "config", "device", "num_requests", "input_tokens", "output_tokens",
    "tokens_per_s", "requests_per_s", "ttft_ms", "tpot_ms", "e2el_ms", "peak_memory_bytes", "energy_j_per_token",
    "repetitions", "versions", "total_tokens_per_s", "decode_tokens_per_s", "bandwidth_gbps",
    "weight_bytes_per_token", "roofline_fraction", "nvml_peak_bytes", "torch_peak_bytes", "kv_cache_tokens",
    "kv_cache_bytes", "details",
)
_JSON_SPEED = {"config", "repetitions", "versions", "details"}


def record_speed(con, run_id: str, variant_uid: str, results: Sequence[SpeedResult]) -> None:
    with transaction(con):
        for r in results:
            d = asdict(r)
            values = {c: _json(d[c]) if c in _JSON_SPEED else d[c] for c in _SPEED_COLUMNS if c not in ("engine", "scenario")}
            _replace(con, "speed_results", {"run_id": run_id, "variant_uid": variant_uid, "engine": r.engine,
                                            "scenario": r.scenario}, {**values, "created_at": now()})


_CHECK_COLUMNS = ("kind", "name", "task", "metric", "value", "lower", "upper", "threshold", "outcome",
                  "min_detectable_drop", "items", "items_to_decide", "note", "detail")


def record_decisions(con, run_id: str, decisions: Sequence[Decision], policy: dict[str, Any]) -> None:
    """Each decision and its checks (`decision_checks`, one row each, in the decision's order), together."""
    checks_sql = (f"INSERT INTO decision_checks (run_id, variant_uid, position, {', '.join(_CHECK_COLUMNS)})"
                  f" VALUES ({', '.join('?' * (len(_CHECK_COLUMNS) + 3))})")
    with transaction(con):
        for d in decisions:
            _replace(con, "decisions", {"run_id": run_id, "variant_uid": d.variant_uid}, {
                "decision": d.decision, "reason": d.reason, "quality_recovery": d.quality_recovery,
                "speedup": d.speedup, "size_ratio": d.size_ratio, "policy_hash": d.policy_hash,
                "policy": _json(policy), "decided_at": now(), "quality_lower_bound": d.quality_lower_bound,
                "flip_rate": d.flip_rate})
            _delete(con, "decision_checks", {"run_id": run_id, "variant_uid": d.variant_uid})
            for position, c in enumerate(d.checks):
                row = asdict(c)
                con.execute(checks_sql, [run_id, d.variant_uid, position,
                                         *(_json(row[k]) if k == "detail" else row[k] for k in _CHECK_COLUMNS)])


# --- reads -------------------------------------------------------------------------------------


def rows(con, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
    cur = con.execute(sql, list(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


# --- GPU suite ---------------------------------------------------------------------------------


def record_serving(con, run_id: str, variant_uid: str, engine: str, scenario: str, loads: Sequence[ServingLoad],
                   slo: Slo | None) -> None:
    """Store a serving scenario's loads and every request of them, replacing an earlier write of the same run."""
    import pandas as pd

    key = [run_id, variant_uid, engine, scenario]
    where = "run_id = ? AND variant_uid = ? AND engine = ? AND scenario = ?"
    with transaction(con):
        con.execute(f"DELETE FROM serving_requests WHERE {where}", key)
        con.execute(f"DELETE FROM serving_loads WHERE {where}", key)
        for load in loads:
            ok = [r for r in load.records if r.success]
            con.execute(
                "INSERT INTO serving_loads VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [*key, load.label, load.max_concurrency, load.request_rate, len(load.records), load.duration_s,
                 len(ok), len(load.records) - len(ok), sum(r.output_tokens for r in ok), load.energy_j,
                 slo.ttft_ms if slo else None, slo.tpot_ms if slo else None, slo.e2el_ms if slo else None, now()],
            )
            if not load.records:
                continue
            ms = lambda s: None if s is None else s * 1000  # noqa: E731
            frame = pd.DataFrame(
                {
                    "run_id": run_id, "variant_uid": variant_uid, "engine": engine, "scenario": scenario,
                    "load": load.label,
                    "request_index": [r.index for r in load.records],
                    "success": [r.success for r in load.records],
                    "error": [r.error for r in load.records],
                    "prompt_tokens": [r.prompt_len for r in load.records],
                    "output_tokens": [r.output_tokens for r in load.records],
                    "ttft_ms": [ms(r.ttft_s) for r in load.records],
                    "tpot_ms": [ms(r.tpot_s) for r in load.records],
                    "e2el_ms": [ms(r.e2el_s) for r in load.records],
                    "itl_ms": [[gap * 1000 for gap in r.itl_s] for r in load.records],
                    "arrival_offset_s": [r.arrival_offset_s for r in load.records],
                    "start_offset_s": [r.start_offset_s for r in load.records],
                }
            )
            con.register("_requests", frame)
            con.execute("INSERT INTO serving_requests SELECT * FROM _requests")
            con.unregister("_requests")


def record_measured(con, run_id: str, variant_uid: str,
                    measured: Sequence[tuple[SpeedResult, Sequence[ServingLoad]]]) -> None:
    """Speed rows and, for serving runs, their loads, judged against the SLO in the row's config, in one transaction."""
    with transaction(con):
        record_speed(con, run_id, variant_uid, [result for result, _ in measured])
        for result, loads in measured:
            if result.config.get("kind") == "serving":
                slo = result.config.get("slo")
                record_serving(con, run_id, variant_uid, result.engine, result.scenario, loads,
                               Slo(**slo) if slo else None)


@contextmanager
def run_outcome(path: str | Path, run_id: str) -> Iterator[None]:
    """Marks the run completed when the block ends, or failed with the one-line error when it raises; an
    interrupt (SIGINT from a time limit, Ctrl-C) too, so that the run is not left 'running'."""
    try:
        yield
    except BaseException as e:
        error = one_line(e) if isinstance(e, Exception) else f"interrupted ({type(e).__name__})"
        with session(path) as con:
            finish_run(con, run_id, error=error)
        raise
    with session(path) as con:
        finish_run(con, run_id)


def record_suite_step(con, run_id: str, index: int, part: str, engine: str, build: str, scenarios: Sequence[str],
                      status: str, reason: str | None, started_s: float | None, seconds: float | None) -> None:
    with transaction(con):
        _replace(con, "suite_steps", {"run_id": run_id, "step_index": index}, {
            "part": part, "engine": engine, "build": build, "scenarios": list(scenarios), "status": status,
            "reason": reason, "started_s": started_s, "seconds": seconds})


def export(con, folder: str | Path, fmt: str = "parquet", views: bool = True) -> list[Path]:
    """Every table of the warehouse as one Parquet or CSV file each, and with `views` every view as computed now."""
    if fmt not in ("parquet", "csv"):
        raise WarehouseError(f"unknown export format {fmt!r}: use parquet or csv")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    kinds = ["BASE TABLE", "VIEW"] if views else ["BASE TABLE"]
    names = [n for (n,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database()"
        " AND table_schema = 'main' AND list_contains(?, table_type) ORDER BY table_name", [kinds],
    ).fetchall()]
    options = "FORMAT parquet" if fmt == "parquet" else "FORMAT csv, HEADER true"
    files = []
    for name in names:
        path = out / f"{name}.{fmt}"
        target = str(path).replace("'", "''")
        con.execute(f"COPY (SELECT * FROM \"{name}\") TO '{target}' ({options})")
        files.append(path)
    return files


def export_parquet(con, folder: str | Path, views: bool = False) -> list[Path]:
    """The tables as Parquet, the form results are kept in: views are derived (`load_parquet` + the views of
    the day recompute them), so their files are written only when asked for."""
    return export(con, folder, "parquet", views=views)


# The schema's own bookkeeping: a loaded export is migrated by this quantgate, not by the one that wrote it.
_BOOKKEEPING = ("schema_keys", "schema_migrations", "schema_views")


def table_names(con) -> list[str]:
    """The warehouse's tables that hold data (not its views, nor the schema's bookkeeping)."""
    return [n for (n,) in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database()"
        " AND table_schema = 'main' AND table_type = 'BASE TABLE' AND NOT list_contains(?, table_name)"
        " ORDER BY table_name", [list(_BOOKKEEPING)],
    ).fetchall()]


def load_parquet(con, folder: str | Path) -> list[str]:
    """Load the table files of a Parquet export into this migrated, empty warehouse; returns the tables loaded.

    Columns are matched by name: an export written under older migrations lacks the newer columns, which get
    their defaults (NULL unless the migration says otherwise). Files of views and of tables this schema does not
    have are not loaded: views are recomputed here from the tables. An export from a newer schema is refused."""
    folder = Path(folder)
    known = max(v for v, _, _ in _migrations())
    versions = folder / "schema_migrations.parquet"
    if versions.exists():
        (written,) = con.execute("SELECT max(version) FROM read_parquet(?)", [str(versions)]).fetchone()
        if written and written > known:
            raise WarehouseError(f"{folder}: written by schema version {written}, newer than this quantgate knows"
                                 f" ({known}); upgrade quantgate")
    loaded = []
    with transaction(con):
        for name in table_names(con):
            path = folder / f"{name}.parquet"
            if not path.exists():
                continue
            ours = {c for (c,) in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_catalog = current_database()"
                " AND table_name = ?", [name]).fetchall()}
            theirs = [d[0] for d in con.execute("SELECT * FROM read_parquet(?) LIMIT 0", [str(path)]).description]
            unknown = sorted(set(theirs) - ours)
            if unknown:
                raise WarehouseError(f"{path}: column {unknown[0]} is not in table {name} of this schema")
            columns = ", ".join(f'"{c}"' for c in theirs)
            try:
                con.execute(f'INSERT INTO "{name}" ({columns}) SELECT {columns} FROM read_parquet(?)', [str(path)])
            except duckdb.Error as e:
                raise WarehouseError(f"{path}: cannot load ({str(e).splitlines()[0]})") from None
            loaded.append(name)
    if not loaded:
        raise WarehouseError(f"{folder}: no table files of a quantgate warehouse export (e.g. runs.parquet)")
    return loaded


def paired_samples(con, run_id: str, metrics: Sequence[tuple[str, str]] = ()) -> list[dict[str, Any]]:
    """Rows of `variant_paired_samples` of one run; only these (task, metric) pairs when any are given."""
    where, params = "run_id = ?", [run_id]
    if metrics:
        where += " AND (task, metric) IN (VALUES " + ", ".join("(?, ?)" for _ in metrics) + ")"
        params += [x for pair in metrics for x in pair]
    return rows(con, f"SELECT * FROM variant_paired_samples WHERE {where} ORDER BY variant_uid, task, metric, filter, doc_id",
                params)


# --- orchestration (nightly, release watcher) --------------------------------------------------


def record_inputs(con, run_id: str, model_id: str, inputs_hash: str, inputs: dict[str, Any]) -> None:
    """What a run evaluated, hashed: the nightly compares it with the model's inputs now."""
    with transaction(con):
        _replace(con, "run_inputs", {"run_id": run_id}, {"model_id": model_id, "inputs_hash": inputs_hash,
                                                         "inputs": _json(inputs), "recorded_at": now()})


def last_success_inputs(con, model_id: str) -> dict[str, Any] | None:
    """inputs_hash, inputs, run_id and finished_at of the model's latest completed run that recorded its inputs."""
    found = rows(
        con,
        "SELECT i.inputs_hash, i.inputs, i.run_id, r.finished_at FROM run_inputs i JOIN runs r USING (run_id)"
        " WHERE i.model_id = ? AND r.status = 'completed' ORDER BY r.finished_at DESC LIMIT 1",
        [model_id],
    )
    return found[0] if found else None


def seen_releases(con, releases: Sequence[tuple[str, str]]) -> set[tuple[str, str]]:
    """The (model id, commit sha) pairs the warehouse knows: evaluated (models) or already triggered."""
    if not releases:
        return set()
    values = ", ".join("(?, ?)" for _ in releases)
    params = [x for pair in releases for x in pair]
    found = con.execute(
        f"WITH wanted(model_id, sha) AS (VALUES {values})"
        " SELECT w.model_id, w.sha FROM wanted w WHERE EXISTS (SELECT 1 FROM models m WHERE m.model_id = w.model_id"
        " AND m.sha = w.sha) OR EXISTS (SELECT 1 FROM release_triggers t WHERE t.model_id = w.model_id AND t.sha = w.sha)",
        params,
    ).fetchall()
    return {(m, s) for m, s in found}


def record_trigger(con, model_id: str, sha: str, source: str, flow_run_id: str | None) -> bool:
    """Remember that a release was triggered; False when it already was (nothing is written then)."""
    with transaction(con):
        return _insert_new(con, "release_triggers", {"model_id": model_id, "sha": sha},
                           {"source": source, "flow_run_id": flow_run_id, "triggered_at": now()})


# --- cost and endpoints ------------------------------------------------------------------------


def record_prices(con, run_id: str, prices: dict[str, float], catalog_hash: str | None = None) -> None:
    """The price table (US$ per device-hour by device kind) a run's costs are computed with."""
    with transaction(con):
        con.execute("DELETE FROM run_prices WHERE run_id = ?", [run_id])
        for device, usd in sorted(prices.items()):
            con.execute("INSERT INTO run_prices VALUES (?, ?, ?, ?, ?)", [run_id, device, float(usd), catalog_hash, now()])


def record_endpoint(con, run_id: str, variant_uid: str, engine: str, scenario: str, base_url: str, model: str,
                    identity: dict[str, Any]) -> None:
    """The server behind an endpoint run: its name and version where it exposes them, and what it said."""
    with transaction(con):
        _replace(con, "serving_endpoints", {"run_id": run_id, "variant_uid": variant_uid, "engine": engine,
                                            "scenario": scenario}, {
            "base_url": base_url, "model": model, "server": identity.get("server"),
            "server_version": identity.get("server_version"), "identity": _json(identity), "probed_at": now()})
