"""The `quantgate` command line."""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated, Any, Optional

import click
import typer
from prefect.exceptions import FailedRun
from rich.console import Console

from quantgate.catalog.errors import QuantgateError
from quantgate.catalog.load import load_catalog
from quantgate.catalog.paths import DEFAULT_CATALOG
from quantgate.catalog.selection import adhoc_model, resolve_variants
from quantgate.flows import interrupts
from quantgate.flows.cli_output import check_format, console, print_frame, print_rows, terminal_width, write_frame
from quantgate.flows.reproduce import reproduce
from quantgate.flows.verdicts import model_notes, verdict_row
from quantgate.warehouse import reads, sessions, transfer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Gate quantized LLM builds on quality and speed.")
catalog_app = typer.Typer(no_args_is_help=True, help="Inspect and validate the model catalog.")
app.add_typer(catalog_app, name="catalog")
warehouse_app = typer.Typer(no_args_is_help=True, help="Open, import into and maintain the warehouse.")
app.add_typer(warehouse_app, name="warehouse")
err = Console(stderr=True, soft_wrap=True)

DEMO_MODEL = "smollm2-135m"

WarehouseOpt = Annotated[
    Optional[str], typer.Option("--warehouse", "-w", help=(
        f"the warehouse: a DuckLake catalog file, or postgres:dbname=... host=... for a team's (env {sessions.ENV_VAR};"
        f" default {sessions.DEFAULT_PATH}; data files of a new one in env {sessions.DATA_ENV_VAR})"))
]
CatalogOpt = Annotated[Optional[Path], typer.Option("--catalog", "-c", help="catalog YAML (default: the packaged one)")]
WorkdirOpt = Annotated[
    Optional[Path], typer.Option("--workdir", help="where checkpoints are kept (env QUANTGATE_HOME; default .quantgate)")
]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help="table, csv, json or markdown")]
TemplateOpt = Annotated[Optional[str], typer.Option(
    help="catalog model whose variants, suite, calibration, scenarios and policy a model outside the catalog gets (default: the catalog's first)")]
TokenizerOpt = Annotated[Optional[Path], typer.Option(
    help="for a shape: a model folder whose tokenizer (and chat template) its random-weights checkpoint carries, e.g. a smaller model of the family")]
# What the end of a run and `quantgate checks` fit in: an 80-120 column terminal keeps every verdict on screen.
TABLE_WIDTH = 100
_debug = False


@app.callback()
def _main(debug: Annotated[bool, typer.Option("--debug", help="show tracebacks")] = False) -> None:
    global _debug
    _debug = debug


@app.command()
def run(
    model: Annotated[str, typer.Argument(help="catalog id, local model folder, hub id org/name[@revision], or a model's shape with random weights shape:NAME|shape:path/to/config.json")],
    variants: Annotated[Optional[str], typer.Option(help="comma-separated variant names or methods (awq,gptq)")] = None,
    catalog: CatalogOpt = None,
    warehouse: WarehouseOpt = None,
    workdir: WorkdirOpt = None,
    scenarios: Annotated[Optional[str], typer.Option(help="comma-separated speed scenarios, instead of the model's")] = None,
    engines: Annotated[Optional[str], typer.Option(help="comma-separated engines to benchmark (transformers,vllm)")] = None,
    remeasure: Annotated[bool, typer.Option(help="measure speed anew even where an earlier run measured the same")] = False,
    gpus: Annotated[Optional[str], typer.Option(help="comma-separated GPU ids as nvidia-smi numbers them: benchmarks of different checkpoints side by side, one per GPU (default: what CUDA_VISIBLE_DEVICES shows)")] = None,
    template: TemplateOpt = None,
    tokenizer: TokenizerOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress and no log path: results and errors only")] = False,
    fmt: FormatOpt = "table",
) -> None:
    """Download, quantize, evaluate, benchmark and decide one model; ends with each variant's verdict and the
    check that made it, then where the time went."""
    from quantgate.flows import live, prefect_api

    # A Ctrl-C from here to the flow's stages (whose guard takes it over) or after them ends the command once it is
    # safe to: raised where it lands, inside an import, it can hang the command (flows/interrupts.py).
    with interrupts.ctrl_c_deferred():
        check_format(fmt)
        cat = load_catalog(catalog or DEFAULT_CATALOG)
        chosen = resolve_variants(cat, model, variants.split(",")) if variants else None
        picked = _names(scenarios)
        kept = _names(engines)
        folder = str(tokenizer) if tokenizer else None
        # Bad input fails here, in one line.
        adhoc_model(cat, model, chosen, template, scenarios=picked, engines=kept, tokenizer=folder)
        with sessions.session(warehouse):  # so does a warehouse that cannot be written (foreign, newer, locked)
            pass
        # The temporary server inside the view (its output goes to the run's log), started ahead of the pipeline's
        # import and stopped only once the flow has ended, a Ctrl-C's included.
        with live.run_view(live.work_dir(str(workdir) if workdir else None), model, quiet=quiet), \
                prefect_api.temporary_server() as server_answers:
            from quantgate.flows.evaluate_model import evaluate_model

            while not server_answers(0.2):
                interrupts.ctrl_c_now()
            card = evaluate_model(model=model, catalog=str(catalog) if catalog else None,
                                  warehouse=str(warehouse) if warehouse else None, variants=chosen,
                                  workdir=str(workdir) if workdir else None, scenarios=picked, engines=kept,
                                  remeasure=remeasure, gpus=gpus, template=template, tokenizer=folder)
    _print_run(card, fmt, warehouse)


def _print_run(card: list[dict], fmt: str, warehouse: Path | None) -> None:
    """The end of `run`: each variant's verdict and the check that made it, then where the time went."""
    verdicts = [verdict_row(r) for r in card]
    if fmt != "table":
        print_frame(verdicts, fmt)
        return
    for note in model_notes(card):
        console.print(note, highlight=False)
    print_rows(verdicts, ["variant", "decision", "deciding_check", "size", "speedup"], width=TABLE_WIDTH)
    if card:
        model_id = card[0]["model_id"]
        console.print(f"every check: quantgate checks {model_id} [VARIANT]\n"
                      f"full report: quantgate report --model {model_id} --out report.html", highlight=False)
        with sessions.session(warehouse, read_only=True) as con:
            stages = reads.stage_summary(con, card[0]["run_id"])
            timeline = reads.run_timeline(con, card[0]["run_id"])
        print_rows(stages, ["stage", "checkpoints", "seconds", "busiest_s", "engine_starts", "reused"], width=TABLE_WIDTH)
        for t in timeline:
            console.print(f"run {t['run_id']}: {t['wall_seconds']:.1f} s from start to decisions, "
                          f"{t['engine_starts']} engine start(s)")


@app.command()
def checks(
    model: Annotated[str, typer.Argument(help="the model id whose latest run's decisions to explain")],
    variant: Annotated[Optional[str], typer.Argument(help="only this variant")] = None,
    run_id: Annotated[Optional[str], typer.Option("--run", help="this run instead of the model's latest")] = None,
    warehouse: WarehouseOpt = None,
    fmt: FormatOpt = "table",
) -> None:
    """Every check behind a model's verdicts, in the order the policy applies them: outcome, value against
    threshold with its interval, and the full reason."""
    check_format(fmt)
    with sessions.session(warehouse, read_only=True) as con:
        run_id = run_id or reads.latest_run(con, model)
        if run_id is None:
            raise typer.BadParameter(f"no finished run of {model!r} in the warehouse", param_hint="model")
        found = reads.decision_checks(con, run_id, variant)
    if not found:
        raise typer.BadParameter(f"run {run_id} has no checks{f' for variant {variant!r}' if variant else ''}")
    if fmt != "table":
        print_frame(found, fmt)
        return
    print_rows(found, ["variant", "outcome", "note"], width=TABLE_WIDTH)  # the note names the check and its figures


app.command()(reproduce)  # flows/reproduce.py: the lm_eval commands of a run's stored evaluations


@app.command()
def pull(
    model: Annotated[str, typer.Argument(help="catalog id, local model folder, hub id org/name[@revision], or a model's shape with random weights shape:NAME|shape:path/to/config.json")],
    catalog: CatalogOpt = None,
    workdir: WorkdirOpt = None,
    tokenizer: TokenizerOpt = None,
) -> None:
    """Download a model into the work dir without evaluating it (a GGUF is dequantized once); runs reuse it."""
    import time

    from quantgate.flows.pull import pull_model

    started = time.monotonic()
    found = pull_model(model=model, catalog=str(catalog) if catalog else None,
                       workdir=str(workdir) if workdir else None, tokenizer=str(tokenizer) if tokenizer else None)
    console.print(f"{found.model_id}: {found.path} ({found.size_bytes or 0:,} bytes) in {time.monotonic() - started:.1f} s")


def _names(csv: str | None) -> list[str] | None:
    return [n.strip() for n in csv.split(",") if n.strip()] or None if csv else None


@app.command()
def demo(warehouse: WarehouseOpt = None, workdir: WorkdirOpt = None) -> None:
    """Run the whole pipeline on SmolLM2-135M-Instruct (offline, CPU) into the local warehouse."""
    run(DEMO_MODEL, None, None, warehouse, workdir, quiet=False)
    wh = warehouse or sessions.default_path()
    console.print(f"\nwarehouse: {wh}   try: quantgate sql \"select * from variant_scorecard\"")


@app.command("gpu-suite")
def gpu_suite_cmd(
    parts: Annotated[Optional[str], typer.Option(help="comma-separated parts of the suite (default all)")] = None,
    shape: Annotated[str, typer.Option(help="a shape of the suite file")] = "qwen2.5-7b-instruct",
    suite: Annotated[Optional[Path], typer.Option(help="GPU suite YAML (default catalog/gpu.yaml)")] = None,
    deadline_s: Annotated[float, typer.Option(help="no step starts after this many seconds")] = 330.0,
    grace_s: Annotated[float, typer.Option(help="a started step may run this far past the deadline")] = 60.0,
    gpus: Annotated[Optional[str], typer.Option(help="comma-separated GPU ids as nvidia-smi numbers them, to run steps side by side on (e.g. 0,1)")] = None,
    warehouse: WarehouseOpt = None,
    workdir: WorkdirOpt = None,
) -> None:
    """Speed-only GPU suite on dummy weights of a real shape (Transformers vs vLLM, serving, levers)."""
    from quantgate.flows.gpu_suite import gpu_suite

    steps = gpu_suite(warehouse=str(warehouse) if warehouse else None, workdir=str(workdir) if workdir else None,
                      shape=shape, suite=str(suite) if suite else None,
                      parts=parts.split(",") if parts else None, deadline_s=deadline_s, grace_s=grace_s,
                      gpus=gpus.split(",") if gpus else None)
    print_rows(steps, ["step_index", "part", "engine", "build", "status", "seconds", "reason"])


@app.command("bench-endpoint")
def bench_endpoint_cmd(
    target: Annotated[str, typer.Argument(help="base URL of an OpenAI-compatible server, or an endpoint name of the catalog")],
    model: Annotated[Optional[str], typer.Option(help="the served model name to request (with a URL)")] = None,
    scenario: Annotated[Optional[str], typer.Option(help="comma-separated serving scenarios of the catalog")] = None,
    api_key_env: Annotated[Optional[str], typer.Option(
        help="environment variable that holds the API key (sent as a Bearer token; never stored)")] = None,
    prompt_format: Annotated[Optional[str], typer.Option(help="text (default) or tokens (token-id prompts)")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(help="tokenizer folder: the scenario's prompts as every engine gets them")] = None,
    vllm_extras: Annotated[Optional[bool], typer.Option(
        "--vllm-extras/--no-vllm-extras", help="send ignore_eos/min_tokens for exact output lengths")] = None,
    device: Annotated[Optional[str], typer.Option(help="device kind serving it, for cost (a gpu_prices key, e.g. 'NVIDIA H200')")] = None,
    num_devices: Annotated[Optional[int], typer.Option(help="devices serving it (e.g. its tensor-parallel size), for cost")] = None,
    variant_uid: Annotated[Optional[str], typer.Option(help="attach the rows to this built variant instead of the endpoint's own")] = None,
    timeout_s: Annotated[float, typer.Option(help="seconds per scenario")] = 900.0,
    catalog: CatalogOpt = None,
    warehouse: WarehouseOpt = None,
) -> None:
    """Benchmark any OpenAI-compatible server by URL with a serving scenario (TTFT, TPOT, ITL, goodput, cost)."""
    from quantgate.flows.bench_endpoint import bench_endpoint_flow

    if prompt_format not in (None, "text", "tokens"):
        raise typer.BadParameter(f"unknown prompt format {prompt_format!r}: use text or tokens", param_hint="--prompt-format")
    is_url = target.startswith(("http://", "https://"))
    if is_url and not model:
        raise typer.BadParameter("a URL needs --model (the served model name)", param_hint="--model")
    rows = bench_endpoint_flow(
        url=target if is_url else None, model=model, scenarios=_names(scenario), endpoint=None if is_url else target,
        api_key_env=api_key_env, prompt_format=prompt_format, tokenizer=str(tokenizer) if tokenizer else None,
        vllm_extras=vllm_extras, device=device, num_devices=num_devices, variant_uid=variant_uid,
        catalog=str(catalog) if catalog else None, warehouse=str(warehouse) if warehouse else None, timeout_s=timeout_s)
    print_rows(rows, ["scenario", "status", "server", "server_version", "tokens_per_s", "ttft_ms", "tpot_ms",
                       "usd_per_million_output_tokens_at_slo", "slo_load", "reason"])
    if any(r["status"] != "ok" for r in rows):
        raise typer.Exit(1)


@app.command()
def deploy(
    repo: Annotated[Optional[Path], typer.Option(help="checkout with prefect.yaml that workers run (default: this one)")] = None,
    model_runs: Annotated[Optional[int], typer.Option(
        min=1, help="how many model runs the GPU pool takes at once over all hosts (default: its workers' limits)")] = None,
    warehouse: WarehouseOpt = None,
) -> None:
    """Create the work pools, every deployment of prefect.yaml and the liveness automations on the Prefect server
    (PREFECT_API_URL), and the warehouse the runs write (as `quantgate warehouse init` does)."""
    from quantgate.flows import deploy as deploying

    deploying.api_url()  # no server: one line, before anything is created
    created = sessions.init(warehouse)
    names = deploying.deploy(repo or deploying.REPO, model_runs=model_runs)
    console.print(created, highlight=False)
    for name in names:
        console.print(name)
    console.print(f"{len(names)} deployments on {deploying.api_url()}; start workers: prefect worker start --pool"
                  " quantgate-cpu, and on each host that runs models --pool quantgate-gpu --limit <its GPU count>"
                  " (--limit 1 on a host without GPUs)")


@app.command()
def nightly(
    all_models: Annotated[bool, typer.Option("--all", help="evaluate every catalog model, changed or not")] = False,
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="only this catalog model (repeatable)")] = None,
    deployment: Annotated[Optional[str], typer.Option(
        help="start each evaluation as a run of this deployment (evaluate-model/evaluate-model) instead of in-process")] = None,
    catalog: CatalogOpt = None,
    warehouse: WarehouseOpt = None,
    workdir: WorkdirOpt = None,
) -> None:
    """Run the nightly now: evaluate every catalog model whose inputs changed since its last successful run."""
    from quantgate.flows.nightly import nightly as nightly_flow

    rows = nightly_flow(catalog=str(catalog) if catalog else None, warehouse=str(warehouse) if warehouse else None,
                        workdir=str(workdir) if workdir else None, all_models=all_models, models=model or None,
                        evaluate_deployment=deployment)
    print_rows(rows, ["model", "action", "status", "reason", "flow_run_id"])


@app.command()
def watch(
    released: Annotated[Optional[list[str]], typer.Option(
        "--released", "-r", help="a model just released, org/name@commit-sha (repeatable); skips the hub listing")] = None,
    listing_file: Annotated[Optional[Path], typer.Option(help="a saved hub listing (JSON list of /api/models entries)")] = None,
    template: Annotated[Optional[str], typer.Option(help="catalog model whose variants/suite a --released model gets")] = None,
    deployment: Annotated[Optional[str], typer.Option(
        help="start each evaluation as a run of this deployment (evaluate-model/evaluate-model) instead of in-process")] = None,
    catalog: CatalogOpt = None,
    warehouse: WarehouseOpt = None,
    workdir: WorkdirOpt = None,
) -> None:
    """Evaluate new hub releases of the authors the catalog watches (or the --released ones)."""
    from quantgate.flows.watch_releases import watch_releases

    rows = watch_releases(catalog=str(catalog) if catalog else None, warehouse=str(warehouse) if warehouse else None,
                          workdir=str(workdir) if workdir else None, released=released or None, template=template,
                          listing_file=str(listing_file) if listing_file else None, evaluate_deployment=deployment)
    print_rows(rows, ["model_id", "sha", "source", "action", "flow_run_id"])


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL to run read-only against the warehouse")],
    warehouse: WarehouseOpt = None,
    fmt: FormatOpt = "table",
) -> None:
    """Run a read-only SQL query against the warehouse and print the result."""
    import duckdb

    check_format(fmt)
    # Read-only and shut off from the file system: a query can change neither the warehouse nor any file.
    with sessions.session(warehouse, read_only=True, sandbox=True) as con:
        try:
            kinds = {s.type for s in con.extract_statements(query)}
            if not kinds <= {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}:
                other = sorted(k.name for k in kinds - {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN})
                raise typer.BadParameter(f"quantgate sql runs queries only (SELECT, EXPLAIN), not {', '.join(other)}",
                                         param_hint="query")
            rel = con.sql(query)
        except duckdb.Error as e:
            raise typer.BadParameter(str(e).splitlines()[0], param_hint="query") from None
        if rel is None:
            return
        if fmt == "table":  # DuckDB's own box rendering, as its CLI prints it
            rel.show(max_width=terminal_width(), max_rows=10_000, max_col_width=120, null_value="NULL")
            return
        write_frame(rel.df(), fmt)


@app.command()
def report(
    model: Annotated[Optional[str], typer.Option(help="only this model id")] = None,
    warehouse: WarehouseOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="write a self-contained HTML report here instead")] = None,
) -> None:
    """Print what moved beyond noise since the previous run, then the scorecard of the latest run of each model."""
    if out:
        from quantgate.warehouse import report as html_report

        with sessions.session(warehouse, read_only=True) as con:
            path = html_report.write(con, out, model)
        console.print(f"report: {path}")
        return
    with sessions.session(warehouse, read_only=True) as con:
        moved = reads.changes_since_previous(con, model)
        rows = reads.latest_scorecards(con, model)
    if moved:
        console.print("[bold]Changes beyond noise since the previous run[/bold] (worse first)")
        print_rows(moved, ["kind", "model_id", "variant", "measure", "previous_value", "value", "delta", "noise",
                            "change", "basis"])
    else:
        console.print("No regressions: nothing moved beyond noise since the previous run.")
    for model_id in sorted({r["model_id"] for r in rows}):
        for note in model_notes([r for r in rows if r["model_id"] == model_id]):
            console.print(note, highlight=False)
    print_rows(rows, ["model_id", "variant", "bits", "size_ratio", "quality_recovery", "quality_lower_bound", "kl",
                       "long_context", "flip_rate", "speedup", "speedup_basis", "decision", "reason"])


@app.command()
def export(
    folder: Annotated[Path, typer.Argument(help="folder to write one file per table and view into")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="parquet or csv")] = "parquet",
    tables_only: Annotated[bool, typer.Option("--tables-only", help="leave the views out: they are derived from the"
                                              " tables (benchmarks/summarize.py recomputes them)")] = False,
    warehouse: WarehouseOpt = None,
) -> None:
    """Write every table and view of the warehouse to FOLDER, one Parquet or CSV file each."""
    if fmt not in ("parquet", "csv"):
        raise typer.BadParameter(f"unknown format {fmt!r}: use parquet or csv", param_hint="--format")
    with sessions.session(warehouse, read_only=True) as con:
        files = transfer.export(con, folder, fmt, views=not tables_only)
    console.print(f"{len(files)} {fmt} files in {folder}")


@warehouse_app.command("init")
def warehouse_init(warehouse: WarehouseOpt = None) -> None:
    """Create the warehouse with its schema and views (or bring an existing one up to date): it can be queried
    before the first run writes. Harmless to repeat; `quantgate deploy` does it too."""
    console.print(sessions.init(warehouse), highlight=False)


@warehouse_app.command("init-sql")
def warehouse_init_sql(
    writable: Annotated[bool, typer.Option(help="attach it writable (the default is read-only)")] = False,
    warehouse: WarehouseOpt = None,
) -> None:
    """Print the SQL that opens the warehouse in DuckDB: duckdb -cmd "$(quantgate warehouse init-sql)"."""
    from quantgate.warehouse import lake

    sys.stdout.write(lake.init_sql(sessions.address(warehouse), read_only=not writable))


@warehouse_app.command("import")
def warehouse_import(
    old: Annotated[Path, typer.Argument(help="a DuckDB-file warehouse of an earlier quantgate (e.g. quantgate.duckdb)")],
    warehouse: WarehouseOpt = None,
) -> None:
    """Bring the runs of a DuckDB-file warehouse over; rows the warehouse already holds are left as they are."""
    from quantgate.warehouse import legacy

    with sessions.session(warehouse) as con:
        added = legacy.import_duckdb(con, old)
    print_rows([{"table": t, "rows_added": n} for t, n in added.items()], ["table", "rows_added"])


@warehouse_app.command("maintain")
def warehouse_maintain(
    keep_days: Annotated[int, typer.Option(help="keep snapshots this many days for time travel")] = 7,
    warehouse: WarehouseOpt = None,
) -> None:
    """DuckLake's upkeep: inlined rows to Parquet, small files merged, old snapshots and their files removed."""
    for step, seconds in sessions.maintain(warehouse, keep_days):
        console.print(f"{step}: {seconds:.1f} s")


@catalog_app.command("validate")
def catalog_validate(path: Annotated[Path, typer.Argument(help="catalog YAML")] = DEFAULT_CATALOG) -> None:
    """Validate a catalog and its policy; print a one-line summary."""
    cat = load_catalog(path)
    console.print(f"{path}: ok — {len(cat.models)} models, {len(cat.variants)} variants, {len(cat.suites)} suites,"
                  f" {len(cat.scenarios)} scenarios, policy v{cat.policy.version} ({cat.policy.hash[:12]})")


def main() -> None:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # At exit the interpreter's last garbage collections walk every object that torch, transformers and Prefect
    # made: seconds, on a rerun that computes nothing. Frozen at exit (after Prefect's server stop, before
    # logging's shutdown), they are left out of those walks; exit handlers still run and files are still flushed,
    # only objects in reference cycles are not finalized, which Python does not promise at exit anyway.
    atexit.register(gc.freeze)
    interrupts.note_ctrl_c()
    with interrupts.exit_if_stuck():
        _main()


def _main() -> None:
    try:
        code = app(standalone_mode=False)
        # Typer returns a command's typer.Exit code, and 130 for a KeyboardInterrupt (a Ctrl-C before or after a
        # flow's interrupt guard), instead of raising them: left unread, each exited 0.
        if isinstance(code, int) and not isinstance(code, bool) and code:
            if code == 128 + signal.SIGINT:
                err.print("error: interrupted", highlight=False)
            sys.exit(code)
    except (typer.Exit, SystemExit) as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        sys.exit(code or 0)
    except typer.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except BaseException as e:  # every user-facing failure is one line; --debug shows the rest
        if _debug:
            traceback.print_exc()
        if (code := interrupts.exit_code(e)) is not None:
            err.print(f"error: {e}" if isinstance(e, interrupts.Interrupted) else "error: interrupted", highlight=False)
            sys.exit(code)
        if not isinstance(e, Exception):
            raise
        msg = e.format_message() if hasattr(e, "format_message") else str(e)
        first = (msg.strip().splitlines() or [type(e).__name__])[0]
        # quantgate's own failures, a flow that ended Failed with one and a refused argument are their message;
        # anything else is named.
        known = isinstance(e, (QuantgateError, FailedRun, typer.TyperException))
        err.print(f"error: {first}" if known else f"error: {type(e).__name__}: {first}", highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    main()
