import math
from pathlib import Path

import pytest

from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.tasks.steps.evaluate import eval_key, evaluate_variant
from tests.shared_data import SHARED, with_chat_template

MODEL = SHARED / "models" / "stories260k-i256"
PIQA_LIMIT = 50
SUITE = SuiteSpec(tasks=(LocalTask(name="qg_simple_stories"), LocalTask(name="qg_piqa", limit=PIQA_LIMIT)), batch_size=8)

pytestmark = pytest.mark.skipif(not MODEL.is_dir(), reason=f"{MODEL} is not there")


@pytest.fixture(scope="module")
def report():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QUANTGATE_EVAL_DATA", raising=False)  # the default data root, beside the repo
        return evaluate_variant(str(MODEL), SUITE)


def metrics_of(report, task):
    return {m.metric: m for m in report.metrics if m.task == task and m.filter == "none"}


def test_piqa_metrics_come_with_stderr_count_and_version(report):
    assert report.status == "ok", report.error
    assert report.eval_key == eval_key(SUITE, "hf")
    piqa = metrics_of(report, "qg_piqa")
    assert set(piqa) == {"acc", "acc_norm"}
    for m in piqa.values():
        assert 0.0 <= m.value <= 1.0
        assert m.stderr is not None and 0.0 < m.stderr < 0.2
        assert m.n_samples == PIQA_LIMIT
        assert m.task_version == "1.0"
        assert m.higher_is_better is True


def test_perplexity_metrics_agree_with_their_samples(report):
    ppl = metrics_of(report, "qg_simple_stories")
    assert set(ppl) == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert all(m.n_samples == 10 and m.higher_is_better is False and m.stderr is None for m in ppl.values())
    assert math.isclose(ppl["bits_per_byte"].value, math.log2(ppl["byte_perplexity"].value), rel_tol=1e-9)
    # The tiny TinyStories model is at home here: a few nats per word, under one bit per byte.
    assert 5 < ppl["word_perplexity"].value < 60 and ppl["bits_per_byte"].value < 1.2

    rows = [s for s in report.samples if s.task == "qg_simple_stories" and s.metric == "word_perplexity"]
    assert sorted(s.doc_id for s in rows) == list(range(10))
    assert all(s.value < 0 and s.value == s.detail["ll"] for s in rows)
    nll, words = -sum(s.value for s in rows), sum(s.detail["weight"] for s in rows)
    assert math.isclose(math.exp(nll / words), ppl["word_perplexity"].value, rel_tol=1e-9)


def test_piqa_samples_cover_the_limit_and_match_the_metric(report):
    for metric in ("acc", "acc_norm"):
        rows = sorted((s for s in report.samples if s.task == "qg_piqa" and s.metric == metric), key=lambda s: s.doc_id)
        assert [s.doc_id for s in rows] == list(range(PIQA_LIMIT))
        assert {s.value for s in rows} <= {0.0, 1.0}
        assert math.isclose(sum(s.value for s in rows) / PIQA_LIMIT, metrics_of(report, "qg_piqa")[metric].value)
    for s in (s for s in report.samples if s.task == "qg_piqa" and s.metric == "acc"):
        lls = s.detail["lls"]
        assert len(lls) == 2 and s.detail["target"] in (0, 1)
        assert s.value == float(lls.index(max(lls)) == s.detail["target"])


def test_eval_key_follows_what_changes_the_numbers(tmp_path):
    key = eval_key(SUITE, "hf")
    assert key == eval_key(SuiteSpec.model_validate(SUITE.model_dump()), "hf")
    assert len(key) == 16
    assert key == eval_key(SUITE.model_copy(update={"batch_size": 1}), "hf")
    assert key != eval_key(SUITE, "vllm")
    assert key != eval_key(SUITE.model_copy(update={"num_fewshot": 5}), "hf")
    more = SuiteSpec(tasks=(LocalTask(name="qg_simple_stories"), LocalTask(name="qg_piqa", limit=PIQA_LIMIT + 1)))
    assert key != eval_key(more, "hf")

    # A task from the suite's own folder: its resolved YAML (includes merged) is part of the key.
    task_file = tmp_path / "my_piqa.yaml"
    base = Path(__file__).resolve().parents[1] / "catalog" / "lm_eval_tasks" / "qg_piqa.yaml"
    suite = SuiteSpec(tasks=(LocalTask(name="my_piqa", include_path=str(tmp_path)),))
    task_file.write_text(f'include: {base}\ntask: my_piqa\ndoc_to_text: "Q: {{{{goal}}}}\\nA:"\n')
    first = eval_key(suite, "hf")
    task_file.write_text(f'# same config, other comments\ninclude: {base}\ntask: my_piqa\ndoc_to_text: "Q: {{{{goal}}}}\\nA:"\n')
    assert eval_key(suite, "hf") == first
    task_file.write_text(f'include: {base}\ntask: my_piqa\ndoc_to_text: "Goal: {{{{goal}}}}\\nA:"\n')
    assert eval_key(suite, "hf") != first


CHAT_GSM8K = LocalTask(name="qg_gsm8k_cot", limit=2, num_fewshot=2, apply_chat_template=True, fewshot_as_multiturn=True)


def test_the_protocol_is_part_of_the_eval_key():
    plain = SuiteSpec(tasks=(LocalTask(name="qg_gsm8k_cot", limit=2),))
    keys = {eval_key(plain, "hf")} | {
        eval_key(SuiteSpec(tasks=(plain.tasks[0].model_copy(update=change),)), "hf")
        for change in ({"num_fewshot": 2}, {"apply_chat_template": True},
                       {"apply_chat_template": True, "fewshot_as_multiturn": True})
    }
    assert len(keys) == 4
    # A protocol left at its defaults keeps the key an evaluation had before protocols existed.
    assert eval_key(SUITE, "hf") == eval_key(SuiteSpec(tasks=tuple(
        LocalTask(name=t.name, limit=t.limit, num_fewshot=None, apply_chat_template=False) for t in SUITE.tasks
    ), batch_size=8), "hf")


def test_chat_few_shot_protocol_reaches_lm_eval(tmp_path):
    chat_model = with_chat_template(tmp_path / "chat")
    suite = SuiteSpec(tasks=(CHAT_GSM8K, LocalTask(name="qg_piqa", limit=4)))
    report = evaluate_variant(str(chat_model), suite)
    assert report.status == "ok", report.error
    assert report.config["protocols"] == {"qg_gsm8k_cot": "2-shot, chat, multiturn", "qg_piqa": "0-shot"}
    # The prompt as the model got it: two worked examples as turns of their own, then the question.
    prompt = report.config["example_prompts"]["qg_gsm8k_cot"]
    assert prompt.startswith("<|user|>\nQuestion: Janet") and prompt.count("<|user|>\nQuestion:") == 3
    assert prompt.count("<|assistant|>\n") == 3 and prompt.count("\n#### ") == 2 and prompt.endswith("<|assistant|>\n")
    assert "Question:" in report.config["example_prompts"]["qg_piqa"]
    strict = [m for m in report.metrics if m.task == "qg_gsm8k_cot" and m.filter == "strict-match"]
    assert [m.n_samples for m in strict] == [2]


def test_chat_protocol_on_a_model_without_a_chat_template_fails_with_one_line():
    report = evaluate_variant(str(MODEL), SuiteSpec(tasks=(CHAT_GSM8K,)))
    assert report.status == "failed" and "has no chat template" in report.error and "\n" not in report.error


def test_unknown_task_fails_with_one_line():
    suite = SuiteSpec(tasks=(LocalTask(name="qg_piqa", limit=2), LocalTask(name="no_such_task_xyz")))
    report = evaluate_variant(str(MODEL), suite)
    assert report.status == "failed"
    assert report.metrics == [] and report.samples == []
    assert "no_such_task_xyz" in report.error and "\n" not in report.error
    assert report.eval_key == eval_key(suite, "hf")


def test_data_root_comes_from_the_environment(tmp_path, monkeypatch):
    (tmp_path / "simple_stories").mkdir()
    stories = ["Once upon a time, a cat sat on a mat. The cat was happy.", "Tim had a big red kite. He flew it in the park."]
    (tmp_path / "simple_stories" / "simple_stories.txt").write_text("\n\n".join(stories) + "\n")
    monkeypatch.setenv("QUANTGATE_EVAL_DATA", str(tmp_path))
    report = evaluate_variant(str(MODEL), SuiteSpec(tasks=(LocalTask(name="qg_simple_stories"),)))
    assert report.status == "ok", report.error
    assert {m.n_samples for m in report.metrics} == {2}

    monkeypatch.setenv("QUANTGATE_EVAL_DATA", str(tmp_path / "elsewhere"))
    report = evaluate_variant(str(MODEL), SuiteSpec(tasks=(LocalTask(name="qg_piqa", limit=2),)))
    assert report.status == "failed"
    assert "QUANTGATE_EVAL_DATA" in report.error and "\n" not in report.error


def test_a_vllm_evaluation_asks_for_vllms_repeatable_offline_scheduling():
    """What this covers on CPU: the evaluation's config records the environment its vLLM child gets (the engine core
    in the evaluating process), and an hf evaluation gets none. That it repeats is shown on the H200: two reference
    runs on two machines, item by item (benchmarks/results/h200/README.md)."""
    from quantgate.tasks.adapters.evaluators import lm_eval

    def config(backend):
        return lm_eval.run_config(str(MODEL), SUITE, backend=backend, device="cuda", dtype="bfloat16", trust_remote_code=False)

    assert config("vllm")["engine_env"] == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert "engine_env" not in config("hf")


@pytest.mark.gpu
def test_vllm_backend_scores_like_hf_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none is visible)")
    pytest.importorskip("vllm", reason="vllm is not installed")
    suite = SuiteSpec(tasks=(LocalTask(name="qg_piqa", limit=20),), batch_size=8)
    hf = evaluate_variant(str(MODEL), suite, backend="hf", device="cuda", dtype="bfloat16")
    vllm = evaluate_variant(str(MODEL), suite, backend="vllm", device="cuda", dtype="bfloat16")
    assert hf.status == vllm.status == "ok", (hf.error, vllm.error)
    assert hf.eval_key != vllm.eval_key
    lls = {b: {s.doc_id: s.detail["lls"] for s in r.samples if s.metric == "acc"} for b, r in (("hf", hf), ("vllm", vllm))}
    assert sorted(lls["hf"]) == sorted(lls["vllm"]) == list(range(20))
    for doc_id, ll in lls["hf"].items():  # bf16 kernels differ; sums over ~30 tokens stay within a few percent
        assert ll == pytest.approx(lls["vllm"][doc_id], rel=0.05, abs=0.5)


def test_a_group_gate_has_its_items_paired_like_any_task(tmp_path):
    """MMLU is a group of 57 subjects: its items are stored again under the group's name, so that a gate on
    qg_mmlu/acc is judged item by item (paired bootstrap), and their mean is the group's size-weighted acc."""
    (tmp_path / "qg_mmlu_two.yaml").write_text(
        "group: qg_mmlu_two\ntask: [qg_mmlu_anatomy, qg_mmlu_astronomy]\n"
        "aggregate_metric_list:\n  - metric: acc\n    weight_by_size: true\nmetadata:\n  version: 1.0\n")
    suite = SuiteSpec(tasks=(LocalTask(name="qg_mmlu_two", include_path=str(tmp_path), limit=3),), batch_size=8)
    report = evaluate_variant(str(MODEL), suite)
    assert report.status == "ok", report.error
    rows = [s for s in report.samples if s.metric == "acc"]
    group = [s for s in rows if s.task == "qg_mmlu_two"]
    members = [s for s in rows if s.task in ("qg_mmlu_anatomy", "qg_mmlu_astronomy")]
    assert len(group) == len(members) == 6 and len({s.doc_id for s in group}) == 6
    assert sorted(s.value for s in group) == sorted(s.value for s in members)
    (acc,) = [m for m in report.metrics if m.task == "qg_mmlu_two" and m.metric == "acc"]
    assert acc.value == pytest.approx(sum(s.value for s in group) / 6)
