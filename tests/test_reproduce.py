"""Every figure re-runnable outside quantgate (issue 45, item 4): `quantgate reproduce` prints lm-eval's own
command line for each stored evaluation of a run, and those commands, run as printed, give back the stored
per-item results bit for bit. Real runs: the pipeline on the tiny model (lm-eval's hf backend on the CPU), then
lm-eval's CLI in a process of its own; and the reference run's stored vLLM evaluation (reference12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantgate.flows import evaluate_model as em
from quantgate.warehouse import sessions, transfer
from tests.cli_runs import run_cli, tiny_catalog
from tests.shared_data import TINY_MODEL

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
LM_EVAL = Path(sys.executable).parent / "lm_eval"
# Two limits, so two lm-eval calls: perplexity documents (log-likelihoods per document) and multiple-choice
# items (0/1 per item).
SUITE = "tasks: [{name: qg_simple_stories, limit: 2}, {name: qg_piqa, limit: 6}]"


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """A warehouse with one real evaluate-model run of the tiny model: its base and an RTN W8A16 build."""
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    tmp = tmp_path_factory.mktemp("reproduce")
    cat = tiny_catalog(tmp, TINY_MODEL, {"rtn-w8a16": "{method: rtn, scheme: W8A16, group_size: null}"}, limit=2)
    cat.write_text(cat.read_text().replace("tasks: [{name: qg_simple_stories, limit: 2}]", SUITE))
    wh = tmp / "w.ducklake"
    card = em.evaluate_model(model="tiny", catalog=str(cat), warehouse=str(wh), workdir=str(tmp / "work"))
    assert len(card) == 1
    return wh


def reproduce(wh: Path, *args: str) -> list[dict]:
    done = run_cli(["reproduce", *args, "-w", str(wh), "-f", "json"])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_printed_commands_reproduce_the_base_item_for_item(stored: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    commands = reproduce(stored, "tiny", "--out", str(out))
    # Base first, then the build; one command per lm-eval call of each.
    assert [(c["variant"], c["tasks"]) for c in commands] == [
        ("base", "qg_simple_stories"), ("base", "qg_piqa"), ("rtn-w8a16", "qg_simple_stories"),
        ("rtn-w8a16", "qg_piqa")]
    base = [c for c in commands if c["variant"] == "base"]
    stories, piqa = (c["argv"] for c in base)
    assert stories[:4] == ["lm_eval", "run", "--model", "hf"]
    assert stories[stories.index("--model_args") + 1] == f"pretrained={TINY_MODEL},dtype=float32,trust_remote_code=False"
    assert stories[stories.index("--limit") + 1] == "2" and piqa[piqa.index("--limit") + 1] == "6"
    for flag, value in (("--batch_size", "8"), ("--device", "cpu"), ("--seed", "0,1234,1234,1234"),
                        ("--include_path", str(REPO / "catalog" / "lm_eval_tasks"))):
        assert piqa[piqa.index(flag) + 1] == value
    assert base[0]["env"]["HF_HUB_OFFLINE"] == "1" and "QUANTGATE_EVAL_DATA" in base[0]["env"]
    assert base[0]["command"].startswith("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 QUANTGATE_EVAL_DATA=")

    # Run as printed (lm_eval from this interpreter's environment), each in a process of its own.
    for c in base:
        done = subprocess.run([str(LM_EVAL), *c["argv"][1:]], env={**os.environ, **c["env"]}, capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
    compared = {(r["task"], r["metric"]): r for r in reproduce(stored, "tiny", "base", "--out", str(out), "--compare")}
    assert set(compared) == {("qg_simple_stories", m) for m in ("bits_per_byte", "byte_perplexity", "word_perplexity")} | {
        ("qg_piqa", "acc"), ("qg_piqa", "acc_norm")}
    for r in compared.values():
        # Every stored item found again, equal bit for bit.
        assert r["items"] == r["reproduced"] == r["equal"] and r["differ"] == 0 and r["max_abs_diff"] == 0, r
    assert compared[("qg_piqa", "acc")]["items"] == 6 and compared[("qg_simple_stories", "bits_per_byte")]["items"] == 2


def test_a_checkpoint_without_a_reproduction_run_says_so(stored: Path, tmp_path: Path) -> None:
    # Nothing under --out yet: the comparison has no reproduced items to show.
    assert reproduce(stored, "tiny", "rtn-w8a16", "--out", str(tmp_path / "empty"), "--compare") == []
    missing = run_cli(["reproduce", "no-such-run", "-w", str(stored)])
    assert missing.returncode != 0 and "no run 'no-such-run' and no finished run of a model 'no-such-run'" in missing.stderr


def test_the_reference_runs_vllm_evaluation_as_lm_evals_command(tmp_path: Path) -> None:
    """reference12's stored base evaluation (vLLM on the H200): MMLU 5-shot and GSM8K 8-shot chain of thought,
    each in the chat template with few-shot turns, in commands of their own (their limits differ)."""
    wh = tmp_path / "w.ducklake"
    with sessions.session(wh) as con:
        transfer.load_parquet(con, REPO / "benchmarks" / "results" / "h200" / "reference12")
    done = run_cli(["reproduce", "qwen2.5-coder-1.5b-instruct", "base", "-w", str(wh), "--out", "out"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (mmlu,) = [ln for ln in lines if "--tasks qg_mmlu " in ln]
    assert mmlu.startswith("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 QUANTGATE_EVAL_DATA=/root/qg-jobs/ref/repo/"
                           ".gpu-carry/data/eval VLLM_ENABLE_V1_MULTIPROCESSING=0 lm_eval run --model vllm --model_args"
                           " pretrained=/tmp/quantgate-reference/models/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m-"
                           "d7bc45e03b26,dtype=bfloat16,trust_remote_code=False,enforce_eager=True")
    assert ("--limit 15 --num_fewshot 5 --apply_chat_template --fewshot_as_multiturn true --batch_size auto --seed"
            " 0,1234,1234,1234 --log_samples --output_path out/base") in mmlu
    (gsm8k,) = [ln for ln in lines if "--tasks qg_gsm8k_cot " in ln]
    assert "--limit 800 --num_fewshot 8 --apply_chat_template --fewshot_as_multiturn true" in gsm8k
    (passkey,) = [ln for ln in lines if "--tasks qg_passkey " in ln]
    assert "--metadata '{\"context_words\": 6000, \"per_depth\": 10}'" in passkey
    # What the stored config cannot say is said: that run stored no engine size.
    assert "# note: the evaluation engine's size (max_model_len, KV cache) was not stored" in done.stdout


def test_an_evaluation_scored_by_next_token_passes_says_so_beside_its_command() -> None:
    """lm_eval's CLI scores each choice as a prompt of its own: the command says that quantgate read the same
    quantities from one next-token pass per context, and how many requests it scored so."""
    from quantgate.tasks.adapters.evaluators.lm_eval_cli import reproductions

    config = {"model_path": "/m", "backend": "vllm", "dtype": "bfloat16", "trust_remote_code": False,
              "tasks": [{"name": "qg_simple_stories"}], "engine": {"max_model_len": 4096}, "batch_size": "auto",
              "loglikelihood_scored": {"next_token": 3420, "lm_eval": 10}}
    (command,) = reproductions(config, "out")
    assert [n for n in command.notes if "3,420 loglikelihood requests" in n and "next-token pass" in n]
    del config["loglikelihood_scored"]
    assert not [n for n in reproductions(config, "out")[0].notes if "next-token" in n]
