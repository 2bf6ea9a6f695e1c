"""Every bad input gets one line (no traceback unless --debug) and leaves the warehouse as it was.

A table of bad inputs, each run through the real `quantgate` entry point (in this process, so the corpus
costs seconds; Prefect's real ephemeral API, real DuckDB). Where a run exists, the only change to the
warehouse is that run's row (and its attempt): status failed, error = the same line. Every other table's
checksum is unchanged; a file that is not a warehouse is not even rewritten.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quantgate.flows import cli
from quantgate.warehouse import sessions
from tests.cli_runs import checksums, copy_warehouse, error_lines, run_cli, tables
from tests.shared_data import SHARED, TINY_MODEL
from tests.test_download import FakeHub, online, use_endpoint  # noqa: F401 - `online` is a fixture
from tests.test_warehouse import seed_run

STORIES = SHARED / "eval" / "simple_stories" / "simple_stories.txt"

CATALOG = """
version: 1
variants:
  rtn-w8a16: {{method: {method}, scheme: {scheme}, group_size: null}}
suites:
  stories: {{tasks: [{{name: qg_simple_stories, limit: 1}}]}}
models:
  - id: tiny
    source: {{kind: local, path: {path}}}
    variants: [rtn-w8a16]
    suite: stories
    calibration: {calibration}
policy:
  version: 1
  quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.95, higher_is_better: false}}]
"""


def write_catalog(tmp: Path, name: str = "catalog.yaml", method: str = "rtn", scheme: str = "W8A16",
                  path: Path = TINY_MODEL, calibration: str = "{samples: 4, seq_len: 32}") -> Path:
    p = tmp / name
    p.write_text(CATALOG.format(method=method, scheme=scheme, path=path, calibration=calibration))
    return p


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> Path:
    """A warehouse with a finished run in it: what bad input must leave alone."""
    path = tmp_path_factory.mktemp("seed") / "w.ducklake"
    with sessions.session(path) as con:
        seed_run(con, "r1")
    return path


def quantgate(capfd, *args: str) -> tuple[int, str, str]:
    """`quantgate ARGS` through its real entry point: exit code, stdout, stderr."""
    argv = sys.argv
    sys.argv = ["quantgate", *args]
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main()
    finally:
        sys.argv = argv
    out, err = capfd.readouterr()
    return exit_.value.code, out, err


def assert_one_line(code: int, out: str, err: str, expected: str) -> str:
    assert code == 1, (out, err)
    assert "Traceback" not in out + err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    return lines[0].removeprefix("error: ")


def not_a_model(tmp: Path) -> Path:
    folder = tmp / "notes"
    folder.mkdir()
    (folder / "README.md").write_text("not a model\n")
    return folder


def encoder_only(tmp: Path) -> Path:
    folder = tmp / "encoder"
    shutil.copytree(TINY_MODEL, folder)
    folder.chmod(0o755)
    config = folder / "config.json"
    config.chmod(0o644)
    config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": ["BertModel"], "model_type": "bert"}))
    return folder


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# id, arguments (from tmp and the catalog), expected text, whether a (failed) run is recorded
CASES = [
    ("malformed catalog", lambda tmp, cat: ["-c", str(_write(tmp, "bad.yaml", "models: [\n  - id: x\n")), "tiny"],
     "bad.yaml: line", False),
    ("unknown method", lambda tmp, cat: ["-c", str(write_catalog(tmp, "m.yaml", method="hqq")), "tiny"],
     "variants.rtn-w8a16.method: Input should be 'awq', 'gptq', 'rtn', 'fp8' or 'bnb'", False),
    ("unknown scheme", lambda tmp, cat: ["-c", str(write_catalog(tmp, "s.yaml", scheme="W3A16")), "tiny"],
     "variants.rtn-w8a16.scheme: Input should be 'W4A16'", False),
    ("unknown variant or method", lambda tmp, cat: ["-c", str(cat), "tiny", "--variants", "hqq"],
     "unknown variant or method 'hqq'", False),
    ("non-existent path", lambda tmp, cat: ["-c", str(cat), str(tmp / "no-such-model")],
     "not a catalog id (['tiny']), an existing folder, or a hub id", False),
    ("catalog path that does not exist",
     lambda tmp, cat: ["-c", str(write_catalog(tmp, "gone.yaml", path=tmp / "gone")), "tiny"],
     "tiny: local model folder", True),
    ("folder that is not a model", lambda tmp, cat: ["-c", str(cat), str(not_a_model(tmp))],
     "is not a model folder (no config.json)", True),
    ("unsupported architecture", lambda tmp, cat: ["-c", str(cat), str(encoder_only(tmp))],
     "architecture BertModel is not supported", True),
    ("unknown template", lambda tmp, cat: ["-c", str(cat), "shape:qwen2.5-7b-instruct", "--template", "nope"],
     "unknown model 'nope': the catalog has ['tiny']", False),
    ("tokenizer for a model that has one", lambda tmp, cat: ["-c", str(cat), "tiny", "--tokenizer", str(TINY_MODEL)],
     "a tokenizer folder is for a model's shape (shape:NAME), not for 'tiny'", False),
    ("calibration on the evaluated text",
     lambda tmp, cat: ["-c", str(write_catalog(tmp, "calib.yaml", method="gptq", scheme="W4A16",
                                               calibration=f"{{path: {STORIES}, samples: 2, seq_len: 64}}")), "tiny"],
     f"calibration set text {STORIES.resolve()} overlaps", True),  # the product names the file it read
]


def _write(tmp: Path, name: str, text: str) -> Path:
    (tmp / name).write_text(text)
    return tmp / name


@pytest.mark.parametrize(("args", "expected", "makes_run"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing_else(args, expected, makes_run, seeded, tmp_path, capfd):
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    before = tables(wh)
    code, out, err = quantgate(capfd, "run", *args(tmp_path, write_catalog(tmp_path)), "-w", str(wh))
    message = assert_one_line(code, out, err, expected)
    after = tables(wh)
    unchanged_but_the_failed_run(before, after, message if makes_run else None)


def unchanged_but_the_failed_run(before: dict, after: dict, message: str | None) -> None:
    new_runs = sorted(set(after["runs"]) - set(before["runs"]))
    if message is None:
        assert checksums(after) == checksums(before)
        return
    assert len(new_runs) == 1 and set(before["runs"]) <= set(after["runs"])
    run = new_runs[0]
    assert run[5] == "failed" and run[6] == message  # status, error: the line the user saw
    attempts = sorted(set(after["run_attempts"]) - set(before.get("run_attempts", [])))
    assert len(attempts) == 1 and attempts[0][6] == "failed" and attempts[0][7] == message
    rest = lambda t: {k: v for k, v in t.items() if k not in ("runs", "run_attempts")}  # noqa: E731
    assert checksums(rest(after)) == checksums(rest(before))


@pytest.mark.parametrize(
    ("hub_status", "expected"),
    [(404, "org/tiny@main: repository not found on the hub"),
     (None, "org/tiny@main: not in the local cache and the hub is unreachable (ConnectError")],
    ids=["unknown hub id", "unreachable hub"],
)
def test_unknown_or_unreachable_hub_id(hub_status, expected, online, seeded, tmp_path, capfd, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    server = FakeHub(hub_status, "RepoNotFound") if hub_status else None
    use_endpoint(online, server.url if server else f"http://127.0.0.1:{closed_port()}")
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    before = tables(wh)
    try:
        code, out, err = quantgate(capfd, "run", "-c", str(write_catalog(tmp_path)), "org/tiny", "-w", str(wh))
    finally:
        if server:
            server.close()
    message = assert_one_line(code, out, err, expected)
    unchanged_but_the_failed_run(before, tables(wh), message)


def test_a_file_that_is_not_a_warehouse_is_named_and_left_alone(tmp_path, capfd):
    junk = tmp_path / "notes.ducklake"
    junk.write_text("meeting notes, not a database\n" * 200)
    digest = hashlib.sha256(junk.read_bytes()).hexdigest()
    for args in (["run", "-c", str(write_catalog(tmp_path)), "tiny"], ["sql", "select 1"], ["report"]):
        code, out, err = quantgate(capfd, *args, "-w", str(junk))
        assert_one_line(code, out, err, f"{junk}: not a quantgate warehouse")
    assert hashlib.sha256(junk.read_bytes()).hexdigest() == digest


def test_a_schema_newer_than_the_code_is_refused_and_left_alone(seeded, tmp_path, capfd):
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    with sessions.session(wh) as con:
        con.execute("INSERT INTO schema_migrations VALUES (999, '0999_future.sql', 'x', now())")
    sessions.close_all()
    before = tables(wh)
    for args in (["run", "-c", str(write_catalog(tmp_path)), "tiny"], ["sql", "select 1"]):
        code, out, err = quantgate(capfd, *args, "-w", str(wh))
        assert_one_line(code, out, err, "schema version 999 is newer than this quantgate knows")
    assert checksums(tables(wh)) == checksums(before)


def test_debug_shows_the_traceback(tmp_path, capfd):
    code, out, err = quantgate(capfd, "--debug", "run", "-c", str(write_catalog(tmp_path, method="hqq")), "tiny")
    assert code == 1 and "Traceback" in err and len(error_lines(err)) == 1


def test_sql_can_neither_write_the_warehouse_nor_touch_files(seeded, tmp_path, capfd):
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    before = checksums(tables(wh))
    target = tmp_path / "leak.csv"
    for query, expected in [("delete from runs", "queries only (SELECT, EXPLAIN), not DELETE"),
                            (f"copy (select * from runs) to '{target}'", "queries only (SELECT, EXPLAIN), not COPY"),
                            ("select * from read_csv('/etc/hostname')", "file system operations are disabled"),
                            (f"attach '{tmp_path / 'other.ducklake'}' as o", "not ATTACH")]:
        code, out, err = quantgate(capfd, "sql", query, "-w", str(wh))
        assert code != 0 and "Traceback" not in out + err
        assert expected in err.lower() if expected == "read-only" else expected in err, err
    assert not target.exists() and not (tmp_path / "other.ducklake").exists()
    assert checksums(tables(wh)) == before


def test_a_warehouse_held_by_another_writer(seeded, tmp_path):
    """Two processes: one holds the warehouse's write lock mid-transaction; `quantgate run` waits
    QUANTGATE_LOCK_WAIT_S and gives up in one line; `quantgate sql` answers at once, from the last commit."""
    wh = tmp_path / "w.ducklake"
    copy_warehouse(seeded, wh)
    before = checksums(tables(wh))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from quantgate.warehouse import sessions, statements
        with sessions.session({str(wh)!r}) as con, statements.transaction(con):
            con.execute("UPDATE runs SET error = 'being written' WHERE run_id = 'r1'")
            print("locked", flush=True)
            sys.stdin.readline()  # until told to let go
            con.execute("UPDATE runs SET error = NULL WHERE run_id = 'r1'")
        print("released", flush=True)
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = run_cli(["run", "-c", str(write_catalog(tmp_path)), "tiny", "-w", str(wh)],
                          env={"QUANTGATE_LOCK_WAIT_S": "1"}, timeout=120)
        assert refused.returncode == 1 and "Traceback" not in refused.stdout + refused.stderr
        assert error_lines(refused.stderr) == [f"error: {wh}: another writer held the warehouse for more than 1s"]
        read = run_cli(["sql", "select count(*) as n, count(error) as errors from runs", "-w", str(wh), "-f", "csv"],
                       timeout=120)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
    finally:
        holder.kill()
        holder.wait()
    assert read.returncode == 0, read.stderr
    assert read.stdout == "n,errors\n1,0\n"
    assert checksums(tables(wh)) == before
