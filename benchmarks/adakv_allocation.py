"""Uniform vs head-adaptive budgets (--budget_allocation adakv) on the bundled model: after a ~1k-token
pydoc prefill, each layer's per-head quotas, the cache bytes (K/V apart), the attention mass the
compressed caches keep (debug_ twins: 1 − attention loss over the next steps), and eager decode speed.
One process, one model load; numbers are reported, never asserted.

    python -m benchmarks.adakv_allocation --strategy heavy_hitter --budget 0.25 --out results/adakv.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from atomic_files import check_writable, write_json_atomic
from cache import cache_statistics
from cache_setup import attach_caches, cache_config
from checkpoint import load_checkpoint
from errors import CliParser, run_cli
from eval.data import pydoc_corpus
from flag_types import POSITIVE, count
from generate import decode_one_token, prefill


def run(model, tokenizer, ids: list[int], strategy: str, budget: float, allocation: str, steps: int) -> dict:
    """Prefill all but the last `steps` tokens, then teacher-force those: statistics after prefill, after the
    steps, and the seconds the steps took."""
    config = cache_config(cache_strategy=[strategy], max_cache_length=[float(budget)], budget_allocation=allocation)
    prompt, rest = torch.tensor([ids[:-steps]]), ids[-steps:]
    attach_caches(model, config, prompt.shape[1], steps, tokenizer)
    model.reset_caches()
    with torch.inference_mode():
        prefill(model, prompt)
        after_prefill = cache_statistics(model.caches())  # the allocation
        t0 = time.perf_counter()
        for i, token in enumerate(rest):  # the same tokens whatever the cache holds
            decode_one_token(model, torch.tensor([[token]]), torch.tensor([prompt.shape[1] + i]))
        seconds = time.perf_counter() - t0
    return {"prefill": after_prefill, "end": cache_statistics(model.caches()), "seconds": seconds}


def measure(model, tokenizer, ids: list[int], strategy: str, budget: float, allocation: str, steps: int) -> dict:
    out = run(model, tokenizer, ids, strategy, budget, allocation, steps)
    stats, quotas = out["prefill"], out["prefill"]["cache_budget_per_head"]
    # The debug_ twin: 1 − attention loss is the attention mass the compressed cache holds, per step.
    loss = run(model, tokenizer, ids, f"debug_{strategy}", budget, allocation, steps)["end"]["attention_loss_mean"]
    return {"allocation": allocation, "budget_per_layer": stats["cache_budget_per_layer"][0],
            "budget_per_head": quotas, "cache_bytes": stats["cache_bytes"], "cache_kv_bytes": stats["cache_kv_bytes"],
            "min_head": min(min(q) for q in quotas), "max_head": max(max(q) for q in quotas),
            "decode_ms_per_step": round(1000 * out["seconds"] / steps, 1), "attention_mass_kept": round(1 - loss, 5)}


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m benchmarks.adakv_allocation", description=__doc__,
                       allow_abbrev=False)
    parser.add_argument("--strategy", default="heavy_hitter", help="a head-specific strategy (adakv pools its heads)")
    parser.add_argument("--budget", type=POSITIVE, default=0.25, help="a fraction of the sequence (≤ 1) or tokens")
    parser.add_argument("--prompt_tokens", type=count(), default=1024)
    parser.add_argument("--steps", type=count(), default=32, help="teacher-forced decode steps after the prompt")
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    for allocation in ("uniform", "adakv"):  # the strategy and budget checked for both runs before the model loads
        cache_config(cache_strategy=[args.strategy], max_cache_length=[float(args.budget)],
                     budget_allocation=allocation)
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    torch.manual_seed(0)
    model, tokenizer = load_checkpoint(None, "cpu", torch.float32)
    ids = tokenizer.encode(pydoc_corpus())[: args.prompt_tokens + args.steps]
    report = {"strategy": args.strategy, "budget": args.budget, "prompt_tokens": args.prompt_tokens,
              "steps": args.steps, "torch_threads": torch.get_num_threads(), "runs": []}
    for allocation in ("uniform", "adakv"):
        row = measure(model, tokenizer, ids, args.strategy, args.budget, allocation, args.steps)
        report["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "budget_per_head"}))
        if allocation == "adakv":
            for layer, quota in enumerate(row["budget_per_head"]):
                print(f"layer {layer:2d}: {' '.join(f'{q:4.0f}' for q in quota)}")
    if args.out:
        write_json_atomic(args.out, report, overwrite=args.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
