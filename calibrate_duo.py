"""Calibrate DuoAttention's head roles (`duo_attention`, strategies/duo_attention.py) on a CPU, offline.

    python calibrate_duo.py      # the bundled model -> duo/SmolLM2-135M-Instruct.json
    python calibrate_duo.py --windows 1 --seq_len 128 --out /tmp/duo.json   # a smoke run

For every (layer, KV head) it measures what a streaming head would lose: text is fed through the model
one token at a time under `debug_recent_global` with a budget of --global_tokens + --recent_window (the
full cache decodes; a StreamingLLM shadow of sinks + window is measured, docs/DESIGN.md §6), and a head's
score is its mean attention loss, 1 − the mass its queries give the sinks and the window. The heads that
lose most are DuoAttention's retrieval heads (the cache keeps the --duo_retrieval_fraction highest).

The paper (arXiv 2410.10819) learns a gate per head instead, by optimising the output under mixed
full/streaming attention on synthetic passkey retrieval; this is the attention-profiling form it
compares with (see the strategy's docstring). Data: --windows evenly spaced --seq_len windows of the
training split of train_gates.py (CPython's documentation), so benchmarks on its held-out split stay
unseen. The result is deterministic for the same arguments and thread count; it is written atomically
and never replaced without --overwrite.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from atomic_files import write_json_atomic
from cache import cache_statistics
from cache_setup import attach_caches, cache_config
from checkpoint import add_checkpoint_argument
from errors import CliParser, UserError, run_cli
from flag_types import THREADS, count
from generate import decode_one_token, prefill
from model import Transformer
from strategies.duo_attention import DUO_DIR
from train_gates import start_calibration


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="calibrate_duo.py", description=__doc__)
    add_checkpoint_argument(p)
    p.add_argument("--out", default=None, help="output file (default: duo/<checkpoint name>.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--windows", type=count(), default=4, help="text windows measured")
    p.add_argument("--seq_len", type=count(2), default=512, help="tokens per window")
    p.add_argument("--global_tokens", type=count(0), default=4, help="sinks of the streaming pattern measured")
    p.add_argument("--recent_window", type=count(1), default=64, help="window of the streaming pattern measured")
    p.add_argument("--threads", type=THREADS, default=1, help="torch threads (1: reproducible; 0: torch's choice)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """What the flags' own ranges (flag_types) cannot say: how they relate."""
    if args.seq_len <= args.global_tokens + args.recent_window:
        raise UserError(f"--seq_len {args.seq_len} must exceed --global_tokens + --recent_window: the pattern "
                        "must evict for a loss to show")


def check_windows(model: Transformer, seq_len: int) -> None:
    """Every layer must be measured, so no sliding window may be shorter than a window of text: a sliding layer
    then keeps its own window (model_policies.py), not the pattern, and would have no score, which would shift
    the file's rows against the layers."""
    windows = [w for i in range(model.args.n_layer) if (w := model.args.layer_window(i))]
    if windows and seq_len > min(windows):
        raise UserError(f"--seq_len {seq_len} is longer than the model's sliding window of {min(windows)} tokens: its "
                        f"sliding layers would keep their window, not the pattern measured; use --seq_len ≤ "
                        f"{min(windows)}")


def window_losses(model, ids: torch.Tensor, args: argparse.Namespace) -> list[list[float]]:
    """Mean attention loss per layer and KV head of the streaming pattern over one window [1, T]."""
    budget = args.global_tokens + args.recent_window
    config = cache_config(["--cache_strategy", "debug_recent_global", "--max_cache_length", str(budget),
                           "--global_tokens", str(args.global_tokens)])
    T = ids.shape[1]
    attach_caches(model, config, budget, T - budget)
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :budget])  # the prompt fits the pattern: the loss comes from decode steps only
        for p in range(budget, T):
            decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]))
    caches = [layer.attention.kv_cache for layer in model.layers]
    return cache_statistics(caches)["attention_loss_per_head"]


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    check_args(args)
    t0 = time.perf_counter()
    out, name, model, chosen, windows = start_calibration(args, DUO_DIR)
    check_windows(model, args.seq_len)
    per_window = [window_losses(model, window, args)
                  for window in tqdm(windows, desc="calibrate duo", unit="window", mininterval=5)]
    scores = [[round(sum(w[layer][h] for w in per_window) / len(per_window), 5)
               for h in range(len(per_window[0][layer]))] for layer in range(len(per_window[0]))]
    payload = {
        "model": name, "n_layer": model.args.n_layer, "n_kv_head": model.args.n_kv_head,
        "head_dim": model.args.head_dim,
        "measure": "mean attention loss of sinks + window (debug_recent_global), per layer and KV head",
        "global_tokens": args.global_tokens, "recent_window": args.recent_window,
        "windows": chosen, "seq_len": args.seq_len, "scores": scores,
    }
    write_json_atomic(out, payload, args.overwrite)
    print(f"wrote {out} ({len(scores)} layers × {len(scores[0])} KV heads, {time.perf_counter() - t0:.0f}s)")
    return out


if __name__ == "__main__":
    run_cli(main)
