"""Warehouses of before the lake: one DuckDB file each, migrated by warehouse/legacy/*.sql. `import_duckdb` brings
one over: a copy of it is brought to the last of those migrations, then every row whose key the lake does not
hold yet is inserted, all in one transaction, so an import run twice (or cut short) adds nothing twice."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import duckdb

from quantgate.warehouse.lake import WarehouseError

LEGACY = Path(__file__).resolve().parent / "legacy"
_ALIAS = "legacy_warehouse"


def migrate_file(path: Path) -> None:
    """Bring a DuckDB-file warehouse to the last legacy migration."""
    from quantgate.warehouse import sessions

    con = duckdb.connect(str(path))
    try:
        try:
            applied = {v for (v,) in con.execute("SELECT version FROM schema_migrations").fetchall()}
        except duckdb.CatalogException:
            raise WarehouseError(f"{path}: not a quantgate warehouse (no schema_migrations table)") from None
        known = sessions.read_migrations(LEGACY)
        if applied and max(applied) > known[-1][0]:
            raise WarehouseError(f"{path}: schema version {max(applied)} is not one of a DuckDB-file warehouse")
        for version, name, sql in known:
            if version in applied:
                continue
            con.execute("BEGIN TRANSACTION")
            con.execute(sql)
            con.execute("INSERT INTO schema_migrations VALUES (?, ?, 'imported', now())", [version, name])
            con.execute("COMMIT")
    finally:
        con.close()


def import_duckdb(con: duckdb.DuckDBPyConnection, old: str | Path) -> dict[str, int]:
    """Copy every row of a DuckDB-file warehouse that the lake lacks (by the keys in schema_keys); {table: rows
    added}. `con` is a writable session of the lake (it holds the write lock)."""
    from quantgate.warehouse import statements, transfer

    old = Path(old)
    if not old.is_file():
        raise WarehouseError(f"{old}: no such file")
    with open(old, "rb") as f:
        if f.read(12)[8:12] != b"DUCK":
            raise WarehouseError(f"{old}: not a DuckDB database")
    with tempfile.TemporaryDirectory(prefix="quantgate-import-") as tmp:
        copy = Path(tmp) / "old.duckdb"
        shutil.copyfile(old, copy)  # the original is only read: its own quantgate may still use it
        try:
            migrate_file(copy)
        except duckdb.Error as e:
            raise WarehouseError(f"{old}: cannot bring it to the last DuckDB-file schema ({str(e).splitlines()[0]})") from None
        old_con = duckdb.connect(str(copy), read_only=True)
        try:
            keys = dict(con.execute("SELECT table_name, key_columns FROM schema_keys").fetchall())
            theirs = {t for (t,) in old_con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
            added = {}
            with statements.transaction(con):
                for table in transfer.table_names(con):
                    if table not in theirs:
                        continue
                    rows = old_con.execute(f'SELECT * FROM "{table}"').to_arrow_table()
                    listed = ", ".join(f'"{c}"' for c in rows.column_names)
                    selected = ", ".join(f'o."{c}"' for c in rows.column_names)
                    match = " AND ".join(f'l."{k}" IS NOT DISTINCT FROM o."{k}"' for k in keys[table])
                    con.register(_ALIAS, rows)
                    try:
                        (n,) = con.execute(
                            f"INSERT INTO {table} ({listed}) SELECT {selected} FROM {_ALIAS} o"
                            f" WHERE NOT EXISTS (SELECT 1 FROM {table} l WHERE {match})").fetchone()
                    finally:
                        con.unregister(_ALIAS)
                    added[table] = n
        finally:
            old_con.close()
    return added
