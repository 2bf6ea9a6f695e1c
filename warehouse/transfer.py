"""The warehouse's tables out to files and back: every table (and view) as Parquet or CSV, and a Parquet export
loaded into a migrated, empty warehouse (the form results are committed in: benchmarks/summarize.py)."""

from __future__ import annotations

from pathlib import Path

import duckdb

from quantgate.warehouse.lake import WarehouseError
from quantgate.warehouse.sessions import known_migrations
from quantgate.warehouse.statements import transaction


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
    known = max(v for v, _, _ in known_migrations())
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
