"""Speed measured once per checkpoint format: two builds whose config, quantization layout and tensor shapes
are the same (RTN and GPTQ, W4A16 group 32) run the same kernels on the same shapes, so the run measures one and
the other takes its rows; a build of another format (W8A16) is measured on its own.

Real `quantgate run` subprocess, Prefect server, DuckDB, llm-compressor and Transformers on stories260k.
"""

from __future__ import annotations

import json
import statistics
import struct
from pathlib import Path

import pytest

from quantgate.tasks.adapters.speed.checkpoint import speed_format
from quantgate.warehouse import sessions
from tests.cli_runs import run_cli, tiny_catalog
from tests.shared_data import TINY_MODEL


def _checkpoint(folder: Path, tensors: dict[str, tuple[str, list[int], bytes]], config: dict) -> Path:
    """A folder with config.json and one safetensors file written byte by byte (name -> dtype, shape, data)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    header, offset, body = {}, 0, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset, body = offset + len(data), body + data
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    return folder


def _quant(actorder: str | None, observer: str = "minmax") -> dict:
    weights = {"num_bits": 4, "type": "int", "group_size": 32, "strategy": "group", "symmetric": True,
               "actorder": actorder, "observer": observer}
    return {"hidden_size": 64, "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                       "config_groups": {"group_0": {"weights": weights}}}}


def test_the_format_is_the_layout_not_the_values_nor_how_the_build_was_calibrated(tmp_path):
    a = _checkpoint(tmp_path / "a", {"w": ("BF16", [2, 2], b"\x01" * 8)}, _quant(None))
    # Other values, another observer, activation order "static" (stored in the ordinary layout): the same format.
    b = _checkpoint(tmp_path / "b", {"w": ("BF16", [2, 2], b"\x07" * 8)}, _quant("static", "memoryless_minmax"))
    assert speed_format(a) == speed_format(b) is not None
    # Another dtype, another shape, activation order "group" (a g_idx and another kernel path): other formats.
    assert speed_format(_checkpoint(tmp_path / "c", {"w": ("F16", [2, 2], b"\x01" * 8)}, _quant(None))) != speed_format(a)
    assert speed_format(_checkpoint(tmp_path / "d", {"w": ("BF16", [4, 1], b"\x01" * 8)}, _quant(None))) != speed_format(a)
    assert speed_format(_checkpoint(tmp_path / "e", {"w": ("BF16", [2, 2], b"\x01" * 8)}, _quant("group"))) != speed_format(a)
    # A folder without weights (a load-time variant's descriptor) has no format of its own to share.
    (tmp_path / "f").mkdir()
    assert speed_format(tmp_path / "f") is None


@pytest.mark.slow
def test_checkpoints_of_one_format_are_measured_once(tmp_path, prefect_api):
    if not TINY_MODEL.exists():
        pytest.skip(f"shared tiny model not found at {TINY_MODEL}")
    cat = tiny_catalog(tmp_path, TINY_MODEL, {"rtn-w4a16-g32": "{method: rtn, scheme: W4A16, group_size: 32}",
                                              "gptq-w4a16-g32": "{method: gptq, scheme: W4A16, group_size: 32}",
                                              "rtn-w8a16": "{method: rtn, scheme: W8A16, group_size: null}"},
                       limit=2, min_recovery=0.5, calibration="{kind: text, samples: 4, seq_len: 32}")
    wh = tmp_path / "w.ducklake"
    result = run_cli(["run", "tiny", "-c", str(cat), "-w", str(wh), "--workdir", str(tmp_path / "work")], prefect_api)
    assert result.returncode == 0, result.stderr[-3000:]
    with sessions.session(wh, read_only=True) as con:
        paths = dict(con.execute("SELECT name, path FROM variants").fetchall())
        assert speed_format(paths["rtn-w4a16-g32"]) == speed_format(paths["gptq-w4a16-g32"]) != speed_format(paths["rtn-w8a16"])
        measured = {n for (n,) in con.execute("SELECT DISTINCT v.name FROM speed_results s JOIN variants v USING (variant_uid)").fetchall()}
        # The base, one of the two W4A16 builds (the first ready), and the W8A16 build.
        assert len(measured) == 3 and {"base", "rtn-w8a16"} <= measured
        (taker,) = {"rtn-w4a16-g32", "gptq-w4a16-g32"} - measured
        (measurer,) = {"rtn-w4a16-g32", "gptq-w4a16-g32"} - {taker}
        uid = dict(con.execute("SELECT name, variant_uid FROM variants").fetchall())
        assert con.execute("SELECT speed_variant_uid FROM run_variants WHERE variant_uid = ?",
                           [uid[taker]]).fetchone()[0] == uid[measurer]
        # Every variant is judged on speed, the taker on its format's rows, under its own uid.
        speedups = dict(con.execute("SELECT v.name, s.speedup FROM variant_speedup s JOIN variants v USING (variant_uid)").fetchall())
        assert speedups[taker] == speedups[measurer] is not None and speedups["rtn-w8a16"] is not None
        # Each measured variant's passes alternated with the base's: its speedup is the median of the pairs' ratios.
        pairs = con.execute("SELECT speedup, pair_ratios FROM variant_speedup s JOIN stg_speed_pass_lists p USING"
                            " (run_id, variant_uid, engine, scenario), LATERAL (SELECT list_transform(list_zip("
                            "p.pass_tps, p.paired_base_tps), lambda x: x[1] / x[2]) AS pair_ratios) WHERE s.paired"
                            ).fetchall()
        ok = con.execute("SELECT count(*) FROM variant_speedup WHERE status = 'ok'").fetchone()[0]
        assert len(pairs) == ok >= 3 and all(s == pytest.approx(statistics.median(r)) for s, r in pairs)
        detail, starts = con.execute("SELECT st.detail, t.engine_starts FROM run_stages st JOIN stage_times t"
                                     " ON t.run_id = st.run_id AND t.stage = st.stage AND t.item = st.item"
                                     " WHERE st.stage = 'benchmark' AND st.item = ?", [uid[taker]]).fetchone()
        assert detail == f"same format as {measurer}: its speed rows" and starts == 0
        assert con.execute("SELECT count(*) FROM decisions").fetchone()[0] == 3
