"""Secrets and safe defaults: the hub token is used but appears nowhere (logs, warehouse, artifacts, Prefect's
database); it may come from a Prefect Secret block; remote code stays off; vLLM's server binds to loopback.

The token run is real end to end: `quantgate run` in a subprocess downloads the tiny model from a local
HTTP server that speaks the hub's protocol (and records the Authorization header), quantizes, evaluates
and decides with a real Prefect server, whose database is searched afterwards too.
"""

from __future__ import annotations

import inspect
import json
import os
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from quantgate.tasks.steps.download import TOKEN_SECRET_ENV, DownloadError
from quantgate.warehouse import sessions
from tests.cli_runs import run_cli, tables
from tests.test_download import FakeHub, fetch_hub, hub, model_copy, online  # noqa: F401 - fixtures

TOKEN = "hf_quantgateTestToken0123456789abcdef"
# Another value for the Secret block, which Prefect's database holds by design.
BLOCK_TOKEN = "hf_quantgateBlockToken9876543210fedcba"


def files_containing(root: Path, needle: bytes) -> list[str]:
    found = []
    for path in Path(root).rglob("*"):
        if path.is_file() and not path.is_symlink() and needle in path.read_bytes():
            found.append(str(path))
    return found


@pytest.mark.slow
def test_a_token_from_the_environment_is_used_and_appears_nowhere(model_copy, tmp_path, prefect_api):  # noqa: F811
    server = FakeHub(repo_dir=model_copy)
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(textwrap.dedent("""
        version: 1
        variants: {rtn-w8a16: {method: rtn, scheme: W8A16, group_size: null}}
        suites: {stories: {tasks: [{name: qg_simple_stories, limit: 1}]}}
        models:
          - {id: hub-tiny, source: {kind: hub, repo_id: org/tiny, revision: main}, variants: [rtn-w8a16], suite: stories}
        policy:
          version: 1
          quality: [{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.95, higher_is_better: false}]
    """))
    wh, work, hf = tmp_path / "w.ducklake", tmp_path / "work", tmp_path / "hf"
    env = {"HF_TOKEN": TOKEN, "HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
           "HF_HOME": str(hf), "PREFECT_LOGGING_LEVEL": "DEBUG"}
    try:
        result = run_cli(["run", "hub-tiny", "-c", str(catalog), "-w", str(wh), "--workdir", str(work)], prefect_api, env)
    finally:
        server.close()
    assert result.returncode == 0, result.stderr[-3000:]
    # The token was used: every request to the hub carried it.
    assert server.auth and set(server.auth) == {f"Bearer {TOKEN}"}
    # ... and is nowhere: not in what the run printed,
    assert TOKEN not in result.stdout + result.stderr
    # not in the warehouse (any table, or the file's bytes),
    contents = tables(wh)
    assert contents["runs"][0][5] == "completed"
    assert TOKEN not in json.dumps(contents)
    assert files_containing(tmp_path, TOKEN.encode()) == []  # warehouse, checkpoints, hub cache, catalog dir
    # not in Prefect's database (flow-run parameters, logs, artifacts).
    prefect_home = Path(os.environ["PREFECT_HOME"])
    assert list(prefect_home.glob("prefect.db*")), "the Prefect server's database was not where expected"
    assert files_containing(prefect_home, TOKEN.encode()) == []
    with sessions.session(wh, read_only=True) as con:
        configs = [json.loads(c) for (c,) in con.execute("SELECT config FROM quality_evals").fetchall()]
    # Remote code stays off: the catalog entry does not turn it on (the lm-eval runs of base and variant).
    suites = [c for c in configs if "trust_remote_code" in c]
    assert len(suites) == 2 and all(c["trust_remote_code"] is False for c in suites)


def test_a_token_from_a_prefect_secret_block(hub: Callable[..., FakeHub], model_copy, tmp_path,  # noqa: F811
                                            monkeypatch, caplog, prefect_api):
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv(TOKEN_SECRET_ENV, "quantgate-hf-token")
    server = hub(repo_dir=model_copy)
    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        Secret(value=BLOCK_TOKEN).save("quantgate-hf-token", overwrite=True)
        with caplog.at_level("DEBUG"):
            art = fetch_hub(tmp_path)
        assert Path(art.path, "model.safetensors").is_file()
        assert set(server.auth) == {f"Bearer {BLOCK_TOKEN}"}
        assert BLOCK_TOKEN not in caplog.text
        monkeypatch.setenv(TOKEN_SECRET_ENV, "no-such-block")
        with pytest.raises(DownloadError) as e:
            fetch_hub(tmp_path / "again")
    assert str(e.value).startswith(f"{TOKEN_SECRET_ENV}='no-such-block': cannot load that Prefect Secret block")
    assert "\n" not in str(e.value)


def test_remote_code_is_off_unless_the_catalog_turns_it_on():
    from quantgate.catalog.models import ModelSpec
    from quantgate.tasks.adapters.engines import EngineOptions
    from quantgate.tasks.steps.evaluate import evaluate_variant

    assert ModelSpec.model_fields["trust_remote_code"].default is False
    assert EngineOptions.__dataclass_fields__["trust_remote_code"].default is False
    assert inspect.signature(evaluate_variant).parameters["trust_remote_code"].default is False


def test_the_vllm_server_binds_to_loopback_unless_told_otherwise():
    from quantgate.tasks.adapters.speed.server import start_server
    from quantgate.tasks.adapters.speed.vllm_cli import vllm_serve_command

    host = inspect.signature(start_server).parameters["host"].default
    assert host == "127.0.0.1"
    command = vllm_serve_command("/m", host=host, port=8000, served_model_name="model")
    assert command[command.index("--host") + 1] == "127.0.0.1"
