"""Checkpoints with real shapes and random values, for speed runs where the hubs are out of reach.

A folder holds config.json, a synthetic byte-level BPE tokenizer with exactly `vocab_size` tokens (or the
tokenizer files it is given: a model of the family's), generation_config.json and, when asked, random safetensors weights laid out exactly as transformers
(BF16) or llm-compressor (W4A16, compressed-tensors "pack-quantized") would save them. Without weights
the folder is for vLLM's `load_format="dummy"`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from quantgate.catalog.errors import QuantgateError
# The published shapes live in the catalog (a source may name one, and the catalog imports no other room);
# the GPU suite and the tests take them from here, beside the writer.
from quantgate.catalog.shapes import QWEN25_7B_INSTRUCT as QWEN25_7B_INSTRUCT, SHAPES as SHAPES

if TYPE_CHECKING:
    import torch

MAX_SHARD_BYTES = 5 * 10**9
IGNORE = ("lm_head",)  # llm-compressor's usual W4A16 recipe keeps the output head in 16 bits
# Dense init: small normals keep activations finite through dozens of random layers.
INIT_STD = 0.02
# Symmetric int4 codes are uniform over -8..7 (std ~4.6); this scale gives dequantized std ~INIT_STD.
W4_SCALE = INIT_STD / 4.6

class DummyWeightsError(QuantgateError, RuntimeError):
    """A config that cannot be laid out as asked; the message is one line."""


@dataclass(frozen=True)
class DummyCheckpoint:
    path: Path
    quant: str | None
    num_parameters: int
    weight_bytes: int
    shards: tuple[str, ...]


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: Literal["dense", "ones", "zeros", "packed", "scale", "shape"]
    weight_shape: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def w4a16_quantization_config(group_size: int = 128, ignore: tuple[str, ...] = IGNORE) -> dict:
    """The `quantization_config` block llm-compressor 0.14 writes for the W4A16 preset, built with
    the same compressed-tensors classes it uses, so it follows the installed version."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    preset = preset_name_to_scheme("W4A16", ["Linear"])
    # llm-compressor records the weight observer it ran (QuantizationMixin's default for weights).
    weights = preset.weights.model_copy(update={"group_size": group_size, "observer": "memoryless_minmax"})
    scheme = preset.model_copy(update={"weights": weights, "format": "pack-quantized"})
    qconfig = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=list(ignore),
    )
    # Same wrapping as compressed_tensors' ModelCompressor.update_config.
    return {
        "version": compressed_tensors.__version__,
        "quant_method": "compressed-tensors",
        "sparsity_config": {},
        "transform_config": {},
        **qconfig.model_dump(mode="json", exclude={"quant_method"}),
    }


def write_dummy_checkpoint(
    out_dir: str | Path,
    config: dict,
    *,
    quant: Literal["w4a16"] | None = None,
    group_size: int = 128,
    write_weights: bool = True,
    generation_config: dict | None = None,
    tokenizer_files: Sequence[Path] = (),
    seed: int = 0,
    device: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> DummyCheckpoint:
    if quant not in (None, "w4a16"):
        raise DummyWeightsError(f"quant must be None or 'w4a16', got {quant!r}")
    vocab = int(config["vocab_size"])
    for key in ("bos_token_id", "eos_token_id"):
        ids = config.get(key)
        for i in ids if isinstance(ids, list) else [ids]:
            if i is not None and not 0 <= i < vocab:
                raise DummyWeightsError(f"config {key}={i} is outside the vocabulary (vocab_size={vocab})")

    if not tokenizer_files and vocab < (least := 256 + len(_special_tokens(config))):
        raise DummyWeightsError(f"vocab_size {vocab} is too small for a byte-level vocabulary (>= {least})")
    plan = _plan(config, quant, group_size)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    full_config = dict(config)
    if quant == "w4a16":
        full_config["quantization_config"] = w4a16_quantization_config(group_size, IGNORE)
    (out / "config.json").write_text(json.dumps(full_config, indent=2, sort_keys=True) + "\n")
    if tokenizer_files:
        _copy_tokenizer(out, tokenizer_files, vocab)
    else:
        _write_tokenizer(out, config)
    gen = generation_config or {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    shards: tuple[str, ...] = ()
    if write_weights:
        import torch

        shards = _write_weights(
            out, plan, seed, device or ("cuda" if torch.cuda.is_available() else "cpu"), max_shard_bytes
        )
    num_parameters = sum(math.prod(t.shape) for t in plan if t.kind not in ("packed", "scale", "shape"))
    num_parameters += sum(math.prod(t.shape) * 8 for t in plan if t.kind == "packed")
    return DummyCheckpoint(
        path=out,
        quant=quant,
        num_parameters=num_parameters,
        weight_bytes=sum(t.nbytes for t in plan),
        shards=shards,
    )


def layout(
    config: dict, quant: Literal["w4a16"] | None = None, group_size: int = 128
) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every tensor a checkpoint of this config holds: name -> (shape, bytes), without writing anything."""
    return {t.name: (t.shape, t.nbytes) for t in _plan(config, quant, group_size)}


def _plan(config: dict, quant: str | None, group_size: int) -> list[_Tensor]:
    """Every tensor the checkpoint holds, named from the transformers model built on the meta device."""
    import torch
    from compressed_tensors.utils import match_named_modules
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
    except (KeyError, ValueError) as e:
        raise DummyWeightsError(f"config is not a transformers config: {e}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    dtype = dtypes.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), torch.bfloat16)

    quantized: set[str] = set()
    if quant == "w4a16":
        if group_size % 8:
            raise DummyWeightsError(f"group_size must be a multiple of 8 (int4 packs 8 to an int32), got {group_size}")
        for name, module in match_named_modules(model, ["Linear"], list(IGNORE)):
            if module.in_features % group_size:
                raise DummyWeightsError(
                    f"{name}: in_features {module.in_features} is not a multiple of group_size {group_size}"
                )
            quantized.add(f"{name}.weight")

    plan: list[_Tensor] = []
    # remove_duplicate drops tied weights (lm_head tied to embed_tokens), which save_pretrained leaves out too.
    for name, param in model.named_parameters(remove_duplicate=True):
        shape = tuple(param.shape)
        if name in quantized:
            base = name.removesuffix(".weight")
            out_f, in_f = shape
            plan += [
                _Tensor(f"{base}.weight_packed", (out_f, in_f // 8), torch.int32, "packed"),
                _Tensor(f"{base}.weight_scale", (out_f, in_f // group_size), dtype, "scale"),
                _Tensor(f"{base}.weight_shape", (2,), torch.int64, "shape", weight_shape=shape),
            ]
        elif name.endswith(".bias"):
            plan.append(_Tensor(name, shape, dtype, "zeros"))
        elif len(shape) == 1:
            plan.append(_Tensor(name, shape, dtype, "ones"))  # norm weights
        else:
            plan.append(_Tensor(name, shape, dtype, "dense"))
    return sorted(plan, key=lambda t: t.name)


def _special_tokens(config: dict) -> dict[int, str]:
    """Qwen's names: "<|endoftext|>" (bos and pad) and "<|im_end|>" (eos). transformers 5 loads any
    qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which adds "<|endoftext|>" unless it exists."""
    vocab = int(config["vocab_size"])
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    bos = config.get("bos_token_id")
    if bos is None:
        bos = eos if eos is not None else vocab - 1
    special = {bos: "<|endoftext|>"}
    if eos is not None and eos != bos:
        special[eos] = "<|im_end|>"
    return special


def _vocabulary(vocab_size: int, special: dict[int, str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary of exactly vocab_size entries: the 256 byte symbols, the special
    tokens at their ids, and space-led lowercase words ("Ġa", "Ġab", ...) built one merge at a time,
    so decoding any ids and re-encoding word tokens round-trips, as with a real BPE tokenizer."""
    from tokenizers import pre_tokenizers

    free = (i for i in range(vocab_size) if i not in special)
    vocab = {token: i for i, token in special.items()}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = next(free)
    merges: list[tuple[str, str]] = []
    letters = "abcdefghijklmnopqrstuvwxyz"
    # Breadth-first over words: every prefix of a word is a token before the word is.
    words = ["Ġ"]
    for i in free:
        prefix, letter = words[len(merges) // len(letters)], letters[len(merges) % len(letters)]
        vocab[prefix + letter] = i
        merges.append((prefix, letter))
        words.append(prefix + letter)
    return vocab, merges


def _copy_tokenizer(out: Path, files: Sequence[Path], vocab: int) -> None:
    """A given tokenizer's files, checked to fit the embedding: an id past `vocab_size` would index out of it."""
    import shutil

    from transformers import AutoTokenizer

    for f in files:
        shutil.copyfile(f, out / f.name)
    try:
        size = len(AutoTokenizer.from_pretrained(str(out)))
    except (OSError, ValueError) as e:
        raise DummyWeightsError(f"tokenizer of {files[0].parent} cannot be loaded: {e}") from None
    if size > vocab:
        raise DummyWeightsError(f"tokenizer of {files[0].parent} has {size:,} tokens, more than the shape's"
                                f" vocab_size {vocab:,}: not a tokenizer of this model's family")


def _write_tokenizer(out: Path, config: dict) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    special = _special_tokens(config)
    vocab, merges = _vocabulary(int(config["vocab_size"]), special)
    # The same BPE settings and pipeline as transformers' Qwen2Tokenizer, which rebuilds the tokenizer
    # from this file's vocab and merges: loaded either way, it behaves the same.
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Special tokens already in the vocabulary add no ids: the tokenizer stays vocab_size long.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=special.get(eos),
        pad_token="<|endoftext|>",
        model_max_length=int(config.get("max_position_embeddings", 2048)),
    )
    fast.save_pretrained(str(out))


def _write_weights(out: Path, plan: list[_Tensor], seed: int, device: str, max_shard_bytes: int) -> tuple[str, ...]:
    import torch
    from safetensors.torch import save_file

    groups: list[list[_Tensor]] = [[]]
    size = 0
    for t in plan:
        if groups[-1] and size + t.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes

    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )

    def write(file: str, group: list[_Tensor]) -> None:
        tensors = {t.name: _random(t, _generator(seed, t.name, device), device).cpu() for t in group}
        save_file(tensors, str(out / file), metadata={"format": "pt"})

    # Shards side by side: drawing random numbers from a seeded generator runs on one core, and a 7B shape is 15 GB
    # of them (125 s on the H200 machine's host one shard after the other: results/h200/shape7b-1). Each shard holds
    # its tensors in memory until written, so as many run at once as the free memory holds twice over.
    with ThreadPoolExecutor(max_workers=_writers(len(groups), max_shard_bytes)) as pool:
        for done in [pool.submit(write, file, group) for file, group in zip(names, groups, strict=True)]:
            done.result()
    weight_map = {t.name: file for file, group in zip(names, groups, strict=True) for t in group}
    if len(names) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in plan)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return tuple(names)


def _generator(seed: int, name: str, device: str) -> torch.Generator:
    """A generator of its own per tensor, seeded by the checkpoint's seed and the tensor's name: the same weights
    whichever order (or thread) writes them."""
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _writers(shards: int, max_shard_bytes: int) -> int:
    """Shards written at once: one per core, as many as twice a shard fits the memory free now, at least one."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free = 0
    return max(1, min(shards, os.cpu_count() or 1, free // (2 * max_shard_bytes)))


def _random(t: _Tensor, gen: torch.Generator, device: str) -> torch.Tensor:
    import torch

    match t.kind:
        case "dense":
            return (torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32) * INIT_STD).to(t.dtype)
        case "ones":
            return torch.ones(t.shape, device=device, dtype=t.dtype)
        case "zeros":
            return torch.zeros(t.shape, device=device, dtype=t.dtype)
        case "packed":
            # Any int32 bit pattern is eight valid unsigned int4 codes.
            return torch.randint(-(2**31), 2**31 - 1, t.shape, generator=gen, device=device, dtype=torch.int32)
        case "scale":
            jitter = torch.rand(t.shape, generator=gen, device=device, dtype=torch.float32)
            return (W4_SCALE * (0.5 + jitter)).to(t.dtype)
        case "shape":
            return torch.tensor(t.weight_shape, dtype=torch.int64, device=device)
    raise AssertionError(t.kind)
