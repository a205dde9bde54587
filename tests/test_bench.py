"""`python -m eval.bench --quick` runs and writes its table in the documented schema (no timing asserted);
the default plan and the comparison columns are built as documented."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from eval.bench.cli import build_parser
from eval.bench.measure import FIELDS
from eval.bench.plan import build_plan, plan_summary, recompile_check_shape
from eval.bench.report import fill_comparisons, summarize_targets
from tests.conftest import ROOT

STRATEGIES = ["recent_global", "random", "keep_it_odd", "l2", "heavy_hitter", "gated", "hybrid"]


@pytest.mark.slow
def test_bench_quick_schema(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.bench", "--quick", "--profile_steps", "4",
                           "--out_dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["read_bandwidth_gb_s"] > 0 and report["meta"]["weight_bytes"] > 0
    assert report["meta"]["read_bandwidth_after_gb_s"] > 0
    assert report["meta"]["transparent_huge_pages"] in ("always", "madvise", "never", "absent")
    assert set(report["targets"]) == {"compiled_fraction_of_bound", "compiled_fraction_of_bound_paired",
                                      "compiled_over_hf_generate",
                                      "compiled_over_hf_static_compiled", "max_eviction_overhead",
                                      "speedup_of_predicted", "peak_memory_at_longest", "scored_prefill_of_full",
                                      "recompilations"}
    rows = report["rows"]
    engines = {r["engine"] for r in rows}
    assert {"ours eager", "ours eager (same-size ref)"} <= engines
    assert {r["strategy"] for r in rows if r["engine"] == "ours eager"} == {"full", "recent_global", "heavy_hitter"}
    # --profile_steps: the full-cache row and the --speedup_strategies row at --speedup_budget, nothing else
    profiled = [(r["strategy"], r["budget"]) for r in rows if "profile" in r]
    assert profiled == [("full", 1.0), ("recent_global", 0.25)]
    assert all(r["profile"]["steps"] == 4 and r["profile"]["ms_per_step_by_kind"]["linear"] > 0
               for r in rows if "profile" in r)
    assert "Where a decode step's time goes" in (tmp_path / "bench.md").read_text()
    for row in rows:
        assert set(row) - {"profile"} == set(FIELDS)
        assert row["decode_tokens_per_second"] > 0 and row["bound_tokens_per_second"] > 0
        assert 0 < row["fraction_of_bound"]
        assert row["recompilations"] is None and row["recompile_check_steps"] is None  # eager only
    compressed = [r for r in rows if r["strategy"] == "recent_global"][0]
    full = [r for r in rows if r["strategy"] == "full" and r["engine"] == "ours eager"][0]
    assert compressed["kv_bytes_read_per_step"] < full["kv_bytes_read_per_step"]
    # Each strategy row: a paired overhead over a full cache of its own size, and a speed-up over the full
    # cache at its context; the same-size reference row holds exactly as many slots.
    ref = [r for r in rows if r["engine"] == "ours eager (same-size ref)"]
    assert len(ref) == 1 and ref[0]["strategy"] == "full"
    for r in rows:
        if r["engine"] == "ours eager" and r["strategy"] != "full":
            assert r["cache_slots"] == ref[0]["cache_slots"] < full["cache_slots"]
            assert r["same_size_full_median_ms"] > 0 and r["median_ms_per_step"] > 0
            assert isinstance(r["overhead_vs_same_size_full"], float) and r["overhead_vs_same_size_full"] > -1
            assert r["speedup_vs_full"] > 0 and r["bound_speedup_vs_full"] > 1
    with open(tmp_path / "bench.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["engine"] for r in csv_rows] == [r["engine"] for r in rows]
    assert list(csv_rows[0]) == FIELDS
    assert "overhead vs same-size full" in (tmp_path / "bench.md").read_text()
    again = subprocess.run([sys.executable, "-m", "eval.bench", "--quick", "--out_dir", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr


def plan_for(*argv: str) -> list:
    return build_plan(build_parser().parse_args(list(argv)), STRATEGIES, n_layer=30, context_length=8192)


def test_default_plan():
    plan = plan_for()
    full = {(j.context, j.compiled) for j in plan if j.kind == "full"}
    # 8192 is cut to 8192 - 64 so that prompt + new tokens fit the model's context; 256: compiled only (the bound)
    assert full == {(c, m) for c in (512, 2048, 4096, 8128) for m in (False, True)} | {(256, True)}
    assert {j.context for j in plan if j.kind == "hf"} == {512, 2048, 4096, 8128}
    strategy = [j for j in plan if j.kind == "strategy"]
    assert {j.strategy for j in strategy if (j.context, j.budget) == (4096, 0.1)} == set(STRATEGIES)
    assert {(j.strategy, j.budget) for j in strategy if j.context == 4096 and j.budget != 0.1} == {
        ("heavy_hitter", 0.25), ("heavy_hitter", 0.5)}
    assert {(j.strategy, j.budget) for j in strategy if j.context == 8128} == {("recent_global", 0.1)}
    assert all(j.compiled for j in strategy)
    # the overhead is measured at 4096 (paired with a same-size full cache); 8192 is for the speed-up only
    assert all((j.pair_blocks > 0) == (j.context == 4096) for j in strategy)
    # one same-size reference per measured size, placed before the first strategy row of that size
    refs = [j for j in plan if j.kind == "ref"]
    assert sorted(j.slots for j in refs) == sorted({j.slots for j in strategy if j.pair_blocks}) == [416, 1040, 2080]
    for ref in refs:
        assert ref.context + ref.new_tokens == ref.slots
        assert plan.index(ref) < min(i for i, j in enumerate(plan) if j.kind == "strategy" and j.slots == ref.slots)
    # one recompilation check per compiled strategy, the full cache included
    checked = [j.strategy for j in plan if j.recompile_steps]
    assert sorted(checked) == sorted(["full", *STRATEGIES])
    assert all(j.recompile_steps == 256 for j in plan if j.recompile_steps)
    assert sum(j.compiled for j in plan) == 18


def test_plan_flags():
    plan = plan_for("--contexts", "1024", "--bound_contexts", "--strategy_contexts", "2048", "--speedup_contexts",
                    "--budget_strategies", "all", "--no_compile", "--no_hf", "--budgets", "0.25", "0.5")
    assert not any(j.compiled or j.recompile_steps for j in plan)
    assert {(j.strategy, j.budget) for j in plan if j.kind == "strategy"} == {
        (s, b) for s in STRATEGIES for b in (0.1, 0.25, 0.5)}
    assert {j.context for j in plan if j.kind == "full"} == {1024, 2048}
    assert not any(j.kind == "ref" or j.pair_blocks for j in plan_for("--no_same_size_ref"))
    assert "compiles" in plan_summary(plan)


@pytest.mark.parametrize("slots,capacity,steps", [(416, 4160, 256), (320, 320, 256), (2080, 4160, 256), (27, 272, 256)])
def test_recompile_check_shape(slots, capacity, steps):
    prompt, n = recompile_check_shape(slots, capacity, steps)
    assert prompt >= 1 and prompt + n <= capacity
    if capacity >= prompt + steps:
        assert n == steps
    if slots < capacity and slots > steps:
        assert prompt < slots < prompt + n  # the cache fills during the run, then evicts


def test_targets():
    def row(engine, strategy, context, tok_s, bound, **kw):
        r = dict.fromkeys(FIELDS)
        r.update(engine=engine, strategy=strategy, context=context, new_tokens=64, decode_tokens_per_second=tok_s,
                 median_ms_per_step=round(1000 / tok_s, 3), bound_tokens_per_second=bound,
                 fraction_of_bound=round(tok_s / bound, 3), budget=0.1, prefill_tokens_per_second=1000.0)
        r.update(kw)
        return r

    mb = 2**20
    rows = [row("hf generate", "full (DynamicCache)", 4096, 5.0, 50.0),
            row("hf generate, static cache compiled", "full (StaticCache)", 4096, 20.0, 50.0),
            row("ours compiled", "full", 4096, 16.0, 50.0, recompilations=0, recompile_check_steps=256,
                kv_bytes_read_per_step=400 * mb, peak_device_memory_mb=1500.0, budget=1.0,
                fraction_of_bound_paired=0.72),
            row("ours compiled", "recent_global", 4096, 27.0, 60.0, recompilations=0, recompile_check_steps=256,
                overhead_vs_same_size_full=0.02, peak_device_memory_mb=1050.0),
            row("ours compiled", "hybrid", 4096, 21.0, 60.0, recompilations=0, overhead_vs_same_size_full=0.3,
                prefill_tokens_per_second=400.0)]
    fill_comparisons(rows)
    assert rows[3]["speedup_vs_full"] == 1.688 and rows[3]["bound_speedup_vs_full"] == 1.2
    t = summarize_targets(rows, 0.1, weights=1000 * mb)
    assert t["compiled_over_hf_generate"] == {"value": 3.2, "target": "> 1", "met": True}
    static = t["compiled_over_hf_static_compiled"]
    assert static["value"] == 0.8 and static["met"] is False
    assert t["compiled_fraction_of_bound"]["value"] == 0.32 and t["compiled_fraction_of_bound"]["met"] is False
    assert t["compiled_fraction_of_bound_paired"]["value"] == 0.72 and t["compiled_fraction_of_bound_paired"]["met"]
    assert t["max_eviction_overhead"]["met"] is False  # hybrid's 30% counts
    assert t["speedup_of_predicted"]["met"] is True
    # limit: 1000 MB of weights + 0.15 x 400 MB of K/V = 1060 MB; recent_global peaked at 1050
    assert t["peak_memory_at_longest"]["value"]["recent_global"]["limit_mb"] == 1060.0
    assert t["peak_memory_at_longest"]["met"] is True
    assert t["scored_prefill_of_full"]["value"] == {"hybrid@4096": 0.4}
    assert t["scored_prefill_of_full"]["met"] is False
    assert t["recompilations"]["met"] is True


def test_paired_fraction_pairs_each_block_with_the_probes_around_it(bundled, monkeypatch):
    """Each block of decode steps is divided by the bound at the mean of the read rates probed just before and
    just after it, and the row reports the median over the blocks. The probes and block times are set (the
    decoding itself runs, on the bundled model's full cache), so the arithmetic is checked exactly."""
    from cache_setup import attach_caches
    from eval.bench import measure
    from eval.bench.plan import cache_args
    from generate import decode_one_token

    model, tokenizer = bundled
    ids, steps = list(range(100, 116)), 9
    attach_caches(model, cache_args("full", 1.0), len(ids), steps, tokenizer)
    rates = iter([1e9, 3e9, 1e9, 3e9, 5e9])  # before block 1, between the blocks, after block 4
    block_seconds = iter([0.5, 0.01, 0.02, 0.01, 0.04])  # the warm-up step, then blocks 1-4 (per step)
    real_block = measure._decode_block
    blocks_run = []

    def fixed_block(model, step, state, n, times):
        real_block(model, step, state, n, [])
        blocks_run.append(n)
        times.extend([next(block_seconds)] * n)

    monkeypatch.setattr(measure, "read_rate", lambda x, repeats=5: next(rates))
    monkeypatch.setattr(measure, "_decode_block", fixed_block)
    monkeypatch.setattr(measure, "probe_buffer", lambda device, megabytes=512: torch.ones(4))
    got = measure.paired_fraction_of_bound(model, ids, decode_one_token, steps, weights=7 * 10**8, kv=10**8)
    assert blocks_run == [1, 2, 2, 2, 2]  # 1 + 4 blocks of (9 - 1) // 4 steps fit the 9 new slots
    # bound = rate / (8e8 bytes a step): blocks 1-3 between probes of 1e9 and 3e9 (2.5 tok/s), block 4 between
    # 3e9 and 5e9 (5 tok/s); fractions 100/2.5, 50/2.5, 100/2.5, 25/5 = 40, 20, 40, 5: median 30
    assert got == pytest.approx(30.0)


@pytest.mark.parametrize("steps", [2, 4])
def test_the_paired_bound_decodes_only_the_steps_the_cache_has_room_for(bundled, monkeypatch, steps):
    """`--new_tokens` below 1 + BOUND_BLOCKS: the blocks shrink to what the full cache of prompt + new slots
    holds (one step a block left 5 steps for 4 slots: an index past the cache, a traceback under --compile)."""
    from cache_setup import attach_caches
    from eval.bench import measure
    from eval.bench.plan import cache_args
    from generate import decode_one_token

    model, tokenizer = bundled
    ids = list(range(100, 116))
    attach_caches(model, cache_args("full", 1.0), len(ids), steps, tokenizer)
    decoded = []
    real_block = measure._decode_block

    def counted_block(model, step, state, n, times):
        decoded.append(n)
        real_block(model, step, state, n, times)

    monkeypatch.setattr(measure, "read_rate", lambda x, repeats=5: 1e9)
    monkeypatch.setattr(measure, "_decode_block", counted_block)
    monkeypatch.setattr(measure, "probe_buffer", lambda device, megabytes=512: torch.ones(4))
    assert measure.paired_fraction_of_bound(model, ids, decode_one_token, steps, weights=7 * 10**8, kv=10**8) > 0
    assert sum(decoded) == steps and all(n >= 1 for n in decoded)


def test_random_weight_shapes_are_the_real_models(bundled):
    """`--random_weights smollm2-135m` has the bundled checkpoint's shapes (read from its GGUF): the shape table
    is checked against a real model, and the random model is built without touching its weights' memory."""
    from eval.bench.measure import random_weight_model, weight_bytes

    model, _ = bundled
    random = random_weight_model("smollm2-135m", "meta", torch.bfloat16)
    keys = ("n_layer", "n_head", "n_kv_head", "dim", "intermediate_size", "vocab_size", "head_dim",
            "tie_embeddings", "context_length")
    assert {k: getattr(random.args, k) for k in keys} == {k: getattr(model.args, k) for k in keys}
    assert random.args.rope_base == model.args.rope_base
    assert weight_bytes(random) == weight_bytes(model) // 2  # bf16 against the fixture's float32


def test_random_weights_and_a_checkpoint_exclude_each_other(tmp_path):
    from errors import UserError
    from eval.bench.cli import main

    with pytest.raises(UserError, match="exclude each other"):
        main(["--random_weights", "llama-3.1-8b", "--checkpoint_path", str(tmp_path), "--dry_run"])
    assert main(["--random_weights", "llama-3.1-8b", "--dry_run", "--no_hf"]) == []


# ---- throughput under a memory cap (--batch_sizes, --kv_memory_gb) ---------------------------------------


def test_batch_plan_takes_the_largest_batch_whose_measured_caches_fit_the_cap():
    from cache_setup import cache_config, cache_specs
    from cache_spec import build_caches
    from eval.bench.batched import GB, batch_plan
    from eval.bench.measure import random_weight_model

    shapes = random_weight_model("smollm2-135m", "meta", torch.bfloat16).args
    args = build_parser().parse_args(["--batch_sizes", "1", "4", "8", "32", "--kv_memory_gb", "0.2",
                                      "--batch_context", "2048", "--budgets", "0.1"])
    plan = batch_plan(args, ["recent_global", "heavy_hitter"], shapes, torch.bfloat16)
    assert [(j.strategy, j.batch_size) for j in plan] == [("full", 4), ("recent_global", 32), ("heavy_hitter", 32)]

    def real_bytes(strategy: str, budget: float, batch: int) -> int:  # the caches built for real, on the CPU
        specs = cache_specs(cache_config(cache_strategy=[strategy], max_cache_length=[budget]), shapes, 2048, 64)
        caches = build_caches(specs, batch, shapes.n_kv_head, shapes.head_dim, 2112, torch.bfloat16, "cpu",
                              {n: torch.zeros(shapes.vocab_size, dtype=torch.bool)
                               for n in ("special", "punct", "separator")})
        return sum(b.numel() * b.element_size() for c in caches for b in c.buffers())

    full = plan[0]
    assert full.cache_bytes == real_bytes("full", 1.0, 4) <= 0.2 * GB < real_bytes("full", 1.0, 8)
    assert plan[1].cache_bytes == real_bytes("recent_global", 0.1, 32) <= 0.2 * GB
    no_cap = build_parser().parse_args(["--batch_sizes", "1", "8", "--batch_context", "256", "--budgets", "0.5"])
    assert [(j.strategy, j.batch_size) for j in batch_plan(no_cap, ["l2"], shapes, torch.bfloat16)] == [
        ("full", 1), ("full", 8), ("l2", 1), ("l2", 8)]


def test_quantized_storages_fit_more_rows_and_are_compared_with_the_dense_full_cache():
    from cache_setup import cache_config, cache_specs
    from eval.bench.batched import ENGINES, batch_plan, caches_bytes, fill_batch_comparisons
    from eval.bench.measure import random_weight_model
    from eval.bench.report import summarize_batch_targets

    shapes = random_weight_model("smollm2-135m", "meta", torch.float32).args
    args = build_parser().parse_args(["--batch_sizes", "1", "4", "8", "16", "32", "--kv_memory_gb", "0.4",
                                      "--batch_context", "2048", "--budgets", "0.1", "--batch_cache_bits", "4", "16"])
    plan = batch_plan(args, ["recent_global"], shapes, torch.float32)
    assert [(j.strategy, j.cache_bits, j.batch_size) for j in plan] == [
        ("full", 16, 4), ("full", 4, 16), ("recent_global", 16, 32), ("recent_global", 4, 32)]
    # The 4-bit full cache's bytes are the per-token codes' own (codes, scales and zero points, measured).
    specs = cache_specs(cache_config(cache_strategy=["full"], max_cache_length=[1.0], cache_bits=4), shapes, 2048, 64)
    assert plan[1].cache_bytes == caches_bytes(specs, shapes, 16, 2112, torch.float32) < plan[0].cache_bytes

    def row(strategy, bits, tok_s):
        r = dict.fromkeys(FIELDS)
        r.update(engine=ENGINES[True], strategy=strategy, budget=1.0, cache_bits=bits, context=2048, new_tokens=16,
                 batch_size=4, kv_memory_cap_gb=0.4, decode_tokens_per_second=tok_s, bound_tokens_per_second=1.0)
        return r

    rows = [row("full", 16, 10.0), row("full", 4, 35.0), row("recent_global", 16, 25.0),
            row("recent_global", 4, 60.0)]
    fill_batch_comparisons(rows)
    assert [r["speedup_vs_full"] for r in rows] == [None, 3.5, 2.5, 6.0]
    # The target judges eviction on dense storage; rows on codes are reported beside it, keyed with their bits.
    target = summarize_batch_targets(rows, 1.0, ["recent_global"])["batched_over_full_at_cap"]
    assert set(target["value"]) == {"full@1/4bit", "recent_global@1", "recent_global@1/4bit"}
    assert target["met"] is False and target["value"]["recent_global@1/4bit"]["speedup"] == 6.0


def test_batched_comparisons_are_against_the_full_cache_under_the_same_cap():
    from eval.bench.batched import ENGINES, fill_batch_comparisons
    from eval.bench.report import summarize_batch_targets

    def row(strategy, budget, batch, tok_s, bound):
        r = dict.fromkeys(FIELDS)
        r.update(engine=ENGINES[True], strategy=strategy, budget=budget, context=2048, new_tokens=16, batch_size=batch,
                 kv_memory_cap_gb=0.2, decode_tokens_per_second=tok_s, bound_tokens_per_second=bound)
        return r

    rows = [row("full", 1.0, 4, 8.0, 40.0), row("recent_global", 0.1, 32, 36.0, 200.0),
            row("heavy_hitter", 0.1, 32, 20.0, 190.0)]
    fill_batch_comparisons(rows)
    assert [r["speedup_vs_full"] for r in rows] == [None, 4.5, 2.5]
    assert rows[1]["bound_speedup_vs_full"] == 5.0
    target = summarize_batch_targets(rows, 0.1, ["recent_global"])["batched_over_full_at_cap"]
    assert target["met"] is True and target["value"]["heavy_hitter@0.1"]["speedup"] == 2.5


BAD_BATCH_INPUT = {
    "cap too small for one row": (["--kv_memory_gb", "0.001"], "holds no batch of full"),
    "batch size zero": (["--batch_sizes", "0"], "--batch_sizes: must be at least 1"),
    "negative batch size": (["--batch_sizes", "4", "-1"], "--batch_sizes: must be at least 1"),
    "negative cap": (["--kv_memory_gb", "-1"], "--kv_memory_gb: must be greater than 0"),
    "storage without codes": (["--batch_cache_bits", "3"], "--batch_cache_bits: invalid choice"),
}


@pytest.mark.parametrize("case", BAD_BATCH_INPUT, ids=list(BAD_BATCH_INPUT))
def test_bad_batch_input_is_one_error_line_and_writes_nothing(tmp_path, case):
    flags, message = BAD_BATCH_INPUT[case]
    out = tmp_path / "bench"
    argv = ["--batch_sizes", "1", "4", "--batch_context", "2048", "--strategies", "recent_global",
            "--random_weights", "smollm2-135m", *flags, "--out_dir", str(out)]
    proc = subprocess.run([sys.executable, "-m", "eval.bench", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error:")
    assert message in proc.stderr and not out.exists()


def test_batched_run_writes_rows_of_measured_batches(tmp_path, bundled):
    from eval.bench.cli import main

    out = tmp_path / "bench"
    rows = main(["--batch_sizes", "1", "2", "4", "--kv_memory_gb", "0.002", "--batch_context", "32",
                 "--new_tokens", "3", "--strategies", "recent_global", "--budgets", "0.25", "--dtype", "float32",
                 "--out_dir", str(out)])
    assert [(r["strategy"], r["batch_size"]) for r in rows] == [("full", 1), ("recent_global", 4)]
    for r in rows:  # compiled by default, as the batch-1 rows; each configuration its own graph
        assert r["engine"] == "ours compiled, batched" and r["compile_seconds"] > 0
        assert set(r) == set(FIELDS) and r["cache_bytes"] <= 0.002e9 and r["decode_tokens_per_second"] > 0
        assert r["bound_tokens_per_second"] > 0 and r["peak_rss_mb"] > 0
    assert rows[1]["speedup_vs_full"] > 0 and rows[1]["bound_speedup_vs_full"] > 1
    report = json.loads((out / "bench.json").read_text())
    assert report["rows"] == rows and report["meta"]["kv_memory_cap_gb"] == 0.002
    with open(out / "bench.csv") as f:
        assert [int(r["batch_size"]) for r in csv.DictReader(f)] == [1, 4]
