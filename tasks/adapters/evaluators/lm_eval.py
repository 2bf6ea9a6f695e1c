"""Quality evaluation with lm-evaluation-harness; with vllm_next_token.py (its vLLM model), the only module that
imports lm_eval.

Each evaluation runs in a fresh Python process (this module run with -m). huggingface_hub and datasets
read their offline switches once, at import, so only a new process can take them; and a vLLM engine gives
its GPU memory back only when its process ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

import yaml

from quantgate.catalog.errors import QuantgateError, one_line
from quantgate.catalog.paths import LOCAL_TASKS_DIR
from quantgate.catalog.records import LocalTaskConfig, MetricResult, QualityReport, SampleResult
from quantgate.catalog.settings import settings
from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.tasks.adapters.evaluators import lm_eval_rows, next_token
from quantgate.tasks.adapters.evaluators.engine import engine_plan, shared_gpu_engine_args
from quantgate.tasks.runtime import faults, gpu_memory, processes

log = logging.getLogger(__name__)

EVALUATOR = "lm-eval"
BOOTSTRAP_ITERS = 1000  # lm-eval's default (100,000) makes bootstrapped stderrs (bleu, ...) take minutes

Backend = Literal["hf", "vllm"]
LOADED_POLL_S = 0.5
# vLLM's documented way to make an offline run repeat on the same GPU model and vLLM version: the engine core in
# the evaluating process, which then batches every request lm-eval handed it before its first step. In its own
# process the core starts stepping while requests still arrive, so a batch's make-up, and with it the last bits
# of the logits, moves from run to run: the reference model's base scored 383 then 384 of 800 GSM8K items on one
# machine, enough to move a gate whose interval ends at its threshold.
VLLM_REPEATABLE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


class EvaluationError(QuantgateError, RuntimeError):
    """An evaluation that could not run; the message is one line."""


def eval_key(suite: SuiteSpec, backend: Backend, dtype: str = "float32") -> str:
    """Hash of what decides the numbers: each task's resolved config and limit, few-shot, lm-eval version, backend, dtype.

    Built-in lm-eval tasks are pinned by the lm-eval version, so only their names go in.
    """
    index = _local_index(suite)
    fingerprint = {
        "evaluator": EVALUATOR,
        "backend": backend,
        **({"loglikelihood": next_token.SCORING} if backend == "vllm" else {}),
        "dtype": dtype,
        "lm_eval": version("lm_eval"),
        "num_fewshot": suite.num_fewshot,
        "tasks": [{"name": t.name, "limit": t.limit, "config": _resolved_config(t.name, index),
                   # only when given, so that the keys of earlier evaluations stay as they were
                   **({"metadata": t.metadata} if t.metadata else {}),
                   **({"protocol": _protocol(t)} if _protocol(t) != _protocol(LocalTask(name=t.name)) else {})}
                  for t in suite.tasks],
    }
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _protocol(task: LocalTask) -> dict[str, Any]:
    return {"num_fewshot": task.num_fewshot, "apply_chat_template": task.apply_chat_template,
            "fewshot_as_multiturn": task.fewshot_as_multiturn}


def protocol_label(num_fewshot: int | None, apply_chat_template: bool, fewshot_as_multiturn: bool) -> str:
    """How a task was asked, e.g. '0-shot', '5-shot, chat, multiturn'; None few-shot: the task YAML's default."""
    parts = [f"{num_fewshot}-shot" if num_fewshot is not None else "task-default shots"]
    return ", ".join(parts + ["chat"] * apply_chat_template + ["multiturn"] * fewshot_as_multiturn)


def run_config(
    model_path: str, suite: SuiteSpec, *, backend: Backend, device: str, dtype: str, trust_remote_code: bool
) -> dict[str, Any]:
    return {
        "model_path": model_path,
        "backend": backend,
        "device": device,
        "dtype": dtype,
        "trust_remote_code": trust_remote_code,
        # vLLM schedules its own batches; lm-eval's "auto" hands it every request at once.
        "batch_size": suite.batch_size if backend == "hf" else "auto",
        "num_fewshot": suite.num_fewshot,
        "tasks": [t.model_dump() for t in suite.tasks],
        "bootstrap_iters": BOOTSTRAP_ITERS,
        "eval_data": str(settings().eval_data) if settings().eval_data else None,
        "lm_eval": version("lm_eval"),
        **({"engine_env": VLLM_REPEATABLE_ENV} if backend == "vllm" else {}),
    }


def evaluate(
    model_path: str,
    suite: SuiteSpec,
    *,
    backend: Backend = "hf",
    device: str = "cpu",
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> QualityReport:
    """Run the suite on a local checkpoint. Raises EvaluationError (one line) when it cannot."""
    _refuse_unrunnable(model_path, suite, backend, trust_remote_code)
    names = [t.name for t in suite.tasks]
    key = eval_key(suite, backend, dtype)
    config = run_config(model_path, suite, backend=backend, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    builtin = [n for n in names if n not in _local_index(suite)]
    # Sized by the model before the engine starts: one that cannot fit says so here, in one line.
    engine = engine_plan(model_path, task_words(suite)).args() if backend == "vllm" and device == "cuda" else {}
    request = {
        "model_path": model_path,
        "suite": suite.model_dump(mode="json"),
        "include_paths": _include_paths(suite),
        "builtin": bool(builtin),
        "engine": engine,
        **{k: config[k] for k in ("backend", "device", "dtype", "trust_remote_code", "batch_size")},
    }
    log.info("lm-eval %s on %s: %s (%s, %s, %s)", config["lm_eval"], model_path, names, backend, device, dtype)
    start = time.perf_counter()
    out = _run_in_own_process(request, _process_env(offline=not builtin, engine_env=config.get("engine_env", {})))
    seconds = time.perf_counter() - start
    log.info("lm-eval done in %.1f s: %d metrics, %d sample rows", seconds, len(out["metrics"]), len(out["samples"]))
    return QualityReport(
        eval_key=key,
        evaluator=EVALUATOR,
        # The protocol each result's task was asked with, by task name as the results name it.
        config=config | {"protocols": out["protocols"], "example_prompts": out["example_prompts"]}
        | ({"engine": engine} if engine else {})
        # How many loglikelihood requests each path scored (vllm backend: vllm_next_token.py).
        | ({"loglikelihood_scored": out["loglikelihood_scored"]} if "loglikelihood_scored" in out else {}),
        metrics=[MetricResult(**m) for m in out["metrics"]],
        samples=[SampleResult(**s) for s in out["samples"]],
        seconds=seconds,
    )


def _refuse_unrunnable(model_path: str, suite: SuiteSpec, backend: str, trust_remote_code: bool) -> None:
    """Raise EvaluationError for a request that cannot run, before any process starts."""
    if backend not in ("hf", "vllm"):
        raise EvaluationError(f"unknown lm-eval backend {backend!r}: use 'hf' or 'vllm'")
    names = [t.name for t in suite.tasks]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise EvaluationError(f"tasks listed more than once in the suite: {dupes}")
    if not Path(model_path).is_dir():
        raise EvaluationError(f"model folder {model_path} does not exist")
    if chat := [t.name for t in suite.tasks if t.apply_chat_template]:
        _check_chat_template(model_path, chat, trust_remote_code)


def _process_env(*, offline: bool, engine_env: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    if offline:  # every task reads local files: nothing may reach for a hub
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("HF_DATASETS_OFFLINE", "1")
    return env | engine_env


def _run_in_own_process(request: dict, env: dict[str, str]) -> dict:
    """The evaluation process's results (this module run with -m); its error, when it wrote one, raised."""
    with tempfile.TemporaryDirectory(prefix="quantgate-lm-eval-") as tmp:
        request_file, result_file = Path(tmp, "request.json"), Path(tmp, "result.json")
        request_file.write_text(json.dumps({**request, "loaded_file": str(Path(tmp, "loaded"))}))
        # Once its model has loaded, the memory held for its start is free for others (gpu_memory.engine_loaded).
        returncode = processes.run_to_end([sys.executable, "-m", __name__, str(request_file), str(result_file)], env,
                                          Path(tmp, "loaded"), gpu_memory.engine_loaded, LOADED_POLL_S)
        if not result_file.is_file():
            raise EvaluationError(f"the lm-eval process exited with code {returncode} before writing results")
        out = json.loads(result_file.read_text())
    if "error" in out:
        raise EvaluationError(out["error"])
    return out


def _check_chat_template(model_path: str, tasks: list[str], trust_remote_code: bool) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise EvaluationError(f"could not load the tokenizer of {model_path}: {one_line(e)}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise EvaluationError(f"{tasks} ask for apply_chat_template, but the tokenizer of {model_path}"
                              " has no chat template")


# --- task configs, resolved for the eval key -----------------------------------------------------------------


def local_task_configs(suite: SuiteSpec) -> dict[str, list[LocalTaskConfig]]:
    """Each suite task that lives in a local YAML: its leaf tasks (a group's or tag's members, else itself) with
    their configs as lm-eval merges them. Built-in lm-eval tasks are left out."""
    index = _local_index(suite)
    return {t.name: _leaves(t.name, index) for t in suite.tasks if t.name in index}


def _leaves(name: str, index: dict) -> list[LocalTaskConfig]:
    entry = index.get(name)
    if entry is None:
        return []
    if entry.yaml_path is None:  # a tag: the tasks that carry it
        return [leaf for t in sorted(entry.tags) for leaf in _leaves(t, index)]
    cfg = _read_yaml(Path(entry.yaml_path))
    if isinstance(cfg.get("task"), list):  # a group
        members = [m.get("task") if isinstance(m, dict) else m for m in cfg["task"]]
        return [leaf for m in members if isinstance(m, str) for leaf in _leaves(m, index)]
    return [LocalTaskConfig(name=name, yaml_path=str(entry.yaml_path), config=cfg)]


def _include_paths(suite: SuiteSpec) -> list[str]:
    extra = [t.include_path for t in suite.tasks if t.include_path]
    return list(dict.fromkeys([str(LOCAL_TASKS_DIR), *extra]))


def _local_index(suite: SuiteSpec) -> dict:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=_include_paths(suite), include_defaults=False).task_index


def _resolved_config(name: str, index: dict) -> Any:
    entry = index.get(name)
    if entry is None:
        return None
    if entry.yaml_path is None:  # a tag: the tasks that carry it
        return {"tag": name, "tasks": {t: _resolved_config(t, index) for t in sorted(entry.tags)}}
    cfg = _read_yaml(Path(entry.yaml_path))
    if isinstance(cfg.get("task"), list):  # a group: fold in its members' configs
        cfg["task"] = [_resolved_member(m, index) for m in cfg["task"]]
    return cfg


def _resolved_member(member: Any, index: dict) -> Any:
    name = member.get("task") if isinstance(member, dict) else member
    resolved = _resolved_config(name, index) if isinstance(name, str) else None
    return member if resolved is None else {"member": member, "config": resolved}


def _read_yaml(path: Path) -> dict:
    """The YAML as lm-eval merges it (includes first, own keys win), each !function named with its file's hash."""

    def function(loader: yaml.SafeLoader, node: yaml.Node) -> dict:
        spec = loader.construct_scalar(node)
        module = path.parent / (spec.rpartition(".")[0].replace(".", "/") + ".py")
        digest = hashlib.sha256(module.read_bytes()).hexdigest() if module.is_file() else None
        return {"!function": spec, "sha256": digest}

    loader = type("FunctionLoader", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", function)
    cfg = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - SafeLoader plus one tag
    includes = cfg.pop("include", [])
    merged: dict = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        inc_cfg = _read_yaml(path.parent / inc)
        inc_cfg.pop("task_list", None)
        merged.update(inc_cfg)
    return merged | cfg


# --- the evaluation process ---------------------------------------------------------------------------------


def _run(request: dict) -> dict:
    suite = SuiteSpec.model_validate(request["suite"])
    managers, by_call = _tasks_by_call(suite, request["include_paths"], request["builtin"])
    lm = _load_model(request)
    Path(request["loaded_file"]).touch()  # the parent tells the launcher: this engine's memory is taken
    faults.point("evaluate:loaded", request["model_path"])  # where a GPU fault test interrupts an evaluation
    return _evaluate_calls(lm, managers, by_call)


# simple_evaluate takes one limit, one protocol (few-shot, chat template, multiturn) and one task manager for all
# its tasks: (limit, metadata as JSON, few-shot, chat template, multiturn).
_Call = tuple[int | None, str, int | None, bool, bool]


def _tasks_by_call(suite: SuiteSpec, paths: list[str], builtin: bool) -> tuple[dict[str, Any], dict[_Call, list]]:
    """The suite's tasks loaded, grouped by the simple_evaluate call that runs them; the task managers by metadata."""
    from lm_eval.tasks import TaskManager

    # One task manager per distinct metadata: lm-eval merges a manager's metadata into every task it loads.
    managers: dict[str, TaskManager] = {}
    by_call: dict[_Call, list] = defaultdict(list)
    for task in suite.tasks:
        meta = json.dumps(task.metadata, sort_keys=True)
        if meta not in managers:
            managers[meta] = TaskManager(include_path=paths, include_defaults=builtin,
                                         metadata=dict(task.metadata) or None)
        manager = managers[meta]
        if task.name not in manager.task_index:
            raise EvaluationError(f"unknown lm-eval task {task.name!r}: not in {paths} nor among lm-eval's built-in tasks")
        try:
            loaded = manager.load(task.name)
        except Exception as e:
            raise EvaluationError(f"task {task.name!r} could not be loaded: {one_line(e)}") from None
        groups = loaded.get("groups", {})
        call = (task.limit, meta, suite.num_fewshot_of(task), task.apply_chat_template, task.fewshot_as_multiturn)
        by_call[call] += [groups[task.name]] if task.name in groups else list(loaded["tasks"].values())
    return managers, by_call


def _load_model(request: dict) -> Any:
    """The lm-eval model of the request's checkpoint, with its backend."""
    from lm_eval.api.registry import get_model

    backend = request["backend"]
    model_args: dict[str, Any] = {
        "pretrained": request["model_path"],
        "dtype": request["dtype"],
        "trust_remote_code": request["trust_remote_code"],
    }
    if (load_time := _load_time_model(request)) is not None:
        # The hf backend takes a loaded model as `pretrained`. A quantization_config in model_args
        # would not reach from_pretrained: HFLM passes its own (from the checkpoint's config) beside
        # the model args, and Transformers 5 dropped load_in_4bit / load_in_8bit.
        model_args = {"pretrained": load_time, "tokenizer": request["model_path"]}
    elif backend == "vllm":
        model_args |= shared_gpu_engine_args(request["engine"])
    # vLLM picks its GPU from CUDA_VISIBLE_DEVICES and rejects a device argument.
    extra = {"batch_size": request["batch_size"], "device": request["device"] if backend == "hf" else None}
    try:
        if backend == "vllm":  # one-token continuations in one next-token pass per context (next_token.py)
            from quantgate.tasks.adapters.evaluators.vllm_next_token import NextTokenVLLM

            return NextTokenVLLM.create_from_arg_obj(model_args, extra)
        return get_model(backend).create_from_arg_obj(model_args, extra)
    except Exception as e:
        raise EvaluationError(f"could not load {request['model_path']} with lm-eval's {backend!r} backend: {one_line(e)}") from None


def _evaluate_calls(lm: Any, managers: dict[str, Any], by_call: dict[_Call, list]) -> dict:
    """Each call's simple_evaluate on the loaded model; their metric and sample rows, protocols and prompts."""
    import lm_eval

    metrics: list[dict] = []
    samples: list[dict] = []
    protocols: dict[str, str] = {}
    prompts: dict[str, str] = {}
    for (limit, meta, num_fewshot, chat, multiturn), tasks in by_call.items():
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            limit=limit,
            num_fewshot=num_fewshot,
            apply_chat_template=chat,
            fewshot_as_multiturn=multiturn,
            log_samples=True,
            task_manager=managers[meta],
            bootstrap_iters=BOOTSTRAP_ITERS,
        )
        metrics += lm_eval_rows.metric_rows(results)
        samples += lm_eval_rows.sample_rows(results)
        # The few-shot count lm-eval used (a YAML may fix it, e.g. 0); a group's row takes its members' count.
        shots = {t: c.get("num_fewshot") for t, c in results["configs"].items()}
        group_shots = next(iter(shots.values()), num_fewshot)
        protocols |= {t: protocol_label(shots.get(t, group_shots), chat, multiturn) for t in results["results"]}
        prompts |= lm_eval_rows.example_prompt(results)
    scored = {"loglikelihood_scored": lm.scored} if hasattr(lm, "scored") else {}
    return {"metrics": metrics, "samples": samples, "protocols": protocols, "example_prompts": prompts, **scored}


def task_words(suite: SuiteSpec) -> list[int] | None:
    """The size in words of each of the suite's tasks that is sized so (qg_passkey's context_words, the suite's
    metadata over the task YAML's); None when a task is one of lm-eval's built-in ones, whose prompts are not
    known here."""
    configs = local_task_configs(suite)
    if any(t.name not in configs for t in suite.tasks):
        return None
    words = [{**(leaf.config.get("metadata") or {}), **task.metadata}.get("context_words")
             for task in suite.tasks for leaf in configs[task.name]]
    return [int(w) for w in words if isinstance(w, (int, float))]


def _load_time_model(request: dict) -> Any:
    """The model of a load-time (bitsandbytes) variant, quantized as Transformers loads the base; None
    for an ordinary checkpoint folder."""
    from quantgate.tasks.adapters import loadtime

    if loadtime.descriptor(request["model_path"]) is None:
        return None
    if request["backend"] != "hf":
        raise EvaluationError(f"a load-time (bitsandbytes) variant is evaluated with lm-eval's hf backend, not {request['backend']!r}")
    try:
        return loadtime.load_model(request["model_path"], device=request["device"], dtype=request["dtype"],
                                   trust_remote_code=request["trust_remote_code"])
    except Exception as e:
        raise EvaluationError(f"could not load {request['model_path']} with its bitsandbytes config: {one_line(e)}") from None


def _main(request_file: str, result_file: str) -> None:
    # The SIGTERM it gets when the run's process dies (processes.run_to_end) ends its engine too, on the way out.
    processes.exit_on_sigterm()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = _run(json.loads(Path(request_file).read_text()))
    except EvaluationError as e:
        out = {"error": str(e)}
    except Exception as e:
        log.exception("lm-eval failed")
        out = {"error": one_line(e)}
    Path(result_file).write_text(json.dumps(out))


if __name__ == "__main__":
    _main(*sys.argv[1:])
