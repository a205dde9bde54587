"""What generate.py reports: a generation's statistics (its timings, its caches' `cache_statistics`, the debug
twins' attention-loss curve), a batch run's throughput, the stats block it prints and the --stats_json it writes.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from typing import TYPE_CHECKING

from atomic_files import write_json_atomic
from cache import cache_statistics
from model import Transformer
from strategies.debug import attention_loss_curve

if TYPE_CHECKING:
    from generate import GenerationResult


def row_cache_statistics(model: Transformer, row: int | None) -> dict:
    """cache_statistics of the attached caches (of one batch row, in its row context) and the debug twins'
    attention-loss curve."""
    with nullcontext() if row is None else model.cache_row(row):
        stats = cache_statistics(model.caches())
        curve = attention_loss_curve(model.caches())
    if curve:
        stats["attention_loss_cumulative_by_step"] = curve
    return stats


def write_stats_json(args: argparse.Namespace, model: Transformer, payload: dict, cache_spec: list) -> None:
    """--stats_json: the run's statistics, its flags (less the prompts' text), the model's config and the
    cache spec."""
    config = {k: v for k, v in vars(args).items() if k != "prompt"}
    write_json_atomic(args.stats_json, {**payload, "config": config, "model": model.args.to_dict(),
                                        "cache_spec": cache_spec}, overwrite=args.overwrite)


def row_stats(prompt_tokens: int, result: GenerationResult, model: Transformer, row: int | None,
              prefilled_tokens: int | None = None) -> dict:
    """A generation's statistics; `row`: its row of a batch, whose caches are read in its row context, and
    `prefilled_tokens` the batch's prompt tokens, which its prefill time covers."""
    stats = {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(result.tokens),
        "prefill_seconds": round(result.prefill_seconds, 4),
        "prefill_tokens_per_second": round((prefilled_tokens or prompt_tokens) / result.prefill_seconds, 2),
        "decode_tokens_per_second": round(result.decode_steps / result.decode_seconds, 2)
        if result.decode_steps else None,
        "total_seconds": round(result.prefill_seconds + result.decode_seconds, 3),
    }
    return stats | (result.cache_statistics or row_cache_statistics(model, row))


def batches_stats(args: argparse.Namespace, rows: list[dict], batches: list[list[int]],
                  firsts: list[GenerationResult], cache_bytes: int) -> dict:
    """The statistics of main_rows' batches: `rows` each prompt's row_stats, `firsts` each batch's first
    result (whose timings are its batch's), `cache_bytes` the largest batch's caches, every row together."""
    prefill_seconds = sum(r.prefill_seconds for r in firsts)
    decode_seconds = sum(r.decode_seconds for r in firsts)
    decoded = sum(r["generated_tokens"] - 1 for r in rows)  # the first token of a row comes from its prefill
    stats = {
        "batch_size": args.batch_size,
        "batches": batches,  # the prompts' indices decoded together, longest prompts first
        "rows": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "generated_tokens": sum(r["generated_tokens"] for r in rows),
        # Prompt tokens over the batches' prefill time: rows of a batch share forward passes (packed_prefill.py).
        "prefill_tokens_per_second": round(sum(r["prompt_tokens"] for r in rows) / prefill_seconds, 2)
        if prefill_seconds else None,
        # Tokens the rows kept (up to their EOS) over the batches' decode time: the batched throughput.
        "decode_tokens_per_second": round(decoded / decode_seconds, 2) if decode_seconds else None,
        "compile_seconds": round(sum(r.compile_seconds for r in firsts), 2) if args.compile else None,
        "cache_bytes": cache_bytes,
        "compression_ratio": round(sum(r["compression_ratio"] for r in rows) / len(rows), 4),
    }
    if all("attention_loss_mean" in r for r in rows):  # debug_ twins: the rows' means (each over its own steps)
        stats["attention_loss_mean"] = round(sum(r["attention_loss_mean"] for r in rows) / len(rows), 5)
    return stats


def row_summary(row: dict) -> str:
    """One line under a batch row's text: its tokens, compression and (debug_ twins) attention loss."""
    parts = [f"{row['prompt_tokens']} prompt + {row['generated_tokens']} new tokens",
             f"compression {row['compression_ratio']}"]
    if "attention_loss_mean" in row:
        parts.append(f"attention loss {row['attention_loss_mean']}")
    return f"({', '.join(parts)})"


def print_stats_block(stats: dict) -> None:
    keys = ["prompt_tokens", "generated_tokens", "prefill_tokens_per_second", "decode_tokens_per_second",
            "total_seconds", "cache_bytes", "compression_ratio", "attention_loss_mean"]
    print("\n---- statistics ----")
    for key in keys:
        if key in stats:
            print(f"{key:<30} {stats[key]}")
    for key in ("compression_ratio_per_layer", "attention_loss_per_layer", "evictions_per_layer"):
        if key in stats:
            print(f"{key:<30} {' '.join(f'{x:g}' for x in stats[key])}")
