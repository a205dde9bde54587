"""Prefill speed of prompts of different lengths as one batch (packed into one sequence, packed_prefill.py)
against the same prompts one row at a time, on this tool's model and caches.

The bundled model (or `--checkpoint_path`, or `--random_weights` with a real model's shapes, built on
`--device`) prefills `--prompts` pydoc passages (random token ids without a tokenizer) of `--min_tokens`,
`--min_tokens` + `--step_tokens`, ... tokens into caches of one row per prompt (each with the budget its
own length gives): once through generate.prefill_rows packed (rows together where they can share a forward pass:
a GPU's default), once row by row in each row's context (the CPU's default, where the products are
batch-invariant and packing would round a row's products by the batch: generate.shares_prefill). The two alternate for
`--rounds` rounds, the order rotating every round, in one process. Reported: prompt tokens per second of
each (median round), the batch's speed-up, and how far each row's last logits and kept positions are from
its row-by-row prefill (the same within float rounding: a batch's products round differently). With
`--prefill_chunk N` every prompt is prefilled N tokens at a time: the rows' chunks packed pass by pass
against each row's chunks alone. With `--decode_steps K`, a batch's rows are compared with batch-1 runs end to
end: each prompt alone (batch-1 caches) prefilled and decoded K greedy steps, then the batch prefilled as the
tool prefills one (generate.prefill_rows' default: packed on a GPU, rows alone on the CPU) and decoded K steps at
one position per row, fed each row's own tokens; reported: the steps whose greedy token differs, the largest
logit difference, and whether every row and layer holds the positions its batch-1 run holds. Numbers are
reported, never asserted.

    OMP_NUM_THREADS=2 python -m benchmarks.batched_prefill --prompts 8 --min_tokens 128 --dtype bfloat16
    python -m benchmarks.batched_prefill --device cuda --random_weights llama-3.1-8b --dtype bfloat16 --prompts 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomic_files import check_writable, write_json_atomic
from cache_setup import attach_caches, attach_row_caches, cache_config
from checkpoint import add_checkpoint_argument, parse_dtype, resolve_device
from errors import CliParser, UserError, run_cli
from eval.bench.measure import RANDOM_SHAPES, check_model_source, load_model
from eval.harness import kept_positions
from flag_types import count, real
from generate import decode_one_token, prefill, prefill_row, prefill_rows
from model import Transformer
from tokenizer import Tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m benchmarks.batched_prefill", description=__doc__,
                       allow_abbrev=False)
    add_checkpoint_argument(parser)
    parser.add_argument("--random_weights", choices=sorted(RANDOM_SHAPES), default=None,
                        help="random weights with this model's shapes, built on the device (no tokenizer)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    parser.add_argument("--cache_strategy", default="heavy_hitter")
    parser.add_argument("--max_cache_length", type=real(0, 1, low_open=True), default=0.25,
                        help="each row's budget, a fraction of its prompt + --max_new_tokens")
    parser.add_argument("--max_new_tokens", type=count(), default=32, help="the tokens each row's budget plans for")
    parser.add_argument("--prompts", type=count(), default=8, help="rows of the batch")
    parser.add_argument("--min_tokens", type=count(2), default=128, help="the shortest prompt")
    parser.add_argument("--step_tokens", type=count(0), default=16, help="how much longer each next prompt is")
    parser.add_argument("--prefill_chunk", type=count(2), default=None,
                        help="prefill every prompt this many tokens at a time (the rows' chunks packed together)")
    parser.add_argument("--rounds", type=count(), default=3, help="batched and row-by-row runs, alternating")
    parser.add_argument("--decode_steps", type=count(0), default=0,
                        help="then decode this many steps as a batch and each row alone, and compare (0: none)")
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def prompts_of(tokenizer: Tokenizer | None, n: int, shortest: int, step: int, vocab: int,
               device: str) -> list[torch.Tensor]:
    """n pydoc passages (seeded random ids without a tokenizer) of shortest, shortest + step, ... tokens, longest
    first (as generate.py orders a batch)."""
    stride = shortest + step * n
    if tokenizer is None:
        ids = torch.randint(vocab, (stride * n,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        import pydoc_data.topics

        ids = tokenizer.encode(" ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)))
    return [torch.tensor(ids[i * stride : i * stride + shortest + step * i], device=device)
            for i in reversed(range(n))]


def prefilled(model: Transformer, prompts: list[torch.Tensor], together: bool) -> tuple[float, torch.Tensor, list]:
    """Seconds, last logits [rows, vocab] and each row's held positions per layer, after one prefill of every
    row (caches reset first)."""
    with torch.inference_mode():
        model.reset_caches()
        t0 = time.perf_counter()
        if together:
            logits = prefill_rows(model, prompts, pack=True)
        else:
            logits = torch.cat([prefill_row(model, b, p, None) for b, p in enumerate(prompts)])
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        seconds = time.perf_counter() - t0
    kept = [[c.pos[b].tolist() for c in model.caches()] for b in range(len(prompts))]
    return seconds, logits.float(), kept


def held(model: Transformer, b: int) -> list[list[list[int]]]:
    """The positions row b holds per layer and KV head, in order (slots differ between a batch and a row alone)."""
    return [layer.tolist() for layer in kept_positions(model.caches(), b)]


def decode_against_alone(model: Transformer, flags: argparse.Namespace, prompts: list[torch.Tensor], steps: int,
                         max_new_tokens: int, tokenizer: Tokenizer | None) -> dict:
    """`steps` greedy steps of each prompt alone, then of the batch fed the same tokens (see the module's
    docstring): whether a batch's rows are their batch-1 runs."""
    alone_logits, alone_tokens, alone_held = [], [], []
    with torch.inference_mode():
        for p in prompts:
            attach_caches(model, flags, len(p), max_new_tokens, tokenizer)
            logits, row_logits = prefill(model, p[None]), []
            for i in range(steps):
                row_logits.append(logits[0].float())
                logits = decode_one_token(model, logits.argmax(-1, keepdim=True), torch.tensor([len(p) + i]).to(p))
            alone_logits.append(torch.stack(row_logits))
            alone_tokens.append(alone_logits[-1].argmax(-1))
            alone_held.append(held(model, 0))
        alone_logits, tokens = torch.stack(alone_logits), torch.stack(alone_tokens)  # [B, steps, vocab], [B, steps]
        attach_row_caches(model, flags, [len(p) for p in prompts], max_new_tokens, tokenizer)
        logits, batch_logits = prefill_rows(model, prompts), []
        positions = torch.tensor([len(p) for p in prompts]).to(prompts[0])
        for i in range(steps):
            batch_logits.append(logits.float())
            logits = decode_one_token(model, tokens[:, i : i + 1], positions + i)
    batch_logits = torch.stack(batch_logits, dim=1)
    batch_held = [held(model, b) for b in range(len(prompts))]
    return {"steps": steps, "steps_with_another_token": int((batch_logits.argmax(-1) != tokens).sum()),
            "max_logit_difference": float((batch_logits - alone_logits).abs().max()),
            "same_kept_positions": batch_held == alone_held,
            "rows_with_other_kept_positions": sum(b != a for b, a in zip(batch_held, alone_held, strict=True))}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    check_model_source(args)
    if args.decode_steps > args.max_new_tokens:
        raise UserError(f"--decode_steps {args.decode_steps}: at most --max_new_tokens ({args.max_new_tokens}), "
                        "the tokens each row's cache plans for")
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    model, tokenizer = load_model(argparse.Namespace(**vars(args), allow_non_finite_weights=False), device, dtype)
    prompts = prompts_of(tokenizer, args.prompts, args.min_tokens, args.step_tokens, model.args.vocab_size, device)
    longest = args.min_tokens + args.step_tokens * (args.prompts - 1)
    if len(prompts[0]) < longest or longest + args.max_new_tokens > model.args.context_length:
        raise UserError(f"prompts up to {longest} tokens + {args.max_new_tokens} new do not fit the model's context "
                        f"of {model.args.context_length} (or the pydoc text): fewer or shorter prompts")
    flags = cache_config(["--cache_strategy", args.cache_strategy, "--max_cache_length", str(args.max_cache_length),
                          *(["--prefill_chunk", str(args.prefill_chunk)] if args.prefill_chunk else [])])
    attach_row_caches(model, flags, [len(p) for p in prompts], args.max_new_tokens, tokenizer, quiet=True)
    for together in (True, False):  # warm-up, not counted: each row its own prompt, which its cache is sized for
        prefilled(model, prompts, together)
    rounds = []
    for r in range(args.rounds):
        order = [True, False] if r % 2 == 0 else [False, True]
        runs = {together: prefilled(model, prompts, together) for together in order}
        (batched_s, batched, batched_kept), (rows_s, alone, alone_kept) = runs[True], runs[False]
        rounds.append({"batched_s": batched_s, "row_by_row_s": rows_s,
                       "max_logit_difference": float((batched - alone).abs().max()),
                       "same_kept_positions": batched_kept == alone_kept})
        print(f"round {r}: batched {batched_s:.3f} s, row by row {rows_s:.3f} s, logits within "
              f"{rounds[-1]['max_logit_difference']:.2g}, same kept positions {rounds[-1]['same_kept_positions']}",
              flush=True)
    decode = decode_against_alone(model, flags, prompts, args.decode_steps, args.max_new_tokens, tokenizer) \
        if args.decode_steps else None
    if decode:
        print(f"decoded {decode['steps']} steps as a batch and each row alone: {decode['steps_with_another_token']} "
              f"steps of {decode['steps'] * len(prompts)} with another greedy token, logits within "
              f"{decode['max_logit_difference']:.2g}, {decode['rows_with_other_kept_positions']} rows of "
              f"{len(prompts)} holding other positions", flush=True)
    tokens = sum(len(p) for p in prompts)
    report = {"cache_strategy": args.cache_strategy, "max_cache_length": args.max_cache_length,
              "prefill_chunk": args.prefill_chunk, "dtype": args.dtype, "device": device,
              "model": args.random_weights or args.checkpoint_path or "bundled",
              "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
              "threads": torch.get_num_threads(),
              "batched_tok_s": tokens / statistics.median(r["batched_s"] for r in rounds),
              "row_by_row_tok_s": tokens / statistics.median(r["row_by_row_s"] for r in rounds),
              "median_speedup": statistics.median(r["row_by_row_s"] / r["batched_s"] for r in rounds),
              "rounds": rounds, "decode": decode}
    chunked = f", chunks of {args.prefill_chunk}" if args.prefill_chunk else ""
    print(f"{args.cache_strategy} at {args.max_cache_length}{chunked}, {args.dtype} on {device}, {len(prompts)} "
          f"prompts of {min(report['prompt_tokens'])}-{max(report['prompt_tokens'])} tokens: batched "
          f"{report['batched_tok_s']:.0f} tok/s, row by row {report['row_by_row_tok_s']:.0f} tok/s, median speed-up "
          f"{report['median_speedup']:.2f}x")
    if args.out:
        write_json_atomic(args.out, report, overwrite=args.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
