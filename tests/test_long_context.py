"""qg_passkey, the long-context retrieval task: its items, its fit in the tiny model's context, its scoring
with lm-eval's own filters and metric, and a suite's metadata reaching the items (a real lm-eval run on
the tiny model). The flow test (tests/test_flow.py) puts its metric in the scorecard."""

import importlib.util
import json
import re

import pytest
import yaml

from quantgate.catalog.load import load_catalog
from quantgate.catalog.paths import LOCAL_TASKS_DIR
from quantgate.catalog.suites import LocalTask, SuiteSpec
from quantgate.tasks.adapters.evaluators.lm_eval import eval_key, evaluate
from tests.shared_data import SHARED

TEXT = SHARED / "eval" / "simple_stories" / "simple_stories.txt"


def _utils():
    spec = importlib.util.spec_from_file_location("qg_task_utils", LOCAL_TASKS_DIR / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def utils():
    if not TEXT.is_file():
        pytest.skip(f"eval data not found at {TEXT}")
    return _utils()


def test_items_plant_one_fact_at_each_depth_the_same_every_time(utils):
    text = TEXT.read_text()
    docs = utils.passkey_prompts(text, context_words=150)
    assert docs == utils.passkey_prompts(text, context_words=150)
    assert len(docs) == 20 and [d["depth"] for d in docs[::4]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for d in docs:
        body, question = d["prompt"].rsplit("\n\n", 1)
        name = re.fullmatch(r"The magic number of (\w+) is", question).group(1)
        needle = f"The magic number of {name} is {d['answer']}."
        assert body.count(needle) == 1 and body.count(name) == 1 and len(d["answer"]) == 4
        assert d["context_words"] >= 150 and len(body.split()) == d["context_words"] + len(needle.split())
        where = body.index(needle) / len(body)
        assert abs(where - d["depth"]) < 0.15, (d["depth"], where)
    assert docs[0]["prompt"].startswith("The magic number of")  # depth 0: first sentence
    assert docs[-1]["prompt"].split("\n\n")[0].endswith(f"is {docs[-1]['answer']}.")  # depth 1: last
    assert len({(d["prompt"].rsplit(' ', 1)[0], d["answer"]) for d in docs}) == 20
    longer = utils.passkey_prompts(text, context_words=3000, depths=[0.5], per_depth=2)
    assert len(longer) == 2 and all(d["context_words"] >= 3000 for d in longer)
    with pytest.raises(ValueError, match="depths must lie in"):
        utils.passkey_prompts(text, depths=[1.5])


def test_default_size_fits_the_tiny_models_context(utils, tiny_model):
    from transformers import AutoConfig, AutoTokenizer

    config = yaml.load((LOCAL_TASKS_DIR / "qg_passkey.yaml").read_text(), Loader=_loader())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    docs = utils.passkey(**config["metadata"])["test"]
    longest = max(len(tokenizer(d["prompt"]).input_ids) for d in docs)
    window = AutoConfig.from_pretrained(tiny_model).max_position_embeddings
    # lm-eval cuts a longer prompt from the left (and the early facts with it): it must not have to.
    assert longest + config["generation_kwargs"]["max_gen_toks"] <= window, (longest, window)


def _loader():
    loader = type("L", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return loader


def test_scoring_takes_the_first_number_and_matches_it_exactly():
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=[str(LOCAL_TASKS_DIR)], include_defaults=False,
                       metadata={"context_words": 40, "per_depth": 1}).load("qg_passkey")["tasks"]["qg_passkey"]
    doc = task.test_docs()[0]
    target = task.doc_to_target(doc)
    [extract] = [f for f in task._filters if f.name == "first-number"]
    responses = [[f" {target}."], [f" {target}0 and more"], [" not a number"], [f" 12 then {target}"]]
    kept = responses
    for make in extract.filters:  # the ensemble's filters in order: regex, take_first
        kept = list(make().apply(kept, [doc] * len(kept)))
    assert kept[0] == target and kept[2] == "[invalid]"
    scores = [task.process_results(doc, [k])["exact_match"] for k in kept]
    assert scores == [1.0, 0.0, 0.0, 0.0]


def test_suite_metadata_sizes_the_items_and_the_eval_key(tiny_model):
    plain = SuiteSpec(tasks=(LocalTask(name="qg_passkey"),))
    small = SuiteSpec(tasks=(LocalTask(name="qg_passkey", metadata={"context_words": 40, "per_depth": 1}),))
    assert eval_key(plain, "hf") != eval_key(small, "hf")
    report = evaluate(str(tiny_model), small)
    [metric] = report.metrics
    assert (metric.task, metric.metric, metric.filter, metric.n_samples) == ("qg_passkey", "exact_match", "first-number", 5)
    assert 0 <= metric.value <= 1 and metric.higher_is_better
    assert sorted(s.doc_id for s in report.samples) == list(range(5))
    assert all(len(s.detail["target"]) == 4 and "response" in s.detail for s in report.samples)
    assert report.config["tasks"][0]["metadata"] == {"context_words": 40, "per_depth": 1}


def test_every_suite_has_long_context_sized_for_its_models():
    cat = load_catalog()
    sizes = {name: next((t.metadata.get("context_words", 150) for t in s.tasks if t.name == "qg_passkey"), None)
             for name, s in cat.suites.items()}
    assert sizes == {"offline-small": 400, "offline-tiny": 150, "offline-full": 6000, "standard": 6000,
                     "gpu-reference": 6000}
    gates = {(g.task, g.required) for g in cat.policy.quality}
    assert ("qg_passkey", False) in gates
    assert "qg_passkey" not in {g.task for g in cat.model("stories260k").policy.quality}
    json.dumps(cat.model_dump(mode="json"))  # metadata stays plain data (the catalog hash)
