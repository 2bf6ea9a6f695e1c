"""The statements the warehouse's writes and reads are made of, on any DuckDB connection (the lake's, or a plain
database such as benchmarks/summarize.py loads committed results into): one transaction that nested uses join, a
row replaced or inserted once, JSON columns and the warehouse's clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import duckdb

from quantgate.warehouse.lake import WarehouseError


def now() -> datetime:
    """The warehouse's clock: UTC, naive, as every timestamp column stores it."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


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
def read_transaction(con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """One snapshot for a read-only session's statements, rolled back at its end (it wrote nothing)."""
    con.execute("BEGIN TRANSACTION")
    _open_transactions.add(id(con))
    try:
        yield
    finally:
        _open_transactions.discard(id(con))
        con.execute("ROLLBACK")


def replace(con, table: str, key: dict[str, Any], values: dict[str, Any]) -> None:
    """The row of `key` in `table` is now `key` + `values` (DuckLake has no keys to upsert on; the write lock
    makes the delete and insert one step)."""
    with transaction(con):
        delete(con, table, key)
        insert(con, table, {**key, **values})


def insert_new(con, table: str, key: dict[str, Any], values: dict[str, Any]) -> bool:
    """Insert the row unless its key is there; whether it was inserted."""
    if holds(con, table, key):
        return False
    insert(con, table, {**key, **values})
    return True


def holds(con, table: str, match: dict[str, Any]) -> bool:
    """Whether `table` has a row with these column values."""
    where = " AND ".join(f'"{c}" = ?' for c in match)
    return con.execute(f"SELECT 1 FROM {table} WHERE {where} LIMIT 1", list(match.values())).fetchone() is not None


def delete(con, table: str, match: dict[str, Any]) -> None:
    """Delete the rows with these column values, looking first: a DuckLake DELETE costs about three lookups, and
    most rows written are new (a run's own)."""
    if holds(con, table, match):
        where = " AND ".join(f'"{c}" = ?' for c in match)
        con.execute(f"DELETE FROM {table} WHERE {where}", list(match.values()))


def insert(con, table: str, row: dict[str, Any]) -> None:
    columns = ", ".join(f'"{c}"' for c in row)
    con.execute(f"INSERT INTO {table} ({columns}) VALUES ({', '.join('?' * len(row))})", list(row.values()))


def as_json(obj: Any) -> str | None:
    return None if obj is None else json.dumps(obj, sort_keys=True, default=str)
