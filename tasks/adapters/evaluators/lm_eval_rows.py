"""lm-eval's results as quantgate's rows: metrics, per-item samples (a group's items under its own name), an
example prompt. Reads the dict simple_evaluate returns; imports nothing of lm_eval."""

from __future__ import annotations

import math
from typing import Any

PROMPT_CHARS = 8000  # of each example prompt kept in the eval config


def example_prompt(results: dict) -> dict[str, str]:
    """The first prompt of the call's first task, as the model got it (few-shot examples, chat template): one
    per protocol, so a reader sees how the numbers were asked for."""
    for task, logged in results.get("samples", {}).items():
        args = logged[0]["arguments"][0] if logged and logged[0]["arguments"] else None
        if args and isinstance(args[0], str):
            return {task: _compact(args[0], limit=PROMPT_CHARS)}
    return {}


def metric_rows(results: dict) -> list[dict]:
    rows = []
    for task, row in results["results"].items():
        for key, value in row.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filter_ = key.split(",", 1)
            n = results["n-samples"].get(task, {}).get("effective", row.get("sample_len"))
            version_ = results["versions"].get(task)
            rows.append(
                {
                    "task": task,
                    "metric": metric,
                    "filter": filter_,
                    # A NaN or infinite score is kept as it is: it says the model's outputs are not finite.
                    "value": _number(value, keep_nonfinite=True),
                    "stderr": _number(row.get(f"{metric}_stderr,{filter_}")),
                    "n_samples": None if n is None else int(n),
                    "task_version": None if version_ is None else str(version_),
                    "higher_is_better": results["higher_is_better"].get(task, {}).get(metric),
                }
            )
    return rows


def sample_rows(results: dict) -> list[dict]:
    rows = []
    for task, logged in results.get("samples", {}).items():
        output_type = results["configs"][task]["output_type"]
        for sample in logged:
            detail = _detail(sample, output_type)
            for metric in sample["metrics"]:
                value, extra = sample[metric], {}
                # Corpus-level metrics log a pair per doc and aggregate later: perplexities (loglikelihood,
                # words or bytes), f1/mcc/bleu (gold, prediction). Only the first kind has a number per doc.
                if isinstance(value, (list, tuple)):
                    if output_type == "loglikelihood_rolling":
                        value, extra = value[0], {"weight": _number(value[1])}
                    else:
                        value, extra = None, {"pair": _compact(value)}
                rows.append(
                    {
                        "task": task,
                        "doc_id": int(sample["doc_id"]),
                        "metric": metric,
                        # A NaN or infinite score is kept as it is: it says the model's outputs are not finite.
                        "value": _number(value, keep_nonfinite=True),
                        "detail": detail | extra,
                        "filter": sample["filter"],
                    }
                )
    return rows + _group_rows(results, rows)


# Subtasks' documents number from 0 each; under their group, each subtask's come from its own block of ids.
GROUP_DOC_BLOCK = 1_000_000


def _group_rows(results: dict, rows: list[dict]) -> list[dict]:
    """Each group's items: its subtasks' rows again under the group's name (a subtask's doc ids offset by its
    position), so that a gate on a group (MMLU's acc over all subjects) is judged item by item, paired
    between base and variant, like any task. Groups averaged by size (weight_by_size, as qg_mmlu) are the mean
    of exactly these items."""
    out = []
    for group, members in sorted(results.get("group_subtasks", {}).items()):
        for i, member in enumerate(sorted(members)):
            out += [{**r, "task": group, "doc_id": i * GROUP_DOC_BLOCK + r["doc_id"],
                     "detail": {**r["detail"], "subtask": member}} for r in rows if r["task"] == member]
    return out


def _detail(sample: dict, output_type: str) -> dict:
    resps = sample["filtered_resps"]
    detail: dict[str, Any] = {"target": _compact(sample["target"])}
    if output_type == "multiple_choice":
        detail["lls"] = [float(r[0]) for r in resps]
    elif output_type == "loglikelihood":
        detail |= {"ll": float(resps[0][0]), "greedy": bool(resps[0][1])}
    elif output_type == "loglikelihood_rolling":
        detail["ll"] = float(resps[0])
    elif output_type == "generate_until":
        detail |= {"response": _compact(sample["resps"][0][0]), "filtered": _compact(resps[0])}
    return detail


def _compact(value: Any, limit: int = 200) -> Any:
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "…"
    if isinstance(value, (list, tuple)):
        return [_compact(v, limit) for v in value]
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, (bool, int)) or value is None:
        return value
    return _compact(str(value), limit)


def _number(value: Any, keep_nonfinite: bool = False) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):  # lm-eval writes "N/A" where it has no stderr
        return None
    return x if keep_nonfinite or math.isfinite(x) else None
