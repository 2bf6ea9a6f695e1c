"""lm-eval's vLLM backend with one-token continuations scored by one next-token pass per context (next_token.py).

Imported only in an evaluation process with the vllm backend (it imports vLLM). Requests whose continuation is
longer than one token (PIQA's sentences, rolling perplexity windows) take lm-eval's own path unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import vllm.sampling_params
from lm_eval.models.vllm_causallms import VLLM
from vllm import SamplingParams

from quantgate.catalog.errors import one_line
from quantgate.tasks.adapters.evaluators import next_token

log = logging.getLogger(__name__)

# vLLM returns the logprobs of a request's `logprob_token_ids` (at most this many) beside its sampled token.
MAX_CANDIDATES = getattr(vllm.sampling_params, "MAX_LOGPROB_TOKEN_IDS", 128)
HAS_TOKEN_LOGPROBS = "logprob_token_ids" in getattr(SamplingParams, "__struct_fields__", ())


class NextTokenVLLM(VLLM):
    """lm-eval's VLLM model; `scored` counts the loglikelihood requests each path scored, and why vLLM refused the
    next-token passes if it did (the evaluation's record)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scored: dict[str, int | str] = {"next_token": 0, "lm_eval": 0}

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's own check: a prompt plus its continuation within max_length - 1 (one token is generated).
        contexts, rest = next_token.plan(requests, self.max_length - 1, MAX_CANDIDATES) if HAS_TOKEN_LOGPROBS \
            else ([], list(range(len(requests))))  # an older vLLM: lm-eval's own path for every request
        results: dict[int, tuple[float, bool]] = self._next_token_passes(requests, contexts) if contexts else {}
        if contexts and not results:  # vLLM refused the passes: lm-eval's path for their requests too
            rest = sorted(rest + [index for c in contexts for index, _ in c.members])
        if rest:
            own = super()._loglikelihood_tokens([requests[i] for i in rest], disable_tqdm=disable_tqdm)
            results |= dict(zip(rest, own, strict=True))
        self.scored["lm_eval"] += len(rest)
        self.scored["next_token"] += len(requests) - len(rest)
        return [results[i] for i in range(len(requests))]

    def _next_token_passes(self, requests: list, contexts: list[next_token.Context]) -> dict[int, tuple[float, bool]]:
        """Each grouped request's (loglikelihood, is_greedy) from one pass per context; none when vLLM refuses the
        requests (its validation, as they are added) or answers without the logprobs asked for, the reason kept in
        `scored`: lm-eval's path then scores them. An engine that fails otherwise fails the evaluation."""
        try:
            params = [SamplingParams(temperature=0, max_tokens=1, logprob_token_ids=c.candidates, detokenize=False)
                      for c in contexts]
            outputs = self._model_generate([list(c.tokens) for c in contexts], generate=True, sampling_params=params)
            results = dict(answer for context, output in zip(contexts, outputs, strict=True)
                           for answer in _read(context, output.outputs[0]))
        except (ValueError, TypeError, LookupError, AttributeError) as e:  # VLLMValidationError: a ValueError
            self.scored["refused"] = one_line(e)
            log.warning("next-token passes refused or unreadable (%s): lm-eval's path instead", one_line(e))
            return {}
        for index, answer in results.items():
            if requests[index][0] is not None:  # lm-eval's cache hook, as its own path feeds it
                self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
        return results


def _read(context: next_token.Context, completion: Any) -> list[tuple[int, tuple[float, bool]]]:
    """A context's answers from its pass: the logprobs of its candidates at the one generated position, beside the
    token generated (greedy: the argmax)."""
    if not completion.logprobs:
        raise ValueError("vLLM returned no logprobs for logprob_token_ids")
    logprobs = {t: getattr(lp, "logprob", lp) for t, lp in completion.logprobs[0].items()}
    return next_token.answers(context, logprobs, completion.token_ids[0])
