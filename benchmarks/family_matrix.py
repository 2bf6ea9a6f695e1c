"""The family × method matrix (issue 43): every family of catalog/families.yaml, as a tiny random-weight model of its
real architecture (tests/tiny_families.py), built with every method and scheme quantgate offers, on the CPU.

Each cell goes through the quantize step a run uses (`tasks/steps/quantize.build_variant`: the family's refusal
before any work, the build with the modules the family keeps in 16 bits, the load in Transformers and the logit
check) and ends one of three ways: built (with its logit error against the base), refused before any work, or
failed, each with its one-line reason. A refused cell is then built all the same, the refusal lifted, to show the
refusal is still needed (when such a build passes, llm-compressor or Transformers has fixed it: lift the refusal).
Then one family goes through a whole `quantgate run` (download of its shape, builds, evaluation, KL, the CPU
benchmark, the decision): what a user sees for a method its family cannot take.

    python benchmarks/family_matrix.py --docs        # run it: benchmarks/results/cpu/family-matrix/, docs/families.md
    python benchmarks/family_matrix.py --out DIR     # run it into DIR (CI compares it with the committed one)
    python benchmarks/family_matrix.py --no-example  # the matrix alone (seconds)
    python benchmarks/family_matrix.py --render      # no run: matrix.md and the docs from the committed matrix.json

The docs section is rendered from matrix.json alone; nothing in it is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.tiny_families, when run as a script

OUT = REPO / "benchmarks" / "results" / "cpu" / "family-matrix"
PAGE = REPO / "docs" / "families.md"
BEGIN, END = "<!-- family-matrix:begin -->", "<!-- family-matrix:end -->"

# The columns: the catalog's own variants, one for each method and scheme (group size 32, as the tiny models' Linears
# are 64 and 128 wide), and two schemes no catalog variant uses, defined in EXTRA_VARIANTS.
COLUMNS = ("awq-w4a16-g32", "gptq-w4a16-g32", "rtn-w4a16-asym-g32", "int8-w8a16", "int8-w8a8", "fp8-dynamic",
           "rtn-w2a16-g32", "bnb-int8", "bnb-nf4", "bnb-fp4")
EXTRA_VARIANTS = {
    "rtn-w4a16-asym-g32": {"method": "rtn", "scheme": "W4A16_ASYM", "group_size": 32},
    "int8-w8a8": {"method": "rtn", "scheme": "W8A8", "group_size": None},
}
# Tiny calibration: 4 samples of 64 tokens of the Python standard library's text (offline everywhere); AWQ and GPTQ
# need some to run, what they make of random weights is not what the matrix asks.
CALIBRATION = {"samples": 4, "seq_len": 64}
LIBRARIES = ("llmcompressor", "compressed-tensors", "transformers", "torch", "bitsandbytes")

# The whole run of one family: a mixture-of-experts, one variant it builds and one it is refused.
EXAMPLE_FAMILY = "qwen3_moe"
EXAMPLE_VARIANTS = ("gptq-w4a16-g32", "int8-w8a8")
EXAMPLE_MODEL = f"tiny-{EXAMPLE_FAMILY}"
# A perplexity suite of 2 documents and one micro Transformers benchmark that times the compressed-tensors build too
# (transformers_decompressed): every stage runs on the mixture-of-experts, in about a minute.
EXAMPLE_CATALOG = """version: 1
variants:
{variants}
suites:
  stories:
    tasks: [{{name: qg_simple_stories, limit: 2}}]
    batch_size: 8
scenarios:
  micro: {{kind: offline, engines: [transformers], device: cpu, num_prompts: 2, input_len: 8, output_len: 4,
          batch_size: 2, repetitions: 1, warmup: 0, transformers_decompressed: true}}
models:
  - id: {model}
    # Random weights of the family's tiny config.json (in the folder beside this catalog): a shape run.
    source: {{kind: shape, config: {family}}}
    variants: [{names}]
    suite: stories
    scenarios: [micro]
    calibration: {{kind: text, samples: {samples}, seq_len: {seq_len}}}
policy:
  version: 1
  quality: [{{task: qg_simple_stories, metric: bits_per_byte, min_recovery: 0.95, higher_is_better: false}}]
  speed: {{engine: transformers, scenario: micro, min_speedup: 0.01}}
  max_size_ratio: 1.0
"""


def variant_specs() -> dict[str, Any]:
    """Each column's VariantSpec: the packaged catalog's variant of that name, else EXTRA_VARIANTS'."""
    from quantgate.catalog.load import load_catalog
    from quantgate.catalog.paths import DEFAULT_CATALOG
    from quantgate.catalog.variants import VariantSpec

    catalog = load_catalog(DEFAULT_CATALOG).variants
    return {name: catalog[name] if name in catalog else VariantSpec(name=name, **EXTRA_VARIANTS[name])
            for name in COLUMNS}


def family_row(name: str) -> dict[str, Any]:
    """What the matrix says of a family: its model_type, its Transformers class, its experts (0: dense)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from tests.tiny_families import tiny_config

    config = tiny_config(name)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__
    return {"family": name, "model_type": config.model_type, "architecture": architecture, "experts": experts}


def logit_error(base: str, build: str, load_time: bool) -> float:
    """The build's relative logit error against its base's on the logit check's probe text, as the check measures
    it (shown beside each built cell: how far it is from its scheme's tolerance)."""
    from quantgate.tasks.adapters import loadtime, logit_check

    # A bitsandbytes variant is loaded as the quantize step loads it (its base's own dtype).
    model = loadtime.load_model(build, device="cpu", dtype="auto" if load_time else logit_check.check_dtype())
    logits = logit_check.centred_logits(model, logit_check.probe_ids(base))
    return round(logit_check.logit_error(logits, logit_check.base_logits(base, logit_check.check_dtype())), 4)


def _built(model: Any, spec: Any, out: Path) -> tuple[str, str | None, Any]:
    """(outcome, one-line reason, the variant) of `spec` of `model` through the quantize step; "traceback" when the
    step raised instead of recording the failure (it must not: the matrix's tests fail on it)."""
    from quantgate.catalog.errors import one_line
    from quantgate.catalog.variants import TextCalibration
    from quantgate.tasks.steps import quantize

    try:
        art = quantize.build_variant(model, spec, TextCalibration(**CALIBRATION), out)
    except Exception as e:
        return "traceback", one_line(e), None
    outcome = {"built": "built", "skipped": "refused", "failed": "failed"}[art.status]
    reason = art.error.removeprefix(f"{spec.name}: ") if art.error else None
    return outcome, reason, art


def built_anyway(model: Any, family: str, spec: Any, out: Path) -> str:
    """A refused cell built all the same, the family's refusal lifted (its kept modules still kept): "built", or
    "failed: REASON"."""
    from unittest import mock

    from quantgate.catalog.families import families
    from quantgate.tasks.steps import quantize

    lifted = families()[family].model_copy(update={"refuse": {}})
    with mock.patch.object(quantize, "model_family", lambda path: lifted):
        outcome, reason, _ = _built(model, spec, out)
    return outcome if reason is None else f"{outcome}: {reason}"


def run_cell(model: Any, family: str, spec: Any, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    outcome, reason, art = _built(model, spec, out)
    seconds = round(time.perf_counter() - start, 2)
    cell = {"family": family, "variant": spec.name, "outcome": outcome, "reason": reason, "seconds": seconds,
            "logit_error": None, "built_anyway": None}
    if outcome == "built":
        cell["logit_error"] = logit_error(model.path, art.path, spec.load_time)
    elif outcome == "refused":
        cell["built_anyway"] = built_anyway(model, family, spec, out)
    return cell


def run_matrix(work: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """(families, variants, cells): every family × every column, built under `work`."""
    import torch

    from quantgate.catalog.families import families
    from quantgate.catalog.records import ModelArtifact
    from quantgate.tasks.adapters import logit_check
    from tests.tiny_families import write_tiny

    # One torch thread: on a small shared CPU, torch's spinning worker threads made AWQ's grid search 10x slower
    # when other processes competed for the cores (tests/conftest.py, one_torch_thread).
    torch.set_num_threads(1)
    specs = variant_specs()
    variants = [{"variant": s.name, "method": s.method, "scheme": s.scheme, "group_size": s.group_size,
                 "tolerance": logit_check.TOLERANCE[s.scheme]} for s in specs.values()]
    rows, cells = [], []
    for name in families():
        rows.append(family_row(name))
        path = write_tiny(name, work / "models" / name)
        model = ModelArtifact(model_id=f"tiny-{name}", path=str(path), source="local", revision=None,
                              sha=f"tiny-{name}")
        for spec in specs.values():
            cells.append(run_cell(model, name, spec, work / "variants"))
            print(f"{name:10} {spec.name:20} {cells[-1]['outcome']:9} {cells[-1]['reason'] or ''}"[:160], flush=True)
    return rows, variants, cells


def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantgate.flows.cli", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)


def run_example(work: Path) -> dict[str, Any]:
    """EXAMPLE_FAMILY's whole `quantgate run` (its shape: random weights of its tiny config) with EXAMPLE_VARIANTS,
    in `work`: the commands, what they printed, each variant's checks, and whether anything printed a traceback."""
    from tests.tiny_families import tiny_config

    specs = variant_specs()
    tiny_config(EXAMPLE_FAMILY).save_pretrained(work / EXAMPLE_FAMILY)
    lines = [f"  {n}: {json.dumps(specs[n].model_dump(include={'method', 'scheme', 'group_size'}))}"
             for n in EXAMPLE_VARIANTS]
    (work / "catalog.yaml").write_text(EXAMPLE_CATALOG.format(
        variants="\n".join(lines), model=EXAMPLE_MODEL, family=EXAMPLE_FAMILY, names=", ".join(EXAMPLE_VARIANTS),
        **CALIBRATION))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.setdefault("PREFECT_HOME", str(work / "prefect"))  # not the user's ~/.prefect
    where = ["--catalog", "catalog.yaml", "--warehouse", "w.ducklake"]
    commands = [["run", EXAMPLE_MODEL, *where, "--workdir", "work", "--quiet"],
                ["checks", EXAMPLE_MODEL, EXAMPLE_VARIANTS[-1], "--warehouse", "w.ducklake"]]
    shown, traceback = [], False
    for args in commands:
        done = _cli(args, work, env)
        traceback |= "Traceback" in done.stdout + done.stderr
        shown.append({"command": " ".join(["quantgate", *args]), "returncode": done.returncode,
                      "stdout": done.stdout.rstrip()})
    checks = _cli(["checks", EXAMPLE_MODEL, "--warehouse", "w.ducklake", "--format", "json"], work, env)
    return {"family": EXAMPLE_FAMILY, "catalog": (work / "catalog.yaml").read_text(), "shown": shown,
            "checks": json.loads(checks.stdout) if checks.returncode == 0 else None, "traceback": traceback}


def measure(example: bool, command: str) -> dict[str, Any]:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="family-matrix-") as tmp:
        rows, variants, cells = run_matrix(Path(tmp))
        matrix_s = time.perf_counter() - start
        shown = run_example(Path(tmp) / "example") if example else None
    return {
        "command": command, "cpus": os.cpu_count(), "torch_threads": 1,
        "wall_seconds": round(time.perf_counter() - start, 1), "matrix_seconds": round(matrix_s, 1),
        "versions": {lib: version(lib) for lib in LIBRARIES}, "calibration": CALIBRATION,
        "families": rows, "variants": variants, "cells": cells, "example": shown,
    }


def changes(expected: dict[str, Any], produced: dict[str, Any]) -> list[str]:
    """Each cell whose outcome differs between two matrices (or that one of them lacks), one line each."""
    def keyed(matrix: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(c["family"], c["variant"]): c for c in matrix["cells"]}

    was, now = keyed(expected), keyed(produced)
    lines = []
    for key in sorted(was.keys() | now.keys()):
        old, new = was.get(key), now.get(key)
        before = old["outcome"] if old else "not in the matrix"
        after = new["outcome"] if new else "not in the matrix"
        if before != after:
            why = f" ({new['reason']})" if new and new.get("reason") else ""
            lines.append(f"{key[0]} × {key[1]}: {before} → {after}{why}")
    return lines


def _why(cell: dict[str, Any]) -> str:
    """A refusal's reason without its "refused for FAMILY (method scheme): " opening, so cells refused for one
    reason share one note."""
    return re.sub(r"^refused for \S+ \([^)]*\): ", "", cell["reason"] or "")


def _notes(matrix: dict[str, Any]) -> dict[tuple[str, str], int]:
    """A number for each distinct (outcome, reason) of the cells not built, in the table's order."""
    notes: dict[tuple[str, str], int] = {}
    for cell in matrix["cells"]:
        if cell["outcome"] != "built":
            notes.setdefault((cell["outcome"], _why(cell)), len(notes) + 1)
    return notes


def _table(matrix: dict[str, Any], notes: dict[tuple[str, str], int]) -> list[str]:
    variants = matrix["variants"]
    head = ["family", "model_type (class)", *[f"`{v['variant']}`<br>{v['method']} {v['scheme']}" for v in variants]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = {(c["family"], c["variant"]): c for c in matrix["cells"]}
    for fam in matrix["families"]:
        name = fam["family"] + (f" (MoE, {fam['experts']} experts)" if fam["experts"] else "")
        row = [name, f"`{fam['model_type']}` ({fam['architecture']})"]
        for v in variants:
            cell = cells[(fam["family"], v["variant"])]
            if cell["outcome"] == "built":
                row.append(f"built {cell['logit_error']:.3f}")
            else:
                row.append(f"{cell['outcome']} [{notes[(cell['outcome'], _why(cell))]}]")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _note_lines(matrix: dict[str, Any], notes: dict[tuple[str, str], int]) -> list[str]:
    lines = []
    for (outcome, why), number in notes.items():
        members = [c for c in matrix["cells"] if c["outcome"] == outcome and _why(c) == why]
        where = ", ".join(f"{c['family']} × {c['variant']}" for c in members)
        lines.append(f"{number}. **{outcome}**: {why} ({where}).")
        anyway = sorted({c["built_anyway"] for c in members if c["built_anyway"]})
        lines += [f"   - built all the same, the refusal lifted: {a}" for a in anyway]
    return lines


def _example_lines(example: dict[str, Any]) -> list[str]:
    lines = ["", f"### A whole run of a family a method cannot handle ({example['family']})", "",
             "The run's catalog (the model's source is the shape of its tiny config.json, in the folder"
             f" `{example['family']}` beside it):", "", "```yaml", example["catalog"].rstrip(), "```"]
    for shown in example["shown"]:
        lines += ["", f"`{shown['command']}` printed (exit status {shown['returncode']}):", "", "```text",
                  shown["stdout"], "```"]
    return lines


def render(matrix: dict[str, Any]) -> str:
    """The docs section (and matrix.md's body), from a matrix.json alone."""
    notes = _notes(matrix)
    versions = ", ".join(f"{k} {v}" for k, v in matrix["versions"].items())
    tolerances = ", ".join(sorted({f"{v['scheme']} {v['tolerance']}" for v in matrix["variants"]}))
    example = f"; the whole run below {matrix['wall_seconds'] - matrix['matrix_seconds']:.0f} s" \
        if matrix["example"] else ""
    lines = [
        f"Generated by `{matrix['command']}` (`benchmarks/family_matrix.py`) from its"
        " `benchmarks/results/cpu/family-matrix/matrix.json`: do not edit by hand.",
        f"Measured on {matrix['cpus']} CPU cores, one torch thread: the {len(matrix['cells'])} cells in"
        f" {matrix['matrix_seconds']:.0f} s{example}; {versions}.", "",
        *_table(matrix, notes), "",
        "**built N**: the checkpoint loaded in Transformers with every tensor in its place and its logits on the"
        " probe text were N off its base's (relative error; the build fails over its scheme's tolerance:"
        f" {tolerances})."
        " **refused**: before any work, the variant a skipped row with the reason. **failed**: after the build, with"
        " the reason.", "",
        *_note_lines(matrix, notes),
    ]
    if matrix["example"]:
        lines += _example_lines(matrix["example"])
    return "\n".join(lines) + "\n"


def write_docs(section: str, page: Path = PAGE) -> None:
    text = page.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not tail and END not in rest:
        raise SystemExit(f"{page} has no {BEGIN} ... {END} section")
    page.write_text(f"{head}{BEGIN}\n{section}{END}{tail}")


def docs_section(page: Path = PAGE) -> str:
    """The generated section as docs/families.md holds it now."""
    return page.read_text().partition(BEGIN)[2].partition(END)[0].removeprefix("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"where matrix.json and matrix.md go (default {OUT})")
    parser.add_argument("--docs", action="store_true", help=f"also replace the matrix section of {PAGE.name}")
    parser.add_argument("--no-example", action="store_true", help="skip the whole `quantgate run` of one family")
    parser.add_argument("--render", action="store_true",
                        help="run nothing: write matrix.md and the docs section again from the committed matrix.json")
    args = parser.parse_args()
    if args.render:  # the docs' own words changed, not what was measured
        matrix = json.loads((OUT / "matrix.json").read_text())
        (OUT / "matrix.md").write_text(f"# Family × method matrix\n\n{render(matrix)}")
        write_docs(render(matrix))
        return
    # llm-compressor's own progress (a dozen lines a build) would bury the matrix's one line a cell.
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    command = " ".join(["python", "benchmarks/family_matrix.py", *sys.argv[1:]])
    matrix = measure(not args.no_example, command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matrix.json").write_text(json.dumps(matrix, indent=1, ensure_ascii=False) + "\n")
    (args.out / "matrix.md").write_text(f"# Family × method matrix\n\n{render(matrix)}")
    if args.docs:
        write_docs(render(matrix))
    print(f"{len(matrix['cells'])} cells in {matrix['matrix_seconds']} s, {matrix['wall_seconds']} s in all:"
          f" {args.out / 'matrix.json'}")


if __name__ == "__main__":
    main()
