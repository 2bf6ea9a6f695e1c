import gc
import importlib.util
import json
import os
import shutil
import statistics

import pytest
import torch

from quantgate.catalog.scenarios import LatencyScenario, OfflineScenario, Sampling
from quantgate.tasks.adapters.engines import EngineError, EngineOptions, create
from quantgate.tasks.adapters.speed.errors import BenchmarkError
from quantgate.tasks.adapters.speed.prompts import make_prompt_sets, make_prompts
from quantgate.tasks.steps.benchmark import run_scenario, run_scenarios
from tests.shared_data import TINY_MODEL

TINY = TINY_MODEL
SMALL = OfflineScenario(num_prompts=4, input_len=16, output_len=8, batch_size=4, warmup=1, repetitions=3, device="cpu")
LINES = ["Once upon a time", "Tom was a small boy who loved trucks. He had a blue truck and a yellow truck.", "Mia"]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens on a machine without a GPU")


@pytest.fixture(scope="module")
def engine():
    e = create("transformers")
    e.load(str(TINY), EngineOptions(device="cpu", dtype="float32"))
    yield e
    e.close()


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(LINES[:2]) + "\n\n" + LINES[2] + "\n")
    return path


def test_transformers_in_spawned_process_measures_exact_fixed_length_output():
    r = run_scenario(str(TINY), "transformers", "tiny", SMALL)

    assert r.status == "ok", r.reason
    assert (r.num_requests, r.input_tokens, r.output_tokens) == (4, 4 * 16, 4 * 8)
    assert r.tokens_per_s > 0 and r.requests_per_s > 0
    assert 0 < r.ttft_ms < r.e2el_ms
    assert len(r.repetitions) == 3
    for rep in r.repetitions:
        assert rep["output_tokens"] == 32
        assert rep["tokens_per_s"] == pytest.approx(32 / rep["wall_s"])
        # One batch of 4: every request shares the batch's TTFT and E2EL, so vLLM's TPOT formula holds per run.
        assert rep["tpot_ms"] == pytest.approx((rep["e2el_ms"] - rep["ttft_ms"]) / (8 - 1))
        # The engine's process group spent CPU time on the pass (its own process, at least, generating).
        assert rep["cpu_s"] is not None and 0 <= rep["cpu_s"] <= 2 * rep["wall_s"] * (os.cpu_count() or 1)
        assert rep["sm_clock_mhz"] is None  # no GPU here
        # This process's garbage collections during the pass (its startup heap frozen before the passes), its own
        # CPU seconds (the front end, a share of its group's) and what the rest of the machine used meanwhile.
        assert rep["gc_collections"] >= 0 and 0 <= rep["gc_s"] <= rep["wall_s"]
        assert 0 <= rep["front_cpu_s"] <= rep["cpu_s"] + 0.05
        assert rep["other_cpu_s"] is not None and rep["other_cpu_s"] >= 0 and rep["steal_s"] >= 0
    assert r.tpot_ms == statistics.median(rep["tpot_ms"] for rep in r.repetitions)
    assert r.tokens_per_s == statistics.median(rep["tokens_per_s"] for rep in r.repetitions)
    assert r.peak_memory_bytes > 0 and r.energy_j_per_token is None
    assert r.device.startswith("cpu") and set(r.versions) >= {"torch", "transformers"} and "vllm" not in r.versions
    assert r.config["num_prompts"] == 4 and r.config["engine_options"]["dtype"] == "float32"
    json.dumps(r.as_dict())  # storable as the warehouse's JSON columns


def test_latency_scenario_times_each_request_alone():
    scenario = LatencyScenario(**{**SMALL.model_dump(exclude={"kind", "batch_size", "prompt_input"}), "num_prompts": 3, "repetitions": 1,
                                  "warmup": 0})
    frozen = gc.get_freeze_count()
    r = run_scenario(str(TINY), "transformers", "lat", scenario, isolate=False)

    assert r.status == "ok", r.reason
    assert gc.get_freeze_count() == frozen  # measured in this process: its heap is the caller's, left unfrozen
    assert (r.num_requests, r.output_tokens) == (3, 3 * 8)
    rep = r.repetitions[0]
    assert rep["requests_per_s"] == pytest.approx(3 / rep["wall_s"])
    assert rep["e2el_ms"] < rep["wall_s"] * 1000  # one request's latency, not the whole run


def test_a_variants_passes_alternate_with_the_bases_in_its_engine_process(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(TINY, base)
    alone = SMALL.model_copy(update={"paired": False})
    paired, unpaired = run_scenarios(str(TINY), "transformers", [("tiny", SMALL), ("alone", alone)],
                                     pair_with=str(base))

    assert paired.status == unpaired.status == "ok", (paired.reason, unpaired.reason)
    # The base's passes, on the same prompts, one beside each of the variant's; its load is a start of the session.
    base_passes = paired.details["paired_base"]
    assert len(base_passes) == len(paired.repetitions) == 3 and all(p["output_tokens"] == 32 for p in base_passes)
    assert paired.details["engine_starts"] == 2 and "unpaired" not in paired.details
    assert "paired_base" not in unpaired.details
    # Base, variant, variant, base, base, variant: each pair's two passes next to each other in time.
    order = sorted([(p["began_at"], "b") for p in base_passes] + [(p["began_at"], "v") for p in paired.repetitions])
    assert "".join(side for _, side in order) == "bvvbbv"


def test_a_base_that_does_not_load_leaves_the_variant_measured_alone_saying_why(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(TINY, broken)
    (broken / "model.safetensors").chmod(0o644)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")

    (r,) = run_scenarios(str(TINY), "transformers", [("tiny", SMALL)], pair_with=str(broken))

    assert r.status == "ok", r.reason
    assert "paired_base" not in r.details and r.details["engine_starts"] == 1
    assert r.details["unpaired"].startswith("the base did not load beside it: ") and "\n" not in r.details["unpaired"]


def test_a_base_folder_that_is_not_there_leaves_the_variant_measured_alone_saying_why(tmp_path):
    (r,) = run_scenarios(str(TINY), "transformers", [("tiny", SMALL)], pair_with=str(tmp_path / "gone"))

    assert r.status == "ok", r.reason
    assert "paired_base" not in r.details and r.details["engine_starts"] == 1
    assert r.details["unpaired"] == f"no base folder at {tmp_path / 'gone'} to pair with"


@no_gpu
def test_vllm_is_skipped_with_a_reason_on_a_cpu_machine():
    r = run_scenario(str(TINY), "vllm", "tiny", SMALL.model_copy(update={"device": "auto"}))

    assert r.status == "skipped"
    assert "vllm" in r.reason.lower()
    assert r.tokens_per_s is None and r.repetitions == []


@no_gpu
def test_cuda_scenario_is_skipped_on_a_cpu_machine():
    r = run_scenario(str(TINY), "transformers", "tiny", SMALL.model_copy(update={"device": "cuda"}))

    assert r.status == "skipped" and "CUDA" in r.reason


def test_crash_in_the_child_is_a_one_line_failure(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(TINY, broken)
    (broken / "model.safetensors").chmod(0o644)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")

    r = run_scenario(str(broken), "transformers", "tiny", SMALL)

    assert r.status == "failed"
    assert r.reason and "\n" not in r.reason and "Safetensor" in r.reason
    assert r.tokens_per_s is None


def test_missing_model_and_timeout_fail_without_raising(tmp_path):
    missing = run_scenario(str(tmp_path / "nope"), "transformers", "tiny", SMALL)
    slow = run_scenario(str(TINY), "transformers", "tiny", SMALL, timeout_s=0.5)

    assert missing.status == "failed" and "no model folder" in missing.reason
    assert slow.status == "failed" and slow.reason == "timed out after 0.5 s"


def test_a_misspelt_engine_option_is_one_clear_error():
    with pytest.raises(BenchmarkError, match=r"unknown engine option\(s\) \['gpu_mem'\]"):
        run_scenario(str(TINY), "transformers", "tiny", SMALL, options={"gpu_mem": 0.5})


def test_random_prompts_are_seeded_fixed_length_and_free_of_special_tokens():
    a = make_prompts(SMALL, str(TINY))
    b = make_prompts(SMALL, str(TINY))
    other_seed = make_prompts(SMALL.model_copy(update={"seed": 1}), str(TINY))

    assert a == b and a != other_seed
    assert len(a) == 4 and all(len(p) == 16 for p in a)
    assert not {0, 1, 2} & {t for p in a for t in p}  # <unk>, <s>, </s>


def test_text_prompts_are_the_benchs_and_need_vllm(engine):
    """prompt_input 'text' takes vLLM's own benchmark dataset; where vLLM is not installed (CPU machines) the
    scenario fails with one line, and Transformers refuses text it would have to tokenize in its timed pass."""
    with pytest.raises(EngineError, match=r"prompts are token ids \(text prompts are for vllm\)"):
        engine.generate(["Once upon a time"], 2)
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: tests/gpu/test_gpu_suite_gpu.py measures its text prompts")
    scenario = OfflineScenario(engines=["vllm"], prompt_input="text", num_prompts=2, input_len=8, output_len=4)
    with pytest.raises(BenchmarkError, match=r"prompt_input 'text' makes its prompts with vLLM's benchmark dataset"):
        make_prompt_sets(scenario, str(TINY), 2)
    assert make_prompts(scenario, str(TINY)) == make_prompts(SMALL.model_copy(update={"num_prompts": 2,
                                                                                   "input_len": 8}), str(TINY))


def test_file_prompts_are_cut_to_input_len_and_filled_from_following_lines(prompts_file):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    encoded = [tok(line, add_special_tokens=False)["input_ids"] for line in LINES]
    scenario = SMALL.model_copy(update={"prompts_file": str(prompts_file), "num_prompts": 4, "input_len": 10})

    prompts = make_prompts(scenario, str(TINY))

    assert [len(p) for p in prompts] == [10, 10, 10, 10]
    assert prompts[0] == (encoded[0] + encoded[1])[:10]  # line 0 is short: continues into line 1
    assert prompts[1] == encoded[1][:10]
    assert prompts[2] == (encoded[2] + encoded[0] + encoded[1])[:10]  # wraps around the file
    assert prompts[3] == prompts[0]


def test_left_padding_gives_each_prompt_the_tokens_it_gets_alone(engine, prompts_file):
    tok = engine._tokenizer
    prompts = [tok(line)["input_ids"] for line in prompts_file.read_text().splitlines() if line]
    assert len({len(p) for p in prompts}) == 3

    batch = engine.generate(prompts, 6)

    assert batch.output_tokens == [6, 6, 6]
    assert [r.output_tokens for r in batch.requests] == [6, 6, 6]
    assert [r.prompt_tokens for r in batch.requests] == [len(p) for p in prompts]
    assert 0 < batch.ttft_s < batch.wall_s
    assert batch.token_ids == [engine.generate([p], 6).token_ids[0] for p in prompts]


def test_sampling_keeps_the_fixed_length_and_leaves_greedy_alone(engine):
    prompts = [engine._tokenizer(line)["input_ids"] for line in LINES]
    greedy = engine.generate(prompts, 8).token_ids
    torch.manual_seed(0)
    sampled = engine.generate(prompts, 8, sampling=Sampling(temperature=1.0))

    assert sampled.output_tokens == [8, 8, 8]
    assert sampled.token_ids != greedy  # 24 draws at temperature 1 over a 512-token vocabulary
    assert engine.generate(prompts, 8).token_ids == greedy
    r = run_scenario(str(TINY), "transformers", "sampled", SMALL.model_copy(update={"temperature": 1.0}), isolate=False)
    assert r.status == "ok" and r.output_tokens == 4 * 3 * 8 // 3 and r.config["temperature"] == 1.0


def test_top_k_and_top_p_reach_the_sampler(engine):
    """Sampling from the single most likely token, by top-k 1 or by a nucleus too small for a second one, is
    greedy at any temperature; top-k 2 is not."""
    prompts = [engine._tokenizer(line)["input_ids"] for line in LINES]
    greedy = engine.generate(prompts, 8).token_ids
    torch.manual_seed(0)
    assert engine.generate(prompts, 8, sampling=Sampling(temperature=2.0, top_k=1)).token_ids == greedy
    assert engine.generate(prompts, 8, sampling=Sampling(temperature=2.0, top_p=1e-6)).token_ids == greedy
    assert engine.generate(prompts, 8, sampling=Sampling(temperature=2.0, top_k=2)).token_ids != greedy
    r = run_scenario(str(TINY), "transformers", "nucleus",
                     SMALL.model_copy(update={"temperature": 0.7, "top_p": 0.9, "top_k": 20}), isolate=False)
    assert r.status == "ok" and (r.config["top_p"], r.config["top_k"]) == (0.9, 20)


def test_counts_stop_at_eos_per_sequence(engine, tmp_path):
    prompts = [engine._tokenizer(line)["input_ids"] for line in LINES]
    fixed = engine.generate(prompts, 8).token_ids
    # Make a token the first prompt generates early the EOS of a copy of the checkpoint.
    eos = fixed[0][2]
    copy = tmp_path / "eos"
    shutil.copytree(TINY, copy)
    (copy / "generation_config.json").chmod(0o644)
    (copy / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos}))
    other = create("transformers")
    other.load(str(copy), EngineOptions(device="cpu", dtype="float32"))

    stopped = other.generate(prompts, 8, ignore_eos=False)

    expected = [row[: row.index(eos) + 1] if eos in row else row for row in fixed]
    assert stopped.token_ids == expected
    assert stopped.output_tokens[0] <= 3 and stopped.output_tokens == [len(r) for r in expected]
    other.close()
