"""Where the warehouse lives and how a process reaches it: a DuckLake queried with DuckDB.

The warehouse is a DuckLake: its catalog (tables, snapshots, small inlined rows) in a SQLite file on one machine
or in PostgreSQL for a team, its data as Parquet files under a data path the writers share (a folder, or an
S3-compatible store). Readers never block writers: each query reads a snapshot, and a SQLite catalog is kept in
WAL mode, where readers and the one committing writer do not wait on each other.

Writers take turns through one write lock per warehouse, held from a writable session's first read to its
commit: a flock beside a SQLite catalog (one machine), a PostgreSQL advisory lock for a PostgreSQL catalog (any
number of hosts). DuckLake enforces no keys; with the lock, "replace the row of this key" and "insert unless the
key is there" are atomic, so every key is stored once, and DuckLake's commits never meet a conflicting one.

The extensions load from their registry wheels (duckdb-extension-ducklake, -sqlite-scanner, -postgres-scanner),
pinned to the DuckDB version they were built for; without the wheels, DuckDB's own INSTALL is tried.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import duckdb

from quantgate.catalog.errors import QuantgateError

ALIAS = "quantgate"
POSTGRES_PREFIX = "postgres:"
# DuckLake 1.5.5 reads a table's statistics from its catalog each time these optimizers ask, about a dozen times
# per table scan: the view stack's scorecard planned in 2.0 s with them, 0.55 s without (SQLite catalog; 1.4 s with
# PostgreSQL). The warehouse's tables are small enough that their join order needs no statistics.
COSTLY_OPTIMIZERS = "join_order,statistics_propagation"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_DUCKDB_MAGIC = b"DUCK"  # at byte 8 of a DuckDB database file


class WarehouseError(QuantgateError, RuntimeError):
    """A warehouse that cannot be opened, migrated or written; the message is one line."""


class NoWarehouse(WarehouseError):
    """A read of a warehouse that was never created: no catalog file, or a catalog database DuckLake never set up."""


# What DuckLake says when a read-only attach finds no lake in its catalog (an empty file, an empty PostgreSQL
# database), and when a lake would be created without a data path.
_NOT_CREATED = "creating a new DuckLake is explicitly disabled"
_NO_DATA_PATH = "data_path is not set"


@dataclass(frozen=True)
class Address:
    """A warehouse: its DuckLake catalog (`sqlite:PATH` or `postgres:CONNINFO`) and where its data files go."""

    catalog: str
    data_path: str

    @property
    def kind(self) -> str:
        return "postgres" if self.catalog.startswith(POSTGRES_PREFIX) else "sqlite"

    @property
    def sqlite_file(self) -> Path | None:
        return Path(self.catalog.removeprefix("sqlite:")) if self.kind == "sqlite" else None

    @property
    def label(self) -> str:
        """How messages name it: the catalog file, or the PostgreSQL database without its password."""
        if self.sqlite_file:
            return str(self.sqlite_file)
        fields = [f for f in self.catalog.removeprefix(POSTGRES_PREFIX).split() if not f.startswith("password=")]
        return POSTGRES_PREFIX + " ".join(fields)

    def attach_sql(self, read_only: bool) -> str:
        # A catalog keeps the data path it was created with. One given here is where this host sees the data
        # files: beside a copied or moved catalog file, or where this host mounts a team's shared folder.
        options = [f"DATA_PATH {sql_literal(self.data_path)}", "OVERRIDE_DATA_PATH true"] if self.data_path else []
        if read_only:
            options.append("READ_ONLY")
        attach = f"ATTACH {sql_literal('ducklake:' + self.catalog)} AS {ALIAS}"
        return f"{attach} ({', '.join(options)})" if options else attach


def address(location: str | Path, data_path: str | None = None) -> Address:
    """The warehouse at `location`: a file path (a SQLite catalog, data in `<path>.files/` unless `data_path`
    says otherwise) or `postgres:dbname=... host=...` (a PostgreSQL catalog; `data_path` names where the data
    files go when the warehouse is created, and later attaches read it from the catalog)."""
    text = str(location)
    if text.startswith(POSTGRES_PREFIX):
        return Address(text, data_path or "")
    path = Path(text).expanduser().absolute()
    data = data_path or f"{path}.files"
    return Address(f"sqlite:{path}", data.rstrip("/") + "/")


def sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def check_file(path: Path) -> None:
    """Refuses a file that is not a warehouse's catalog: a DuckDB warehouse of before the lake (with how to bring
    it over), or anything else."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(_SQLITE_MAGIC) or not head:
        return
    if head[8:12] == _DUCKDB_MAGIC:
        raise WarehouseError(f"{path}: a DuckDB-file warehouse of an earlier quantgate; bring it over with"
                             f" `quantgate warehouse import {path}`")
    raise WarehouseError(f"{path}: not a quantgate warehouse (neither a DuckLake catalog nor a DuckDB file)")


def extension_files(kind: str) -> list[str]:
    """What LOAD takes for a warehouse of this kind: the extension files shipped in the registry wheels, or
    the extension names for DuckDB to load from its own directory where no wheel is installed."""
    wanted = [("ducklake", "duckdb_extension_ducklake"),
              ("sqlite_scanner" if kind == "sqlite" else "postgres_scanner",
               "duckdb_extension_sqlite_scanner" if kind == "sqlite" else "duckdb_extension_postgres_scanner")]
    out = []
    for name, module in wanted:
        try:
            package = Path(importlib.import_module(module).__file__ or "").parent
        except ImportError:
            out.append(name)
            continue
        found = sorted(package.glob(f"extensions/v{duckdb.__version__}/{name}.duckdb_extension"))
        if not found:
            raise WarehouseError(f"{module} has no {name} extension for DuckDB {duckdb.__version__}"
                                 f" (pip install '{module.replace('_', '-')}=={duckdb.__version__}')")
        out.append(str(found[0]))
    return out


def load_sql(kind: str) -> list[str]:
    return [f"LOAD {sql_literal(f)}" if f.endswith(".duckdb_extension") else f"LOAD {f}" for f in extension_files(kind)]


def init_sql(where: Address, read_only: bool = True) -> str:
    """The statements that open the warehouse in any DuckDB of the pinned version (the `duckdb` CLI, a
    notebook): load the extensions, attach the lake, make it the default catalog."""
    return ";\n".join([*load_sql(where.kind), where.attach_sql(read_only), f"USE {ALIAS}"]) + ";\n"


def open_lake(where: Address, read_only: bool, config: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
    """A DuckDB database with the warehouse attached as `quantgate` and in use. A SQLite catalog that does not
    exist yet is created (writable only) in WAL mode."""
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False,
                                 **(config or {})})
    try:
        for statement in load_sql(where.kind):
            con.execute(statement)
        if where.sqlite_file:
            _prepare_sqlite(where, read_only)
        con.execute(where.attach_sql(read_only))
        con.execute(f"USE {ALIAS}")
    except duckdb.Error as e:
        con.close()
        if read_only and _NOT_CREATED in str(e):
            raise not_created(where) from None
        if _NO_DATA_PATH in str(e):
            raise WarehouseError(f"{where.label}: a new warehouse needs a folder for its data files every writer"
                                 " reaches: set QUANTGATE_WAREHOUSE_DATA (e.g. /shared/quantgate-lake/ or s3://...)"
                                 ) from None
        raise WarehouseError(f"{where.label}: cannot open warehouse ({str(e).splitlines()[0]})") from None
    return con


def not_created(where: Address) -> NoWarehouse:
    return NoWarehouse(f"no warehouse at {where.label}: create it with 'quantgate warehouse init'"
                       " (or 'quantgate deploy')")


def _prepare_sqlite(where: Address, read_only: bool) -> None:
    path = where.sqlite_file
    assert path is not None
    if path.exists():
        check_file(path)
    elif read_only:
        raise not_created(where)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    if not read_only:
        Path(where.data_path).mkdir(parents=True, exist_ok=True)
        # WAL: a reader's open snapshot never holds up a writer's commit (nor the other way round).
        with sqlite3.connect(path) as db:
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode=WAL")


class WriteLock(Protocol):
    def acquire(self, wait_s: float) -> bool: ...
    def release(self) -> None: ...


class FileLock:
    """flock on a file beside a SQLite catalog: writers on the machine take turns; released when the process
    ends, however it ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, wait_s: float) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.01)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class AdvisoryLock:
    """A PostgreSQL session-level advisory lock on the catalog's database: writers on every host take turns;
    PostgreSQL releases it when the holding connection ends, however the process ends."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.key = int.from_bytes(hashlib.sha256(b"quantgate-warehouse-writer").digest()[:8], "big", signed=True)
        self._db: Any = None

    def _connection(self) -> Any:
        import psycopg

        if self._db is None or self._db.closed or self._db.broken:
            try:
                self._db = psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10)
            except psycopg.Error as e:
                raise WarehouseError(f"cannot reach the warehouse's PostgreSQL ({str(e).splitlines()[0]})") from None
        return self._db

    def acquire(self, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            (got,) = self._connection().execute("SELECT pg_try_advisory_lock(%s)", [self.key]).fetchone()
            if got:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def release(self) -> None:
        self._connection().execute("SELECT pg_advisory_unlock(%s)", [self.key])


def write_lock(where: Address) -> WriteLock:
    if where.sqlite_file:
        return FileLock(where.sqlite_file.with_name(where.sqlite_file.name + ".writer.lock"))
    return AdvisoryLock(where.catalog.removeprefix(POSTGRES_PREFIX))


# DuckLake's own upkeep: inlined rows flushed to Parquet, small files merged, old snapshots expired and the files
# only they referenced deleted. Readers are unaffected: a snapshot still read is older than the expiry age.
MAINTENANCE = (
    f"CALL ducklake_flush_inlined_data({sql_literal(ALIAS)})",
    f"CALL ducklake_merge_adjacent_files({sql_literal(ALIAS)})",
    f"CALL ducklake_expire_snapshots({sql_literal(ALIAS)}, older_than => now() - INTERVAL '{{keep_days}} days')",
    f"CALL ducklake_cleanup_old_files({sql_literal(ALIAS)}, cleanup_all => true)",
)
