"""One next-token pass per context gives lm-eval's loglikelihoods of one-token continuations (next_token.py).

On the CPU the next-token distributions come from Transformers, the role vLLM's engine has on the GPU (there
`vllm_next_token.NextTokenVLLM` asks vLLM for them: `tests/gpu/test_next_token_gpu.py` sets it beside lm-eval's own
vLLM path); what is checked here is the grouping and the reading back, against lm-eval's hf backend scoring every
request as its own prompt.
"""

from __future__ import annotations

import pytest

from quantgate.tasks.adapters.evaluators import next_token
from tests.shared_data import SHARED

MODEL = SHARED / "models" / "stories260k-i256"
pytestmark = pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} is not there")

CONTEXTS = ["Once upon a time, there was a little girl named Lily. She",
            "The dog ran to the park. He saw a big",
            "Tom and Sue went to the"]
CHOICES = [" was", " had", " liked", " big", " dog", " park", " little"]


@pytest.fixture(scope="module")
def lm():
    from lm_eval.api.registry import get_model

    return get_model("hf").create_from_arg_obj({"pretrained": str(MODEL), "dtype": "float32"},
                                               {"batch_size": 4, "device": "cpu"})


def _requests(lm) -> list[next_token.Request]:
    """MMLU's shape: each context with several choices, most one token long, some longer (lm-eval's path)."""
    out = []
    for context in CONTEXTS:
        for choice in [*CHOICES, " went to the park"]:
            out.append(((context, choice), *lm._encode_pair(context, choice)))
    return out


def _next_token_logprobs(lm, tokens: tuple[int, ...]) -> tuple[dict[int, float], int]:
    import torch

    with torch.no_grad():
        logits = lm.model(torch.tensor([tokens])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return dict(enumerate(logprobs.tolist())), int(torch.argmax(logits))


def test_one_pass_per_context_gives_lm_evals_loglikelihoods_of_one_token_continuations(lm):
    requests = _requests(lm)
    own = lm._loglikelihood_tokens(requests)  # lm-eval: every request a prompt of its own
    contexts, rest = next_token.plan(requests, lm.max_length, max_candidates=128)
    assert len(contexts) == len(CONTEXTS)
    assert all(len(requests[i][2]) > 1 for i in rest) and rest  # the longer continuations stay on lm-eval's path
    scored = {}
    for context in contexts:
        scored |= dict(next_token.answers(context, *_next_token_logprobs(lm, context.tokens)))
    assert sorted(scored) == sorted(set(range(len(requests))) - set(rest))
    for index, (loglikelihood, greedy) in scored.items():
        assert loglikelihood == pytest.approx(own[index][0], abs=1e-4), requests[index][0]
        assert greedy == own[index][1], requests[index][0]


def test_what_one_pass_cannot_score_takes_lm_evals_path():
    one, two = [5], [5, 6]
    requests = [(("a", "b"), [1, 2, 3], one), (("a", "c"), [1, 2, 3], [7]), (("a", "d"), [1, 2, 3], two),
                (("", "e"), [], one), (("f", "g"), list(range(10)), one), (("a", "h"), [1, 2, 3], [8])]
    contexts, rest = next_token.plan(requests, max_length=10, max_candidates=2)
    # two tokens; no context; context and continuation past max_length; a third candidate past max_candidates
    assert rest == [2, 3, 4, 5]
    (context,) = contexts
    assert context.tokens == (1, 2, 3) and context.candidates == [5, 7]
    assert next_token.answers(context, {5: -0.5, 7: -1.5, 9: -0.1}, greedy=9) == [(0, (-0.5, False)), (1, (-1.5, False))]
    with pytest.raises(ValueError, match="lack continuation tokens"):
        next_token.answers(context, {5: -0.5}, greedy=5)
