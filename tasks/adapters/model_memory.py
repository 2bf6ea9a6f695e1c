"""The GPU memory and disk each stage of a run needs, from the model: its config (layers, widths, KV heads, context),
its weight files (or, for a model's shape, the layout its config implies) and each variant's scheme. Evaluation
engines are sized here (max_model_len, KV cache, the share of the GPU vLLM checks for at start); a run's unmeasured
jobs are counted by what they need against the GPU's memory; a stage that cannot fit says so, in one line, before
anything starts. Speed engines keep their sizing (tasks/adapters/speed/options.py), with the engine overhead of
this module.

Each number says where it comes from: a measurement under benchmarks/results/, or llm-compressor 0.14's and vLLM's
code paths, counted."""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.variants import CalibrationSize, VariantSpec
from quantgate.tasks.adapters.dummy_weights import DummyWeightsError
from quantgate.tasks.adapters.quantizers.batching import calibration_batch_size
from quantgate.tasks.adapters.roofline import RooflineError, Tensors, checkpoint_tensors, kv_bytes_per_token
from quantgate.tasks.adapters.speed.checkpoint import text_config
from quantgate.tasks.runtime.telemetry import device_memory

GIB = 1 << 30
# What keeps a checkpoint from being sized: no readable config, an architecture Transformers cannot lay out.
SIZING_ERRORS = (RooflineError, DummyWeightsError, OSError, KeyError, ValueError, TypeError)


class CapacityError(QuantgateError, RuntimeError):
    """A stage that cannot fit the GPU memory or the disk this host has; one line: what it needs, what there is."""


# --- the GPU ---------------------------------------------------------------------------------------------------
# The share of a GPU's memory (NVML's total) jobs may plan to take, alone or together: the rest is the driver's
# reservation and the allocators' fragmentation. vLLM's default for one engine that has the GPU to itself is 0.9;
# engines here size their KV cache, so what they take is counted, not a share.
GPU_USABLE_SHARE = 0.95
# What a process that runs torch holds beside its tensors (CUDA context, the caching allocator's slack): NVML's peak
# less torch's for the reference's Transformers engine, 5.56 vs 4.80 GiB (benchmarks/results/h200/reference12).
TORCH_PROCESS_BYTES = 768 << 20

# --- vLLM engines ----------------------------------------------------------------------------------------------
# An engine's memory beside its weights and KV cache: a fixed part (CUDA context, CUDA graphs, workspaces) and the
# activations of its profile run, ENGINE_PROFILE_TOKENS (vLLM's max_num_batched_tokens for an offline engine on a
# GPU of 70 GiB or more) through the widest layer: 2 x intermediate (the fused gate/up projection) and 4 x hidden
# around it, 16 bits. NVML's peak less weights and KV cache was 3.50 GiB for the reference's 1.5B base and
# 3.88 / 3.90 for its FP8 / W4A16 builds (results/h200/reference12, CUDA graphs to batch 512), 4.54 GiB for the 7B
# shape (results/h200/suite7-crosscheck, to 128); this gives 3.73 and 4.59. An evaluation engine runs eager (no
# graphs) and holds less.
ENGINE_FIXED_BYTES = 3 * GIB
ENGINE_PROFILE_TOKENS = 16_384
# vLLM's KV cache block: a sequence takes whole blocks.
KV_BLOCK_TOKENS = 16

# --- evaluation engines (lm-eval's vLLM backend) ----------------------------------------------------------------
# The context where a suite's prompts are not known here (one of lm-eval's built-in tasks): the model's own, up to
# this: Qwen2.5's 32,768, what the engines had before max_model_len was set. A 128K-context model (Llama-3.1-8B)
# would need 16 GiB of KV cache for its one longest sequence before vLLM starts it.
EVAL_MAX_MODEL_LEN = 32_768
# One request of a task of the catalog's own (catalog/lm_eval_tasks), prompt and answer: few-shot MMLU and 8-shot
# GSM8K CoT in a chat template with a 256-token answer take under half of it. lm-eval cuts a longer prompt from the
# left, so this errs long.
EVAL_TASK_TOKENS = 4_096
# Tokens per word of a task sized in words (qg_passkey's context_words), at most: stories260k's 512-token vocabulary
# spends about 2.5 on a word of its text (catalog/lm_eval_tasks/qg_passkey.yaml), 32K-150K vocabularies about 1.3.
EVAL_TOKENS_PER_WORD = 3
# The tokens an evaluation's KV cache holds (vLLM schedules as many of lm-eval's requests at once as fit), up to
# EVAL_KV_MAX_BYTES. The reference's evaluations ran with 8 GiB at 28 KiB a token: 299,593 tokens, some 230 GSM8K CoT
# sequences at once (results/h200/reference12); this is near that.
EVAL_KV_TOKENS = 1 << 18
# A larger model holds fewer tokens rather than a larger cache: 8 GiB, what every evaluation engine had before, is
# 150K tokens at 7B's 56 KiB; more would keep builds and other evaluations off the GPU for little.
EVAL_KV_MAX_BYTES = 8 * GIB
# The share of the GPU vLLM is asked to find free at start where the GPU's size is not known (no NVML): small, as
# the engine takes its weights and sized KV cache, not a share.
EVAL_UNSIZED_UTILIZATION = 0.05

# --- builds (llm-compressor 0.14, tasks/adapters/quantizers/llmcompressor.py) -------------------------------------
# A calibrated build keeps the model in host memory and onloads one decoder layer at a time; its working set is
# counted from llm-compressor's code (_calibration_bytes) and comes to 92 % (AWQ), 98 % (GPTQ) of the peaks torch's
# allocator measured for the reference's builds, 6.89 and 2.40 GiB (results/h200/reference12): this margin over it.
BUILD_MARGIN = 1.15
# Bytes of each stored scale of a compressed-tensors build (bf16), and the block of a bitsandbytes 4-bit scale (fp32).
SCALE_BYTES = 2
BNB_BLOCK = 64
# KL holds both models in Transformers (a compressed-tensors build decompressed to 16 bits as it loads) and, per
# window, both models' logits in 16 bits, their float32 copies and log-softmaxes and the KL of each position: 24
# bytes per position and vocabulary entry (tasks/steps/divergence.py).
KL_BYTES_PER_LOGIT = 24
# Room a build's folder needs beside its weights: tokenizer, configs, recipe, the filesystem's blocks.
DISK_MARGIN_BYTES = 256 << 20

# Tensors stored as integers, whatever their element size.
_INTEGER = ("weight_packed", "weight_zero_point", "g_idx", "weight_shape")
_EMBEDDING = re.compile(r"(embed_tokens|wte|word_embeddings|embed_in)\.weight$")
_FIRST_LAYER = re.compile(r"\.(layers|h|blocks)\.0\.")
# Keys of a config that bound a model's context, as vLLM reads them; a sliding window does not (vLLM attends within
# it at any length), so it is not one of them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_sequence_length", "max_seq_length", "seq_len")


def gib(n_bytes: int | float) -> str:
    return f"{n_bytes / GIB:.1f}"


def usable_bytes(gpu_bytes: int) -> int:
    return int(gpu_bytes * GPU_USABLE_SHARE)


def gpu_bytes() -> int | None:
    """The visible GPU's total memory (NVML), None without one."""
    memory = device_memory()
    return None if memory is None else memory[1]


@dataclass(frozen=True)
class StageNeed:
    """The GPU memory one stage takes, by part (weights, KV cache, ...)."""

    stage: str
    parts: dict[str, int]

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())

    def over(self, gpu_bytes: int | None) -> str | None:
        """Why it does not fit a GPU of `gpu_bytes` (one line), or None when it does or the GPU is not known."""
        if gpu_bytes is None or self.bytes <= usable_bytes(gpu_bytes):
            return None
        parts = [f"{name} {gib(n)}" for name, n in self.parts.items() if n]
        detail = f" ({' + '.join(parts)})" if len(parts) > 1 else ""
        return (f"{self.stage} needs {gib(self.bytes)} GiB of GPU memory{detail}; the GPU has {gib(gpu_bytes)} GiB,"
                f" {gib(usable_bytes(gpu_bytes))} of it usable")


# --- weights ----------------------------------------------------------------------------------------------------


def sized_tensors(model_path: str | Path) -> Tensors | None:
    """The checkpoint's tensors (its files' headers, else its config's layout), None when it cannot be sized."""
    try:
        return checkpoint_tensors(model_path)
    except SIZING_ERRORS:
        return None


def loaded_weight_bytes(tensors: Tensors, dtype_bytes: int = 2) -> int:
    """Weights as they are loaded (or saved) in a `dtype_bytes` float type: 16- and 32-bit float tensors in that
    type; packed, FP8 and integer tensors as stored."""
    total = 0
    for name, (shape, nbytes) in tensors.items():
        count = math.prod(shape)
        floating = count and nbytes in (2 * count, 4 * count) and not name.endswith(_INTEGER)
        total += count * dtype_bytes if floating else nbytes
    return total


def _ignored(module: str, spec: VariantSpec) -> bool:
    return any(re.match(p[3:], module) if p.startswith("re:") else module == p or module.endswith(f".{p}")
               for p in spec.ignore)


def _quantized(name: str, shape: tuple[int, ...], spec: VariantSpec) -> bool:
    """Whether a build quantizes this tensor: a Linear's 2-D weight that is no embedding and not ignored."""
    return (len(shape) == 2 and name.endswith(".weight") and not _EMBEDDING.search(name)
            and not _ignored(name.removesuffix(".weight"), spec))


def _linear_bytes(out_f: int, in_f: int, spec: VariantSpec) -> int:
    """A quantized Linear's bytes: packed codes and scales (and zero points for an asymmetric scheme)."""
    if spec.scheme in ("nf4", "fp4"):
        return out_f * in_f // 2 + math.ceil(out_f * in_f / BNB_BLOCK) * 4
    if spec.scheme == "int8":
        return out_f * in_f + out_f * 4
    groups = 1 if spec.group_size is None else math.ceil(in_f / spec.group_size)
    zero_points = out_f * groups * spec.bits // 8 if spec.scheme.endswith("_ASYM") else 0
    return out_f * in_f * spec.bits // 8 + out_f * groups * SCALE_BYTES + zero_points


def variant_weight_bytes(base: Tensors, spec: VariantSpec, dtype_bytes: int = 2) -> int:
    """A build's weights from its base's tensors, before it is built: its quantized Linears packed as its scheme
    stores them, everything else in `dtype_bytes` floats (a CPU build keeps float32)."""
    total = 0
    for name, (shape, nbytes) in base.items():
        if _quantized(name, shape, spec):
            total += _linear_bytes(shape[0], shape[1], spec)
        else:
            total += loaded_weight_bytes({name: (shape, nbytes)}, dtype_bytes)
    return total


def variant_disk_bytes(base_path: str | Path, spec: VariantSpec, dtype_bytes: int = 2) -> int:
    """The disk a build of `spec` will take (0 when its base cannot be sized)."""
    tensors = sized_tensors(base_path)
    return 0 if tensors is None else variant_weight_bytes(tensors, spec, dtype_bytes) + DISK_MARGIN_BYTES


def transformers_weight_bytes(base: Tensors, spec: VariantSpec | None) -> int:
    """A checkpoint as Transformers loads it: the base and a compressed-tensors build in 16 bits (it decompresses
    the latter as it loads), a bitsandbytes variant quantized."""
    return variant_weight_bytes(base, spec) if spec is not None and spec.load_time else loaded_weight_bytes(base)


# --- engines ----------------------------------------------------------------------------------------------------


def engine_overhead_bytes(config: dict[str, Any]) -> int:
    """A vLLM engine's memory beside its weights and KV cache (ENGINE_FIXED_BYTES)."""
    hidden = int(config.get("hidden_size") or 0)
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    return ENGINE_FIXED_BYTES + ENGINE_PROFILE_TOKENS * (2 * intermediate + 4 * hidden) * 2


def model_context(config: dict[str, Any]) -> int:
    """The longest sequence the model takes, as vLLM derives it from the config (EVAL_MAX_MODEL_LEN without one)."""
    limits = [int(config[k]) for k in _CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0]
    return min(limits) if limits else EVAL_MAX_MODEL_LEN


def eval_max_model_len(config: dict[str, Any], words: Sequence[int] | None) -> int:
    """An evaluation engine's max_model_len: what the suite's tasks need (EVAL_TASK_TOKENS a request, more for a
    task sized in `words`; None: a task whose prompts are not known, EVAL_MAX_MODEL_LEN), within the model's own."""
    need = EVAL_MAX_MODEL_LEN if words is None else max(
        [EVAL_TASK_TOKENS, *(w * EVAL_TOKENS_PER_WORD + EVAL_TASK_TOKENS for w in words)])
    return min(model_context(config), need)


@dataclass(frozen=True)
class EvalEngine:
    """An evaluation engine's vLLM options and the memory it takes."""

    max_model_len: int
    weight_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    gpu_memory_utilization: float

    def need(self, stage: str) -> StageNeed:
        return StageNeed(stage, {"weights": self.weight_bytes, "KV cache": self.kv_cache_bytes,
                                 "engine": self.overhead_bytes})

    def args(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "kv_cache_memory_bytes": self.kv_cache_bytes,
                "gpu_memory_utilization": self.gpu_memory_utilization}


def eval_engine(weight_bytes: int, config: dict[str, Any], max_model_len: int, gpu_bytes: int | None) -> EvalEngine:
    """The engine of an evaluation: a KV cache of EVAL_KV_TOKENS up to EVAL_KV_MAX_BYTES, less where that does not
    fit the GPU beside the weights, never less than one sequence of max_model_len (vLLM will not start with less);
    the share of the GPU vLLM checks is free at start is what the engine takes."""
    per_token = kv_bytes_per_token(config)
    floor = (math.ceil(max_model_len / KV_BLOCK_TOKENS) + 1) * KV_BLOCK_TOKENS * per_token
    kv = max(floor, min(EVAL_KV_TOKENS * per_token, EVAL_KV_MAX_BYTES))
    overhead = engine_overhead_bytes(config)
    share = EVAL_UNSIZED_UTILIZATION
    if gpu_bytes:
        kv = max(floor, min(kv, usable_bytes(gpu_bytes) - weight_bytes - overhead))
        share = min(1.0, math.ceil(100 * (weight_bytes + kv + overhead) / gpu_bytes) / 100)
    return EvalEngine(max_model_len, weight_bytes, kv, overhead, share)


# --- builds, KL, an evaluation in Transformers --------------------------------------------------------------------


def _widths(config: dict[str, Any]) -> tuple[int, int, int]:
    """Hidden, intermediate and attention (heads x head dim) widths."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    return hidden, int(config.get("intermediate_size") or 4 * hidden), heads * head_dim


def _calibration_bytes(config: dict[str, Any], spec: VariantSpec, calib: CalibrationSize,
                       linears: list[tuple[int, ...]]) -> int:
    """One decoder layer's calibration working set in llm-compressor 0.14's sequential pipeline: a batch through the
    layer (4 x intermediate and 6 x hidden per token, 16 bits); GPTQ adds a float32 Hessian per Linear (in²) and
    its hook's float32 copy of a batch's widest input; AWQ keeps every calibration token's input to each smoothed
    parent (2 x hidden, attention, intermediate) and the parent's outputs twice (original and quantized), all in
    16 bits on the GPU (offload_device None for a dense model), and its statistics hook copies a batch's
    intermediate activations (abs in 16 bits, then float32)."""
    hidden, inter, attn = _widths(config)
    tokens = calib.samples * calib.seq_len
    batch = calibration_batch_size(calib.samples, calib.seq_len) * calib.seq_len
    work = batch * (4 * inter + 6 * hidden) * 2
    if spec.method == "gptq":
        work += sum(shape[1] ** 2 * 4 for shape in linears) + batch * max(s[1] for s in linears) * 4
    elif spec.method == "awq":
        work += tokens * (2 * hidden + attn + inter) * 2 + 2 * tokens * hidden * 2 + batch * inter * 6
    return work


def build_need(base: Tensors, config: dict[str, Any], spec: VariantSpec, calib: CalibrationSize | None) -> StageNeed:
    """The GPU memory a build takes: a calibrated one, a layer's weights and its calibration working set; a
    data-free one (FP8, RTN), the whole model in bf16 and a float32 copy of its largest Linear as it is quantized;
    a load-time one (bitsandbytes), the base loaded quantized to check its logits."""
    stage = f"quantize {spec.name}"
    if spec.load_time:
        return StageNeed(stage, {"weights": variant_weight_bytes(base, spec), "process": TORCH_PROCESS_BYTES})
    linears = {name: shape for name, (shape, _) in base.items() if _quantized(name, shape, spec)}
    if not spec.needs_calibration or calib is None:
        largest = max((math.prod(s) for s in linears.values()), default=0)
        return StageNeed(stage, {"weights": loaded_weight_bytes(base), "quantization": int(BUILD_MARGIN * largest * 4),
                                 "process": TORCH_PROCESS_BYTES})
    layer = {name: v for name, v in base.items() if _FIRST_LAYER.search(name)}
    work = _calibration_bytes(config, spec, calib, [s for n, s in linears.items() if n in layer] or [(0, 0)])
    return StageNeed(stage, {"a layer's weights": loaded_weight_bytes(layer), "calibration": int(BUILD_MARGIN * work),
                             "process": TORCH_PROCESS_BYTES})


def kl_need(base: Tensors, config: dict[str, Any], variants: Sequence[VariantSpec], window: int) -> StageNeed:
    """KL: the base and the largest variant loaded at once in Transformers, and a window's logits."""
    variant = max((transformers_weight_bytes(base, v) for v in variants), default=0)
    logits = window * int(config.get("vocab_size") or 0) * KL_BYTES_PER_LOGIT
    return StageNeed("kl", {"base": loaded_weight_bytes(base), "variant": variant, "logits": logits,
                            "process": TORCH_PROCESS_BYTES})


def hf_eval_need(stage: str, weight_bytes: int, config: dict[str, Any], batch: int, max_model_len: int) -> StageNeed:
    """An evaluation with lm-eval's hf backend: the model as Transformers loads it and one batch's logits and their
    log-softmax in 16 bits, prompts of up to EVAL_TASK_TOKENS."""
    logits = batch * min(max_model_len, EVAL_TASK_TOKENS) * int(config.get("vocab_size") or 0) * 4
    return StageNeed(stage, {"weights": weight_bytes, "logits": logits, "process": TORCH_PROCESS_BYTES})


# --- a run ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPlan:
    """A run's stages by what they need: `jobs` share the GPU (each its stages in turn: a variant's build, then its
    evaluation), `alone` run after them (KL); `eval_bytes` is the most one evaluation takes."""

    jobs: tuple[tuple[StageNeed, ...], ...]
    alone: tuple[StageNeed, ...]
    eval_bytes: int

    def check(self, gpu_bytes: int | None, who: str) -> None:
        """CapacityError (one line) for the first stage that cannot fit the GPU, before any starts."""
        stages = [s for job in self.jobs for s in job] + list(self.alone)
        if over := [why for s in stages if (why := s.over(gpu_bytes))]:
            more = f" (and {len(over) - 1} more stage{'s' * (len(over) > 2)})" if len(over) > 1 else ""
            raise CapacityError(f"{who}: {over[0]}{more}")

    def jobs_per_gpu(self, gpu_bytes: int | None) -> int | None:
        """How many jobs fit one GPU at once: as many of the largest as its memory holds, at least one (None: the
        GPU's size is not known)."""
        largest = max(s.bytes for job in self.jobs for s in job)
        return max(1, usable_bytes(gpu_bytes) // largest) if gpu_bytes else None

    def summary(self) -> str:
        """Each stage's need, for the run's log."""
        stages = [s for job in self.jobs for s in job] + list(self.alone)
        return ", ".join(f"{s.stage} {gib(s.bytes)} GiB" for s in stages)


def plan_run(base_path: str | Path, variants: Sequence[tuple[VariantSpec, CalibrationSize | None]], *, backend: str,
             words: Sequence[int] | None, hf_batch: int, kl_window: int, gpu_bytes: int | None) -> RunPlan | None:
    """What each stage of a model's run on a GPU needs, predicted from its base before any variant is built; None
    when the base cannot be sized (its checks are then the engines' own)."""
    tensors, config = sized_tensors(base_path), text_config(base_path)
    if tensors is None or not config:
        return None
    max_len = eval_max_model_len(config, words)

    def evaluation(name: str, spec: VariantSpec | None) -> StageNeed:
        if backend != "vllm":
            return hf_eval_need(f"evaluate {name}", transformers_weight_bytes(tensors, spec), config, hf_batch, max_len)
        weights = loaded_weight_bytes(tensors) if spec is None else variant_weight_bytes(tensors, spec)
        return eval_engine(weights, config, max_len, gpu_bytes).need(f"evaluate {name}")

    try:
        jobs = [(evaluation("base", None),)]
        jobs += [(build_need(tensors, config, spec, calib), evaluation(spec.name, spec)) for spec, calib in variants]
        kl = (kl_need(tensors, config, [spec for spec, _ in variants], kl_window),) if variants else ()
    except SIZING_ERRORS:
        return None
    return RunPlan(tuple(jobs), kl, max(job[-1].bytes for job in jobs))


def pair_problem(variant_bytes: int, base_bytes: int, gpu_bytes: int | None) -> str | None:
    """Why a variant's engine process cannot load its base's engine beside it for paired passes, or None."""
    if not gpu_bytes or not variant_bytes or not base_bytes or variant_bytes + base_bytes <= usable_bytes(gpu_bytes):
        return None
    return (f"the base's engine and the variant's need {gib(base_bytes)} + {gib(variant_bytes)} GiB together, more"
            f" than the GPU's {gib(usable_bytes(gpu_bytes))} usable GiB: each timed in its own process")


# --- disk -------------------------------------------------------------------------------------------------------
_DISK_LOCK = threading.Lock()
# Builds under way in this process: (device, bytes it will write, the folder it writes them to).
_WRITING: dict[int, tuple[int, int, Path]] = {}
_TOKENS = itertools.count()


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


@contextmanager
def disk_reserved(folder: Path, need: int, what: str) -> Iterator[None]:
    """Room on `folder`'s disk for `need` bytes to be written there, beside what the builds under way in this process
    have yet to write; CapacityError (one line) when there is none."""
    device = os.stat(folder).st_dev
    with _DISK_LOCK:
        pending = sum(max(0, n - _folder_bytes(f)) for d, n, f in _WRITING.values() if d == device)
        free = shutil.disk_usage(folder).free - pending
        if need > free:
            others = f" ({gib(pending)} GiB more held for builds under way)" if pending else ""
            raise CapacityError(f"{what} needs {gib(need)} GiB of disk under {folder.parent}; {gib(free)} GiB"
                                f" free{others}")
        token = next(_TOKENS)
        _WRITING[token] = (device, need, folder)
    try:
        yield
    finally:
        with _DISK_LOCK:
            del _WRITING[token]
