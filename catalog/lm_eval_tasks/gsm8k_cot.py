"""qg_gsm8k_cot's loader: GSM8K split into worked examples and asked problems (a module of its own, so that the
hashes of utils.py, and with them the eval keys of the other qg_* tasks, stay as they were)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from datasets import Dataset, DatasetDict

# lm-eval loads a task's !function module by its file path, with no package around it: utils.py likewise.
_spec = importlib.util.spec_from_file_location("qg_task_utils", Path(__file__).with_name("utils.py"))
utils = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(utils)


def gsm8k_answer(answer: str) -> str:
    """A GSM8K solution without its calculator annotations ("48/2 = <<48/2=24>>24" → "48/2 = 24"), ending "#### N"."""
    return re.sub(r"<<[^>]*>>", "", answer)


def gsm8k_cot(fewshot_items: int = 8, **kwargs) -> DatasetDict:
    """The first `fewshot_items` test problems, their solutions without calculator annotations, are the worked
    examples (split "fewshot"); the others are asked (split "test"): no example is ever asked."""
    docs = [{"question": d["question"], "answer": gsm8k_answer(d["answer"])} for d in utils.gsm8k()["test"]]
    k = int(fewshot_items)
    return DatasetDict({"fewshot": Dataset.from_list(docs[:k]), "test": Dataset.from_list(docs[k:])})
