"""Token-level KL divergence of a variant's next-token distributions from its base's, on a plain text.

Both models see the same windows of tokens (the base's tokenizer, each window led by BOS when the
tokenizer has one); every position of every window is scored with KL(P_base || P_variant) in float32.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task

from quantgate.catalog.errors import QuantgateError, one_line
from quantgate.catalog.records import MetricResult, QualityReport, SampleResult

if TYPE_CHECKING:
    import torch

TASK, METRIC, VERSION = "kl_divergence", "mean_token_kl", "1"
EVALUATOR = "quantgate-kl"
# Tokens of each window both models score (its logits are what KL holds beside the two models: model_memory.kl_need).
WINDOW_TOKENS = 256


class DivergenceError(QuantgateError, RuntimeError):
    """Unusable input for a KL run (unreadable or too short text, mismatched vocabularies); one line."""


def kl_eval_key(text_file: str, seq_len: int = WINDOW_TOKENS, max_tokens: int = 4096, dtype: str = "float32") -> str:
    """'kl:' + 16 hex chars over the text's content and the windowing; the variant uid already names the base."""
    try:
        digest = hashlib.sha256(Path(text_file).read_bytes()).hexdigest()
    except OSError as e:
        raise DivergenceError(f"KL text {text_file}: cannot read ({e.strerror or e})") from None
    key = {"text": digest, "seq_len": seq_len, "max_tokens": max_tokens, "dtype": dtype, "version": VERSION}
    return "kl:" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _windows(base_path: str, text_file: str, seq_len: int, max_tokens: int) -> list[torch.Tensor]:
    import torch
    from transformers import AutoTokenizer

    if seq_len < 2 or max_tokens < 1:
        raise DivergenceError(f"KL windows: seq_len must be >= 2 and max_tokens >= 1 (got {seq_len}, {max_tokens})")
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except OSError as e:
        raise DivergenceError(f"KL text {text_file}: cannot read ({e.strerror or e})") from None
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    # A token rarely spans more than 16 characters: cut a corpus-sized file before tokenizing it.
    ids = tokenizer(text[: 16 * max_tokens], add_special_tokens=False, verbose=False).input_ids[:max_tokens]
    if not ids:
        raise DivergenceError(f"KL text {text_file}: no tokens")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    step = seq_len - len(bos)
    return [torch.tensor([bos + ids[i : i + step]]) for i in range(0, len(ids), step)]


def _load(path: str, device: str, dtype: str) -> torch.nn.Module:
    # A checkpoint folder, or a load-time (bitsandbytes) variant: the base quantized as it loads.
    from quantgate.tasks.adapters.loadtime import load_model

    return load_model(path, device=device, dtype=dtype)


def kl_divergence(
    base_path: str,
    variant_path: str,
    text_file: str,
    *,
    seq_len: int = WINDOW_TOKENS,
    max_tokens: int = 4096,
    device: str = "cpu",
    dtype: str = "float32",
) -> tuple[MetricResult, list[SampleResult]]:
    """Mean over scored positions of KL(P_base || P_variant), and one sample per window (doc_id = window index).
    stderr is over the per-window means: positions in one window are correlated, windows far less so.
    Both models stay loaded and the windows go one at a time, so memory is two models plus one
    window's logits (seq_len x vocab), whatever max_tokens is.
    """
    windows = _windows(base_path, text_file, seq_len, max_tokens)
    return _against(_load(base_path, device, dtype), _load(variant_path, device, dtype), windows, device)


def _against(base: torch.nn.Module, variant: torch.nn.Module, windows: list[torch.Tensor],
             device: str) -> tuple[MetricResult, list[SampleResult]]:
    import torch

    samples: list[SampleResult] = []
    total, count = 0.0, 0
    with torch.inference_mode():
        for i, ids in enumerate(windows):
            ids = ids.to(device)
            log_p = torch.log_softmax(base(ids).logits[0].float(), dim=-1)
            log_q = torch.log_softmax(variant(ids).logits[0].float(), dim=-1)
            if log_p.shape != log_q.shape:
                raise DivergenceError(
                    f"KL: vocabularies differ (base {log_p.shape[-1]}, variant {log_q.shape[-1]} logits)"
                )
            # kl_div(input=log Q, target=log P) sums P * (log P - log Q): KL(P_base || P_variant).
            kl = torch.nn.functional.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
            total += kl.sum().item()
            count += kl.numel()
            detail = {
                "tokens": kl.numel(),
                "max_kl": kl.max().item(),
                "top1_agreement": (log_p.argmax(-1) == log_q.argmax(-1)).float().mean().item(),
            }
            samples.append(SampleResult(task=TASK, doc_id=i, metric=METRIC, value=kl.mean().item(), detail=detail))
    means = [s.value for s in samples]
    stderr = None
    if len(means) > 1:
        mean = sum(means) / len(means)
        stderr = math.sqrt(sum((m - mean) ** 2 for m in means) / (len(means) - 1) / len(means))
    metric = MetricResult(
        task=TASK, metric=METRIC, filter="none", value=total / count, stderr=stderr, n_samples=count,
        task_version=VERSION, higher_is_better=False,
    )  # fmt: skip
    return metric, samples


def kl_reports(
    base_path: str,
    variant_paths: dict[str, str],
    text_file: str,
    *,
    seq_len: int = WINDOW_TOKENS,
    max_tokens: int = 4096,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, QualityReport]:
    """kl_divergence of each variant (by uid) as a QualityReport for `writers.record_quality`, the base loaded
    once for all of them and each variant in turn; a failure comes back as status "failed" (a failed base
    load fails every report)."""
    import torch

    config = {"base": base_path, "text_file": text_file, "seq_len": seq_len, "max_tokens": max_tokens,
              "device": device, "dtype": dtype}  # fmt: skip
    key = kl_eval_key(text_file, seq_len, max_tokens, dtype)
    start = time.perf_counter()

    def failed(e: Exception, since: float) -> QualityReport:
        error = str(e) if isinstance(e, DivergenceError) else one_line(e)
        return QualityReport(key, EVALUATOR, config, [], [], time.perf_counter() - since, "failed", error)

    try:
        windows = _windows(base_path, text_file, seq_len, max_tokens)
        base = _load(base_path, device, dtype)
    except Exception as e:
        return {uid: failed(e, start) for uid in variant_paths}
    out: dict[str, QualityReport] = {}
    for uid, path in variant_paths.items():
        since = time.perf_counter()
        try:
            metric, samples = _against(base, _load(path, device, dtype), windows, device)
        except Exception as e:
            out[uid] = failed(e, since)
            continue
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        out[uid] = QualityReport(key, EVALUATOR, config, [metric], samples, time.perf_counter() - since)
    return out


def kl_report(base_path: str, variant_path: str, text_file: str, **options: Any) -> QualityReport:
    """kl_reports of one variant."""
    return kl_reports(base_path, {"variant": variant_path}, text_file, **options)["variant"]


kl_reports_task = task(kl_reports, name="kl-divergence")
