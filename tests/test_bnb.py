"""bitsandbytes variants on the CPU, with the real bitsandbytes (its CPU backend), transformers, DuckDB.

Covered here: the spec rules, the uid, the variant folder (no weights, the config), the build check and
its size, loading for KL, the vLLM in-flight rules, and the skipped path where bitsandbytes is absent
(a child process in which `import bitsandbytes` fails) down to the decision and the scorecard. The
evaluate-model flow on the tiny model (tests/test_flow.py) takes bnb-int8 and bnb-nf4 through lm-eval,
KL, the Transformers benchmark and the decisions. Not covered on the CPU: CUDA kernels and vLLM's
in-flight quantization (tests/gpu/test_bnb_gpu.py).
"""

import json
import logging
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.load import load_catalog
from quantgate.catalog.records import ModelArtifact
from quantgate.catalog.variants import VariantSpec
from quantgate.tasks.adapters import loadtime
from quantgate.tasks.steps import quantize
from quantgate.tasks.steps.decide import decide
from quantgate.tasks.steps.divergence import kl_divergence
from quantgate.warehouse import ledger, reads, sessions, writers
from tests.shared_data import SHARED

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")

TEXT_FILE = SHARED / "eval" / "simple_stories" / "simple_stories.txt"


def _model(path: Path) -> ModelArtifact:
    return ModelArtifact("stories260k", str(path), "local", None, "0" * 64)


def test_bnb_specs_take_bnb_schemes_and_no_group_size():
    nf4 = VariantSpec(name="n", method="bnb", scheme="nf4")
    assert (nf4.group_size, nf4.bits, nf4.load_time, nf4.needs_calibration) == (None, 4, True, False)
    assert VariantSpec(name="i", method="bnb", scheme="int8").bits == 8
    assert not VariantSpec(name="a", method="awq").load_time
    for bad, words in [
        (dict(method="bnb", scheme="W4A16"), "method 'bnb' takes scheme int8 / nf4 / fp4"),
        (dict(method="rtn", scheme="nf4"), "method 'bnb' takes scheme"),
        (dict(method="bnb", scheme="nf4", group_size=64), "has no group_size"),
        (dict(method="bnb", scheme="int8", double_quant=True), "double_quant applies to the 4-bit"),
        (dict(method="bnb", scheme="nf4", calibration=True), "takes no calibration"),
        (dict(method="gptq", double_quant=True), "double_quant applies to method 'bnb' only"),
    ]:
        with pytest.raises(ValueError, match=words):
            VariantSpec(name="x", **bad)


def test_a_bad_bnb_variant_in_a_catalog_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent("""
        version: 1
        variants: {b: {method: bnb, scheme: W4A16}}
        suites: {s: {tasks: [{name: qg_piqa}]}}
        models: [{id: m, source: {kind: local, path: .}, variants: [b], suite: s}]
        policy: {version: 1, quality: []}
    """))
    with pytest.raises(CatalogError) as e:
        load_catalog(path)
    assert "\n" not in str(e.value) and "variants.b" in str(e.value) and "takes scheme int8 / nf4 / fp4" in str(e.value)


def test_uid_is_base_sha_plus_config_plus_bitsandbytes_version(tiny_model):
    model = _model(tiny_model)
    specs = [VariantSpec(name="a", method="bnb", scheme=s, double_quant=d)
             for s, d in [("int8", False), ("nf4", False), ("nf4", True), ("fp4", False)]]
    uids = [quantize.load_time_uid(model, s) for s in specs]
    assert len(set(uids)) == 4
    # The name is not part of what the variant is; the bitsandbytes version is.
    assert quantize.load_time_uid(model, specs[1].model_copy(update={"name": "other"})) == uids[1]
    recipe, recipe_hash = quantize.recipe_for(specs[2])
    assert json.loads(recipe)["bitsandbytes"] == {
        "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
        "llm_int8_skip_modules": ["lm_head"]}
    versions = quantize.load_time_versions()
    older = {**versions, "bitsandbytes": "0.49.0"}
    assert quantize.variant_uid(model, recipe_hash, versions, libs=quantize.LOAD_TIME_LIBS) == uids[2]
    assert quantize.variant_uid(model, recipe_hash, older, libs=quantize.LOAD_TIME_LIBS) != uids[2]


def test_build_writes_a_weightless_folder_measures_size_and_is_reused(tiny_model, tmp_path):
    model = _model(tiny_model)
    nf4 = VariantSpec(name="bnb-nf4", method="bnb", scheme="nf4")
    built = quantize.build_variant(model, nf4, None, tmp_path)
    assert built.status == "built", built.error
    folder = Path(built.path)
    assert folder.parent == tmp_path and folder.name == built.uid
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", loadtime.LOAD_FILE, quantize.MARKER} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    desc = loadtime.descriptor(folder)
    assert desc["base_path"] == str(tiny_model.resolve()) and desc["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    # Size in memory of the 4-bit model against the fp32 base on disk (embeddings stay fp32).
    base_bytes = quantize.weights_bytes(tiny_model)
    assert 0.1 * base_bytes < built.size_bytes < 0.5 * base_bytes
    assert built.lib_versions["bitsandbytes"] == version("bitsandbytes") and built.build_seconds > 0
    again = quantize.build_variant(model, nf4, None, tmp_path)
    assert again.reused and again.uid == built.uid and again.size_bytes == built.size_bytes
    # A plain from_pretrained on the folder fails loudly instead of loading the unquantized base.
    from transformers import AutoModelForCausalLM

    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_message_logged_on_every_matmul_is_logged_once(caplog):
    loadtime._log_once("quantgate.test.bnb_noise")
    loadtime._log_once("quantgate.test.bnb_noise")  # a second load adds no second filter
    noisy = logging.getLogger("quantgate.test.bnb_noise")
    with caplog.at_level(logging.WARNING, logger="quantgate.test.bnb_noise"):
        for _ in range(3):
            noisy.warning("inputs will be cast from %s to float16", "torch.bfloat16")
        noisy.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["inputs will be cast from torch.bfloat16 to float16",
                                                        "something else"]


def test_int8_is_loaded_quantized_and_stays_close_to_the_base(tiny_model, tmp_path):
    import bitsandbytes as bnb

    built = quantize.build_variant(_model(tiny_model), VariantSpec(name="i8", method="bnb", scheme="int8"), None, tmp_path)
    assert built.status == "built", built.error
    model = loadtime.load_model(built.path, device="cpu", dtype="float32")
    linear = model.model.layers[0].mlp.up_proj
    assert isinstance(linear, bnb.nn.Linear8bitLt) and linear.weight.dtype == torch.int8
    assert not isinstance(model.lm_head, bnb.nn.Linear8bitLt)  # ignore: [lm_head]
    metric, samples = kl_divergence(str(tiny_model), built.path, str(TEXT_FILE), seq_len=128, max_tokens=256)
    assert 0 < metric.value < 0.01 and len(samples) == 3
    assert min(s.detail["top1_agreement"] for s in samples) > 0.9


def test_vllm_quantizes_in_flight_nf4_only(tiny_model, tmp_path):
    for scheme in ("nf4", "int8", "fp4"):
        folder = tmp_path / scheme
        folder.mkdir()
        loadtime.write_folder(folder, tiny_model, VariantSpec(name=scheme, method="bnb", scheme=scheme))
        problem = loadtime.vllm_problem(folder)
        if scheme == "nf4":
            assert problem is None
            assert loadtime.vllm_args(folder) == (str(tiny_model.resolve()), {"quantization": "bitsandbytes"})
        else:
            assert f"4-bit NF4 only, not {scheme}" in problem
            with pytest.raises(loadtime.LoadTimeError, match="NF4 only"):
                loadtime.vllm_args(folder)
    assert loadtime.vllm_problem(tiny_model) is None and loadtime.vllm_args(tiny_model) == (str(tiny_model), {})


SKIP_CHILD = """
import json, sys
sys.modules["bitsandbytes"] = None  # `import bitsandbytes` now raises ImportError, as where it is not installed
from dataclasses import asdict
from quantgate.catalog.variants import VariantSpec
from quantgate.tasks.steps import quantize
from quantgate.catalog.records import ModelArtifact
model = ModelArtifact("stories260k", sys.argv[1], "local", None, "0" * 64)
v = quantize.build_variant(model, VariantSpec(name="bnb-nf4", method="bnb", scheme="nf4"), None, sys.argv[2])
print(json.dumps(asdict(v)))
"""


def test_without_bitsandbytes_the_variant_is_skipped_with_the_reason(tiny_model, tmp_path):
    out = subprocess.run([sys.executable, "-c", SKIP_CHILD, str(tiny_model), str(tmp_path / "variants")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    from quantgate.catalog.records import VariantArtifact

    skipped = VariantArtifact(**json.loads(out.stdout.strip().splitlines()[-1]))
    assert skipped.status == "skipped" and not skipped.ok and skipped.path is None
    assert skipped.error.startswith("bnb-nf4: bitsandbytes is not installed") and "\n" not in skipped.error
    assert not (tmp_path / "variants").exists() or not any((tmp_path / "variants").iterdir())

    # Stored and decided like any variant: the scorecard says skipped, the decision says why.
    model = _model(tiny_model)
    base = quantize.base_variant(model)
    wh = tmp_path / "w.ducklake"
    with sessions.session(wh) as con:
        ledger.start_run(con, "r1", "evaluate-model", "stories260k", None, None, "host", {})
        writers.record_model(con, "r1", model)
        writers.record_variant(con, "r1", base, "base")
        writers.record_variant(con, "r1", skipped, "variant")
        row = reads.rows(con, "SELECT * FROM variants WHERE variant_uid = ?", [skipped.uid])[0]
        assert (row["status"], row["skipped"]) == ("failed", True)
        assert reads.find_variant(con, skipped.uid) is None
        policy = load_catalog().model("stories260k").policy
        decision = decide(row, base.size_bytes, [], [], policy)
        assert decision.decision == "reject"
        assert decision.reason == f"reject: not built (skipped): {skipped.error}"
        writers.record_decisions(con, "r1", [decision], policy.model_dump(mode="json"))
        ledger.finish_run(con, "r1")
        card = reads.rows(con, "SELECT * FROM variant_scorecard")
    assert [(r["variant"], r["build_status"], r["decision"]) for r in card] == [("bnb-nf4", "skipped", "reject")]
    assert "bitsandbytes is not installed" in card[0]["reason"]
