"""Calibration sets: exact-length token samples of each kind, their fingerprint, and the overlap check
against what a suite evaluates, on the real tiny model's tokenizer and the real eval data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from quantgate.catalog.errors import CatalogError
from quantgate.catalog.load import load_catalog
from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.catalog.variants import ChatCalibration, EvalHoldoutCalibration, HoldoutSlice, TextCalibration
from quantgate.tasks.steps.calibration import CalibrationError, check_calibration, load_calibration
from tests.shared_data import SHARED, TINY_MODEL, with_chat_template

STORIES = SHARED / "eval" / "simple_stories" / "simple_stories.txt"
GSM8K = SHARED / "eval" / "gsm8k" / "test.jsonl"

pytestmark = pytest.mark.skipif(not TINY_MODEL.is_dir() or not GSM8K.is_file(), reason="needs ../shared/data")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(tmp_path_factory.mktemp("chat") / "model")


def _conversations(path: Path, pairs: list[tuple[str, str]]) -> Path:
    lines = [json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
             for q, a in pairs]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_text_samples_are_exactly_seq_len_tokens_and_open_like_the_tokenizer():
    calib = TextCalibration(samples=6, seq_len=48)  # the Python standard library
    samples = load_calibration(calib, TINY_MODEL)
    bos = AutoTokenizer.from_pretrained(TINY_MODEL).bos_token_id
    assert len(samples.input_ids) == 6 and {len(s) for s in samples.input_ids} == {48}
    assert all(s[0] == bos for s in samples.input_ids) and len(set(samples.input_ids)) == 6
    assert samples.label == "text stdlib (*.py)"
    assert load_calibration(calib, TINY_MODEL).fingerprint == samples.fingerprint
    for changed in ({"seed": 1}, {"seq_len": 49}, {"samples": 7}):
        assert load_calibration(calib.model_copy(update=changed), TINY_MODEL).fingerprint != samples.fingerprint


def test_a_set_too_small_for_its_size_is_refused_in_one_line(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("one two three")
    with pytest.raises(CalibrationError, match=r"make 0 samples of 64 tokens, 4 asked") as err:
        load_calibration(TextCalibration(path=str(short), samples=4, seq_len=64), TINY_MODEL)
    assert "\n" not in str(err.value)
    with pytest.raises(CalibrationError, match="no such file or folder"):
        load_calibration(TextCalibration(path=str(tmp_path / "missing.txt")), TINY_MODEL)


def test_chat_samples_are_rendered_with_the_models_template(chat_model, tmp_path):
    pairs = [(f"Question {i}: how many legs does a spider have?", f"A spider has {i + 8} legs.") for i in range(40)]
    calib = ChatCalibration(path=str(_conversations(tmp_path / "chat.jsonl", pairs)), samples=4, seq_len=64)
    samples = load_calibration(calib, chat_model)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    first = tokenizer.decode(list(samples.input_ids[0]))
    assert first.startswith("<|user|>\nQuestion") and "<|assistant|>\nA spider has" in first
    assert {len(s) for s in samples.input_ids} == {64}
    # The template is part of what the samples are: another template, another fingerprint.
    other = with_chat_template(tmp_path / "other")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("<|", "[").replace("|>", "]")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_calibration(calib, other).fingerprint != samples.fingerprint
    with pytest.raises(CalibrationError, match="has no chat template") as err:
        load_calibration(calib, TINY_MODEL)
    assert "\n" not in str(err.value)


def test_a_bad_chat_line_names_the_file_and_line(chat_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "no messages"}\n')
    with pytest.raises(CalibrationError, match=r"bad.jsonl line 2: not a"):
        load_calibration(ChatCalibration(path=str(bad), samples=1, seq_len=8), chat_model)


def test_eval_holdout_renders_question_answer_turns(chat_model):
    calib = EvalHoldoutCalibration(items=(HoldoutSlice(dataset="gsm8k", start=1000),), samples=3, seq_len=1500)
    text = AutoTokenizer.from_pretrained(chat_model).decode(list(load_calibration(calib, chat_model).input_ids[0]))
    # A problem, then its worked solution without calculator annotations, ending "#### N".
    assert text.startswith("<|user|>\n") and "\n<|assistant|>\n" in text and "\n#### " in text and "<<" not in text


# --- overlap with what is evaluated ----------------------------------------------------------------------

GSM8K_COT = SuiteSpec(tasks=(LocalTask(name="qg_gsm8k_cot", limit=100, num_fewshot=8),))


def test_calibration_on_evaluated_items_is_refused(chat_model, tmp_path):
    # qg_gsm8k_cot asks test problems 8..107 (the first 8 are its worked examples).
    asked = EvalHoldoutCalibration(items=(HoldoutSlice(dataset="gsm8k", start=50, stop=90),), samples=2, seq_len=256)
    with pytest.raises(CalibrationError, match=r"eval_holdout gsm8k\[50:90\] overlaps qg_gsm8k_cot item \d+") as err:
        check_calibration(asked, chat_model, GSM8K_COT)
    assert "\n" not in str(err.value) and "% of its text" in str(err.value)
    # A worked example is in the prompt of every question: calibrating on it is refused too.
    examples = asked.model_copy(update={"items": (HoldoutSlice(dataset="gsm8k", start=0, stop=8),), "samples": 1})
    with pytest.raises(CalibrationError, match="overlaps qg_gsm8k_cot"):
        check_calibration(examples, chat_model, GSM8K_COT)
    # One copied MMLU question among unrelated conversations (MMLU dev: the few-shot pool of a 5-shot suite).
    mmlu = SuiteSpec(tasks=(LocalTask(name="qg_mmlu", limit=5, num_fewshot=5),))
    import csv

    with (SHARED / "eval" / "mmlu" / "dev" / "anatomy_dev.csv").open(newline="") as f:
        question = next(csv.DictReader(f))["question"]
    pairs = [(f"Tell me about the number {i}.", f"The number {i} comes after {i - 1}.") for i in range(30)]
    pairs.insert(7, (question, "B"))
    copied = ChatCalibration(path=str(_conversations(tmp_path / "copied.jsonl", pairs)), samples=3, seq_len=128)
    with pytest.raises(CalibrationError, match="overlaps qg_mmlu_anatomy"):
        check_calibration(copied, chat_model, mmlu)


def test_calibration_on_the_kl_text_is_refused():
    stories = TextCalibration(path=str(STORIES), samples=2, seq_len=64)
    with pytest.raises(CalibrationError, match=r"overlaps the KL text item \d+") as err:
        check_calibration(stories, TINY_MODEL, GSM8K_COT)  # its KL text: the stories, by default
    assert "\n" not in str(err.value)


def test_disjoint_calibration_passes(chat_model):
    past = EvalHoldoutCalibration(items=(HoldoutSlice(dataset="gsm8k", start=200),), samples=4, seq_len=256)
    assert len(check_calibration(past, chat_model, GSM8K_COT).input_ids) == 4
    assert len(check_calibration(TextCalibration(samples=4, seq_len=64), TINY_MODEL, GSM8K_COT).input_ids) == 4


def test_the_catalogs_calibration_sets_pass_against_its_suites(chat_model):
    cat = load_catalog()
    for model in cat.models:  # each set a calibrated variant of the model is built with (e.g. plain-32x128)
        for calib in cat.calibration_sets(model):
            if isinstance(calib, TextCalibration):
                check_calibration(calib.model_copy(update={"samples": 4}), TINY_MODEL, cat.suites[model.suite])
    small = cat.calibrations["chat-holdout"].model_copy(update={"samples": 8, "seq_len": 512})
    for suite in ("gpu-reference", "offline-full"):
        check_calibration(small, chat_model, cat.suites[suite])


def test_models_name_calibration_sets_of_the_catalog(tmp_path):
    text = (Path(__file__).resolve().parents[1] / "catalog" / "models.yaml").read_text()
    named = text.replace("calibration: {kind: text, samples: 64, seq_len: 128}", "calibration: chat-holdout")
    (tmp_path / "models.yaml").write_text(named)
    for policy in (Path(__file__).resolve().parents[1] / "catalog").glob("policy*.yaml"):
        (tmp_path / policy.name).write_text(policy.read_text())
    tiny = load_catalog(tmp_path / "models.yaml").model("stories260k")
    assert tiny.calibration.name == "chat-holdout" and tiny.calibration.kind == "eval_holdout"
    (tmp_path / "models.yaml").write_text(named.replace("calibration: chat-holdout", "calibration: no-such-set"))
    with pytest.raises(CatalogError, match="unknown calibration set 'no-such-set'") as err:
        load_catalog(tmp_path / "models.yaml")
    assert "\n" not in str(err.value)
