"""lm-eval's own command line for a stored evaluation, and its per-item results set beside the stored ones.

quantgate runs lm-eval through `simple_evaluate` in a child process (tasks/adapters/evaluators/lm_eval.py); this
module writes the `lm_eval run` command that asks lm-eval for the same thing, from the evaluation's stored config
alone (quality_evals.config), so that any evaluation in the warehouse, old ones included, can be re-run outside
quantgate. One command per `simple_evaluate` call: quantgate calls it once per distinct (limit, metadata, few-shot,
chat template, multiturn), as lm-eval's CLI takes one of each. What the CLI sets that quantgate did not is stated
with the command (`notes`), never hidden.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantgate.catalog.paths import LOCAL_TASKS_DIR, eval_data_root
from quantgate.catalog.suites import LocalTask, SuiteSpec

# lm-eval's own seeds (python, numpy, torch, few-shot sampling): simple_evaluate's defaults, which quantgate keeps.
SEED = "0,1234,1234,1234"
# What the vLLM backend's engine takes beside the stored engine size (tasks/adapters/evaluators/engine.py).
VLLM_FIXED_ARGS = {"enforce_eager": True}
_SAMPLES_FILE = re.compile(r"^samples_(?P<task>.+)_\d{4}-\d{2}-\d{2}T[\d.-]+\.jsonl$")


@dataclass(frozen=True)
class Reproduction:
    """One `lm_eval run` command: its tasks, the environment it needs and its arguments."""

    tasks: list[str]
    env: dict[str, str]
    argv: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        """The shell line: `NAME=value ... lm_eval run ...`, each word quoted as a shell needs it."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), *map(shlex.quote, self.argv)])


def _task(stored: dict[str, Any]) -> LocalTask:
    """A task as the stored config dumped it (configs of older quantgates lack the later fields: their defaults)."""
    return LocalTask(**{k: v for k, v in stored.items() if k in LocalTask.model_fields})


def _model_args(config: dict[str, Any]) -> str:
    """`pretrained=...,dtype=...` as lm-eval's CLI parses it (k=v pairs split on commas; True/False and numbers
    typed), in the order quantgate built its dict."""
    args: dict[str, Any] = {"pretrained": config["model_path"], "dtype": config["dtype"],
                            "trust_remote_code": config["trust_remote_code"]}
    if config["backend"] == "vllm":
        args |= {**VLLM_FIXED_ARGS, **(config.get("engine") or {})}
    return ",".join(f"{k}={v}" for k, v in args.items())


def _env(config: dict[str, Any], builtin: bool) -> dict[str, str]:
    """The variables quantgate's lm-eval process had that decide its numbers: the offline switches (every task
    local), the eval data root the qg_* tasks read, the vLLM engine's repeatable mode."""
    env = {} if builtin else {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["QUANTGATE_EVAL_DATA"] = config.get("eval_data") or str(eval_data_root())
    return env | dict(config.get("engine_env") or {})


def _notes(config: dict[str, Any], include_paths: list[str]) -> list[str]:
    notes = []
    if config["backend"] == "vllm" and not config.get("engine"):
        notes.append("the evaluation engine's size (max_model_len, KV cache) was not stored with this evaluation:"
                     " vLLM's defaults apply")
    if scored := (config.get("loglikelihood_scored") or {}).get("next_token"):
        notes.append(f"quantgate scored {scored:,} loglikelihood requests with one-token continuations by one"
                     " next-token pass per context (tasks/adapters/evaluators/next_token.py); lm_eval's CLI scores"
                     " each as a prompt of its own: the same quantities, up to floating-point rounding")
    if len(include_paths) > 1:
        notes.append(f"lm_eval's --include_path takes one folder; quantgate also read {', '.join(include_paths[1:])}")
    return notes


def reproductions(config: dict[str, Any], output_path: str, load_time: bool = False) -> list[Reproduction]:
    """The `lm_eval run` commands of one stored evaluation config, in the order quantgate made its calls; none for a
    load-time (bitsandbytes) variant, which only quantgate's own loader builds (its model goes to lm-eval as an
    object, not a path)."""
    if load_time:
        return []
    tasks = [_task(t) for t in config["tasks"]]
    suite = SuiteSpec(tasks=tuple(tasks), num_fewshot=config.get("num_fewshot"))
    from quantgate.tasks.adapters.evaluators.lm_eval import local_task_configs

    local = local_task_configs(suite)
    include_paths = list(dict.fromkeys([str(LOCAL_TASKS_DIR), *(t.include_path for t in tasks if t.include_path)]))
    # As lm_eval._run groups them: one simple_evaluate call per (limit, metadata, few-shot, chat, multiturn).
    calls: dict[tuple[int | None, str, int | None, bool, bool], list[str]] = defaultdict(list)
    for t in tasks:
        meta = json.dumps(t.metadata, sort_keys=True)
        calls[(t.limit, meta, suite.num_fewshot_of(t), t.apply_chat_template, t.fewshot_as_multiturn)].append(t.name)
    env = _env(config, builtin=any(t.name not in local for t in tasks))
    out = []
    for (limit, meta, shots, chat, multiturn), names in calls.items():
        argv = ["lm_eval", "run", "--model", config["backend"], "--model_args", _model_args(config),
                "--tasks", ",".join(names), "--include_path", include_paths[0]]
        argv += ["--limit", str(limit)] if limit is not None else []
        argv += ["--num_fewshot", str(shots)] if shots is not None else []
        # lm-eval's CLI turns multiturn on with the chat template unless told otherwise.
        argv += ["--apply_chat_template", "--fewshot_as_multiturn", str(multiturn).lower()] if chat else []
        argv += ["--metadata", meta] if meta != "{}" else []
        argv += ["--batch_size", str(config["batch_size"])]
        # vLLM takes its GPU from CUDA_VISIBLE_DEVICES: quantgate passed it no device.
        argv += ["--device", config["device"]] if config["backend"] == "hf" else []
        argv += ["--seed", SEED, "--log_samples", "--output_path", output_path]
        out.append(Reproduction(names, env, argv, _notes(config, include_paths)))
    return out


# --- the reproduced items beside the stored ones --------------------------------------------------------------


def read_samples(folder: str | Path) -> dict[tuple[str, str, str, int], float]:
    """{(task, metric, filter, doc_id): value} of every `samples_<task>_<date>.jsonl` lm-eval's --log_samples wrote
    under `folder`: a perplexity's (log-likelihood, weight) pair read as its log-likelihood, as quantgate stores it;
    corpus metrics' (gold, prediction) pairs, which have no number per item, left out."""
    found: dict[tuple[str, str, str, int], float] = {}
    for path in sorted(Path(folder).rglob("samples_*.jsonl")):
        match = _SAMPLES_FILE.match(path.name)
        if match is None:
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            sample = json.loads(line)
            for metric in sample["metrics"]:
                value = sample[metric]
                if isinstance(value, list):
                    value = value[0] if isinstance(value[0], (int, float)) else None
                if isinstance(value, (int, float)):
                    found[(match["task"], metric, sample["filter"], int(sample["doc_id"]))] = float(value)
    return found


def compare(stored: list[dict[str, Any]], reproduced: dict[tuple[str, str, str, int], float]) -> list[dict[str, Any]]:
    """Per (task, metric, filter) of the `stored` items (quality_samples rows with a number): how many the
    reproduction has, how many equal bit for bit, how many differ, and the largest difference. A group's rows
    (MMLU under qg_mmlu) are its subtasks' again, compared under the subtasks' names."""
    by_metric: dict[tuple[str, str, str], list[tuple[float, float | None]]] = defaultdict(list)
    for r in stored:
        if r["value"] is None or not math.isfinite(r["value"]):
            continue
        key = (r["task"], r["metric"], r["filter"])
        by_metric[key].append((r["value"], reproduced.get((*key, int(r["doc_id"])))))
    out = []
    for (task, metric, filter_), pairs in sorted(by_metric.items()):
        found = [(a, b) for a, b in pairs if b is not None]
        if not found:
            continue  # a group's own rows, or a task the reproduction did not run
        gaps = [abs(a - b) for a, b in found]
        out.append({"task": task, "metric": metric, "filter": filter_, "items": len(pairs),
                    "reproduced": len(found), "equal": sum(g == 0 for g in gaps), "differ": sum(g != 0 for g in gaps),
                    "max_abs_diff": max(gaps)})
    return out
