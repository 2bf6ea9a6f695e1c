"""Loglikelihoods of one-token continuations from one next-token pass per context (no engine imported here).

A multiple-choice task asks lm-eval for the loglikelihood of each choice after the same context: MMLU's four
letters are four requests, each the whole few-shot prompt (about 660 tokens in the reference suite) plus one token.
lm-eval's vLLM backend scores every request as its own prompt with `prompt_logprobs`, and vLLM computes such a
prompt from scratch (a request that asks for prompt logprobs reads nothing from the prefix cache): four prefills of
the same context, and none of the few-shot prefix that a subject's questions share is reused. When every
continuation is one token, what lm-eval reads (the logprob of that token after the context, and whether it is the
argmax) is the next-token distribution after the context, which one pass per distinct context gives for all its
choices at once, with the prefix cache on. `plan` groups the requests; `answers` turns a context's next-token
logprobs back into lm-eval's (loglikelihood, is_greedy) per request. The numbers are the same quantities lm-eval
computes, up to floating-point rounding of a different batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# What an eval key records of it (lm_eval.eval_key): evaluations scored before it are not reused beside it.
SCORING = "one-token continuations: one next-token pass per context"
# A request as lm-eval hands it to `_loglikelihood_tokens`: ((context, continuation) strings, their token ids).
Request = tuple[tuple[str, str], Sequence[int], Sequence[int]]


@dataclass
class Context:
    """One distinct context and the requests that score a one-token continuation after it."""

    tokens: tuple[int, ...]
    members: list[tuple[int, int]] = field(default_factory=list)  # (request index, continuation token)

    @property
    def candidates(self) -> list[int]:
        """The distinct continuation tokens to ask the next-token logprobs of, in first-seen order."""
        return list(dict.fromkeys(token for _, token in self.members))


def plan(requests: Sequence[Request], max_length: int, max_candidates: int) -> tuple[list[Context], list[int]]:
    """The contexts to score in one pass each, and the indices of the requests lm-eval's own path keeps: a
    continuation of more than one token, a context that is empty or would be truncated (lm-eval then cuts its
    start), or more distinct tokens after one context than one pass may ask for (`max_candidates`) go that way."""
    contexts: dict[tuple[int, ...], Context] = {}
    rest: list[int] = []
    for index, (_, context, continuation) in enumerate(requests):
        if len(continuation) != 1 or not context or len(context) + 1 > max_length:
            rest.append(index)
            continue
        group = contexts.setdefault(tuple(context), Context(tuple(context)))
        if continuation[0] not in (candidates := group.candidates) and len(candidates) >= max_candidates:
            rest.append(index)
            continue
        group.members.append((index, continuation[0]))
    return list(contexts.values()), rest


def answers(context: Context, logprobs: Mapping[int, float], greedy: int) -> list[tuple[int, tuple[float, bool]]]:
    """Each member request's (loglikelihood, is_greedy) from the next-token `logprobs` after the context (holding
    every candidate) and its argmax token `greedy`, as lm-eval's `_parse_logprobs` reads them from prompt logprobs."""
    missing = [t for t in context.candidates if t not in logprobs]
    if missing:
        raise ValueError(f"next-token logprobs lack continuation tokens {missing[:5]}")
    return [(index, (float(logprobs[token]), token == greedy)) for index, token in context.members]
