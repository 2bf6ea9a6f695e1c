"""Warehouses of before the lake (one DuckDB file, warehouse/legacy migrations) come over whole: `quantgate
warehouse import` brings every row, twice adds nothing, and the views answer as they did on the old file."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import duckdb
import pytest

from quantgate.warehouse import legacy, reads, sessions, transfer, writers
from tests.cli_runs import quantgate

# The committed run whose tables are kept (the other runs' are in git history: benchmarks/results/h200/README.md).
REFERENCE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200" / "reference12"


def legacy_warehouse(path: Path, tables: Path, upto: int = 11, views: bool = True) -> None:
    """A DuckDB-file warehouse as an earlier quantgate left it: the legacy migrations up to `upto`, the rows of
    a Parquet export (the columns that schema had), and today's views, as that quantgate created them."""
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name VARCHAR NOT NULL,"
                " checksum VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)")
    for version, name, sql in sessions.read_migrations(legacy.LEGACY):
        if version <= upto:
            con.execute(sql)
            con.execute("INSERT INTO schema_migrations VALUES (?, ?, 'x', now())", [version, name])
    for file in sorted(tables.glob("*.parquet")):
        name = file.stem
        if name.startswith("schema_") or not con.execute(
                "SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [name]).fetchone()[0]:
            continue
        ours = [c for (c,) in con.execute("SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [name]).fetchall()]
        theirs = [d[0] for d in con.execute("SELECT * FROM read_parquet(?) LIMIT 0", [str(file)]).description]
        both = ", ".join(f'"{c}"' for c in ours if c in theirs)
        con.execute(f"INSERT INTO {name} ({both}) SELECT {both} FROM read_parquet(?)", [str(file)])
    if views:
        # Today's views read models.random_weights (lake migration 0013, after the legacy schema) and the base's
        # provenance (0015): the old file gets the columns with the value every model of its time had (provenance not
        # recorded), so that the views can be created on it.
        con.execute("ALTER TABLE models ADD COLUMN IF NOT EXISTS random_weights BOOLEAN DEFAULT false")
        con.execute("ALTER TABLE models ADD COLUMN IF NOT EXISTS prequantized BOOLEAN")
        con.execute("ALTER TABLE models ADD COLUMN IF NOT EXISTS provenance VARCHAR")
        # ... and the engine-drift findings the regressions view reads (0016), empty in a file of its time.
        con.execute((sessions.MIGRATIONS / "0016_engine_drift.sql").read_text().split("INSERT INTO schema_keys")[0])
        for view in sorted(sessions.VIEWS.glob("*.sql")):
            con.execute(view.read_text())
    con.close()


def _rows(con, view: str) -> list[tuple]:
    def norm(v):
        return round(v, 9) if isinstance(v, float) and math.isfinite(v) else v
    return sorted((tuple(norm(v) for v in r) for r in con.execute(f"SELECT * FROM {view}").fetchall()), key=repr)


def _as_legacy_tables(tmp_path: Path) -> Path:
    """reference12's tables as a pre-lake quantgate could have written them: a copy whose speed and serving checks
    read `inconclusive` where this run wrote `uninformative` (an outcome legacy migration 0010's CHECK does not
    know); every other row and column as committed."""
    tables = tmp_path / "reference12-legacy"
    tables.mkdir()
    for file in REFERENCE.glob("*.parquet"):
        shutil.copyfile(file, tables / file.name)
    checks = tables / "decision_checks.parquet"
    duckdb.sql(f"COPY (SELECT * REPLACE (CASE outcome WHEN 'uninformative' THEN 'inconclusive' ELSE outcome END"
               f" AS outcome) FROM read_parquet('{REFERENCE / checks.name}')) TO '{checks}' (FORMAT parquet)")
    left = duckdb.sql(f"SELECT count(*) FILTER (outcome = 'uninformative'), count(*) FROM '{checks}'").fetchone()
    assert left == (0, 21)
    return tables


@pytest.mark.skipif(not (REFERENCE / "runs.parquet").exists(),
                    reason="the committed reference12 tables are not in this checkout")
def test_a_duckdb_warehouse_is_imported_whole_and_its_views_answer_the_same(tmp_path):
    old = tmp_path / "quantgate.duckdb"
    legacy_warehouse(old, _as_legacy_tables(tmp_path))
    lake = tmp_path / "w.ducklake"
    out = quantgate("warehouse", "import", str(old), "-w", str(lake))
    assert out.returncode == 0, out.stderr
    assert "variants" in out.stdout

    con_old = duckdb.connect(str(old), read_only=True)
    with sessions.session(lake, read_only=True) as con:
        for table in transfer.table_names(con):
            assert con.execute(f"SELECT count(*) FROM {table}").fetchone() == \
                con_old.execute(f"SELECT count(*) FROM {table}").fetchone(), table
        views = [v for (v,) in con_old.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
        assert {"variant_scorecard", "variant_recovery", "variant_speedup", "vllm_crosscheck"} <= set(views)
        for view in views:
            assert _rows(con, view) == _rows(con_old, view), view
    con_old.close()

    again = quantgate("warehouse", "import", str(old), "-w", str(lake))  # twice: nothing added
    assert again.returncode == 0, again.stderr
    with sessions.session(lake, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM speed_results").fetchone() == \
            duckdb.connect(str(old), read_only=True).execute("SELECT count(*) FROM speed_results").fetchone()


def test_an_older_duckdb_warehouse_is_migrated_on_the_way_and_its_decisions_stay_readable(tmp_path):
    """A warehouse as legacy migration 0008 left it: decisions with their checks as JSON, no decision_checks."""
    from quantgate.catalog.records import Decision, DecisionCheck
    from tests.test_warehouse import seed_run

    seeded = tmp_path / "seed.ducklake"
    with sessions.session(seeded) as con:
        seed_run(con, "r1")
        transfer.export_parquet(con, tmp_path / "pq")
    old = tmp_path / "old.duckdb"
    legacy_warehouse(old, tmp_path / "pq", upto=8, views=False)
    with duckdb.connect(str(old)) as con:
        con.execute("INSERT INTO decisions VALUES ('r1', 'v1', 'reject', 'reject: qg_piqa/acc recovery 0.95 < 0.99',"
                    " ?, 0.95, 1.5, 0.25, 'ph', '{\"version\": 1}', now(), 0.9, 0.02)",
                    ['[{"check": "serving gpu-serving", "passed": false, "value": 0.5, "point": "default"}]'])

    lake = tmp_path / "w.ducklake"
    with sessions.session(lake) as con:
        added = legacy.import_duckdb(con, old)
        assert added["decisions"] == 1 and added["runs"] == 1
        (kept,) = reads.rows(con, "SELECT * FROM decisions")
        assert (kept["decision"], kept["reason"], kept["quality_lower_bound"], kept["flip_rate"]) == (
            "reject", "reject: qg_piqa/acc recovery 0.95 < 0.99", 0.9, 0.02)
        assert '"passed": false' in kept["checks"]  # the old JSON stays as it was
        (card,) = reads.rows(con, "SELECT * FROM variant_scorecard")
        assert (card["decision"], card["reason"], card["size_ratio"]) == ("reject", kept["reason"], 0.25)
        assert card["deciding_check"] is None and card["serving_goodput_ratio"] is None  # no check rows for it

        seed_run(con, "r2")
        check = DecisionCheck("quality", "qg_piqa/acc", "inconclusive", "qg_piqa/acc spans 0.95", task="qg_piqa",
                              metric="acc", value=0.96, lower=0.93, upper=0.99, threshold=0.95, items=100,
                              items_to_decide=440, min_detectable_drop=0.03)
        writers.record_decisions(con, "r2", [Decision("v1", "inconclusive", "inconclusive: qg_piqa/acc spans 0.95",
                                                     [check], "ph", 0.96, None, 0.25, 0.93)], {"version": 1})
        (card,) = reads.rows(con, "SELECT * FROM variant_scorecard")
        assert (card["run_id"], card["decision"], card["deciding_check"], card["deciding_value"],
                card["deciding_threshold"], card["items_to_decide"], card["min_detectable_drop"]) == (
            "r2", "inconclusive", "qg_piqa/acc", 0.96, 0.95, 440, 0.03)


def test_importing_what_is_not_a_duckdb_warehouse_is_one_line(tmp_path):
    junk = tmp_path / "junk.duckdb"
    junk.write_text("not a database")
    out = quantgate("warehouse", "import", str(junk), "-w", str(tmp_path / "w.ducklake"))
    assert out.returncode == 1 and out.stderr.strip() == f"error: {junk}: not a DuckDB database"
