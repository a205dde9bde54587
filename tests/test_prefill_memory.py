"""benchmarks/prefill_memory.py: which configurations it measures, its targets' arithmetic, the model's context
read without loading weights, and one small run end to end on the CPU (fresh processes, the JSON written once;
an existing file refused without --overwrite)."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys

import pytest

from benchmarks.prefill_memory import build_parser, cache_flags, context_length, plan, profile_table, targets
from benchmarks.resident_memory import peak_since, reset_peak, status_bytes
from cache_setup import cache_config
from errors import UserError
from eval.bench.profile import KIND_NAMES
from strategies.tova import TovaCache
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


def test_storage_flags_reach_every_row_and_only_when_given():
    def storage(*argv: str) -> list[list[str]]:
        return [s["storage"] for s in plan(build_parser().parse_args(list(argv)), 8192, "cpu", "float32")]

    assert storage("--strategies", "recent_global", "--lengths", "1024") == [[], []]
    kivi = ["--cache_bits", "2", "--cache_quantization", "kivi", "--residual_length", "64"]
    assert storage("--strategies", "recent_global", "--lengths", "1024", *kivi) == [kivi, kivi]
    # a storage the cache flags refuse is refused before any run
    with pytest.raises(UserError, match="residual_length"):
        storage("--cache_bits", "2", "--cache_quantization", "kivi", "--residual_length", "100")


def test_head_budget_flags_reach_every_row_and_only_when_given():
    def allocation(*argv: str) -> list[list[str]]:
        return [s["allocation"] for s in plan(build_parser().parse_args(list(argv)), 8192, "cpu", "float32")]

    assert allocation("--strategies", "tova", "--lengths", "1024") == [[], []]
    pooled = ["--budget_allocation", "adakv", "--adakv_floor", "0.5"]
    assert allocation("--strategies", "tova", "kvzip", "--lengths", "1024", *pooled) == [pooled] * 4
    spec = plan(build_parser().parse_args(["--strategies", "tova", *pooled]), 8192, "cpu", "float32")[1]
    assert cache_config(cache_flags(spec)).budget_allocation == "adakv"  # what the row's process attaches
    # what the cache flags refuse is refused before any run: a strategy with nothing to pool, a floor alone
    with pytest.raises(UserError, match="keeps the same tokens in every head"):
        allocation("--strategies", "recent_global", "--budget_allocation", "adakv")
    with pytest.raises(UserError, match="--adakv_floor applies to --budget_allocation adakv only"):
        allocation("--adakv_floor", "0.5")


def test_profiled_rows_are_those_of_the_profile_lengths():
    specs = plan(build_parser().parse_args(["--lengths", "1024", "4096", "--profile_lengths", "4096"]), 8192, "cpu",
                 "float32")
    assert [(s["length"], s["chunk"]) for s in specs if s["profile"]] == [(4096, 0), (4096, 256)] * 2
    with pytest.raises(UserError, match="--profile_lengths 2048: each must be one of --lengths"):
        plan(build_parser().parse_args(["--lengths", "1024", "--profile_lengths", "2048"]), 8192, "cpu", "float32")


def test_profile_table_lists_the_profiled_rows_by_kind():
    kinds = dict.fromkeys(KIND_NAMES, 0.0) | {"attention": 30.0, "linear": 50.0}
    profiled = {"timeline": "cpu ops", "profiled_ms": 90.0, "recorded_ms": 80.0, "ms_by_kind": kinds,
                "top": [["aten::addmm", 50.0], ["aten::_scaled_dot_product_flash_attention_for_cpu", 30.0]]}
    rows = [{"strategy": "s", "prompt_tokens": 96, "prefill_chunk": 32, "profile": profiled},
            {"strategy": "s", "prompt_tokens": 48, "prefill_chunk": None, "profile": None}]
    lines = profile_table(rows).splitlines()
    assert len(lines) == 5 and lines[0].startswith("Where a prefill's time goes (torch.profiler, cpu ops")
    assert lines[4].startswith("| s | 96 | chunks of 32 | 90.0 | 80.0 | 30.0 | 0.0 | 50.0 |")
    assert lines[4].endswith("| aten::addmm (50.0); aten::_scaled_dot_product_flash_attention_for_cpu (30.0) |")
    assert profile_table(rows[1:]) == ""


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


def test_the_peak_since_a_reset_sees_memory_touched_and_freed_in_between():
    # Fresh pages from the kernel, each written, so resident (malloc may hand back pages already resident, and
    # an untouched mapping holds none), and unmapped by close().
    start = reset_peak()
    touched = mmap.mmap(-1, 64 << 20)
    for offset in range(0, 64 << 20, mmap.PAGESIZE):
        touched[offset] = 1
    held = status_bytes("VmRSS")
    touched.close()
    assert held - start > 60 << 20
    # the freed block is gone from the resident size but not from the peak
    assert status_bytes("VmRSS") < held - (32 << 20) and peak_since(start) - start > 60 << 20
    # a new reset forgets it
    assert peak_since(reset_peak()) < held - (32 << 20)


@pytest.mark.slow
def test_a_small_run_end_to_end(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.prefill_memory", "--strategies", "recent_global", "--budget", "32",
               "--chunk", "32", "--lengths", "48", "96", "--profile_lengths", "96", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt_tokens"], r["prefill_chunk"], r["memory"]) for r in rows] == [
        (48, None, "RSS"), (48, 32, "RSS"), (96, None, "RSS"), (96, 32, "RSS")]
    # the peak never below the start: the kernel's counters are read in per-CPU batches, and a 48-token
    # prefill after the warm-up may add less than their error
    assert all(r["peak_bytes"] >= r["before_bytes"] > 100 << 20 and r["prefill_tokens_per_second"] > 0 for r in rows)
    # The 96-token rows profiled: the weights' products and attention both recorded, the kinds summing to the
    # recorded total.
    assert [r["profile"] is not None for r in rows] == [False, False, True, True]
    for r in rows[2:]:
        p = r["profile"]
        assert p["ms_by_kind"]["linear"] > 0 and p["ms_by_kind"]["attention"] > 0
        assert abs(sum(p["ms_by_kind"].values()) - p["recorded_ms"]) < 0.2 and p["profiled_ms"] > 0
    assert "Where a prefill's time goes" in proc.stdout
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "--overwrite" in again.stderr
    assert json.loads(out.read_text())["rows"] == rows


@pytest.mark.parametrize("argv, message", [
    (["--random_weights", "llama-3.2-1b"], "--random_weights is not measured with --engine transformers"),
    (["--rerotate_positions"], "--rerotate_positions is not measured"),
    (["--profile_lengths", "1024"], "--profile_lengths is not measured"),
    (["--checkpoint_path", "some/dir"], "loads a GGUF file, not some/dir"),
])
def test_the_transformers_engine_refuses_what_it_cannot_measure(argv, message, tmp_path):
    from benchmarks.prefill_memory import main

    with pytest.raises(UserError, match=message):
        main(["--engine", "transformers", "--lengths", "1024", "--out", str(tmp_path / "rows.json"), *argv])
    assert not (tmp_path / "rows.json").exists()


@pytest.mark.slow
def test_a_small_run_through_transformers_end_to_end(tmp_path):
    """--engine transformers: transformers' generate with the adapter's caches, its own prefill_chunk_size
    feeding the chunks; one row per configuration, in fresh processes."""
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.prefill_memory", "--engine", "transformers", "--strategies",
               "heavy_hitter", "--budget", "32", "--chunk", "32", "--lengths", "48", "--one_shot_max", "32",
               "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    # One row, chunked (each row is a process loading transformers and the GGUF: ~20-30 s): a one-shot row
    # differs only in the prefill_chunk_size it passes (None); the lengths' loop is test_a_small_run_end_to_end's.
    assert [(r["prompt_tokens"], r["prefill_chunk"], r["engine"]) for r in rows] == [(48, 32, "transformers")]
    # the peak never below the start: the kernel's counters are read in per-CPU batches, and a 48-token
    # prefill after the warm-up may add less than their error
    assert all(r["peak_bytes"] >= r["before_bytes"] > 100 << 20 and r["prefill_tokens_per_second"] > 0 for r in rows)
    assert "chunks of 32, transformers' generate" in proc.stdout


def test_a_strategy_that_cannot_prefill_in_chunks_is_measured_one_shot_only(capsys, monkeypatch):
    # Every registered strategy takes chunks with the bench's flags: one that refused them (its class's
    # `chunked_prefill_refusal`, as a new strategy may) gets one-shot rows only.
    monkeypatch.setattr(TovaCache, "chunked_prefill_refusal", "a refusal for the test")
    assert planned("--strategies", "tova", "recent_global", "--lengths", "1024", "--chunk", "256") == [
        ("tova", 1024, 0), ("recent_global", 1024, 0), ("recent_global", 1024, 256)]
    assert "tova: one-shot rows only (--prefill_chunk: the tova cache cannot" in capsys.readouterr().err
    with pytest.raises(UserError, match="nothing to measure for tova: it prefills one shot only"):
        planned("--strategies", "tova", "--lengths", "8192", "--one_shot_max", "4096")
    with pytest.raises(UserError, match="no_such_strategy"):  # refused before any run, not in the run's process
        planned("--strategies", "recent_global", "no_such_strategy")
