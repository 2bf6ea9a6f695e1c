"""On the GPU: the evaluation's vLLM backend scores one-token continuations by one next-token pass per context
(vllm_next_token.NextTokenVLLM), and what it reads is what lm-eval's own vLLM path reads, on the same engine.

Run on the device: `bash benchmarks/gpu/run_tests.sh tests/gpu/test_next_token_gpu.py`.
"""

from __future__ import annotations

import pytest

from tests.shared_data import SHARED

pytestmark = pytest.mark.gpu

MODEL = SHARED / "models" / "stories260k-i256"
CONTEXTS = ["Once upon a time, there was a little girl named Lily. She",
            "The dog ran to the park. He saw a big",
            "Tom and Sue went to the"]
CHOICES = [" was", " had", " liked", " big", " dog", " park", " little", " went to the park"]


def test_next_token_passes_read_what_lm_evals_own_vllm_path_reads():
    pytest.importorskip("vllm", reason="vllm is not installed")
    from lm_eval.models.vllm_causallms import VLLM

    from quantgate.tasks.adapters.evaluators.vllm_next_token import NextTokenVLLM

    lm = NextTokenVLLM(pretrained=str(MODEL), dtype="bfloat16", gpu_memory_utilization=0.2, enforce_eager=True)
    requests = [((c, x), *lm._encode_pair(c, x)) for c in CONTEXTS for x in CHOICES]
    one_token = sum(len(r[2]) == 1 for r in requests)
    ours = lm._loglikelihood_tokens(requests)
    assert lm.scored == {"next_token": one_token, "lm_eval": len(requests) - one_token}  # vLLM took the new path
    theirs = VLLM._loglikelihood_tokens(lm, requests)  # every request a prompt of its own, prompt logprobs
    for request, (ll, greedy), (their_ll, their_greedy) in zip(requests, ours, theirs, strict=True):
        assert ll == pytest.approx(their_ll, abs=0.05), request[0]  # bf16 kernels over other batches
        assert greedy == their_greedy, request[0]
