"""The family × method matrix (benchmarks/family_matrix.py, issue 43) as CI runs it: every family of
catalog/families.yaml × every method and scheme, through the quantize step on the CPU (real llm-compressor and
Transformers, tiny random-weight models), compared cell by cell with the committed run
(benchmarks/results/cpu/family-matrix/matrix.json); then one mixture-of-experts through a whole `quantgate run`.
The script runs once for the module: about a minute and a half on 2 cores."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest

from benchmarks import family_matrix
from quantgate.catalog.families import families
from quantgate.catalog.variants import Method, VariantSpec
from tests.shared_data import SHARED, TINY_MODEL

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "cpu" / "family-matrix"
REGENERATE = "python benchmarks/family_matrix.py --docs"
OUTCOMES = {"built", "refused", "failed"}

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TINY_MODEL.is_dir() or not (SHARED / "eval").is_dir(),
                                                  reason="needs ../shared/data")]


@pytest.fixture(scope="module")
def produced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("family-matrix")
    done = subprocess.run([sys.executable, "benchmarks/family_matrix.py", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "matrix.json").read_text())


@pytest.fixture(scope="module")
def committed() -> dict[str, Any]:
    return json.loads((COMMITTED / "matrix.json").read_text())


def test_every_cell_is_built_refused_or_failed_in_one_line(produced):
    tolerance = {v["variant"]: v["tolerance"] for v in produced["variants"]}
    for cell in produced["cells"]:
        where = f"{cell['family']} × {cell['variant']}: {cell['outcome']}: {cell['reason']}"
        # "traceback": the quantize step raised instead of recording the failure.
        assert cell["outcome"] in OUTCOMES, where
        assert (cell["reason"] is None) == (cell["outcome"] == "built"), where
        if cell["reason"] is not None:
            assert "\n" not in cell["reason"] and "Traceback" not in cell["reason"] and cell["reason"].strip(), where
        else:  # what the docs show beside it: within its scheme's tolerance, as the check judged
            assert 0 <= cell["logit_error"] <= tolerance[cell["variant"]], where


def test_the_matrix_is_the_committed_one_cell_by_cell(produced, committed):
    changed = family_matrix.changes(committed, produced)
    assert not changed, "\n".join([*changed, f"if the change is meant: {REGENERATE}, then commit what it wrote"])


def test_a_built_cell_that_now_fails_is_a_change(committed):
    broken = copy.deepcopy(committed)
    cell = next(c for c in broken["cells"] if c["outcome"] == "built" and c["family"] == "qwen3_moe")
    cell.update(outcome="failed", reason="its logits are off its base's by 1.200")
    dropped = broken["cells"].pop()
    assert family_matrix.changes(committed, broken) == sorted([
        f"qwen3_moe × {cell['variant']}: built → failed (its logits are off its base's by 1.200)",
        f"{dropped['family']} × {dropped['variant']}: {dropped['outcome']} → not in the matrix",
    ])


def test_every_refusal_is_still_needed(produced):
    refused = [c for c in produced["cells"] if c["outcome"] == "refused"]
    assert refused
    for cell in refused:
        # Built all the same, it fails: else llm-compressor or Transformers has fixed it; lift the refusal.
        assert cell["built_anyway"].startswith("failed: "), f"{cell['family']} × {cell['variant']}: {cell}"
        assert "\n" not in cell["built_anyway"]


def test_the_matrix_is_every_family_and_every_method_and_scheme(produced):
    assert [f["family"] for f in produced["families"]] == list(families())
    assert len(produced["families"]) >= 8 and len([f for f in produced["families"] if f["experts"]]) >= 2
    assert {v["method"] for v in produced["variants"]} == set(get_args(Method))
    assert {v["scheme"] for v in produced["variants"]} == set(get_args(VariantSpec.model_fields["scheme"].annotation))
    assert len(produced["cells"]) == len(produced["families"]) * len(produced["variants"])


def test_the_docs_are_the_committed_matrix(committed):
    section = family_matrix.render(committed)
    assert committed["command"] == REGENERATE
    assert family_matrix.docs_section() == section, f"docs/families.md's matrix is not the committed one: {REGENERATE}"
    assert (COMMITTED / "matrix.md").read_text() == f"# Family × method matrix\n\n{section}"


def test_a_mixture_of_experts_goes_through_a_whole_run_and_its_refused_variant_says_why(produced):
    example = produced["example"]
    assert not example["traceback"] and [s["returncode"] for s in example["shown"]] == [0, 0]
    built, refused = family_matrix.EXAMPLE_VARIANTS
    spec = family_matrix.variant_specs()[refused]
    why = f"{refused}: {families()[family_matrix.EXAMPLE_FAMILY].refusal(spec)}"
    checks = {(c["variant"], c["kind"]): c for c in example["checks"]}
    assert [c for c in example["checks"] if c["variant"] == refused] == [checks[(refused, "build")]]
    assert checks[(refused, "build")]["outcome"] == "fail" and checks[(refused, "build")]["note"] == why
    # The built one was evaluated (random weights: uninformative, by design), timed on the CPU and sized.
    assert checks[(built, "quality")]["outcome"] in {"uninformative", "inconclusive"}
    assert checks[(built, "speed")]["outcome"] == "pass" and checks[(built, "speed")]["value"] > 0
    assert checks[(built, "size")]["outcome"] == "pass"
    run = example["shown"][0]["stdout"]
    assert re.search(rf"│ {refused}\s+│ reject\s+│ build\s", run), run
    assert re.search(rf"│ {built}\s+│ inconclusive\s", run), run
    for stage in ("download", "evaluate", "quantize", "kl", "benchmark", "decide"):
        assert re.search(rf"│ {stage}\s+│ [1-9]", run), f"{stage} did not run:\n{run}"
