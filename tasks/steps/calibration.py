"""Calibration data: a catalog calibration set read, rendered and tokenized into exact-length samples, and
checked for overlap with everything the suite evaluates before any build uses it.

Every sample starts at a document (a paragraph of a text file, a conversation) of the set, taken in an order
shuffled by the set's seed; documents shorter than `seq_len` tokens are packed with the next ones and the
sample is cut at exactly `seq_len` tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import random
import re
import sysconfig
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prefect import task

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.paths import default_kl_text
from quantgate.catalog.records import CalibrationSamples, LocalTaskConfig
from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.catalog.variants import (
    CalibrationSpec, ChatCalibration, EvalHoldoutCalibration, HoldoutSlice, TextCalibration,
)

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
# What a set is checked against: (name, documents) for the KL text and each evaluated task.
Evaluated = list[tuple[str, list[dict[str, Any]]]]

# Overlap is found on word 13-grams, the unit of GPT-3's contamination study (Brown et al. 2020, app. C): a
# copied question or passage shares many, while the phrases that recur in unrelated text ("which of the
# following is", a licence line, a chat template's system prompt) are shorter. Fields of 8 to 12 words (short
# questions) are compared whole; shorter ones (choices such as "None of the above", numbers) say nothing.
SHINGLE_WORDS = 13
MIN_FIELD_WORDS = 8
# A shingle that recurs in this many items of one task is that task's template (MMLU moral_scenarios repeats
# a 30-word stem in every question; passkey haystacks repeat the same stories), not an item's own text.
TEMPLATE_ITEMS = 5
# An item is copied when the calibration holds at least this share of its distinctive shingles (a copied
# question holds them all), or this many of them (20 words of a long passage, copied word for word); a
# template phrase running into an item's first words (moral_scenarios: "... as of 2020? Scenario 1 | I was")
# matches a few of dozens.
COPIED_SHARE = 0.5
COPIED_SHINGLES = 8


class CalibrationError(QuantgateError, RuntimeError):
    """A calibration set that cannot be read, is too small, or overlaps evaluated text; the message is one line."""


def label(calib: CalibrationSpec) -> str:
    if calib.name:
        return calib.name
    match calib:
        case TextCalibration():
            folder = calib.path is None or Path(calib.path).is_dir()
            return f"text {calib.path or 'stdlib'}" + (f" ({calib.glob})" if folder else "")
        case ChatCalibration():
            return f"chat {calib.path}"
        case EvalHoldoutCalibration():
            return "eval_holdout " + ", ".join(f"{s.dataset}[{s.start}:{s.stop or ''}]" for s in calib.items)
    raise CalibrationError(f"unknown calibration kind {calib.kind!r}")


def load_calibration(calib: CalibrationSpec, tokenizer_dir: str | Path) -> CalibrationSamples:
    """`calib.samples` samples of exactly `calib.seq_len` tokens of `tokenizer_dir`'s tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    name = label(calib)
    if isinstance(calib, TextCalibration) or (isinstance(calib, EvalHoldoutCalibration) and not calib.chat):
        # Plain text opens the way the tokenizer opens any text (Llama: BOS); a chat template has its own framing.
        prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])
        texts = (_paragraphs(calib) if isinstance(calib, TextCalibration)
                 else ["\n".join(m["content"] for m in turns) for turns in _holdout(calib.items)])
        docs: Iterable[str] = (t + "\n\n" for t in _shuffled(texts, calib.seed))
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise CalibrationError(f"calibration set {name}: {tokenizer_dir} has no chat template to render"
                                   f" {calib.kind} samples with; use kind text")
        prefix = []
        conversations = _chat_file(calib) if isinstance(calib, ChatCalibration) else _holdout(calib.items)
        docs = (tokenizer.apply_chat_template(m, tokenize=False) for m in _shuffled(conversations, calib.seed))
    tokenized = (tokenizer(d, add_special_tokens=False, verbose=False)["input_ids"] for d in docs)
    samples = _pack(tokenized, prefix, calib.seq_len, calib.samples)
    if len(samples) < calib.samples:
        raise CalibrationError(f"calibration set {name}: its documents make {len(samples)} samples of"
                               f" {calib.seq_len} tokens, {calib.samples} asked")
    return CalibrationSamples(label=name, seq_len=calib.seq_len, input_ids=tuple(samples))


def _pack(docs: Iterator[list[int]], prefix: list[int], seq_len: int, wanted: int) -> list[tuple[int, ...]]:
    samples: list[tuple[int, ...]] = []
    current = list(prefix)
    for ids in docs:
        current += ids
        if len(current) >= seq_len:
            samples.append(tuple(current[:seq_len]))
            if len(samples) == wanted:
                break
            current = list(prefix)
    return samples


def _shuffled(items: list, seed: int) -> list:
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def _paragraphs(calib: TextCalibration) -> list[str]:
    root = Path(calib.path) if calib.path else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise CalibrationError(f"calibration text {root}: no such file or folder")
    if root.is_file():
        files = [root]
    else:
        # Installed packages may live under the stdlib folder (pyenv, a plain install): not the stdlib's own text.
        files = sorted(f for f in root.glob(calib.glob)
                       if f.is_file() and not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts))
    if not files:
        raise CalibrationError(f"calibration set {label(calib)}: no files match {calib.glob!r} under {root}")
    paragraphs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            if f == root:
                raise CalibrationError(f"calibration text {f}: not UTF-8 text") from None
            # A folder may hold files in other encodings (the stdlib's own tests do, on purpose): left out.
            log.debug("calibration: %s is not UTF-8 text; left out", f)
            continue
        except OSError as e:
            raise CalibrationError(f"calibration text {f}: cannot read ({e.strerror or e})") from None
        paragraphs += [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paragraphs:
        raise CalibrationError(f"calibration set {label(calib)}: no text in {root}")
    return paragraphs


def _chat_file(calib: ChatCalibration) -> list[Messages]:
    try:
        lines = Path(calib.path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise CalibrationError(f"calibration chat file {calib.path}: cannot read ({e.strerror or e})") from None
    conversations = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            if not messages or not all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in messages):
                raise ValueError("messages must be a non-empty list of {role, content} strings")
        except (ValueError, KeyError, TypeError) as e:
            raise CalibrationError(f"calibration chat file {calib.path} line {n}: not a {{\"messages\": [...]}}"
                                   f" conversation ({e})") from None
        conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    return conversations


def _holdout(slices: tuple[HoldoutSlice, ...]) -> list[Messages]:
    from quantgate.catalog.lm_eval_tasks import utils
    from quantgate.catalog.lm_eval_tasks.gsm8k_cot import gsm8k_answer

    conversations: list[Messages] = []
    for s in slices:
        if s.dataset == "gsm8k":
            docs = list(utils.gsm8k()["test"])[s.start:s.stop]
            conversations += [_turns(d["question"], gsm8k_answer(d["answer"])) for d in docs]
        elif s.dataset == "hellaswag":
            docs = list(utils.hellaswag()["validation"])[s.start:s.stop]
            conversations += [_turns(d["query"], d["choices"][d["label"]]) for d in docs]
        else:
            files = (utils.data_root() / "mmlu" / "test").glob("*_test.csv")
            for subject in sorted(f.name.removesuffix("_test.csv") for f in files):
                for d in list(utils.mmlu(subject)["test"])[s.start:s.stop]:
                    question = d["question"].strip() + "".join(f"\n{k}. {c}" for k, c in zip("ABCD", d["choices"]))
                    conversations.append(_turns(question, f"{'ABCD'[d['answer']]}. {d['choices'][d['answer']]}"))
    return conversations


def _turns(question: str, answer: str) -> Messages:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


# --- overlap with what is evaluated ----------------------------------------------------------------------


def check_calibration(calib: CalibrationSpec, tokenizer_dir: str | Path, suite: SuiteSpec,
                      evaluated: Evaluated | None = None) -> CalibrationSamples:
    """The calibration samples, after checking that they share no text with any item the suite evaluates (each
    local task's evaluated documents within its limit, and its few-shot pool when it asks for few-shot) nor with
    the suite's KL text. Raises CalibrationError naming the set, the task and an example item.

    `evaluated`: `evaluated_documents(suite)`, where the caller has read them already (its cache key has)."""
    samples = load_calibration(calib, tokenizer_dir)
    index = _EvaluatedText()
    for name, docs in evaluated if evaluated is not None else evaluated_documents(suite):
        index.add(name, docs)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    texts = (tokenizer.decode(list(ids), skip_special_tokens=True) for ids in samples.input_ids)
    if (hit := index.overlap(texts)) is not None:
        task_name, item, share, words = hit
        raise CalibrationError(f"calibration set {samples.label} overlaps {task_name} item {item} ({share:.0%} of its"
                               f" text, e.g. \"{words}\"); calibrate on text the suite does not evaluate")
    return samples


def evaluated_documents(suite: SuiteSpec) -> Evaluated:
    """What check_calibration compares a calibration set with: (name, documents) for the suite's KL text (one
    document a paragraph) and for each leaf of its local tasks (the documents it evaluates)."""
    kl_text = suite.kl_text or default_kl_text()
    try:
        paragraphs = re.split(r"\n\s*\n", Path(kl_text).read_text(encoding="utf-8"))
    except OSError as e:
        raise CalibrationError(f"KL text {kl_text}: cannot read ({e.strerror or e})") from None
    evaluated: Evaluated = [("the KL text", [{"text": p} for p in paragraphs if p.strip()])]
    from quantgate.tasks.adapters.evaluators.lm_eval import local_task_configs

    configs = local_task_configs(suite)
    if unchecked := [t.name for t in suite.tasks if t.name not in configs]:
        log.warning("calibration overlap not checked against %s: not local tasks", unchecked)
    for t in suite.tasks:
        for leaf in configs.get(t.name, []):
            evaluated.append((leaf.name, _evaluated_docs(leaf, t, suite)))
    return evaluated


def calibration_documents(calib: CalibrationSpec) -> list[str] | list[Messages]:
    """A set's documents as read (text paragraphs, conversations), before they are shuffled, rendered and
    tokenized: with the tokenizer and the set's spec, what its samples are made of."""
    match calib:
        case TextCalibration():
            return _paragraphs(calib)
        case ChatCalibration():
            return _chat_file(calib)
        case EvalHoldoutCalibration():
            return _holdout(calib.items)
    raise CalibrationError(f"unknown calibration kind {calib.kind!r}")


def strings(doc: Any) -> list[str]:
    """The text of a document as the check reads it: its string values, nested ones included, in order."""
    return list(_strings(doc))


def _evaluated_docs(leaf: LocalTaskConfig, task_spec: LocalTask, suite: SuiteSpec) -> list[dict[str, Any]]:
    cfg = leaf.config
    function = cfg.get("custom_dataset")
    if not isinstance(function, dict) or "!function" not in function:
        log.warning("calibration overlap not checked against %s: its data is not loaded by a local function", leaf.name)
        return []
    module_name, _, attr = function["!function"].rpartition(".")
    file = Path(leaf.yaml_path).parent / (module_name.replace(".", "/") + ".py")
    spec = importlib.util.spec_from_file_location(f"quantgate_task_data_{module_name}", file)
    if spec is None or spec.loader is None:
        raise CalibrationError(f"task {leaf.name}: cannot load its data module {file}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # As lm-eval calls a custom_dataset: the task's metadata (the suite's over the YAML's) and dataset_kwargs.
    metadata = (cfg.get("metadata") or {}) | task_spec.metadata
    data = getattr(module, attr)(**metadata, **(cfg.get("dataset_kwargs") or {}))
    split = cfg.get("test_split") or cfg.get("validation_split")
    docs = list(data[split])[:task_spec.limit]
    fewshot = suite.num_fewshot_of(task_spec)
    if (cfg.get("num_fewshot") if fewshot is None else fewshot) and cfg.get("fewshot_split"):
        docs += list(data[cfg["fewshot_split"]])
    return docs


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _digest(words: list[str]) -> bytes:
    return hashlib.blake2b(" ".join(words).encode(), digest_size=8).digest()


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


class _EvaluatedText:
    """Content hashes of the distinctive shingles of every evaluated item, and which items hold each."""

    def __init__(self) -> None:
        self.items: list[tuple[str, int, int]] = []  # (task, item, number of distinctive shingles)
        self.owners: dict[bytes, list[int]] = defaultdict(list)
        self.text: dict[bytes, str] = {}
        self.lengths: set[int] = set()

    def add(self, task_name: str, docs: list[dict[str, Any]]) -> None:
        per_item: list[dict[bytes, list[str]]] = []
        for doc in docs:
            shingles: dict[bytes, list[str]] = {}
            for field in _strings(doc):
                words = _words(field)
                if len(words) < MIN_FIELD_WORDS:
                    continue
                n = min(SHINGLE_WORDS, len(words))
                for i in range(len(words) - n + 1):
                    shingles[_digest(words[i:i + n])] = words[i:i + n]
            per_item.append(shingles)
        seen = Counter(d for shingles in per_item for d in shingles)
        for item, shingles in enumerate(per_item):
            own = {d: w for d, w in shingles.items() if seen[d] < TEMPLATE_ITEMS}
            if not own:
                continue
            self.items.append((task_name, item, len(own)))
            for d, words in own.items():
                self.owners[d].append(len(self.items) - 1)
                self.text[d] = " ".join(words)
                self.lengths.add(len(words))

    def overlap(self, texts: Iterable[str]) -> tuple[str, int, float, str] | None:
        """The evaluated item whose distinctive shingles the texts share most, when they share COPIED_SHARE of
        them or COPIED_SHINGLES: (task, item, share, one shared shingle)."""
        shared: Counter[int] = Counter()
        example: dict[int, bytes] = {}
        found: set[bytes] = set()
        for text in texts:
            words = _words(text)
            for n in self.lengths:
                for i in range(len(words) - n + 1):
                    d = _digest(words[i:i + n])
                    if d in self.owners and d not in found:
                        found.add(d)
                        for item in self.owners[d]:
                            shared[item] += 1
                            example.setdefault(item, d)
        copied = [i for i, n in shared.items() if n >= COPIED_SHINGLES or n / self.items[i][2] >= COPIED_SHARE]
        if not copied:
            return None
        worst = max(copied, key=lambda i: shared[i] / self.items[i][2])
        task_name, item, total = self.items[worst]
        return task_name, item, shared[worst] / total, self.text[example[worst]]


check_calibration_task = task(check_calibration, name="check-calibration", tags=["quantize"])
