"""Sessions on the warehouse (warehouse/lake.py finds, attaches and locks the lake): where it is, one attach per
process shared by its sessions, the write lock a writable session holds, and the schema the first one brings up to
date (versioned, checksummed migrations, then the views); init, connect and maintenance."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb

from quantgate.catalog.settings import Settings, settings
from quantgate.warehouse import lake
from quantgate.warehouse.lake import WarehouseError
from quantgate.warehouse.statements import now, read_transaction, replace, transaction

HERE = Path(__file__).resolve().parent
MIGRATIONS = HERE / "migrations"
VIEWS = HERE / "views"
ENV_VAR = "QUANTGATE_WAREHOUSE"
DATA_ENV_VAR = "QUANTGATE_WAREHOUSE_DATA"
DEFAULT_PATH: str = Settings.model_fields["warehouse"].default
# How long a writer waits for the write lock before giving up with a one-line error.
LOCK_WAIT_ENV = "QUANTGATE_LOCK_WAIT_S"


def default_path() -> str:
    return settings().warehouse


def address(location: str | Path | None = None) -> lake.Address:
    """The warehouse named by `location`, else by $QUANTGATE_WAREHOUSE, else ./quantgate.ducklake; the data path
    of a new one from $QUANTGATE_WAREHOUSE_DATA."""
    return lake.address(location or default_path(), settings().warehouse_data or None)


def read_migrations(folder: Path) -> list[tuple[int, str, str]]:
    """(version, file name, SQL) of each numbered migration in `folder`, in order."""
    return [(int(f.name.split("_", 1)[0]), f.name, f.read_text()) for f in sorted(folder.glob("*.sql"))]


def known_migrations() -> list[tuple[int, str, str]]:
    """This quantgate's migrations (warehouse/migrations/), in order: the schema version it knows is the last."""
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
            with read_transaction(con):
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
    known = max(v for v, _, _ in known_migrations())
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
    known = known_migrations()
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
        replace(con, "schema_views", {"id": 1}, {"checksum": checksum, "applied_at": now()})
