"""The bench's flags and its run: plan, measure every row, report (see eval/bench/__init__.py)."""


from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

import cpu_bf16_kernels
from atomic_files import atomic_write, write_json_atomic
from checkpoint import add_compile_scope_argument, add_model_arguments, parse_dtype, positive_int, resolve_device
from compiled_step import graphs_compiled
from errors import CliParser, UserError
from eval import bench as bench_package
from eval.bench.batched import (
    ENGINES,
    batch_plan,
    bench_batch,
    check_batch_flags,
    fill_batch_comparisons,
    format_batch_table,
)
from eval.bench.measure import (
    FIELDS,
    RANDOM_SHAPES,
    bench_hf,
    bench_ours,
    check_model_source,
    load_model,
    measure_read_bandwidth,
    weight_bytes,
)
from eval.bench.plan import build_plan, plan_summary
from eval.bench.profile import format_profiles
from eval.bench.report import (
    fill_comparisons,
    format_table,
    format_targets,
    summarize_batch_targets,
    summarize_targets,
)
from eval.data import pydoc_corpus
from eval.results import check_out_dir, refuse_file_as_out_dir
from flag_types import POSITIVE, count, explicit_dests, refuse_unused
from strategies import CACHE_STRATEGIES
from weight_arena import transparent_huge_pages


def add_batch_arguments(p: CliParser) -> None:
    """--batch_sizes' mode: throughput under a memory cap (eval/bench/batched.py)."""
    p.add_argument("--batch_sizes", nargs="+", type=positive_int, default=None,
                   help="throughput under a memory cap instead of the plan above: the full cache and each of "
                        "--strategies at each of --budgets, at a --batch_context prompt, decoded as one batch: the "
                        "largest of these batch sizes whose caches fit --kv_memory_gb (without it, each size)")
    p.add_argument("--kv_memory_gb", type=POSITIVE, default=None,
                   help="the cap for --batch_sizes: bytes of every cache buffer of the batch (K/V and bookkeeping), "
                        "in 10^9 bytes")
    p.add_argument("--batch_context", type=positive_int, default=2048,
                   help="prompt tokens of every row of --batch_sizes")
    p.add_argument("--batch_cache_bits", nargs="+", type=int, choices=[2, 4, 8, 16], default=[16],
                   help="the storages every configuration of --batch_sizes runs on: 16 dense, 2/4/8 per-token "
                        "codes (each compared with the dense full cache under the cap)")


def build_parser() -> CliParser:
    p = CliParser(prog="python -m eval.bench", description=bench_package.__doc__)  # what the bench does
    p.add_argument("--contexts", nargs="*", type=positive_int, default=[512, 2048, 4096, 8192],
                   help="HF, eager and compiled full-cache rows (a context is cut to the model's context "
                        "length minus --new_tokens)")
    p.add_argument("--bound_contexts", nargs="*", type=positive_int, default=[256],
                   help="compiled full-cache rows only (the fraction-of-bound target is at 256)")
    p.add_argument("--strategy_contexts", nargs="*", type=positive_int, default=[4096],
                   help="contexts where every strategy runs at --speedup_budget, and --budget_strategies at each "
                        "of --budgets too")
    p.add_argument("--speedup_contexts", nargs="*", type=positive_int, default=[8192],
                   help="further contexts where --speedup_strategies run at --speedup_budget only, without the "
                        "overhead measurement (none: pass the flag alone)")
    p.add_argument("--speedup_strategies", nargs="+", default=["recent_global"])
    p.add_argument("--speedup_budget", type=POSITIVE, default=0.1,
                   help="the budget every strategy runs at (the speed-up target's budget)")
    p.add_argument("--new_tokens", type=count(2), default=64)
    p.add_argument("--strategies", nargs="+", default=None, help="default: every registered strategy")
    p.add_argument("--budgets", nargs="+", type=POSITIVE, default=[0.1, 0.25, 0.5])
    p.add_argument("--budget_strategies", nargs="+", default=["heavy_hitter"],
                   help="strategies run at every --budgets at --strategy_contexts (default: heavy_hitter, whose "
                        "per-step work grows with the cache: attention probabilities, an O(slots) state update; "
                        "all: every strategy, about 15 more minutes)")
    p.add_argument("--recompile_steps", type=count(0), default=256,
                   help="per compiled strategy (once), decode this many more steps on its compiled graph, with a "
                        "prompt that lets the cache fill and then evict, and count new graphs (0: off)")
    p.add_argument("--profile_steps", type=count(0), default=0,
                   help="profile this many more decode steps of each full-cache row and each --speedup_strategies "
                        "row at --speedup_budget with torch.profiler: ms per step by kind of work (linear, "
                        "attention, cache write, fused kernels, compiled code's entry; bench.json rows' profile, a "
                        "table in bench.md; 0: off)")
    p.add_argument("--overhead_blocks", type=positive_int, default=8,
                   help="strategy rows: decode --new_tokens more steps on the strategy's caches and as many on a "
                        "same-size full cache, alternating in this many blocks, for overhead_vs_same_size_full")
    p.add_argument("--no_same_size_ref", action="store_true",
                   help="skip the same-size full-cache references and the overhead measurement")
    p.add_argument("--inductor_freezing", action="store_true",
                   help="experiment: compile with torch._inductor.config.freezing (weights folded and prepacked for "
                        "oneDNN; faster decode here, but each compile is cold and keeps ~250 MB in the process)")
    add_batch_arguments(p)
    p.add_argument("--no_compile", action="store_true", help="eager rows only")
    p.add_argument("--no_hf", action="store_true", help="skip the Hugging Face rows")
    p.add_argument("--hf_static", action="store_true",
                   help="also transformers' static cache with its forward compiled (its documented recipe for speed; "
                        "CUDA graphs on a GPU), at each of --contexts")
    add_model_arguments(p, compile_flag=False, batch_flag=False)
    add_compile_scope_argument(p)  # the compiled rows' scope (the bench compiles unless --no_compile)
    p.set_defaults(dtype="bfloat16")  # the bench measures speed as deployed: bfloat16 on the CPU too
    p.add_argument("--random_weights", choices=sorted(RANDOM_SHAPES), default=None,
                   help="random weights with a real model's shapes instead of a checkpoint (decode speed depends on "
                        "the shapes only; nothing is downloaded); prompts are random token ids")
    p.add_argument("--quick", action="store_true", help="~1 minute: context 256, 16 tokens, eager, 2 strategies")
    p.add_argument("--dry_run", action="store_true", help="print the plan and its estimated duration, run nothing")
    p.add_argument("--out_dir", default="results/bench")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bench.json/csv in --out_dir")
    return p


# What --quick sets, the flags only the plan of rows reads, and those only --batch_sizes reads: typed with a
# mode that ignores them, they are refused rather than dropped without a word.
QUICK_SETS = ("contexts", "strategy_contexts", "speedup_contexts", "bound_contexts", "new_tokens", "no_compile",
              "budgets", "speedup_budget")
PLAN_ONLY = ("contexts", "bound_contexts", "strategy_contexts", "speedup_contexts", "budget_strategies",
             "recompile_steps", "profile_steps", "overhead_blocks", "no_same_size_ref", "inductor_freezing", "no_hf",
             "hf_static", "quick")
BATCHED_ONLY = ("kv_memory_gb", "batch_context", "batch_cache_bits")


def check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    explicit = explicit_dests(parser, argv)
    if args.quick:
        refuse_unused(parser, explicit, QUICK_SETS, "--quick sets it (drop --quick to choose it)")
    if args.batch_sizes:
        refuse_unused(parser, explicit, PLAN_ONLY, "--batch_sizes measures batched throughput only")
    else:
        refuse_unused(parser, explicit, BATCHED_ONLY, "it applies to --batch_sizes only")
    if args.quick or args.no_compile:
        refuse_unused(parser, explicit, ("compile_scope",), "no row is compiled with --quick or --no_compile")


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_modes(parser, args, argv)
    if args.quick:
        args.contexts, args.strategy_contexts, args.speedup_contexts, args.bound_contexts = [256], [256], [], []
        args.new_tokens, args.no_compile = 16, True
        args.strategies = args.strategies or ["recent_global", "heavy_hitter"]
        args.budgets, args.speedup_budget = [0.25], 0.25
    strategies = check_values(args)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    out_dir = Path(args.out_dir)
    if args.batch_sizes:
        return run_batched(args, argv, strategies, device, dtype, out_dir)
    if args.dry_run:
        model, _ = load_model(args, "meta" if args.random_weights else "cpu", dtype)
        plan = build_plan(args, strategies, model.args.n_layer, model.args.context_length)
        for job in plan:
            print(f"{job.engine():<30} {job.strategy:<14} budget {job.budget:<5g} context {job.context:<6} "
                  f"slots {job.slots:<6} new {job.new_tokens}"
                  + (f" + {job.recompile_steps}-step recompile check" if job.recompile_steps else "")
                  + (f" + {job.profile_steps} profiled steps" if job.profile_steps else ""))
        print(plan_summary(plan))
        return []
    refuse_existing_report(out_dir, args.overwrite)
    return run_rows(args, argv, strategies, device, dtype, out_dir)


@torch.no_grad()  # scoped, as run_batched: tests call the bench in process, and training tests follow
def run_rows(args: argparse.Namespace, argv: list[str], strategies: list[str], device: str, dtype: torch.dtype,
             out_dir: Path) -> list[dict]:
    """The rows of the plan, measured and written; the model is loaded first, since the plan fits each context
    to its length, and a plan that cannot fit is refused before anything is written."""
    model = tokenizer = None
    if args.random_weights:  # built on the device when its first row runs; its shapes from a meta copy now
        shapes = load_model(args, "meta", dtype)[0]
        model_args, total_weight_bytes = shapes.args, weight_bytes(shapes)
    else:
        model, tokenizer = load_model(args, device, dtype)
        model_args, total_weight_bytes = model.args, weight_bytes(model)
    plan = build_plan(args, strategies, model_args.n_layer, model_args.context_length)
    check_out_dir(out_dir)
    freezing = args.inductor_freezing or torch._inductor.config.freezing
    with torch._inductor.config.patch(freezing=freezing):  # scoped too: later compiles in the process keep theirs
        bandwidth = measure_read_bandwidth(device)
        print(f"read bandwidth: {bandwidth / 1e9:.2f} GB/s", flush=True)
        print(plan_summary(plan), flush=True)
        started, partial = time.perf_counter(), out_dir / "bench.partial.jsonl"
        rows = measure_rows(args, plan, model, tokenizer, model_args, device, dtype, bandwidth, partial)
        # Measured again after the rows: on a shared host the read rate moves by up to 2x between runs (and
        # within one), and the fractions of the bound move with the probe they are divided by.
        bandwidth_after = measure_read_bandwidth(device)
        print(f"read bandwidth after the rows: {bandwidth_after / 1e9:.2f} GB/s (the fractions use the first)",
              flush=True)
    fill_comparisons(rows)
    targets = summarize_targets(rows, args.speedup_budget, total_weight_bytes)
    table = "\n\n".join(filter(None, [format_table(rows), format_profiles(rows), format_targets(targets)]))
    print(table)
    meta = run_meta(args, argv, device, bandwidth, total_weight_bytes, started) | {
        "read_bandwidth_after_gb_s": round(bandwidth_after / 1e9, 2),
        "processor": platform.processor() or platform.machine(),
        "graphs_compiled": graphs_compiled(), "compiled_rows": sum(j.compiled for j in plan),
        "inductor_freezing": freezing, "compile_scope": args.compile_scope}
    write_outputs(out_dir, {"meta": meta, "targets": targets, "rows": rows}, table)
    partial.unlink()
    return rows


def check_values(args: argparse.Namespace) -> list[str]:
    """The values no parser type checks; returns the strategies to measure (every registered one by default)."""
    if args.new_tokens < 2:
        raise UserError(f"--new_tokens must be ≥ 2, got {args.new_tokens}")
    if args.overhead_blocks < 1:
        raise UserError(f"--overhead_blocks must be ≥ 1, got {args.overhead_blocks}")
    strategies = [s for s in (args.strategies or CACHE_STRATEGIES) if s != "full"]
    for s in strategies + args.speedup_strategies + [b for b in args.budget_strategies if b != "all"]:
        if s not in CACHE_STRATEGIES:
            raise UserError(f"unknown strategy {s!r}; available: {', '.join(CACHE_STRATEGIES)}")
    contexts = args.contexts + args.bound_contexts + args.strategy_contexts + args.speedup_contexts
    if args.profile_steps and contexts and min(contexts) <= args.profile_steps + 2:
        # every context has a full-cache row, profiled after a prefill of all but its steps and 2 warm-up steps
        raise UserError(f"--profile_steps {args.profile_steps} needs prompts longer than {args.profile_steps + 2} "
                        f"tokens; context {min(contexts)} is not")
    check_model_source(args)
    return strategies


def refuse_existing_report(out_dir: Path, overwrite: bool) -> None:
    refuse_file_as_out_dir(out_dir)
    if (out_dir / "bench.json").exists() and not overwrite:
        raise UserError(f"{out_dir / 'bench.json'} exists; pass --overwrite or another --out_dir")


def corpus_token_ids(tokenizer, vocab_size: int, length: int) -> list[int]:
    """The bench's prompt: the pydoc corpus, or random ids without a tokenizer (speed does not depend on them)."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (length,), generator=generator).tolist()
    ids = tokenizer.encode(pydoc_corpus()[: 40 * length])
    if len(ids) < length:
        raise UserError(f"the corpus has {len(ids)} tokens, fewer than the longest context {length}")
    return ids[:length]


def token_classes(tokenizer, vocab_size: int) -> dict | None:
    """Without a tokenizer, the hybrid cache's special / punctuation classes are empty."""
    if tokenizer is not None:
        return None
    return {name: torch.zeros(vocab_size, dtype=torch.bool) for name in ("special", "punct")}


def measure_rows(args: argparse.Namespace, plan: list, model, tokenizer, model_args, device: str,
                 dtype: torch.dtype, bandwidth: float, partial: Path) -> list[dict]:
    """Every planned row, ours first, then transformers' with our model released (peak device memory is one
    model's). Each row is appended to `partial` as it is measured: a run cut short keeps its rows."""
    from tqdm import tqdm

    corpus_ids = corpus_token_ids(tokenizer, model_args.vocab_size, max(j.context for j in plan))
    classes = token_classes(tokenizer, model_args.vocab_size)
    source = {"random_weights": args.random_weights, "checkpoint_path": args.checkpoint_path}
    rows: list[dict] = []
    group = None  # compiled graphs are kept from a same-size reference through the strategy rows of its size
    full_caches: dict = {}
    partial.write_text("")
    plan = [j for j in plan if not j.kind.startswith("hf")] + [j for j in plan if j.kind.startswith("hf")]
    for job in tqdm(plan, desc="bench"):
        ids = corpus_ids[: job.context]
        if job.kind.startswith("hf"):
            if model is not None:
                model = full_caches = None
                torch._dynamo.reset()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            try:
                row = bench_hf(source, ids, job.new_tokens, dtype, device, bandwidth, job.kind == "hf_static")
            except Exception as e:  # another library's failure costs its row, not the run's other rows
                tqdm.write(f"warning: {job.engine()} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                row = None
        else:
            if model is None:
                model, _ = load_model(args, device, dtype)
            key = job.slots if job.kind in ("ref", "strategy") else None
            # A group holds the reference and each strategy's graph; allow them all without recompiling.
            with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
                row = bench_ours(model, tokenizer, ids, job.new_tokens, job.strategy, job.budget, job.compiled,
                                 bandwidth, job.recompile_steps, job.engine(), job.pair_blocks,
                                 reset=key is None or key != group, full_caches=full_caches,
                                 keep_as_reference=job.kind == "ref", classes=classes,
                                 compile_scope=args.compile_scope, profile_steps=job.profile_steps)
            group = key
        if row is not None:
            rows.append(row)
            tqdm.write(json.dumps(row))
            with partial.open("a") as f:
                f.write(json.dumps(row) + "\n")
    return rows


def run_meta(args: argparse.Namespace, argv: list[str], device: str, bandwidth: float, total_weight_bytes: int,
             started: float) -> dict:
    """What a report says about the run that made it: machine, model, versions, bandwidth, wall time."""
    return {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.machine(),
            "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
            "model": args.random_weights or args.checkpoint_path or "bundled SmolLM2-135M-Instruct",
            "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": args.dtype,
            "read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "weight_bytes": total_weight_bytes, "argv": argv,
            "wall_seconds": round(time.perf_counter() - started), "cpu_bf16_kernels": cpu_bf16_kernels.kernel_status(),
            "transparent_huge_pages": transparent_huge_pages()}


def write_outputs(out_dir: Path, report: dict, table: str) -> None:
    """bench.json (meta, targets, rows), bench.csv (the rows) and bench.md (the tables), each atomically."""
    write_json_atomic(out_dir / "bench.json", report, overwrite=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS, extrasaction="ignore")  # a row's profile: bench.json
    writer.writeheader()
    writer.writerows(report["rows"])
    atomic_write(out_dir / "bench.csv", buffer.getvalue(), overwrite=True)
    atomic_write(out_dir / "bench.md", table + "\n", overwrite=True)


@torch.no_grad()  # not torch.set_grad_enabled(False): tests call the bench in process, and training tests follow
def run_batched(args: argparse.Namespace, argv: list[str] | None, strategies: list[str], device: str,
                dtype: torch.dtype, out_dir: Path) -> list[dict]:
    """--batch_sizes: the batched rows (eval/bench/batched.py), planned (and a cap that holds no row refused)
    before anything is written."""
    check_batch_flags(args)
    if not args.dry_run:
        refuse_existing_report(out_dir, args.overwrite)
    shapes = load_model(args, "meta", dtype)[0] if args.random_weights else None
    model, tokenizer = (None, None) if shapes else load_model(args, device, dtype)
    model_args = (shapes or model).args
    plan = batch_plan(args, strategies, model_args, dtype)
    for job in plan:
        print(f"{job.strategy:<20} budget {job.budget:<5g} batch {job.batch_size:<5} caches "
              f"{job.cache_bytes / 1e9:.4g} GB, context {job.context}, new {job.new_tokens}", flush=True)
    if args.dry_run:
        return []
    check_out_dir(out_dir)
    bandwidth = measure_read_bandwidth(device)
    print(f"read bandwidth: {bandwidth / 1e9:.2f} GB/s", flush=True)
    if model is None:
        model, _ = load_model(args, device, dtype)
    ids = corpus_token_ids(tokenizer, model_args.vocab_size, plan[0].context)
    classes = token_classes(tokenizer, model_args.vocab_size)
    started, rows = time.perf_counter(), []
    scope = None if args.no_compile else args.compile_scope
    for job in plan:
        rows.append(bench_batch(model, tokenizer, ids, job, bandwidth, args.kv_memory_gb, classes, scope))
        print(json.dumps(rows[-1]), flush=True)
    fill_batch_comparisons(rows)
    targets = summarize_batch_targets(rows, args.speedup_budget, args.speedup_strategies)
    table = format_batch_table(rows) + "\n\n" + format_targets(targets)
    print(table)
    meta = run_meta(args, argv, device, bandwidth, weight_bytes(model), started) | {
        "kv_memory_cap_gb": args.kv_memory_gb, "engine": ENGINES[scope is not None], "compile_scope": scope}
    write_outputs(out_dir, {"meta": meta, "targets": targets, "rows": rows}, table)
    return rows
