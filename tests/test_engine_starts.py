"""benchmarks/engine_starts.py on logs written as vLLM 0.26 writes them (the lines below are from the H100 7B run's
engines and a `vllm serve`'s, prefixed by its process as the server's log has them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SESSION = """\
INFO 12-06 04:21:31 [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: model='/tmp/m'
INFO 12-06 04:21:40 [default_loader.py:430] Loading weights took 2.24 seconds
INFO 12-06 04:21:41 [model_runner.py:305] Model loading took 14.29 GiB and 5.069676 seconds
INFO 12-06 04:21:50 [backends.py:220] torch.compile takes 10.49 s in total
INFO 12-06 04:21:52 [kv_cache_utils.py:2177] GPU KV cache size: 149,792 tokens
INFO 12-06 04:22:30 [gpu_model_runner.py:3400] Graph capturing finished in 31 secs, took 0.53 GiB
INFO 12-06 04:22:47 [core.py:347] init engine (profile, create kv cache, warmup model) took 52.10 s
INFO 12-06 04:22:47 [model_runner.py:305] Model loading took 5.27 GiB and 3.445114 seconds
"""
SERVER = """\
(APIServer pid=3951) INFO 12-06 04:26:00 [api_server.py:1000] vLLM API server version 0.26.0
(EngineCore_DP0 pid=4012) INFO 12-06 04:26:20 [default_loader.py:430] Loading weights took 1.41 seconds
(EngineCore_DP0 pid=4012) INFO 12-06 04:27:10 [core.py:347] init engine (profile, create kv cache, warmup model) took 40.00 s
(APIServer pid=3951) INFO 12-06 04:27:20 [launcher.py:44] Application startup complete.
"""


def test_each_engine_start_is_a_row_of_its_own_figures(tmp_path):
    session = tmp_path / "serving-logs" / "base" / "ref-offline+ref-latency" / "vllm-0.log"
    server = tmp_path / "serving-logs" / "base" / "ref-serving" / "point00" / "serve-ref-serving@default-0.log"
    for path, text in ((session, SESSION), (server, SERVER)):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "run.log").write_text(SESSION)  # the run's own log: not an engine start's
    out = tmp_path / "engine-starts.md"
    printed = subprocess.run([sys.executable, str(REPO / "benchmarks/engine_starts.py"), str(tmp_path), "--out", str(out)],
                             capture_output=True, text=True, check=True).stdout
    rows = [line for line in printed.splitlines() if line.startswith("| serving-logs")]
    assert rows == [
        # the first of each figure: a paired session's base loads first (14.29 GiB), the variant after it
        "| serving-logs/base/ref-offline+ref-latency/vllm-0.log | 2.24 | 14.29 | 5.069676 | 10.49 | 31 | 52.10"
        " | 149792 | 76 |",
        "| serving-logs/base/ref-serving/point00/serve-ref-serving@default-0.log | 1.41 |  |  |  |  | 40.00 |  | 80 |",
    ]
    assert out.read_text().startswith(f"# Engine starts of {tmp_path}")
