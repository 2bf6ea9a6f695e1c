"""A serving scenario's loads against a stand-in OpenAI streaming server in its own process (started and
stopped by PID like `vllm serve`), through to the warehouse's per-request rows and views."""

from __future__ import annotations

import math
import sys
import textwrap
import time

import pytest

from quantgate.catalog.records import Slo
from quantgate.catalog.scenarios import ServingScenario
from quantgate.tasks.adapters.speed.server import free_port, start_server
from quantgate.tasks.adapters.speed.serving import drive_loads
from quantgate.tasks.runtime.telemetry import Telemetry
from quantgate.warehouse import reads, sessions, writers

# Streams max_tokens chunks of one token: 20 ms to the first, 5 ms between the rest.
_SERVER = textwrap.dedent(
    """
    import asyncio, json, sys
    from aiohttp import web

    async def health(request):
        return web.Response(text="ok")

    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.02)
        n = body["max_tokens"]
        for i in range(n):
            choice = {"index": 0, "text": " t", "finish_reason": "length" if i == n - 1 else None}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\\n\\n".encode())
            await asyncio.sleep(0.005)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\n".encode())
        await resp.write(b"data: [DONE]\\n\\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
    """
)


def test_loads_run_in_order_and_land_in_the_views(tmp_path):
    scenario = ServingScenario(engines=["vllm"], device="cpu", input_len=8, output_len=4,
                            concurrency=[1, 4], rounds=2, request_rates=[50], num_prompts=6, warmup=1,
                            slo={"ttft_ms": 1000, "tpot_ms": 1000})
    sizes = scenario.load_sizes()
    prompts = [[i] * 8 for i in range(max(n for *_, n in sizes))]
    port = free_port()

    with Telemetry("cpu") as telemetry:
        server = start_server("unused", port=port, command=[sys.executable, "-c", _SERVER, str(port)],
                              log_path=tmp_path / "serve.log", ready_timeout_s=60)
        server.model = "fake"  # a served model name, as start_server sets for `vllm serve`
        with server:
            loads = drive_loads(server, scenario, sizes, prompts, telemetry, deadline=time.monotonic() + 120)
    assert not server.running

    assert [(ld.label, ld.max_concurrency, ld.request_rate, len(ld.records)) for ld in loads] == [
        ("c=1", 1, None, 2), ("c=4", 4, None, 8), ("rate=50", None, 50.0, 6)]
    assert all(r.success and r.output_tokens == 4 and r.ttft_s >= 0.02 for ld in loads for r in ld.records)
    # Poisson arrivals spread over about num_prompts / rate seconds, the last one exactly there.
    assert loads[2].records[-1].arrival_offset_s == pytest.approx(6 / 50)
    assert all(ld.energy_j is None for ld in loads)  # no energy counter on a CPU

    with sessions.session(tmp_path / "w.ducklake") as con:
        writers.record_serving(con, "r", "v", "vllm", "serving", loads, Slo(**scenario.slo.model_dump()))
        pct = {r["load"]: r for r in reads.rows(con, "SELECT * FROM latency_percentiles")}
        good = {r["load"]: r for r in reads.rows(con, "SELECT * FROM serving_goodput")}
    assert set(pct) == {"c=1", "c=4", "rate=50"}
    assert pct["c=4"]["completed"] == 8 and pct["c=4"]["ttft_p50_ms"] >= 20
    assert pct["c=1"]["tpot_p50_ms"] >= 5 and len(loads[0].records[0].itl_s) == 3
    assert good["c=4"]["good_requests"] == 8
    assert good["rate=50"]["goodput_requests_per_s"] == pytest.approx(6 / loads[2].duration_s)


def test_loads_stop_when_the_time_is_up(tmp_path):
    scenario = ServingScenario(engines=["vllm"], device="cpu", concurrency=[1], request_rates=[math.pi])
    with Telemetry("cpu") as telemetry:
        # No server is needed: no load may start once the deadline has passed.
        loads = drive_loads(None, scenario, scenario.load_sizes(), [[1]], telemetry, deadline=time.monotonic() - 1)
    assert loads == []
