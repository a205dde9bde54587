"""Each strategy at several budgets on a ~1k-token pydoc prompt: decode tok/s (compiled), measured
compression ratio, and the debug_ attention loss (eager). One process, one model load.

    python -m benchmarks.strategy_report --budgets 0.5 0.25 0.1 --out results/strategy_report.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from atomic_files import check_writable, write_json_atomic
from cache import cache_statistics
from cache_setup import attach_caches, cache_config, cache_specs
from cache_spec import LayerCacheSpec
from checkpoint import add_model_arguments, load_checkpoint, parse_dtype, resolve_device
from compiled_step import compile_decode_step
from errors import CliParser, UserError, run_cli
from eval.data import pydoc_corpus
from flag_types import POSITIVE, count
from generate import decode_one_token, generate
from strategies import CACHE_STRATEGIES, get_strategy
from strategies.debug import attention_loss_curve


def pydoc_prompt(tokenizer, n_tokens: int) -> list[int]:
    text = pydoc_corpus()
    return tokenizer.encode(text)[:n_tokens]


def strategy_config(strategy: str, budget: float) -> argparse.Namespace:
    return cache_config(cache_strategy=[strategy], max_cache_length=[float(budget)])


def attach(model, tokenizer, ids: list[int], strategy: str, budget: float, new: int) -> list[LayerCacheSpec]:
    """The caches generate.py would give this strategy, budget and sequence (sliding layers included)."""
    return attach_caches(model, strategy_config(strategy, budget), len(ids), new, tokenizer)


def run(model, tokenizer, ids, strategy: str, budget: float, new: int, compiled: bool) -> dict:
    attach(model, tokenizer, ids, strategy, budget, new)
    torch._dynamo.reset()
    step = compile_decode_step() if compiled else decode_one_token
    if compiled:  # warm up (cold compile) on a throwaway run
        generate(model, ids, 3, [], step)
    result = generate(model, ids, new, [], step)
    stats = cache_statistics(model.caches())
    return {"strategy": strategy, "budget": budget, "compiled": compiled,
            "decode_tokens_per_second": round(result.decode_steps / result.decode_seconds, 2),
            "compression_ratio": stats["compression_ratio"], "cache_bytes": stats["cache_bytes"],
            "attention_loss_mean": stats.get("attention_loss_mean"),
            "attention_loss_curve": attention_loss_curve(model.caches()) or None}


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m benchmarks.strategy_report", description=__doc__,
                  allow_abbrev=False)
    p.add_argument("--budgets", nargs="+", type=POSITIVE, default=[0.5, 0.25, 0.1],
                   help="fractions of prompt + new tokens (<= 1) or token counts (> 1)")
    p.add_argument("--strategies", nargs="+", default=[s for s in CACHE_STRATEGIES if s != "full"])
    p.add_argument("--prompt_tokens", type=count(2), default=1024)
    p.add_argument("--max_new_tokens", type=count(2), default=128)
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--out", default="results/strategy_report.json")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    add_model_arguments(p, compile_flag=False, batch_flag=False)
    p.set_defaults(dtype="float32")  # on a GPU too: the report compares numbers, not a deployment
    return p


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    for strategy in a.strategies:  # every name checked before anything loads
        get_strategy(strategy)
        if strategy.startswith("debug_"):
            raise UserError(f"--strategies {strategy}: name the strategy; its debug_ twin runs for the attention loss")
    check_writable(a.out, a.overwrite, "--out")
    device = resolve_device(a.device)
    model, tokenizer = load_checkpoint(a.checkpoint_path, device, parse_dtype(a.dtype, device),
                                       allow_non_finite=a.allow_non_finite_weights)
    ids = pydoc_prompt(tokenizer, a.prompt_tokens)
    if len(ids) + a.max_new_tokens > model.args.context_length:
        raise UserError(f"--prompt_tokens {len(ids)} + --max_new_tokens {a.max_new_tokens} exceed the model's context "
                        f"of {model.args.context_length}")
    t0 = time.time()
    compiled = not a.no_compile
    runs = [("full", 1.0)] + [(s, b) for s in a.strategies for b in a.budgets]
    for strategy, budget in runs:  # a budget too small for a strategy's protected tokens stops before any run
        cache_specs(strategy_config(strategy, budget), model.args, len(ids), a.max_new_tokens)
    rows = []
    for strategy, budget in tqdm(runs, desc="strategy_report", unit="run"):
        row = run(model, tokenizer, ids, strategy, budget, a.max_new_tokens, compiled)
        if strategy != "full":
            debug = run(model, tokenizer, ids, f"debug_{strategy}", budget, a.max_new_tokens, False)
            row["attention_loss_mean"] = debug["attention_loss_mean"]
            row["attention_loss_curve"] = debug["attention_loss_curve"]
        rows.append(row)
        tqdm.write(json.dumps(row))
    report = {"rows": rows, "seconds": round(time.time() - t0, 1), "dtype": a.dtype, "prompt_tokens": len(ids),
              "max_new_tokens": a.max_new_tokens}
    write_json_atomic(a.out, report, overwrite=a.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
