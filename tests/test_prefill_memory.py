"""benchmarks/prefill_memory.py: which configurations it measures, its targets' arithmetic, the model's context
read without loading weights, and one small run end to end on the CPU (fresh processes, the JSON written once;
an existing file refused without --overwrite)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.prefill_memory import build_parser, context_length, plan, targets
from errors import UserError
from tests.conftest import ROOT


def planned(*argv: str, context: int = 8192) -> list[tuple[str, int, int]]:
    specs = plan(build_parser().parse_args(list(argv)), context, "cpu", "float32")
    return [(s["strategy"], s["length"], s["chunk"]) for s in specs]


def test_plan_runs_one_shot_only_where_it_fits():
    assert planned("--strategies", "recent_global", "--lengths", "1024", "4096", "--chunk", "256") == [
        ("recent_global", 1024, 0), ("recent_global", 1024, 256), ("recent_global", 4096, 0),
        ("recent_global", 4096, 256)]
    # past --one_shot_max, or past the context (re-rotated), chunked only
    assert planned("--strategies", "tova", "--lengths", "2048", "8192", "--one_shot_max", "4096") == [
        ("tova", 2048, 0), ("tova", 2048, 256), ("tova", 8192, 256)]
    assert planned("--strategies", "tova", "--lengths", "16384", "--rerotate_positions") == [("tova", 16384, 256)]
    with pytest.raises(UserError, match="need --rerotate_positions"):
        planned("--lengths", "16384")


def test_targets_compare_chunked_peaks_and_speeds():
    def row(n: int, chunk: int | None, peak: int, speed: float) -> dict:
        return {"strategy": "s", "prompt_tokens": n, "prefill_chunk": chunk, "peak_bytes": peak,
                "prefill_tokens_per_second": speed, "prefill_tokens_per_cpu_second": speed / 2}

    rows = [row(1024, 256, 1000, 90.0), row(4096, 256, 1050, 80.0), row(4096, None, 3000, 100.0),
            row(8192, 256, 1200, 70.0)]
    assert targets(rows, 256) == ["s: chunked peak at 16× vs 4× the budget: +5.0% (target < 10%)",
                                  "s: chunked peak at 32× vs 4× the budget: +20.0% (target < 10%)",
                                  "s: 4096 tokens, chunked / one-shot prefill speed 0.80 wall, 0.80 CPU (target ≥ 0.5)"]


def test_context_is_read_from_the_config_or_header():
    assert context_length(build_parser().parse_args(["--random_weights", "llama-3.1-8b"])) == 131072
    assert context_length(build_parser().parse_args([])) == 8192  # the bundled GGUF's header


@pytest.mark.slow
def test_a_small_run_end_to_end(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.prefill_memory", "--strategies", "recent_global", "--budget", "32",
               "--chunk", "32", "--lengths", "96", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt_tokens"], r["prefill_chunk"], r["memory"]) for r in rows] == [(96, None, "RSS"), (96, 32, "RSS")]
    assert all(r["peak_bytes"] >= r["before_bytes"] > 0 and r["prefill_tokens_per_second"] > 0 for r in rows)
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "--overwrite" in again.stderr
    assert json.loads(out.read_text())["rows"] == rows
