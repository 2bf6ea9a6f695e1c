"""The HTML report: rendered from a real warehouse seeded through the warehouse's own writers, checked for its
content, for not reaching the network, and (where Chromium is installed) as a screenshot."""

import re
import shutil
import subprocess

import pytest

from quantgate.catalog.records import (
    Decision, DecisionCheck, MetricResult, ModelArtifact, QualityReport, RequestRecord, ServingLoad, SpeedResult,
    VariantArtifact,
)
from quantgate.warehouse import ledger, report, sessions, writers

# name: (piqa acc, tokens/s, peak bytes, J/token, decision)
BUILDS = {
    "base": (0.70, 100.0, 4 * 2**30, 0.50, None),
    "gptq": (0.69, 180.0, 2 * 2**30, 0.30, "accept"),
    "awq": (0.60, 170.0, 2 * 2**30, 0.28, "reject"),
    "int8": (0.695, 130.0, 3 * 2**30, 0.40, "inconclusive"),
}


def requests(n, ttft_s, tpot_s):
    return [RequestRecord(i, True, None, 32, 16, ttft_s * (1 + i / n), [tpot_s] * 15, ttft_s + 15 * tpot_s, tpot_s, 0.0, 0.0)
            for i in range(n)]


def seed(con, run_id, started, acc_shift=0.0, model="m", speed=True):
    ledger.start_run(con, run_id, "evaluate-model", model, "c.yaml", "h", "host", {})
    con.execute("UPDATE runs SET started_at = ? WHERE run_id = ?", [started, run_id])
    writers.record_model(con, run_id, ModelArtifact(model, f"/{model}", "local", None, "abc" * 10))
    decisions = []
    for name, (acc, tps, peak, joules, verdict) in BUILDS.items():
        uid = f"{model}-{name}"
        v = VariantArtifact(uid=uid, model_uid=f"{model}@abc", name=name, method="base" if name == "base" else name,
                            scheme="W4A16", bits=4, group_size=32, path=f"/x/{uid}", recipe="r", recipe_hash=uid,
                            size_bytes=400 if name == "base" else 120)
        writers.record_variant(con, run_id, v, "base" if name == "base" else "variant")
        acc = acc - (acc_shift if name == "awq" else 0.0)
        writers.record_quality(con, run_id, uid, QualityReport(eval_key=f"k-{run_id}", evaluator="lm-eval", config={},
            seconds=1.0, metrics=[MetricResult("qg_piqa", "acc", "none", acc, 0.005, 2000, "1", True)], samples=[]))
        writers.record_speed(con, run_id, uid, [] if not speed else [
            SpeedResult(engine="transformers", scenario="offline", status="ok", reason=None, config={}, tokens_per_s=tps,
                        peak_memory_bytes=peak, energy_j_per_token=joules),
            SpeedResult(engine="vllm", scenario="offline", status="skipped", reason="no GPU", config={})])
        if verdict:
            rec = acc / BUILDS["base"][0]
            outcome = {"accept": "pass", "reject": "fail", "inconclusive": "inconclusive"}[verdict]
            note = f"qg_piqa/acc recovery {rec:.3f} {'spans' if outcome == 'inconclusive' else '<'} 0.95"
            check = DecisionCheck("quality", "qg_piqa/acc", outcome, note, task="qg_piqa", metric="acc", value=rec,
                                  lower=rec - 0.06, upper=rec + 0.06, threshold=0.95, items=2000,
                                  items_to_decide=9000 if outcome == "inconclusive" else None, min_detectable_drop=0.06)
            why = "accept: all checks passed" if verdict == "accept" else f"{verdict}: {note}"
            decisions.append(Decision(uid, verdict, why, [check], "p" * 12, rec, tps / 100.0 if speed else None, 0.3,
                                      rec - 0.06, 0.02))
    writers.record_serving(con, run_id, f"{model}-gptq", "vllm", "serving", [] if not speed else [
        ServingLoad("c=1", 1, None, requests(8, 0.02, 0.004), 2.0),
        ServingLoad("c=8", 8, None, requests(16, 0.06, 0.005), 2.0)], None)
    writers.record_decisions(con, run_id, decisions, {"version": 1})
    ledger.finish_run(con, run_id)


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "w.ducklake"
    with sessions.session(path) as con:
        seed(con, "r1", "2026-01-01 10:00:00")
        seed(con, "r2", "2026-01-02 10:00:00", acc_shift=0.1)  # awq's accuracy drops far beyond noise
        seed(con, "n1", "2026-01-02 11:00:00", model="n", speed=False)  # quality and size only
    return path


@pytest.fixture(scope="module")
def page(warehouse, tmp_path_factory):
    out = tmp_path_factory.mktemp("html") / "report.html"
    with sessions.session(warehouse, read_only=True) as con:
        report.write(con, out)
    return out


def test_report_has_regressions_first_then_scorecard_rows_and_plots(page):
    html = page.read_text()
    assert html.index("<h2>Regressions") < html.index("<h2>Scorecard") < html.index("<h2>Quality against speed")
    assert "qg_piqa/acc" in html and "<tr class='flagged'>" in html  # awq's drop is listed and flagged
    rows = re.findall(r"<tr class='(\w+)'><td class='decision'>(\w+)</td><td class='deciding'>"
                      r"[^<]*</td><td class='model_id'>m</td><td class='variant'>(\w+)</td>", html)
    assert sorted(rows) == [("accept", "accept", "gptq"), ("inconclusive", "inconclusive", "int8"),
                            ("reject", "reject", "awq")]
    assert "tr.inconclusive td.decision{background:" in html  # a colour of its own, in the table and the scatter
    assert f"fill='{report.INCONCLUSIVE}'" in html and f"fill='{report.ACCEPT}'" in html
    # The deciding check as data: its name, number and threshold, and the items that would decide it.
    assert "<td class='deciding'>qg_piqa/acc: 0.9929 vs 0.95; ~9,000 items would decide</td>" in html
    assert html.count("<td class='model_id'>n</td>") == 3
    assert "reject: qg_piqa/acc recovery 0.714 &lt; 0.95" in html  # reasons are shown, escaped
    assert "<details><summary>why</summary><p>reject: qg_piqa/acc" in html  # the full reason on demand
    assert html.count("<svg") == 2 + 2 + 4  # one scatter per model, memory and energy bars, four latency curves
    assert "speedup over base" in html and "stroke-dasharray" in html  # x = speedup, Pareto frontier drawn
    assert "size ratio to base" in html  # model n has no speed: its x axis falls back to size
    assert "m · gptq · transformers" in html and "m · base · transformers/offline" in html
    assert "m · gptq · vllm · c=8" in html and "Time to first token" in html


def test_report_loads_nothing_from_the_network(page):
    html = page.read_text()
    refs = re.findall(r"""(?:src|href|url)\s*[=(]\s*['"]?([^'")\s>]+)""", html, flags=re.I)
    assert not [r for r in refs if re.match(r"(https?:)?//", r)], refs
    assert "<script" not in html and "<link" not in html and "@import" not in html
    # The only URL is the SVG namespace, which browsers never fetch.
    assert set(re.findall(r"https?://[^'\"\s]+", html)) == {"http://www.w3.org/2000/svg"}


def test_pareto_frontier_keeps_only_undominated_points():
    pts = [(1.8, 0.99), (1.7, 0.86), (1.3, 0.993), (1.2, 0.98)]
    assert report.pareto(pts) == [2, 0]
    assert report.pareto([(0.3, 0.99), (0.5, 0.995), (0.4, 0.9)], higher_x_better=False) == [0, 1]


def test_empty_warehouse_reports_what_is_missing(tmp_path):
    with sessions.session(tmp_path / "e.ducklake") as con:
        html = report.render(con)
    assert "No evaluate-model runs" in html and "No serving loads measured" in html and "<svg" not in html


def test_cli_report_writes_html_and_keeps_terminal_output_without_out(warehouse, tmp_path):
    from typer.testing import CliRunner

    from quantgate.flows.cli import app

    out = tmp_path / "sub" / "r.html"
    done = CliRunner().invoke(app, ["report", "-w", str(warehouse), "--out", str(out), "--model", "m"])
    assert done.exit_code == 0, done.output
    assert out.exists() and "<svg" in out.read_text() and str(out) in done.output
    text = CliRunner().invoke(app, ["report", "-w", str(warehouse)], terminal_width=250).output
    assert "Changes beyond noise" in text and "quality_lower_bound" in text


def _chromium() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_chromium() is None, reason="no Chromium installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(page, tmp_path):
    png = tmp_path / "r.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1280,2000",
                    page.as_uri()], check=True, capture_output=True, timeout=120)
    assert png.exists() and png.stat().st_size > 10_000
    Image = pytest.importorskip("PIL.Image")
    with Image.open(png) as im:
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # None: more colours than counted


def test_deciding_check_is_a_rejects_first_failure_or_an_accepts_closest_gate():
    quality = {"check": "qg_piqa/acc", "passed": True, "value": 0.99, "lower": 0.97, "threshold": 0.95, "note": "q"}
    speed = {"check": "speed vllm/offline", "passed": False, "value": 0.9, "threshold": 1.1, "note": "s"}
    size = {"check": "size", "passed": True, "value": 0.3, "threshold": 1.0, "note": "z"}
    assert report.deciding_check("reject", [quality, speed, size]) == "speed vllm/offline: value 0.9 < 1.1"
    assert report.deciding_check("accept", [quality, size]) == "qg_piqa/acc: CI low 0.97 ≥ 0.95"
    assert report.deciding_check("accept", [size]) == "size: value 0.3 ≤ 1"
    assert report.deciding_check("reject", [{"check": "build", "passed": False, "note": "build failed"}]) == "build failed"


@pytest.mark.skipif(_chromium() is None, reason="no Chromium installed (apt-get install -y chromium)")
def test_report_fits_1400px_without_horizontal_scroll(warehouse, tmp_path):
    """Chromium lays out the page at 1400 px, long reasons included, every <details> open; the page is no
    wider than the window. The measuring script is added to a copy: the report itself has none."""
    with sessions.session(warehouse, read_only=True) as con:
        html = report.render(con)
    long_reason = "reject: " + "; ".join(f"qg_task_{i}/metric recovery 0.9{i} (95% CI lower bound 0.8{i}) < 0.95"
                                         for i in range(12))
    html = html.replace("reject: qg_piqa/acc", long_reason + " qg_piqa/acc").replace("<details>", "<details open>")
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", "<script>document.body.setAttribute('data-width',"
                                             " document.documentElement.scrollWidth)</script></body>"))
    dom = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1000", "--dump-dom",
                          probe.as_uri()], check=True, capture_output=True, text=True, timeout=120).stdout
    width = int(re.search(r'data-width="(\d+)"', dom).group(1))
    assert width <= 1400, f"the page is {width} px wide at a 1400 px window"
    scorecard = html[html.index("<table class='scorecard'>"):]
    scorecard = scorecard[:scorecard.index("</table>")]
    first = re.findall(r"<tr class='\w+'><td class='(\w+)'", scorecard)
    assert len(first) == 6 and set(first) == {"decision"}  # every scorecard row starts with the verdict
