"""Decode speed side by side, in one process, same model, dtype and prompt for every row:
Hugging Face `generate` (default dynamic cache, when transformers is installed), ours eager, ours
compiled with the full cache, and ours compiled with each strategy at each budget; at each context.

Decode of one sequence is memory-bound: each step reads every weight and the cached K/V once. The
machine's read bandwidth is measured in the same run, and each row is compared with the bound it
implies: bandwidth / (weight bytes + K/V bytes read per step).

    python -m eval.bench                 # contexts 512 2048 4096, 64 new tokens, bf16
    python -m eval.bench --quick         # about a minute: one short context, eager rows
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import resource
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from cache import CACHE_STRATEGIES, cache_statistics
from cache_spec import add_cache_arguments, resolve_cache_spec
from checkpoint import bundled_checkpoint_path, load_checkpoint, parse_dtype
from errors import CliParser, UserError, run_cli
from eval.data import pydoc_corpus
from generate import compile_decode_step, decode_one_token, generate, setup_caches, write_json_atomic

FIELDS = ["engine", "strategy", "budget", "context", "new_tokens", "prefill_tokens_per_second",
          "decode_tokens_per_second", "ms_per_step", "compression_ratio", "cache_bytes", "kv_bytes_read_per_step",
          "bound_tokens_per_second", "fraction_of_bound", "recompilations", "compile_seconds", "peak_rss_mb"]


def measure_read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum over a buffer much larger than the caches), best of n."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (tied embeddings counted once): what one decode step reads."""
    seen = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def kv_bytes_read(caches: list) -> int:
    """Bytes of K/V storage attention reads per step (codes + scales when quantized), all layers."""
    total = 0
    for c in caches:
        for name, buf in c.named_buffers():
            if name.split(".")[-1] in ("k_cache", "v_cache", "k_codes", "v_codes", "k_scale", "v_scale",
                                       "k_zero", "v_zero"):
                total += buf.numel() * buf.element_size()
    return total


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def cache_args(strategy: str, budget: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(["--cache_strategy", strategy, "--max_cache_length", str(budget)])


def bench_ours(model, tokenizer, ids: list[int], new: int, strategy: str, budget: float, compiled: bool,  # noqa: ANN001
               bandwidth: float) -> dict:
    specs = resolve_cache_spec(cache_args(strategy, budget), model.args.n_layer, len(ids), new)
    setup_caches(model, specs, len(ids) + new, tokenizer)
    compile_seconds = None
    step = decode_one_token
    if compiled:
        torch._dynamo.reset()
        step = compile_decode_step()
        t = time.perf_counter()
        generate(model, ids, 3, [], step)  # cold compile on a throwaway run
        compile_seconds = round(time.perf_counter() - t, 1)
    graphs_before = counters["stats"]["unique_graphs"]
    result = generate(model, ids, new, [], step)
    stats = cache_statistics(model.caches())
    kv = kv_bytes_read(model.caches())
    bound = bandwidth / (weight_bytes(model) + kv)
    tok_s = result.decode_steps / result.decode_seconds
    return {"engine": "ours compiled" if compiled else "ours eager", "strategy": strategy, "budget": budget,
            "context": len(ids), "new_tokens": new,
            "prefill_tokens_per_second": round(len(ids) / result.prefill_seconds, 1),
            "decode_tokens_per_second": round(tok_s, 2), "ms_per_step": round(1000 / tok_s, 2),
            "compression_ratio": stats["compression_ratio"], "cache_bytes": stats["cache_bytes"],
            "kv_bytes_read_per_step": kv, "bound_tokens_per_second": round(bound, 1),
            "fraction_of_bound": round(tok_s / bound, 3),
            "recompilations": counters["stats"]["unique_graphs"] - graphs_before if compiled else None,
            "compile_seconds": compile_seconds, "peak_rss_mb": peak_rss_mb()}


def bench_hf(ids: list[int], new: int, dtype: torch.dtype, bandwidth: float) -> dict | None:
    """transformers' generate with its default cache on the same GGUF; None when transformers is absent."""
    try:
        import transformers
    except ImportError:
        return None
    path = bundled_checkpoint_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    x = torch.tensor([ids])
    with torch.inference_mode():
        t = time.perf_counter()
        model(x)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t
    decode = max(total - prefill, 1e-9)
    tok_s = (new - 1) / decode
    a = model.config
    kv = 2 * a.num_hidden_layers * a.num_key_value_heads * (a.hidden_size // a.num_attention_heads) * (
        len(ids) + new // 2) * torch.empty((), dtype=dtype).element_size()  # K/V read per step, on average
    bound = bandwidth / (weight_bytes(model) + kv)
    del model
    return {"engine": "hf generate", "strategy": "full (DynamicCache)", "budget": 1.0, "context": len(ids),
            "new_tokens": new, "prefill_tokens_per_second": round(len(ids) / prefill, 1),
            "decode_tokens_per_second": round(tok_s, 2), "ms_per_step": round(1000 / tok_s, 2),
            "compression_ratio": 0.0, "cache_bytes": None, "kv_bytes_read_per_step": kv,
            "bound_tokens_per_second": round(bound, 1), "fraction_of_bound": round(tok_s / bound, 3),
            "recompilations": None, "compile_seconds": None, "peak_rss_mb": peak_rss_mb()}


def format_table(rows: list[dict]) -> str:
    cols = ["engine", "strategy", "budget", "context", "prefill_tokens_per_second", "decode_tokens_per_second",
            "ms_per_step", "compression_ratio", "fraction_of_bound", "recompilations", "peak_rss_mb"]
    short = {"prefill_tokens_per_second": "prefill tok/s", "decode_tokens_per_second": "decode tok/s",
             "compression_ratio": "compression", "fraction_of_bound": "of bound", "peak_rss_mb": "peak RSS MB",
             "recompilations": "recompiles"}
    lines = ["| " + " | ".join(short.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def build_parser() -> CliParser:
    p = CliParser(prog="python -m eval.bench", description=__doc__.split("\n")[0])
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 4096])
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--strategies", nargs="+", default=None, help="default: every registered strategy")
    p.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.25, 0.5])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no_compile", action="store_true", help="eager rows only")
    p.add_argument("--no_hf", action="store_true", help="skip the Hugging Face row")
    p.add_argument("--quick", action="store_true", help="~1 minute: context 256, 16 tokens, eager, 2 strategies")
    p.add_argument("--out_dir", default="results/bench")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bench.json/csv in --out_dir")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.contexts, args.new_tokens, args.no_compile = [256], 16, True
        args.strategies, args.budgets = args.strategies or ["recent_global", "heavy_hitter"], [0.25]
    strategies = args.strategies or [s for s in CACHE_STRATEGIES if s != "full"]
    for s in strategies:
        if s not in CACHE_STRATEGIES:
            raise UserError(f"unknown strategy {s!r}; available: {', '.join(CACHE_STRATEGIES)}")
    dtype = parse_dtype(args.dtype)
    out_dir = Path(args.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out_dir}: {e.strerror}") from None
    if (out_dir / "bench.json").exists() and not args.overwrite:
        raise UserError(f"{out_dir / 'bench.json'} exists; pass --overwrite or another --out_dir")
    torch.set_grad_enabled(False)
    bandwidth = measure_read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.2f} GB/s", flush=True)
    model, tokenizer = load_checkpoint(None, "cpu", dtype)
    corpus = pydoc_corpus()
    corpus_ids = tokenizer.encode(corpus[: 40 * max(args.contexts)])
    rows: list[dict] = []
    from tqdm import tqdm

    plan = []
    for context in args.contexts:
        plan.append(("hf", context, "full", 1.0, False))
        plan.append(("ours", context, "full", 1.0, False))
        if not args.no_compile:
            plan.append(("ours", context, "full", 1.0, True))
        for s in strategies:
            for b in args.budgets:
                plan.append(("ours", context, s, b, not args.no_compile))
    for engine, context, strategy, budget, compiled in tqdm(plan, desc="bench"):
        ids = corpus_ids[:context]
        if engine == "hf":
            row = None if args.no_hf else bench_hf(ids, args.new_tokens, dtype, bandwidth)
        else:
            row = bench_ours(model, tokenizer, ids, args.new_tokens, strategy, budget, compiled, bandwidth)
        if row is not None:
            rows.append(row)
            tqdm.write(json.dumps(row))
    table = format_table(rows)
    print(table)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "dtype": args.dtype, "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "weight_bytes": weight_bytes(model), "argv": argv}
    write_json_atomic(out_dir / "bench.json", {"meta": meta, "rows": rows}, overwrite=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    tmp = out_dir / ".bench.csv.tmp"
    tmp.write_text(buffer.getvalue())
    tmp.replace(out_dir / "bench.csv")
    (out_dir / "bench.md").write_text(table + "\n")
    return rows


if __name__ == "__main__":
    run_cli(main)
