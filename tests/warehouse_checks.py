"""Checks on a whole warehouse that several tests make."""

from __future__ import annotations


def duplicated_keys(con) -> dict[str, int]:
    """{table: rows beyond the first of their key}, for every table of schema_keys; empty when each key is once."""
    extra = {}
    for table, key in con.execute("SELECT table_name, key_columns FROM schema_keys ORDER BY 1").fetchall():
        columns = ", ".join(f'"{c}"' for c in key)
        (n,) = con.execute(f"SELECT count(*) - count(DISTINCT ({columns})) FROM {table}").fetchone()
        if n:
            extra[table] = n
    return extra
