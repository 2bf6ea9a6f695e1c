"""catalog/families.yaml against tiny random-weight models of each family's real architecture (tests/tiny_families.py):
its config finds its family, what a family keeps in 16 bits names modules it has, AWQ has llm-compressor's own
mappings for it, a build of a mixture-of-experts keeps its router and shared-expert gate unquantized, a correct build
of every family passes the logit check, a refused variant is refused before any work, and a family that needs
nothing more keeps its builds' uids. Real llm-compressor builds on the CPU, about a second each."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantgate.catalog.families import families, family_of
from quantgate.catalog.records import ModelArtifact
from quantgate.catalog.variants import TextCalibration, VariantSpec
from quantgate.tasks.adapters.quantizers import llmcompressor
from quantgate.tasks.steps import caching, quantize
from tests.shared_data import SHARED, TINY_MODEL
from tests.tiny_families import FAMILIES, tiny_model, write_tiny

STORIES = SHARED / "eval" / "simple_stories" / "simple_stories.txt"
CALIB = TextCalibration(path=str(STORIES), samples=4, seq_len=64)
# Routers (mlp.gate) and Qwen2-MoE's shared-expert gate.
GATES = re.compile(r"\.mlp\.(gate|shared_expert_gate)$")

pytestmark = [pytest.mark.skipif(not TINY_MODEL.is_dir() or not STORIES.is_file(), reason="needs ../shared/data"),
              pytest.mark.usefixtures("one_torch_thread")]



@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], ModelArtifact]:
    """Each family's tiny checkpoint, written once for the module."""
    root, made = tmp_path_factory.mktemp("families"), {}

    def get(family: str) -> ModelArtifact:
        if family not in made:
            path = write_tiny(family, root / family)
            made[family] = ModelArtifact(model_id=f"tiny-{family}", path=str(path), source="local", revision=None,
                                         sha=f"tiny-{family}")
        return made[family]

    return get


def _tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _matches(pattern: str, module: str) -> bool:
    # llm-compressor's ignore: "re:" and a regular expression matched from the start, else the name or its end.
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith(f".{pattern}")


def test_every_family_has_a_tiny_model():
    assert set(families()) == set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_config_finds_its_family_and_what_it_keeps_names_its_modules(name):
    model = tiny_model(name)
    family = family_of(model.config.to_dict())
    assert family is not None and family.name == name
    modules = [n for n, _ in model.named_modules()]
    for pattern in family.keep:
        kept = [m for m in modules if _matches(pattern, m)]
        assert kept, f"{name}: {pattern} names no module"
        assert all(GATES.search(f".{m}") for m in kept), f"{name}: {pattern} keeps more than routers and gates"


@pytest.mark.parametrize("name", [f for f in FAMILIES if "awq" not in families()[f].refuse])
def test_awq_has_llm_compressors_own_mappings_for_every_family_that_takes_it(name):
    from llmcompressor.modifiers.transform.awq import AWQ_MAPPING_REGISTRY

    # Else llm-compressor falls back to Llama's mappings (q/k/v, gate/up), wrong for fused or extra norms.
    assert type(tiny_model(name)).__name__ in AWQ_MAPPING_REGISTRY


def test_a_family_that_needs_nothing_more_keeps_the_spec_so_its_builds_uids(tiny):
    spec = VariantSpec(name="gptq-w4a16-g32", method="gptq", group_size=32)
    llama = ModelArtifact(model_id="tiny", path=str(TINY_MODEL), source="local", revision=None, sha="fixed")
    for model in (llama, tiny("qwen2")):
        built, refused = quantize.for_family(model, spec)
        assert built is spec and refused is None


@pytest.mark.parametrize(("name", "method", "scheme"), [
    ("qwen2_moe", "rtn", "W4A16"), ("qwen2_moe", "awq", "W4A16"), ("qwen3_moe", "gptq", "W4A16"),
    ("qwen3_moe", "fp8", "FP8_DYNAMIC"), ("qwen2_moe", "rtn", "W8A16"),
])
def test_an_moe_build_keeps_its_routers_and_gates_in_16_bits(name, method, scheme, tiny, tmp_path):
    spec = VariantSpec(name=f"{method}-{scheme}".lower(), method=method, scheme=scheme,
                       group_size=32 if scheme == "W4A16" else None)
    art = quantize.build_variant(tiny(name), spec, CALIB, tmp_path)
    assert art.status == "built", art.error  # and so it loaded and passed the logit check
    tensors = _tensors(art.path)
    gates = {k.removesuffix(".weight") for k in tensors if GATES.search(k.removesuffix(".weight"))}
    assert len(gates) == (4 if name == "qwen2_moe" else 2)  # 2 layers: a router each, and a shared-expert gate
    assert all(tensors[f"{g}.weight"].dtype == torch.float32 for g in gates)
    assert not [k for k in tensors if k.rpartition(".")[0] in gates and not k.endswith(".weight")]
    assert any(re.search(r"\.experts\.3\.down_proj\.weight_scale$", k) for k in tensors)  # the experts are quantized
    ignored = json.loads((Path(art.path) / "config.json").read_text())["quantization_config"]["ignore"]
    assert gates <= set(ignored)


def test_without_its_family_a_qwen2_moe_build_would_quantize_the_shared_expert_gate(tiny, tmp_path):
    bare = VariantSpec(name="rtn-w4a16-g32", method="rtn", group_size=32)  # ignore: lm_head only
    llmcompressor.quantize(Path(tiny("qwen2_moe").path), bare, None, tmp_path)
    assert "model.layers.0.mlp.shared_expert_gate.weight_packed" in _tensors(tmp_path)


@pytest.mark.parametrize("scheme", ["W8A16", "W4A16"])
@pytest.mark.parametrize("name", [f for f in FAMILIES if "rtn" not in families()[f].refuse])
def test_a_correct_build_of_every_family_passes_the_logit_check(name, scheme, tiny, tmp_path):
    spec = VariantSpec(name="rtn", method="rtn", scheme=scheme, group_size=32 if scheme == "W4A16" else None)
    art = quantize.build_variant(tiny(name), spec, CALIB, tmp_path)
    assert art.status == "built", art.error


def test_a_refused_variant_is_refused_before_any_work(tiny, tmp_path):
    unreadable = TextCalibration(path=str(tmp_path / "no-such-calibration.txt"))  # read, it would fail the build
    gptq = VariantSpec(name="gptq-w4a16-g32", method="gptq", group_size=32)
    w8a8 = VariantSpec(name="int8-w8a8", method="rtn", scheme="W8A8", group_size=None)
    mixtral = quantize.build_variant(tiny("mixtral"), gptq, unreadable, tmp_path / "out")
    moe = quantize.build_variant(tiny("qwen3_moe"), w8a8, unreadable, tmp_path / "out")
    assert mixtral.status == moe.status == "skipped" and mixtral.path is None and not moe.ok
    assert mixtral.error.startswith("gptq-w4a16-g32: refused for mixtral (gptq W4A16): llm-compressor 0.14 saves")
    assert moe.error.startswith("int8-w8a8: refused for qwen3_moe (rtn W8A8): Transformers 5 does not load W8A8")
    assert "\n" not in mixtral.error + moe.error and not (tmp_path / "out").exists()
    # Its cache key is made without reading the calibration either.
    assert caching.quantize_key(tiny("mixtral"), gptq, unreadable).startswith("quantize-")


def test_what_vllm_cannot_load_is_refused_only_where_vllm_serves_it(tiny, tmp_path):
    """INT8 W8A16 channel-wise experts: vLLM 0.26 fails to load them (benchmarks/results/h100/moe-4layers-1), so a
    run that evaluates and measures with vLLM refuses the build before any work, in one line; a CPU run (lm-eval's
    hf backend) builds it, and a grouped W8A16 is not refused."""
    unreadable = TextCalibration(path=str(tmp_path / "no-such-calibration.txt"))
    int8 = VariantSpec(name="int8-w8a16", method="rtn", scheme="W8A16", group_size=None)
    refused = quantize.build_variant(tiny("qwen3_moe"), int8, unreadable, tmp_path / "out", serving="vllm")
    assert refused.status == "skipped" and refused.path is None and not (tmp_path / "out").exists()
    assert refused.error.startswith("int8-w8a16: refused for qwen3_moe on vLLM (rtn W8A16): vLLM 0.26 cannot load"
                                    " channel-wise weight-only experts")
    assert "\n" not in refused.error
    assert quantize.for_family(tiny("qwen3_moe"), int8, "hf")[1] is None
    grouped = int8.model_copy(update={"name": "int8-w8a16-g32", "group_size": 32})
    assert quantize.for_family(tiny("qwen3_moe"), grouped, "vllm")[1] is None
    assert quantize.for_family(tiny("qwen2"), int8, "vllm")[1] is None  # a dense family's experts: none
