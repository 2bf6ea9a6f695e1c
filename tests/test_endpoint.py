"""The endpoint engine against a real OpenAI-compatible server: `transformers serve` (transformers 5.x,
FastAPI + uvicorn) on the tiny llama in ../shared/data, started on CPU in its own process group and
stopped by PID. Driven through the CLI (`quantgate bench-endpoint`) into a real warehouse.

Covered: the streaming client against a server that is not vLLM (text prompts, no vLLM-only fields,
usage on a closing choice chunk), per-request TTFT/TPOT/ITL rows, goodput and cost views, the server
identity recorded, and an API key taken from the environment that appears nowhere in the warehouse.
Not covered here: servers that need the key (transformers serve ignores the Authorization header),
vLLM/SGLang/Ollama's /version answers (unit-tested on their recorded shapes below)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from quantgate.catalog.scenarios import ServingScenario
from quantgate.tasks.adapters.endpoint import Target, _name_and_version, endpoint_prompts, scrub
from quantgate.tasks.adapters.speed.server import free_port, start_server
from quantgate.warehouse import reads, sessions

pytestmark = pytest.mark.skipif(importlib.util.find_spec("openai") is None,
                                reason="transformers serve needs the openai package (test extra)")

KEY = "sk-quantgate-test-5f2b9c1e0d7a"  # a made-up key; the check is that it lands nowhere


def _catalog(tmp_path) -> str:
    text = textwrap.dedent(
        """
        version: 1
        variants: {rtn: {method: rtn, scheme: W4A16, group_size: 32}}
        suites: {s: {tasks: [{name: qg_piqa}]}}
        scenarios:
          ep:
            kind: serving
            engines: [vllm]
            input_len: 16
            output_len: 8
            concurrency: [1, 2]
            rounds: 2
            request_rates: [4]
            num_prompts: 4
            warmup: 1
            slo: {ttft_ms: 5000, tpot_ms: 2000}
        models: [{id: m, source: {kind: local, path: /nonexistent}, variants: [rtn], suite: s}]
        policy: {version: 1, quality: [{task: qg_piqa, metric: acc, min_recovery: 0.9, higher_is_better: true}]}
        gpu_prices: {cpu: 0.25, NVIDIA H200: 3.5}
        """
    )
    path = tmp_path / "catalog.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def transformers_server(tmp_path_factory):
    from tests.shared_data import TINY_MODEL

    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(TINY_MODEL), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32"]
    server = start_server(str(TINY_MODEL), port=port, command=cmd, log_path=log, ready_timeout_s=180,
                          env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    with server:
        yield server, str(TINY_MODEL)
    assert not server.running


def test_cli_benchmarks_a_real_server_into_the_warehouse(transformers_server, tmp_path):
    server, model = transformers_server
    wh = tmp_path / "w.ducklake"
    from tests.shared_data import TINY_MODEL

    env = {**os.environ, "QG_TEST_API_KEY": KEY, "PREFECT_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, "-m", "quantgate.flows.cli", "bench-endpoint", server.base_url + "/v1", "--model", model,
         "--scenario", "ep", "--api-key-env", "QG_TEST_API_KEY", "--tokenizer", str(TINY_MODEL), "--device", "cpu",
         "--catalog", _catalog(tmp_path), "--warehouse", str(wh), "--timeout-s", "240"],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert KEY not in proc.stdout + proc.stderr

    with sessions.session(wh, read_only=True) as con:
        (speed,) = reads.rows(con, "SELECT * FROM speed_results")
        loads = {r["load"]: r for r in reads.rows(con, "SELECT * FROM serving_loads")}
        reqs = reads.rows(con, "SELECT * FROM serving_requests ORDER BY load, request_index")
        pct = {r["load"]: r for r in reads.rows(con, "SELECT * FROM latency_percentiles")}
        (ep,) = reads.rows(con, "SELECT * FROM serving_endpoints")
        cost = reads.rows(con, "SELECT * FROM variant_cost")
        prices = reads.rows(con, "SELECT device, usd_per_hour FROM run_prices ORDER BY device")
        tables = [n for (n,) in con.execute("SELECT table_name FROM information_schema.tables"
                                           " WHERE table_catalog = current_database()").fetchall()]
        dump = "".join(str(reads.rows(con, f'SELECT * FROM "{t}"')) for t in tables)
    assert speed["engine"] == "endpoint" and speed["status"] == "ok", speed["reason"]
    assert set(loads) == {"c=1", "c=2", "rate=4"}
    assert [loads[k]["num_prompts"] for k in ("c=1", "c=2", "rate=4")] == [2, 4, 4]
    assert len(reqs) == 10 and all(r["success"] for r in reqs), [r["error"] for r in reqs]
    for r in reqs:
        # Without vLLM's ignore_eos a request may end at EOS; the usage chunk's count is what is stored.
        assert 1 <= r["output_tokens"] <= 8 and r["prompt_tokens"] > 0
        assert r["ttft_ms"] > 0 and r["e2el_ms"] >= r["ttft_ms"]
        if r["output_tokens"] > 1:
            # A busy server may send the later tokens in the first token's chunk: then TPOT is 0, never less.
            assert r["tpot_ms"] >= 0 and len(r["itl_ms"]) >= 1 and all(g >= 0 for g in r["itl_ms"])
            # E2EL ends at the last token chunk: TTFT plus the gaps (the closing usage chunk adds none).
            assert r["e2el_ms"] == pytest.approx(r["ttft_ms"] + sum(r["itl_ms"]), rel=1e-6)
    assert pct["c=2"]["ttft_p50_ms"] > 0 and pct["c=2"]["itl_p50_ms"] is not None
    # The server's identity: uvicorn answers every request, and the stream names the model it served.
    assert ep["server"] == "uvicorn" and ep["base_url"] == server.base_url and ep["model"] == model
    assert speed["versions"] and '"server": "uvicorn"' in speed["versions"] and model in speed["versions"]
    assert '"/version"' in ep["identity"]  # asked, even though this server does not answer it
    # Cost: the CPU price of this run, at peak and at the SLO.
    assert prices == [{"device": "NVIDIA H200", "usd_per_hour": 3.5}, {"device": "cpu", "usd_per_hour": 0.25}]
    (c,) = cost
    assert c["price_key"] == "cpu" and c["usd_per_million_output_tokens"] == pytest.approx(
        0.25 / (speed["tokens_per_s"] * 3600) * 1e6)
    assert c["slo_load"] in loads and c["usd_per_million_output_tokens_at_slo"] > 0
    # The key was sent from the environment and is stored nowhere: only the variable's name is.
    assert KEY not in dump and KEY.encode() not in wh.read_bytes()
    assert "QG_TEST_API_KEY" in speed["config"]


def test_prompts_without_a_tokenizer_are_seeded_words():
    scenario = ServingScenario(engines=["vllm"], input_len=12, output_len=4, concurrency=[1],
                            shared_prefix_len=5, seed=3)
    target = Target(url="http://h:1", model="m")
    a, b = endpoint_prompts(target, scenario, 3), endpoint_prompts(target, scenario, 3)
    assert a == b and all(len(p.split()) == 12 for p in a)
    assert len({" ".join(p.split()[:5]) for p in a}) == 1 and len(set(a)) == 3


def test_base_url_drops_credentials_query_and_v1():
    t = Target(url="https://user:pw@api.example.com:8443/v1/?token=x", model="m")
    assert t.base_url == "https://api.example.com:8443"
    assert scrub({"a": ["xx-KEY-xx"], "KEY": 1}, "KEY") == {"a": ["xx-***-xx"], "***": 1}


@pytest.mark.parametrize("answers, headers, expected", [
    # vllm serve: /version and owned_by "vllm" on its model list.
    ({"/version": {"status": 200, "json": {"version": "0.26.0"}},
      "/v1/models": {"status": 200, "json": {"data": [{"id": "m", "owned_by": "vllm"}]}}}, {"server": "uvicorn"},
     ("vllm", "0.26.0")),
    # Ollama: /api/version.
    ({"/api/version": {"status": 200, "json": {"version": "0.5.7"}}, "/version": {"status": 404}}, {}, ("ollama", "0.5.7")),
    # TGI: /info.
    ({"/info": {"status": 200, "json": {"version": "3.0.1", "model_id": "m"}}}, {}, ("text-generation-inference", "3.0.1")),
    # Nothing answered: the server header names it.
    ({"/version": {"status": 404}, "/v1/models": {"status": 500}}, {"server": "uvicorn"}, ("uvicorn", None)),
])
def test_server_name_and_version_from_what_it_answers(answers, headers, expected):
    assert _name_and_version(answers, headers) == expected
