"""Throughput under a memory cap (`--batch_sizes`, `--kv_memory_gb`): for each strategy and budget, the
largest of the batch sizes whose caches fit the cap, decoded as one batch of rows sharing positions.

A compressed cache holds fewer bytes per row, and quantized storage (`--batch_cache_bits`) fewer bytes per
token, so more rows fit the same memory; decode reads the weights
once per step for the whole batch, so tokens per second summed over the rows grow with the batch until
the step stops being bound by reading the weights. The bound: B x bandwidth / (weight bytes + the B rows'
K/V bytes read per step).

A batch's size in bytes is measured, never extrapolated: its caches are built at that batch size on the
`meta` device (the same modules and buffers, without memory) and their buffers counted, bookkeeping
included (positions, masks, scores: cache_bytes, docs/DESIGN.md §6); the caches then decoded are built for
real and counted again. Every row holds the same prefilled prompt: one prompt is prefilled at batch 1
and copied into every row (decode speed does not depend on the tokens, and prefilling B prompts would
cost B times as long as the decode being measured); each row then evicts on its own.

Rows are compiled as the bench's batch-1 rows are (compiled_step.CompiledDecodeStep, prepared for the batch
at one shared position per step, a CUDA graph on a GPU), or eager with --no_compile. Each configuration is
a graph of its own (its caches' shapes), compiled before its prompt and reported apart from its speed.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from cache import cache_statistics
from cache_setup import cache_specs
from cache_spec import LayerCacheSpec, build_caches
from compiled_step import compile_decode_step
from errors import UserError
from eval.batching import attach_row_caches, fill_rows
from eval.bench.measure import (
    FIELDS,
    bandwidth_bound,
    kv_bytes_read,
    peak_device_memory_mb,
    peak_rss_mb,
    synchronize,
    weight_bytes,
)
from eval.bench.plan import cache_args
from generate import decode_one_token, prefill
from model import ModelArgs, Transformer

ENGINES = {False: "ours eager, batched", True: "ours compiled, batched"}  # by whether the rows are compiled
GB = 1e9  # --kv_memory_gb is in 10^9 bytes


@dataclass
class BatchJob:
    strategy: str
    budget: float
    batch_size: int
    cache_bytes: int  # of the caches at this batch size, measured on the meta device
    context: int
    new_tokens: int
    cache_bits: int = 16  # 16: dense storage; 2/4/8: per-token codes


def caches_bytes(specs: list[LayerCacheSpec], model_args: ModelArgs, batch_size: int, capacity: int,
                 dtype: torch.dtype) -> int:
    """Bytes of every buffer of the caches built at `batch_size`, on the meta device (no memory used)."""
    classes = {name: torch.zeros(model_args.vocab_size, dtype=torch.bool) for name in ("special", "punct")}
    caches = build_caches(specs, batch_size, model_args.n_kv_head, model_args.head_dim, capacity, dtype, "meta",
                          classes)
    return sum(c.nbytes() for c in caches)


def check_batch_flags(args: argparse.Namespace) -> None:
    if args.kv_memory_gb is not None and not args.kv_memory_gb > 0:  # NaN and inf fail too
        raise UserError(f"--kv_memory_gb must be a positive number of GB, got {args.kv_memory_gb:g}")
    if args.batch_context < 1:
        raise UserError(f"--batch_context must be ≥ 1, got {args.batch_context}")


def batch_plan(args: argparse.Namespace, strategies: list[str], model_args: ModelArgs,
               dtype: torch.dtype) -> list[BatchJob]:
    """The full cache first, then every strategy at every budget, each on every storage of --batch_cache_bits:
    the largest of --batch_sizes whose caches fit --kv_memory_gb, or (no cap) a row per batch size. A
    configuration with no batch size that fits is a UserError, before anything runs."""
    new = args.new_tokens
    context = args.batch_context
    if context + new > model_args.context_length:
        raise UserError(f"--batch_context {context} plus --new_tokens {new} exceeds the model's context of "
                        f"{model_args.context_length} tokens")
    cap = None if args.kv_memory_gb is None else args.kv_memory_gb * GB
    storages = sorted(set(args.batch_cache_bits), reverse=True)  # dense (16) first: the comparisons' reference
    configs = [("full", 1.0, bits) for bits in storages] + [
        (s, b, bits) for s in strategies for b in sorted(set(args.budgets)) for bits in storages]
    jobs = []
    for strategy, budget, bits in configs:
        specs = cache_specs(cache_args(strategy, budget, bits), model_args, context, new)
        sizes = {b: caches_bytes(specs, model_args, b, context + new, dtype) for b in sorted(set(args.batch_sizes))}
        fitting = [b for b, n in sizes.items() if cap is None or n <= cap]
        if not fitting:
            smallest = min(sizes)
            raise UserError(f"--kv_memory_gb {args.kv_memory_gb:g} holds no batch of {strategy} at budget {budget:g}"
                            f"{'' if bits == 16 else f' in {bits}-bit codes'}: "
                            f"its caches take {sizes[smallest] / GB:.4g} GB at batch {smallest} (context {context} + "
                            f"{new} new tokens); a cap must hold at least one row")
        for b in fitting if cap is None else [max(fitting)]:
            jobs.append(BatchJob(strategy, budget, b, sizes[b], context, new, bits))
    return jobs


def bench_batch(model: Transformer, tokenizer: object, ids: list[int], job: BatchJob, bandwidth: float,
                cap_gb: float | None, classes: dict | None = None, compile_scope: str | None = None) -> dict:
    """One row: the job's caches at its batch size, one prompt prefilled and copied into every row, then
    `new_tokens` greedy steps of all rows at shared positions; the first step is a warm-up, the rest timed
    with one synchronisation at the end. `compile_scope` (block or step) compiles the step, before the
    prompt, on these caches (dynamo's caches reset first: no graph of another configuration is reused)."""
    device = model.tok_embeddings.weight.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    specs = cache_specs(cache_args(job.strategy, job.budget, job.cache_bits), model.args, len(ids), job.new_tokens)
    caches, single = attach_row_caches(model, specs, len(ids) + job.new_tokens, job.batch_size, tokenizer, classes)
    step, compile_seconds = decode_one_token, None
    if compile_scope is not None:
        torch._dynamo.reset()
        step = compile_decode_step(scope=compile_scope)
        step.prepare(model, job.batch_size)  # on the B-row caches, attached last; they are reset afterwards
        compile_seconds = round(step.compile_seconds, 1)
    model.setup_caches(single)
    model.reset_caches()
    with torch.inference_mode():
        synchronize(device)
        t0 = time.perf_counter()
        logits = prefill(model, torch.tensor([ids], device=device))
        synchronize(device)
        prefill_s = time.perf_counter() - t0
        model.setup_caches(caches)
        fill_rows(caches, single)
        del single
        token = logits.argmax(dim=-1, keepdim=True).expand(job.batch_size, 1).contiguous()
        pos = torch.tensor([len(ids)], device=device)
        token = step(model, token, pos).argmax(dim=-1, keepdim=True)  # warm-up
        steps = job.new_tokens - 1
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            pos = pos + 1
            token = step(model, token, pos).argmax(dim=-1, keepdim=True)
        synchronize(device)
        seconds = time.perf_counter() - t0
    stats = cache_statistics(caches)
    if stats["cache_bytes"] != job.cache_bytes:  # the meta build and the real one are the same modules
        raise RuntimeError(f"{job.strategy}: {stats['cache_bytes']} cache bytes built, {job.cache_bytes} planned")
    kv = kv_bytes_read(caches)
    bound = bandwidth_bound(bandwidth, weight_bytes(model), kv, job.batch_size)
    tok_s = job.batch_size * steps / seconds
    row = dict.fromkeys(FIELDS)
    row.update({"engine": ENGINES[compile_scope is not None], "strategy": job.strategy, "budget": job.budget,
                "context": len(ids), "new_tokens": job.new_tokens, "batch_size": job.batch_size,
                "kv_memory_cap_gb": cap_gb, "cache_slots": max(s.max_cache_length for s in specs),
                "prefill_tokens_per_second": round(len(ids) / prefill_s, 1),
                "decode_tokens_per_second": round(tok_s, 2), "ms_per_step": round(1000 * seconds / steps, 3),
                "median_ms_per_step": round(1000 * seconds / steps, 3),
                "compression_ratio": stats["compression_ratio"], "cache_bytes": stats["cache_bytes"],
                "kv_bytes_read_per_step": kv, "bound_tokens_per_second": round(bound, 1),
                "fraction_of_bound": round(tok_s / bound, 3), "compile_seconds": compile_seconds,
                "peak_rss_mb": peak_rss_mb(), "peak_device_memory_mb": peak_device_memory_mb(device),
                "cache_bits": job.cache_bits})
    model.remove_caches()
    return row


def fill_batch_comparisons(rows: list[dict]) -> None:
    """Each batched row's throughput over the dense full cache's under the same cap (with no cap: at the same
    batch size), measured and as the bound predicts it."""
    def dense_full(r: dict) -> bool:
        return r["strategy"] == "full" and r.get("cache_bits") in (None, 16)  # rows from before the field: dense

    for r in rows:
        if r["engine"] not in ENGINES.values() or dense_full(r):
            continue
        full = next((f for f in rows if f["engine"] == r["engine"] and dense_full(f)
                     and f["context"] == r["context"] and f["new_tokens"] == r["new_tokens"]
                     and (r["kv_memory_cap_gb"] is not None or f["batch_size"] == r["batch_size"])), None)
        if full is not None:
            r["speedup_vs_full"] = round(r["decode_tokens_per_second"] / full["decode_tokens_per_second"], 3)
            r["bound_speedup_vs_full"] = round(r["bound_tokens_per_second"] / full["bound_tokens_per_second"], 3)


def format_batch_table(rows: list[dict]) -> str:
    cols = ["strategy", "budget", "cache_bits", "context", "batch_size", "cache_bytes", "decode_tokens_per_second",
            "bound_tokens_per_second", "fraction_of_bound", "speedup_vs_full", "bound_speedup_vs_full",
            "median_ms_per_step", "compile_seconds", "peak_rss_mb", "peak_device_memory_mb"]
    short = {"batch_size": "batch", "cache_bits": "bits", "decode_tokens_per_second": "decode tok/s (all rows)",
             "bound_tokens_per_second": "bound tok/s", "fraction_of_bound": "of bound",
             "speedup_vs_full": "× full at cap", "bound_speedup_vs_full": "bound × full",
             "median_ms_per_step": "ms/step", "compile_seconds": "compile s", "peak_rss_mb": "peak RSS MB",
             "peak_device_memory_mb": "peak GPU MB"}
    lines = ["| " + " | ".join(short.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)
