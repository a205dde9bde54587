"""`python -m eval.bench --quick` runs and writes its table in the documented schema (no timing asserted)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from eval.bench import FIELDS
from tests.conftest import ROOT


@pytest.mark.slow
def test_bench_quick_schema(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.bench", "--quick", "--out_dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["read_bandwidth_gb_s"] > 0 and report["meta"]["weight_bytes"] > 0
    rows = report["rows"]
    engines = {r["engine"] for r in rows}
    assert {"ours eager"} <= engines
    assert {r["strategy"] for r in rows if r["engine"] == "ours eager"} == {"full", "recent_global", "heavy_hitter"}
    for row in rows:
        assert set(row) == set(FIELDS)
        assert row["decode_tokens_per_second"] > 0 and row["bound_tokens_per_second"] > 0
        assert 0 < row["fraction_of_bound"]
    compressed = [r for r in rows if r["strategy"] == "recent_global"][0]
    assert compressed["kv_bytes_read_per_step"] < [r for r in rows if r["strategy"] == "full"][0][
        "kv_bytes_read_per_step"]
    with open(tmp_path / "bench.csv") as f:
        assert [r["engine"] for r in csv.DictReader(f)] == [r["engine"] for r in rows]
    again = subprocess.run([sys.executable, "-m", "eval.bench", "--quick", "--out_dir", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr
