"""Fidelity of `gated` against other strategies under teacher forcing on held-out pydoc text.

    python -m benchmarks.gated_fidelity --out results/gated_fidelity.json
    python -m benchmarks.gated_fidelity --strategies gated recent_global --budgets 0.1 --windows 1

Held-out text: the pydoc topics train_gates.py never trains on. Per window of --seq_len tokens, the first
--prefill_tokens are prefilled (compressed by each strategy's own prompt compressor when they exceed the
budget), then every later token is fed one at a time through generate.decode_one_token, and each step's
next-token distribution is compared with the full model's on the same prefix: KL(full ‖ compressed), top-1
agreement, and perplexity (compressed vs full). The reference is one cache-less forward over the window
(the full cache's decode gives the same logits to ~1e-5). Budgets are fractions of the window (or tokens).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from atomic_files import write_json_atomic
from cache_setup import attach_caches, cache_config
from checkpoint import add_model_arguments, load_checkpoint, parse_dtype, resolve_device
from errors import CliParser, UserError, run_cli
from flag_types import POSITIVE, THREADS, count
from generate import decode_one_token, prefill
from train_gates import pydoc_split


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="gated_fidelity.py", description=__doc__)
    p.add_argument("--strategies", nargs="+", default=["gated", "heavy_hitter", "l2", "recent_global"])
    p.add_argument("--budgets", nargs="+", type=POSITIVE, default=[0.1, 0.25],
                   help="fractions of the window (≤ 1) or tokens (> 1)")
    p.add_argument("--seq_len", type=count(2), default=1024, help="tokens per window (prefilled + scored)")
    p.add_argument("--prefill_tokens", type=count(), default=128, help="tokens prefilled (fewer than --seq_len)")
    p.add_argument("--windows", type=count(), default=1, help="consecutive windows of held-out text")
    p.add_argument("--gates_path", default=None, help="gates file for `gated` (default: the shipped one)")
    p.add_argument("--threads", type=THREADS, default=None, help="torch threads (0: torch's choice)")
    p.add_argument("--out", default=None, help="write the results as JSON")
    p.add_argument("--overwrite", action="store_true")
    add_model_arguments(p, compile_flag=False, batch_flag=False)
    return p


def cache_args(strategy: str, budget: float, gates_path: str | None) -> argparse.Namespace:
    gates = {"gates_path": gates_path} if gates_path else {}
    return cache_config(cache_strategy=[strategy], max_cache_length=[float(budget)], **gates)


def teacher_force(model, ids: torch.Tensor, n_prompt: int, ref_logp: torch.Tensor) -> dict[str, list[float]]:
    """Per scored position: KL(full ‖ compressed), top-1 agreement, NLL of the true next token (both)."""
    out: dict[str, list[float]] = {"kl": [], "agree": [], "nll": [], "nll_full": []}
    n = ids.shape[1]
    model.reset_caches()
    with torch.inference_mode():
        logits = prefill(model, ids[:, :n_prompt])
        for pos in range(n_prompt, n):
            logp, ref = F.log_softmax(logits[0].float(), dim=-1), ref_logp[pos - 1]
            out["kl"].append(float((ref.exp() * (ref - logp)).sum()))
            out["agree"].append(float(logp.argmax() == ref.argmax()))
            out["nll"].append(float(-logp[ids[0, pos]]))
            out["nll_full"].append(float(-ref[ids[0, pos]]))
            if pos < n - 1:
                logits = decode_one_token(model, ids[:, pos : pos + 1], torch.tensor([pos], device=ids.device))
    return out


def summarize(trace: dict[str, list[float]]) -> dict[str, float]:
    mean = lambda xs: sum(xs) / len(xs)
    ppl, ppl_full = math.exp(mean(trace["nll"])), math.exp(mean(trace["nll_full"]))
    return {"kl_mean": round(mean(trace["kl"]), 5), "top1_agreement": round(mean(trace["agree"]), 4),
            "perplexity": round(ppl, 3), "perplexity_full": round(ppl_full, 3),
            "perplexity_delta": round(ppl - ppl_full, 3), "positions": len(trace["kl"])}


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.prefill_tokens >= args.seq_len:
        raise UserError(f"--prefill_tokens {args.prefill_tokens} leaves no token of the --seq_len {args.seq_len} "
                        "window to score")
    if args.gates_path and "gated" not in args.strategies:
        raise UserError("--gates_path would be ignored: it applies to the gated strategy, not in --strategies")
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise UserError(f"{args.out} exists; pass --overwrite to replace it")
    if args.threads:  # 0: torch's own choice
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model, tokenizer = load_checkpoint(args.checkpoint_path, device, parse_dtype(args.dtype, device),
                                       allow_non_finite=args.allow_non_finite_weights)
    text_ids = tokenizer.encode(pydoc_split(held_out=True))
    windows = [text_ids[i * args.seq_len : (i + 1) * args.seq_len] for i in range(args.windows)]
    windows = [torch.tensor([w], device=device) for w in windows if len(w) == args.seq_len]
    print(f"held-out pydoc: {len(text_ids)} tokens; {len(windows)} window(s) of {args.seq_len}", flush=True)

    traces: dict[tuple[str, float], dict[str, list[float]]] = {}
    for ids in windows:
        model.remove_caches()
        with torch.inference_mode():
            ref_logp = F.log_softmax(model(ids, torch.arange(args.seq_len, device=device))[0].float(), dim=-1)
        for budget in args.budgets:
            for strategy in args.strategies:
                t0 = time.perf_counter()
                specs = attach_caches(model, cache_args(strategy, budget, args.gates_path), args.prefill_tokens,
                                      args.seq_len - args.prefill_tokens, tokenizer)
                trace = teacher_force(model, ids, args.prefill_tokens, ref_logp)
                for key, values in trace.items():
                    traces.setdefault((strategy, budget), {}).setdefault(key, []).extend(values)
                s = summarize(trace)
                print(f"{strategy:<14} budget {budget:g} ({specs[0].max_cache_length} tokens): KL {s['kl_mean']:.4f} "
                      f"top-1 {s['top1_agreement']:.3f} ΔPPL {s['perplexity_delta']:+.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)

    rows = [{"strategy": s, "budget": b, **summarize(t)} for (s, b), t in traces.items()]
    print("\n| budget | strategy | KL(full ‖ ·) | top-1 agreement | PPL | ΔPPL |")
    print("|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["budget"], r["kl_mean"])):
        print(f"| {r['budget']:g} | {r['strategy']} | {r['kl_mean']:.4f} | {r['top1_agreement']:.3f} | "
              f"{r['perplexity']:.2f} | {r['perplexity_delta']:+.2f} |")
    if args.out:
        config = {k: v for k, v in vars(args).items() if k not in ("out", "overwrite")}
        write_json_atomic(args.out, {"config": config, "held_out_tokens": len(text_ids), "rows": rows},
                          overwrite=args.overwrite)
    return rows


if __name__ == "__main__":
    run_cli(main)
