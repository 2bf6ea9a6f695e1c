"""The serving client and server lifecycle, against a small OpenAI-style streaming server (aiohttp.web)
that stands in for `vllm serve`; the client, the metrics and the process handling are the real code."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web

from quantgate.catalog.records import RequestRecord, Slo
from quantgate.catalog.scenarios import Sampling
from quantgate.tasks.adapters.speed.bench import vllm_bench_throughput
from quantgate.tasks.adapters.speed.client import arrival_offsets, run_load
from quantgate.tasks.adapters.speed.errors import ServingError
from quantgate.tasks.adapters.speed.metrics import summarize
from quantgate.tasks.adapters.speed.server import free_port, start_server
from quantgate.tasks.adapters.speed.vllm_cli import vllm_serve_command
from quantgate.tasks.adapters.dummy_weights import QWEN25_7B_INSTRUCT, write_dummy_checkpoint
from tests.shapes import SMALL_QWEN

# Prompt-coded behaviour of the fake server: [OK, ttft_ms, gap_ms, tokens_per_chunk, ...] streams
# normally; [HTTP_500] answers 500; [STREAM_ERROR] sends one token then vLLM's in-stream error event.
OK, HTTP_500, STREAM_ERROR = 1, 500, 501


class FakeOpenAI:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def reset(self) -> None:
        self.bodies.clear()
        self.in_flight = self.max_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "root": "fake-model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        if prompt[0] == HTTP_500:
            return web.Response(status=500, text="boom")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            ttft_ms, gap_ms, per_chunk = prompt[1:4] if prompt[0] == OK else (10, 10, 1)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b": ping\n\n")
            n = body["max_tokens"]
            sent = 0
            await asyncio.sleep(ttft_ms / 1000)
            while sent < n:
                k = min(per_chunk, n - sent)
                sent += k
                choice = {"index": 0, "text": " t7" * k, "finish_reason": "length" if sent == n else None}
                await _event(resp, {"id": "c", "object": "text_completion", "choices": [choice]})
                if prompt[0] == STREAM_ERROR:
                    await _event(resp, {"error": {"message": "engine died", "code": 500}})
                    break
                if sent < n:
                    await asyncio.sleep(gap_ms / 1000)
            else:
                usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
                await _event(resp, {"id": "c", "choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


async def _event(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(f"data: {json.dumps(data)}\n\n".encode())


@pytest.fixture(scope="module")
def server():
    fake = FakeOpenAI()
    port = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(fake.app())
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield fake, f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def fake(server):
    server[0].reset()
    return server


def test_timings_follow_the_server_delays(fake):
    srv, url = fake
    run = run_load(url, [[OK, 300, 100, 1, 42, 43]], output_len=5)
    (r,) = run.records
    assert r.success and r.error is None
    assert run.model == "fake-model"
    assert r.output_tokens == 5 and r.prompt_len == 6
    assert r.ttft_s == pytest.approx(0.3, abs=0.08)
    assert len(r.itl_s) == 4 and all(gap == pytest.approx(0.1, abs=0.05) for gap in r.itl_s)
    assert r.e2el_s == pytest.approx(0.7, abs=0.12)
    # E2EL ends at the last token chunk, so it is exactly TTFT plus the gaps.
    assert r.e2el_s == pytest.approx(r.ttft_s + sum(r.itl_s))
    assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 4)
    body = srv.bodies[0]
    assert body["prompt"] == [OK, 300, 100, 1, 42, 43]
    assert body["model"] == "fake-model"
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (5, 5, True)
    assert body["temperature"] == 0.0 and body["stream"] is True and "top_p" not in body
    assert body["stream_options"] == {"include_usage": True}
    assert run.config["temperature"] == 0.0


def test_a_sampled_load_sends_its_temperature_with_top_p_one(fake):
    srv, url = fake
    run = run_load(url, [[OK, 1, 1, 1, 42]], output_len=3, sampling=Sampling(temperature=1.0))
    assert (srv.bodies[0]["temperature"], srv.bodies[0]["top_p"]) == (1.0, 1.0)
    assert run.config["temperature"] == 1.0 and run.records[0].output_tokens == 3


def test_a_loads_top_p_and_top_k_reach_the_server(fake):
    srv, url = fake
    run = run_load(url, [[OK, 1, 1, 1, 42]], output_len=3, sampling=Sampling(temperature=0.7, top_p=0.9, top_k=20))
    assert (srv.bodies[0]["temperature"], srv.bodies[0]["top_p"], srv.bodies[0]["top_k"]) == (0.7, 0.9, 20)
    assert (run.config["top_p"], run.config["top_k"]) == (0.9, 20)
    run_load(url, [[OK, 1, 1, 1, 42]], output_len=3, sampling=Sampling(temperature=0.7, top_p=0.9, top_k=20),
             vllm_extras=False)
    assert "top_k" not in srv.bodies[-1] and srv.bodies[-1]["top_p"] == 0.9  # OpenAI's fields alone


def test_chunks_carrying_several_tokens_count_by_usage(fake):
    _, url = fake
    (r,) = run_load(url, [[OK, 100, 100, 2]], output_len=6).records
    assert r.success
    # Three chunks of two tokens: two gaps, six tokens, TPOT over the five tokens after the first.
    assert len(r.itl_s) == 2
    assert r.output_tokens == 6
    assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 5)
    assert r.tpot_s == pytest.approx(0.2 / 5, abs=0.02)


def test_concurrency_cap_is_respected(fake):
    srv, url = fake
    prompts = [[OK, 60, 30, 1]] * 6
    capped = run_load(url, prompts, output_len=3, max_concurrency=2)
    assert srv.max_in_flight == 2
    assert all(r.success for r in capped.records)
    # Waiting for a slot delays the send, not the arrival.
    assert max(r.start_offset_s for r in capped.records) > 0.2
    assert all(r.arrival_offset_s == 0.0 for r in capped.records)
    srv.reset()
    run_load(url, prompts, output_len=3)
    assert srv.max_in_flight == 6
    # Warm-up requests go first, under the same cap, and are not recorded.
    srv.reset()
    warmed = run_load(url, prompts[:2], output_len=3, max_concurrency=1, warmup=3)
    assert len(srv.bodies) == 5 and srv.max_in_flight == 1
    assert [r.index for r in warmed.records] == [0, 1]


def test_poisson_arrivals_are_seeded_and_scaled():
    a = arrival_offsets(20, 4.0, seed=7)
    assert a == arrival_offsets(20, 4.0, seed=7)
    assert a != arrival_offsets(20, 4.0, seed=8)
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    assert a[-1] == pytest.approx(20 / 4.0)
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ServingError, match="request_rate"):
        arrival_offsets(3, 0.0, seed=0)


def test_requests_are_sent_on_the_poisson_schedule(fake):
    _, url = fake
    run = run_load(url, [[OK, 5, 5, 1]] * 5, output_len=2, request_rate=20.0, seed=3)
    expected = arrival_offsets(5, 20.0, seed=3)
    assert [r.arrival_offset_s for r in run.records] == expected
    for r, due in zip(run.records, expected, strict=True):
        assert due - 0.005 <= r.start_offset_s <= due + 0.1
    assert run.duration_s >= expected[-1]
    assert run.config["request_rate"] == 20.0


def test_errors_are_recorded_per_request(fake):
    _, url = fake
    run = run_load(url, [[OK, 5, 5, 1], [HTTP_500], [STREAM_ERROR], [OK, 5, 5, 1]], output_len=3)
    assert [r.index for r in run.records] == [0, 1, 2, 3]
    assert [r.success for r in run.records] == [True, False, False, True]
    assert run.records[1].error.startswith("HTTP 500") and "boom" in run.records[1].error
    assert "engine died" in run.records[2].error
    s = summarize(run.records, run.duration_s)
    assert (s["completed"], s["failed"], s["output_tokens"]) == (2, 2, 6)


def test_unreachable_server_fails_each_request():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServingError, match="cannot list models"):
        run_load(url, [[1, 2]], output_len=2)
    run = run_load(url, [[1, 2], [3, 4]], output_len=2, model="m")
    assert [r.success for r in run.records] == [False, False]
    assert all("Connect" in r.error for r in run.records)


def _record(i: int, ttft: float, itl: list[float], n: int, success: bool = True) -> RequestRecord:
    e2el = ttft + sum(itl)
    return RequestRecord(
        index=i,
        success=success,
        error=None if success else "x",
        prompt_len=10,
        output_tokens=n if success else 0,
        ttft_s=ttft if success else None,
        itl_s=itl if success else [],
        e2el_s=e2el if success else None,
        tpot_s=(e2el - ttft) / (n - 1) if success and n > 1 else None,
        arrival_offset_s=0.0,
        start_offset_s=0.0,
    )


def test_summary_percentiles_and_goodput():
    records = [
        _record(0, 0.1, [0.02, 0.02, 0.02], 4),  # tpot 20 ms
        _record(1, 0.2, [0.05, 0.05, 0.05], 4),  # tpot 50 ms
        _record(2, 0.4, [0.01, 0.01, 0.01], 4),  # tpot 10 ms
        _record(3, 0.0, [], 0, success=False),
    ]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=250, tpot_ms=30))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["output_tokens_per_s"] == pytest.approx(12 / 2.0)
    assert s["requests_per_s"] == pytest.approx(1.5)
    assert s["total_tokens_per_s"] == pytest.approx((30 + 12) / 2.0)
    assert s["ttft_ms_p50"] == pytest.approx(200.0)
    assert s["ttft_ms_p90"] == pytest.approx(np.percentile([100, 200, 400], 90))
    assert s["tpot_ms_p99"] == pytest.approx(np.percentile([20, 50, 10], 99))
    assert s["itl_ms_mean"] == pytest.approx(np.mean([20] * 3 + [50] * 3 + [10] * 3))
    assert s["e2el_ms_p50"] == pytest.approx(350.0)  # e2el 160, 350, 430
    # Only request 0 meets both limits (1 is too slow per token, 2 too slow to start).
    assert s["good_requests"] == 1
    assert s["goodput_requests_per_s"] == pytest.approx(0.5)


# --- process lifecycle ---------------------------------------------------------------------------

# A stand-in for `vllm serve`: a parent that starts a child HTTP server (as vLLM starts its engine core)
# and writes the child's pid; GET /health finds the file named `health`.
_SERVER = textwrap.dedent(
    """
    import subprocess, sys
    www, port, pid_file = sys.argv[1:4]
    child = subprocess.Popen([sys.executable, "-m", "http.server", port, "--bind", "127.0.0.1", "--directory", www])
    open(pid_file, "w").write(str(child.pid))
    print("serving", flush=True)
    child.wait()
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_server_lifecycle_kills_its_group_and_nothing_else(tmp_path):
    www = tmp_path / "www"
    www.mkdir()
    (www / "health").write_text("ok")
    port = free_port()
    pid_file = tmp_path / "child.pid"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        handle = start_server(
            "unused",
            port=port,
            command=[sys.executable, "-c", _SERVER, str(www), str(port), str(pid_file)],
            log_path=tmp_path / "server.log",
            ready_timeout_s=30,
        )
        child = int(pid_file.read_text())
        assert handle.running and _alive(handle.pid) and _alive(child)
        with urllib.request.urlopen(f"{handle.base_url}/health", timeout=5) as r:
            assert r.status == 200
        handle.stop(grace_s=5)
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not handle.running and not _alive(handle.pid) and not _alive(child)
        assert _alive(bystander.pid)
        assert "serving" in (tmp_path / "server.log").read_text()
    finally:
        bystander.kill()
        bystander.wait()


def test_server_that_exits_early_reports_its_log(tmp_path):
    with pytest.raises(ServingError, match=r"exited with code 2 .*unknown flag --bogus"):
        start_server(
            "unused",
            port=free_port(),
            command=[sys.executable, "-c", "print('unknown flag --bogus'); raise SystemExit(2)"],
            log_path=tmp_path / "server.log",
        )


def test_port_in_use_is_refused_before_starting(tmp_path, fake):
    _, url = fake
    port = int(url.rsplit(":", 1)[1])
    marker = tmp_path / "started"
    with pytest.raises(ServingError, match=f"port {port} .* already in use"):
        start_server("unused", port=port, command=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert not marker.exists()


def test_server_not_ready_in_time_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(ServingError, match="not ready after 1s"):
        start_server(
            "unused",
            port=free_port(),
            command=[sys.executable, "-c", script],
            log_path=tmp_path / "server.log",
            ready_timeout_s=1,
        )
    assert not _alive(int(pid_file.read_text()))


def test_vllm_serve_command_binds_loopback_and_names_the_model():
    cmd = vllm_serve_command(
        "/m", host="127.0.0.1", port=8123, served_model_name="base", extra_args=["--dtype", "bfloat16"]
    )
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    assert cmd[3:5] == ["serve", "/m"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--served-model-name") + 1] == "base"
    assert cmd[-2:] == ["--dtype", "bfloat16"]


# --- on the device: real `vllm serve` and `vllm bench throughput` on a small dummy checkpoint ----------

_NO_GPU = importlib.util.find_spec("vllm") is None or not torch.cuda.is_available()
_SMALL_QWEN = {**QWEN25_7B_INSTRUCT, **SMALL_QWEN}
# A fixed 1 GiB KV cache, as sized_kv_cache gives an engine that starts beside other work: no memory profiling,
# which another engine starting or stopping on the same GPU would upset.
_ENGINE_ARGS = ["--max-model-len", "256", "--gpu-memory-utilization", "0.1", "--kv-cache-memory-bytes", str(1 << 30),
                "--enforce-eager", "--seed", "0"]


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU, reason="needs vllm and a CUDA GPU")
@pytest.mark.parametrize("quant", [None, "w4a16"])
def test_vllm_serve_and_bench_throughput_on_the_device(tmp_path, quant):
    ck = write_dummy_checkpoint(tmp_path / "model", _SMALL_QWEN, quant=quant)
    prompts = [[(7 * i + j) % 2000 for j in range(32)] for i in range(8)]
    with start_server(
        str(ck.path),
        port=free_port(),
        extra_args=[*_ENGINE_ARGS, "--enable-per-request-metrics"],
        log_path=tmp_path / "serve.log",
        ready_timeout_s=600,
    ) as srv:
        run = run_load(srv.base_url, prompts, output_len=16, max_concurrency=4, model=srv.model, warmup=2)
    assert not srv.running
    assert all(r.success for r in run.records), [r.error for r in run.records if not r.success]
    assert all(r.output_tokens == 16 and r.prompt_len == 32 for r in run.records)
    # --enable-per-request-metrics puts vLLM's own timings on the usage chunk.
    assert all(isinstance(r.server_metrics, dict) for r in run.records)
    summary = summarize(run.records, run.duration_s, Slo(ttft_ms=10_000, tpot_ms=1_000))
    assert summary["good_requests"] == 8 and summary["output_tokens_per_s"] > 0

    # Through its gate (tasks/adapters/speed/bench_gate.py): one warm-up pass, then its timed pass three times.
    res = vllm_bench_throughput(
        str(ck.path), input_len=32, output_len=16, num_prompts=16, work_dir=tmp_path / "bench", num_warmups=16,
        passes=3, extra_args=_ENGINE_ARGS,
    )
    assert res["num_requests"] == 16 and res["output_tokens_per_s"] > 0
    assert len(res["repetitions"]) == 3 and res["elapsed_s"] >= sum(r["wall_s"] for r in res["repetitions"])
    assert res["own_mean_output_tokens_per_s"] > 0
