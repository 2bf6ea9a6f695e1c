"""Speed measurement of a checkpoint, as backend × scenario × launcher.

Backends: the offline engines (tasks/adapters/engines, run by tasks/steps/benchmark.py), a `vllm serve` process
(server.py, driven by client.py) and `vllm bench throughput` (bench.py, through bench_gate.py); vllm_cli.py alone knows
vLLM's command line, its environment and its log lines. Scenarios: offline and latency (tasks/steps/benchmark.py),
serving (serving.py) and its sweep (sweep.py), on prompts made by prompts.py. Launchers: tasks/runtime/launch.py;
retry.py is the one out-of-memory retry every backend's engine start goes through.
"""
