import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import duckdb
import pytest

from quantgate.catalog.records import (
    MetricResult, ModelArtifact, QualityReport, SampleResult, SpeedResult, VariantArtifact,
)
from quantgate.warehouse import lake, ledger, reads, sessions, transfer, writers


def _variant(uid, name, method="gptq", size=100, status="built", error=None, reused=False):
    return VariantArtifact(uid=uid, model_uid="m@abc", name=name, method=method, scheme="W4A16", bits=4, group_size=32,
                           path=f"/x/{uid}", recipe="r", recipe_hash="h", lib_versions={"llmcompressor": "0.14"},
                           size_bytes=size, build_seconds=1.0, peak_memory_bytes=1, status=status, error=error, reused=reused)


def _quality(key, ppl, acc):
    return QualityReport(eval_key=key, evaluator="lm-eval", config={}, seconds=1.0, metrics=[
        MetricResult("qg_simple_stories", "word_perplexity", "none", ppl, None, 10, "1", False),
        MetricResult("qg_piqa", "acc", "none", acc, 0.05, 100, "1", True),
    ], samples=[SampleResult("qg_piqa", i, "acc", float(i % 2), {"target": 0}) for i in range(4)])


def _speed(tps):
    return SpeedResult(engine="transformers", scenario="s", status="ok", reason=None, config={"x": 1}, tokens_per_s=tps)


def seed_run(con, run_id, variant_ppl=4.0, base_tps=100.0, variant_tps=150.0):
    ledger.start_run(con, run_id, "evaluate-model", "m", "c.yaml", "h", "host", {})
    writers.record_model(con, run_id, ModelArtifact("m", "/m", "local", None, "abc" * 10))
    base = _variant("base", "base", method="base", size=400)
    var = _variant("v1", "gptq-w4a16-g32")
    writers.record_variant(con, run_id, base, "base")
    writers.record_variant(con, run_id, var, "variant")
    writers.record_quality(con, run_id, "base", _quality("k", 3.0, 0.60))
    writers.record_quality(con, run_id, "v1", _quality("k", variant_ppl, 0.57))
    writers.record_speed(con, run_id, "base", [_speed(base_tps)])
    writers.record_speed(con, run_id, "v1", [_speed(variant_tps)])
    ledger.finish_run(con, run_id)


def test_migrations_apply_once_and_views_compute(tmp_path):
    path = tmp_path / "w.ducklake"
    with sessions.session(path) as con:
        seed_run(con, "r1")
        rec = {(r["task"], r["metric"]): r["recovery"] for r in reads.rows(con, "SELECT * FROM variant_recovery")}
        assert rec[("qg_simple_stories", "word_perplexity")] == pytest.approx(3.0 / 4.0)  # lower is better: inverted
        assert rec[("qg_piqa", "acc")] == pytest.approx(0.57 / 0.60)
        (speedup,) = con.execute("SELECT speedup FROM variant_speedup").fetchone()
        assert speedup == pytest.approx(1.5)
        assert con.execute("SELECT count(*) FROM quality_samples").fetchone()[0] == 8
    with sessions.session(path) as con:  # reopening applies nothing twice
        assert con.execute("SELECT count(*) FROM schema_migrations").fetchone()[0] == len(sessions.known_migrations())


def test_each_number_shows_the_protocol_it_was_asked_with(tmp_path):
    with sessions.session(tmp_path / "w.ducklake") as con:
        seed_run(con, "r1")  # evaluations stored without protocols: shown as NULL
        assert {r["protocol"] for r in reads.rows(con, "SELECT protocol FROM variant_recovery")} == {None}
        ledger.start_run(con, "r2", "evaluate-model", "m", "c.yaml", "h", "host", {})
        writers.record_variant(con, "r2", _variant("base", "base", method="base", size=400), "base")
        writers.record_variant(con, "r2", _variant("v1", "gptq-w4a16-g32"), "variant")
        protocols = {"protocols": {"qg_piqa": "5-shot, chat, multiturn", "qg_simple_stories": "0-shot"}}
        for uid, ppl in (("base", 3.0), ("v1", 4.0)):
            report = _quality("k2", ppl, 0.6)
            writers.record_quality(con, "r2", uid, QualityReport(**{**report.__dict__, "config": protocols}))
        shown = {r["task"]: r["protocol"] for r in reads.rows(con, "SELECT * FROM variant_recovery WHERE run_id = 'r2'")}
        assert shown == protocols["protocols"]


def test_views_are_recreated_only_when_their_sql_changes(tmp_path, monkeypatch):
    import shutil

    path = tmp_path / "w.ducklake"
    views = tmp_path / "views"
    shutil.copytree(sessions.VIEWS, views)
    monkeypatch.setattr(sessions, "VIEWS", views)
    held = lambda con: con.execute("SELECT checksum, applied_at FROM schema_views").fetchone()  # noqa: E731
    with sessions.session(path) as con:
        first = held(con)
    with sessions.session(path) as con:  # same SQL: nothing recreated
        assert held(con) == first
    (views / "99_extra.sql").write_text("CREATE OR REPLACE VIEW extra_view AS SELECT 42 AS answer;")
    sessions.close_all()  # a process checks the views at its first writable session
    with sessions.session(path) as con:  # changed SQL: recreated, the new view included
        assert held(con)[0] != first[0]
        assert con.execute("SELECT answer FROM extra_view").fetchone() == (42,)
    # A view file that fails leaves the views and their checksum as they were, and says why.
    (views / "99_extra.sql").write_text("CREATE OR REPLACE VIEW extra_view AS SELECT * FROM no_such_table;")
    sessions.close_all()
    with pytest.raises(Exception, match="no_such_table"), sessions.session(path):
        pass
    with sessions.session(path, read_only=True) as con:
        assert con.execute("SELECT answer FROM extra_view").fetchone() == (42,)


def test_rewriting_the_same_results_adds_no_rows(tmp_path):
    with sessions.session(tmp_path / "w.ducklake") as con:
        seed_run(con, "r1")
        before = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("variants", "quality_results", "quality_samples", "speed_results", "models")}
        seed_run(con, "r1")
        writers.record_variant(con, "r2", _variant("v1", "gptq-w4a16-g32", reused=True), "variant")
        after = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in before}
        assert before == after
        assert con.execute("SELECT reused FROM run_variants WHERE run_id = 'r2'").fetchone()[0] is True


def test_scorecard_shows_latest_run_only(tmp_path):
    from quantgate.catalog.records import Decision

    with sessions.session(tmp_path / "w.ducklake") as con:
        for run in ("r1", "r2"):
            seed_run(con, run)
            writers.record_decisions(con, run, [Decision("v1", "accept", f"accept: {run}", [], "ph", 0.9, 1.5, 0.25)], {"version": 1})
        rows = reads.rows(con, "SELECT * FROM variant_scorecard")
        assert [(r["run_id"], r["variant"], r["decision"], r["reason"]) for r in rows] == [("r2", "gptq-w4a16-g32", "accept", "accept: r2")]


def test_a_changed_migration_is_refused(tmp_path, monkeypatch):
    mig = tmp_path / "migrations"
    shutil.copytree(sessions.MIGRATIONS, mig)
    monkeypatch.setattr(sessions, "MIGRATIONS", mig)
    path = tmp_path / "w.ducklake"
    with sessions.session(path):
        pass
    sessions.close_all()
    first = sorted(mig.glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- edited\n")
    with pytest.raises(lake.WarehouseError, match="changed after it was applied"), sessions.session(path):
        pass


def test_the_gpu_suites_models_stored_before_migration_14_are_marked_random_weights(tmp_path, monkeypatch):
    mig = tmp_path / "migrations"
    shutil.copytree(sessions.MIGRATIONS, mig)
    (mig / "0014_gpu_suite_random_weights.sql").unlink()
    real = sessions.MIGRATIONS
    monkeypatch.setattr(sessions, "MIGRATIONS", mig)
    path = tmp_path / "w.ducklake"
    with sessions.session(path) as con:
        seed_run(con, "r1")  # a real model
        ledger.start_run(con, "g1", "gpu-suite", "tiny", "gpu.yaml", "h", "host", {})
        suite = ModelArtifact("tiny", "/g", "local", None, "d" * 40)  # as the suite stored it before: not marked
        writers.record_model(con, "g1", suite)
        writers.record_variant(con, "g1", replace(_variant(f"{suite.uid}:dummy-bf16", "bf16", method="base"),
                                                  model_uid=suite.uid, weights="dummy"), "base")
    sessions.close_all()
    monkeypatch.setattr(sessions, "MIGRATIONS", real)
    with sessions.session(path) as con:
        assert con.execute("SELECT model_id, random_weights FROM models ORDER BY 1").fetchall() == [
            ("m", False), ("tiny", True)]


def test_schema_newer_than_code_and_foreign_files(tmp_path):
    path = tmp_path / "w.ducklake"
    with sessions.session(path) as con:
        con.execute("INSERT INTO schema_migrations VALUES (999, '0999_future.sql', 'x', now())")
    sessions.close_all()
    with pytest.raises(lake.WarehouseError, match="schema version 999 is newer"), sessions.session(path):
        pass
    with pytest.raises(lake.WarehouseError, match="schema version 999 is newer"):
        sessions.connect(path)
    junk = tmp_path / "junk.ducklake"
    junk.write_text("this is not a database" * 100)
    with pytest.raises(lake.WarehouseError, match="not a quantgate warehouse"), sessions.session(junk):
        pass
    old = tmp_path / "quantgate.duckdb"  # a warehouse of before the lake: how to bring it over
    duckdb.connect(str(old)).close()
    with pytest.raises(lake.WarehouseError, match="quantgate warehouse import"):
        sessions.connect(old)


def test_a_reader_never_waits_and_a_second_writer_waits_then_gives_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "w.ducklake"
    with sessions.session(path) as con:
        seed_run(con, "r1")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from quantgate.warehouse import ledger, sessions, statements
        with sessions.session({str(path)!r}) as con, statements.transaction(con):
            ledger.start_run(con, "r2", "evaluate-model", "m", None, None, "host", {{}})
            print("holding", flush=True)
            time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with sessions.session(path, read_only=True) as con:  # the committed snapshot, at once
            assert [r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()] == ["r1"]
        monkeypatch.setenv(sessions.LOCK_WAIT_ENV, "1")
        with pytest.raises(lake.WarehouseError, match="another writer held the warehouse for more than 1s"), \
                sessions.session(path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with sessions.session(path) as con:  # free again once the other writer is gone; its open write left nothing
        assert [r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()] == ["r1"]


@pytest.mark.parametrize("raised, error", [(ValueError("bad\nsecond line"), "ValueError: bad"),
                                           (KeyboardInterrupt(), "interrupted (KeyboardInterrupt)")])
def test_run_outcome_records_a_failure_or_an_interrupt_and_reraises(tmp_path, raised, error):
    wh = tmp_path / "w.ducklake"
    with sessions.session(wh) as con:
        ledger.start_run(con, "r", "gpu-suite", "m", "c.yaml", "h", "host", {})
    with pytest.raises(type(raised)), ledger.run_outcome(wh, "r"):
        raise raised
    with sessions.session(wh, read_only=True) as con:
        (run,) = reads.rows(con, "SELECT status, error, finished_at FROM runs")
    assert run["status"] == "failed" and run["error"] == error and run["finished_at"] is not None


def test_run_outcome_marks_a_clean_end_completed(tmp_path):
    wh = tmp_path / "w.ducklake"
    with sessions.session(wh) as con:
        ledger.start_run(con, "r", "gpu-suite", "m", "c.yaml", "h", "host", {})
    with ledger.run_outcome(wh, "r"):
        pass
    with sessions.session(wh, read_only=True) as con:
        (run,) = reads.rows(con, "SELECT status, error FROM runs")
    assert run == {"status": "completed", "error": None}


def test_writing_sessions_of_one_process_take_turns(tmp_path):
    """Threads writing at once (the GPU suite's lanes record their steps): each session recreates the views,
    which two at once would conflict on; with turns every write lands."""
    import threading

    wh = tmp_path / "w.ducklake"
    with sessions.session(wh) as con:
        ledger.start_run(con, "r", "gpu-suite", "m", "c.yaml", "h", "host", {})
    errors = []

    def write(i: int) -> None:
        try:
            for j in range(5):
                with sessions.session(wh) as con:
                    writers.record_prices(con, f"r{i}-{j}", {"cpu": float(i)}, "h")
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with sessions.session(wh, read_only=True) as con:
        assert con.execute("SELECT count(*) FROM run_prices").fetchone()[0] == 20


def test_maintenance_moves_inlined_rows_to_parquet_and_keeps_every_answer(tmp_path):
    path = tmp_path / "w.ducklake"
    with sessions.session(path) as con:
        seed_run(con, "r1")
        before = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone() for t in transfer.table_names(con)}
        card = reads.rows(con, "SELECT * FROM variant_scorecard")
    steps = [step for step, _ in sessions.maintain(path, keep_days=0)]
    assert steps == ["ducklake_flush_inlined_data", "ducklake_merge_adjacent_files", "ducklake_expire_snapshots",
                     "ducklake_cleanup_old_files"]
    assert list((tmp_path / "w.ducklake.files" / "main" / "runs").glob("*.parquet"))  # out of the catalog
    with sessions.session(path, read_only=True) as con:
        assert {t: con.execute(f"SELECT count(*) FROM {t}").fetchone() for t in transfer.table_names(con)} == before
        assert reads.rows(con, "SELECT * FROM variant_scorecard") == card


def _gsm8k(key, strict, flexible):
    """A GSM8K-style evaluation: each item's answer under strict-match (None: no `#### N` line, lm-eval's
    '[invalid]') and flexible-extract, right (1) or wrong (0)."""
    def rows(filter_, scores, invalid):
        return [SampleResult("qg_gsm8k", i, "exact_match", float(x or 0),
                             {"target": "7", "response": "…", "filtered": "[invalid]" if bad else "7"}, filter_)
                for i, (x, bad) in enumerate(zip(scores, invalid))]

    mean = lambda xs: sum(x or 0 for x in xs) / len(xs)  # noqa: E731
    return QualityReport(eval_key=key, evaluator="lm-eval", config={}, seconds=1.0, metrics=[
        MetricResult("qg_gsm8k", "exact_match", "strict-match", mean(strict), 0.01, len(strict), "1", True),
        MetricResult("qg_gsm8k", "exact_match", "flexible-extract", mean(flexible), 0.01, len(flexible), "1", True),
    ], samples=rows("strict-match", strict, [x is None for x in strict])
      + rows("flexible-extract", flexible, [False] * len(flexible)))


def test_a_loss_of_format_is_told_apart_from_a_loss_of_skill(tmp_path):
    from quantgate.catalog.policy import Policy
    from quantgate.tasks.steps.decide import decide

    # 200 problems. The base writes `#### N` on 90% of them and is right on 60 by either filter; the variant
    # drops the format on half its answers but is right on 58 by its last number.
    base_strict = [1] * 60 + [0] * 120 + [None] * 20
    variant_strict = [1] * 30 + [0] * 70 + [None] * 100
    base_flexible = [1] * 60 + [0] * 140
    variant_flexible = [1] * 58 + [0] * 142
    with sessions.session(tmp_path / "w.ducklake") as con:
        ledger.start_run(con, "r1", "evaluate-model", "m", "c.yaml", "h", "host", {})
        writers.record_variant(con, "r1", _variant("base", "base", method="base", size=400), "base")
        writers.record_variant(con, "r1", _variant("v1", "gptq-w4a16-g32"), "variant")
        writers.record_quality(con, "r1", "base", _gsm8k("k", base_strict, base_flexible))
        writers.record_quality(con, "r1", "v1", _gsm8k("k", variant_strict, variant_flexible))
        shares = {(r["variant_uid"], r["filter"]): (r["extracted_share"], r["right_share"])
                  for r in reads.rows(con, "SELECT * FROM checkpoint_answer_format")}
        assert shares[("base", "strict-match")] == pytest.approx((0.9, 0.3))
        assert shares[("v1", "strict-match")] == pytest.approx((0.5, 0.15))
        assert shares[("v1", "flexible-extract")] == pytest.approx((1.0, 0.29))
        policy = Policy.model_validate({"version": 1, "max_size_ratio": 0.75, "quality": [
            {"task": "qg_gsm8k", "metric": "exact_match", "filter": "strict-match", "min_recovery": 0.95,
             "higher_is_better": True}]})
        evidence = reads.decision_evidence(con, "r1", [("qg_gsm8k", "exact_match")])
        flips = {r["filter"]: r["flip_rate"] for r in evidence.flips}
    assert set(flips) == {"strict-match", "flexible-extract"}  # flip rates per filter
    d = decide(evidence.variants[0], 400, policy=policy, **evidence.of("v1"))
    assert d.decision == "reject" and d.checks[0].outcome == "fail"
    assert ("mostly format: 50% of its answers in the strict-match format vs the base's 90%, recovery 0.9667 under"
            " flexible-extract") in d.reason
    assert d.checks[0].detail["format"]["other_recovery"] == pytest.approx(58 / 60)
