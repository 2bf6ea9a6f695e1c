"""The prompts of a speed scenario, the same for every engine and variant: token ids of exactly input_len, or
(an offline scenario's `prompt_input: text`) the text prompts of `vllm bench throughput`'s random dataset."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from quantgate.catalog.scenarios import OfflineScenario, ScenarioSpec
from quantgate.tasks.adapters.speed.errors import BenchmarkError

# One pass's prompts as the engine takes them: token ids, or text it tokenizes itself.
Prompts = list[list[int]] | list[str]


def make_prompts(scenario: ScenarioSpec, tokenizer_path: str) -> list[list[int]]:
    """num_prompts prompts of exactly input_len token ids, the same for every engine and variant.

    Without a prompts_file: uniform random ids from the vocabulary minus special and added tokens, seeded
    by scenario.seed. With one: prompt i is the first input_len tokens of the text starting at its
    (i mod lines)-th non-empty line, continuing into the next lines when that line is too short.
    With shared_prefix_len k, the first k tokens are the same in every prompt.
    """
    return _token_prompt_sets(scenario, tokenizer_path, 1)[0]


def make_prompt_sets(scenario: ScenarioSpec, tokenizer_path: str, passes: int) -> list[Prompts]:
    """The prompts of each of `passes` passes over a scenario. They are the same every pass, except that
    with a shared prefix and random prompts each pass gets fresh tails: prefix caching may then reuse
    the shared prefix from one pass to the next, never a whole prompt."""
    if isinstance(scenario, OfflineScenario) and scenario.prompt_input == "text":
        return [bench_text_prompts(scenario, tokenizer_path)] * passes
    return list(_token_prompt_sets(scenario, tokenizer_path, passes))


def _token_prompt_sets(scenario: ScenarioSpec, tokenizer_path: str, passes: int) -> list[list[list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    k = scenario.shared_prefix_len
    if scenario.prompts_file:
        prompts = _file_prompts(Path(scenario.prompts_file), tokenizer, scenario.num_prompts, scenario.input_len)
        if k:
            prompts = [prompts[0][:k] + p[k:] for p in prompts]
        return [prompts] * passes
    excluded = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    pool = [i for i in range(len(tokenizer)) if i not in excluded]

    def draw(rng: random.Random, n: int) -> list[int]:
        return [rng.choice(pool) for _ in range(n)]

    if not k:
        rng = random.Random(scenario.seed)
        return [[draw(rng, scenario.input_len) for _ in range(scenario.num_prompts)]] * passes
    prefix = draw(random.Random(f"{scenario.seed}/prefix"), k)
    sets = []
    for n in range(passes):
        rng = random.Random(f"{scenario.seed}/pass{n}")
        sets.append([prefix + draw(rng, scenario.input_len - k) for _ in range(scenario.num_prompts)])
    return sets


def bench_text_prompts(scenario: OfflineScenario, tokenizer_path: str) -> list[str]:
    """The text prompts `vllm bench throughput --dataset-name random --random-range-ratio 0 --seed S` times, made by
    vLLM's own dataset and tokenizer loader as the bench makes them (GPU machines: vLLM is installed there)."""
    try:
        from vllm.benchmarks.datasets import RandomDataset
        from vllm.tokenizers import get_tokenizer
    except ImportError as e:
        raise BenchmarkError(f"prompt_input 'text' makes its prompts with vLLM's benchmark dataset: {e}") from None
    requests = RandomDataset(random_seed=scenario.seed).sample(
        tokenizer=get_tokenizer(tokenizer_path), num_requests=scenario.num_prompts, prefix_len=0, range_ratio=0.0,
        input_len=scenario.input_len, output_len=scenario.output_len)
    return [r.prompt for r in requests]


def _file_prompts(path: Path, tokenizer: Any, num_prompts: int, input_len: int) -> list[list[int]]:
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise BenchmarkError(f"prompts_file {path}: {e.strerror or e}") from None
    if not lines:
        raise BenchmarkError(f"prompts_file {path}: no non-empty lines")
    encoded: dict[int, list[int]] = {}

    def tokens(j: int) -> list[int]:
        if j not in encoded:
            encoded[j] = tokenizer(lines[j], add_special_tokens=False)["input_ids"]
        return encoded[j]

    prompts = []
    for i in range(num_prompts):
        ids: list[int] = []
        for step in range(len(lines)):
            ids += tokens((i + step) % len(lines))
            if len(ids) >= input_len:
                break
        if len(ids) < input_len:
            raise BenchmarkError(f"prompts_file {path}: the whole file has fewer than input_len={input_len} tokens")
        prompts.append(ids[:input_len])
    return prompts

