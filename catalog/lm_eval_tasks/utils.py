"""Loaders for the qg_* tasks: read the offline eval data into `datasets` objects, never touching a hub.

lm-eval calls a task's `custom_dataset` with the task metadata and `dataset_kwargs` as keyword arguments,
so every loader takes **kwargs. The data root is $QUANTGATE_EVAL_DATA, else ../shared/data/eval beside the
repository that holds this file.
"""

from __future__ import annotations

import bz2
import csv
import json
from pathlib import Path

from datasets import Dataset, DatasetDict

DATA_ENV = "QUANTGATE_EVAL_DATA"


def data_root() -> Path:
    from quantgate.catalog.paths import eval_data_root

    return eval_data_root()


def _file(*parts: str) -> Path:
    path = data_root().joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"eval data file {path} not found (set {DATA_ENV} to the folder that holds the eval data)")
    return path


def simple_stories(**kwargs) -> DatasetDict:
    text = _file("simple_stories", "simple_stories.txt").read_text(encoding="utf-8")
    stories = [s.strip() for s in text.split("\n\n") if s.strip()]
    return DatasetDict({"test": Dataset.from_list([{"text": s} for s in stories])})


def piqa(**kwargs) -> DatasetDict:
    with _file("piqa", "valid.jsonl").open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    labels = _file("piqa", "valid-labels.lst").read_text().split()
    if len(labels) != len(rows):
        raise ValueError(f"piqa: {len(rows)} questions but {len(labels)} labels")
    docs = [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(y)} for r, y in zip(rows, labels)]
    return DatasetDict({"validation": Dataset.from_list(docs)})


def hellaswag(**kwargs) -> DatasetDict:
    # llama.cpp layout: 6 lines per item (context, gold index, 4 endings), already cleaned of WikiHow markup.
    with bz2.open(_file("hellaswag", "hellaswag_val_full.txt.bz2"), "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    docs = [
        {"query": lines[i], "label": int(lines[i + 1]), "choices": lines[i + 2 : i + 6]}
        for i in range(0, len(lines) - 5, 6)
    ]
    return DatasetDict({"validation": Dataset.from_list(docs)})


def truthfulqa_mc(**kwargs) -> DatasetDict:
    items = json.loads(_file("truthfulqa", "mc_task.json").read_text(encoding="utf-8"))
    docs = []
    for item in items:
        choices, labels = zip(*item["mc1_targets"].items())
        docs.append({"question": item["question"], "choices": list(choices), "label": labels.index(1)})
    return DatasetDict({"validation": Dataset.from_list(docs)})


def gsm8k(**kwargs) -> DatasetDict:
    with _file("gsm8k", "test.jsonl").open(encoding="utf-8") as f:
        docs = [json.loads(line) for line in f if line.strip()]
    return DatasetDict({"test": Dataset.from_list(docs)})


def mmlu(subject: str, **kwargs) -> DatasetDict:
    def read(split: str) -> Dataset:
        with _file("mmlu", split, f"{subject}_{split}.csv").open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        return Dataset.from_list(
            [{"question": r["question"], "choices": [r[f"choice{i}"] for i in range(4)], "answer": int(r["answer"])} for r in rows]
        )

    return DatasetDict({"dev": read("dev"), "test": read("test")})


# --- qg_passkey: long-context retrieval --------------------------------------------------------------------

# Needle owners: names that do not occur in simple_stories.txt, so the haystack never answers for them.
PASSKEY_NAMES = (
    "Aurelio", "Brisa", "Casimir", "Delphine", "Evander", "Fenna", "Gideon", "Hestia", "Ignatius", "Juniper",
    "Kasimir", "Linnea", "Marisol", "Nikolai", "Ottilie", "Perpetua", "Quillon", "Rosalind", "Severin", "Thelonius",
)


def passkey_prompts(
    text: str,
    *,
    context_words: int = 150,
    depths: list[float] | tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0),
    per_depth: int = 4,
    seed: int = 1234,
) -> list[dict]:
    """Needle-in-a-haystack items, the same on every run: a haystack of `context_words` words cut at
    sentence ends from `text` (repeated as often as needed, each item starting at another sentence), with
    the needle "The magic number of NAME is NNNN." placed after the sentence nearest to `depth` of the
    way through (0: first, 1: last); the prompt then asks for the number, which is the target."""
    import random
    import re

    # A sentence ends at . ! or ? (and a closing quote right after it) followed by a space.
    sentences = [s for s in re.split(r"(?:(?<=[.!?])|(?<=[.!?][\"”]))\s+", " ".join(text.split())) if s]
    if not sentences:
        raise ValueError("passkey: the haystack text has no sentences")
    if context_words < 20:
        raise ValueError(f"passkey: context_words must be at least 20, got {context_words}")
    rng = random.Random(seed)
    docs = []
    for d, depth in enumerate(depths):
        if not 0.0 <= float(depth) <= 1.0:
            raise ValueError(f"passkey: depths must lie in [0, 1], got {depth}")
        for i in range(per_depth):
            name = PASSKEY_NAMES[(d * per_depth + i) % len(PASSKEY_NAMES)]
            number = str(rng.randint(1000, 9999))
            start = rng.randrange(len(sentences))
            hay: list[str] = []
            words = 0
            while words < context_words:
                sentence = sentences[(start + len(hay)) % len(sentences)]
                hay.append(sentence)
                words += len(sentence.split())
            at = round(float(depth) * len(hay))
            needle = f"The magic number of {name} is {number}."
            body = " ".join(hay[:at] + [needle] + hay[at:])
            docs.append({
                "prompt": f"{body}\n\nThe magic number of {name} is",
                "answer": number,
                "depth": float(depth),
                "context_words": words,
            })
    return docs


def passkey(context_words: int = 150, depths: list[float] | None = None, per_depth: int = 4, seed: int = 1234,
            **kwargs) -> DatasetDict:
    """qg_passkey's items from simple_stories.txt; the parameters come from the task's metadata, which a
    suite may override (LocalTask.metadata), e.g. context_words: 6000 for a model with an 8K context."""
    text = _file("simple_stories", "simple_stories.txt").read_text(encoding="utf-8")
    docs = passkey_prompts(text, context_words=int(context_words),
                           depths=tuple(depths) if depths is not None else (0.0, 0.25, 0.5, 0.75, 1.0),
                           per_depth=int(per_depth), seed=int(seed))
    return DatasetDict({"test": Dataset.from_list(docs)})
