"""Stream past the model's context with re-rotated positions (StreamingLLM, arXiv 2309.17453 §3.2).

    OMP_NUM_THREADS=1 python -m benchmarks.streaming_past_context --out results/streaming.json
    python -m benchmarks.streaming_past_context --tokens 4096 --budget 512 --global_tokens 4 0

Teacher-forces `--tokens` of CPython's pydoc text (default 2× the bundled SmolLM2's 8192-token context)
through a `recent_global` cache of `--budget` tokens with `--rerotate_positions`, once per value of
`--global_tokens` (4 attention sinks, and 0: a plain sliding window). The first `--budget` tokens are
one prefill (nothing evicted yet; its logits score them), every later token goes one at a time through
the decode path. Reported: perplexity per `--segment` tokens. Where the sequence fits the context, the
full-attention perplexity of the same tokens (one cache-less forward over the first context-length
tokens) is the reference; past the context there is none, which is the point.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from atomic_files import write_json_atomic
from cache_setup import attach_caches, cache_config
from checkpoint import add_model_arguments, load_checkpoint, parse_dtype, resolve_device
from compiled_step import compile_decode_step
from errors import CliParser, UserError, run_cli
from eval.data import pydoc_corpus
from flag_types import count, explicit_dests
from generate import check_lengths, decode_one_token
from ignored_flags import check_compile_scope_read


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="streaming_past_context.py", description=__doc__)
    p.add_argument("--tokens", type=count(3), default=None, help="tokens teacher-forced (default: 2× the context)")
    p.add_argument("--text_offset", type=count(0), default=0, help="first token of the pydoc text used")
    p.add_argument("--budget", type=count(2), default=1024, help="recent_global budget in tokens (≤ the context)")
    p.add_argument("--global_tokens", type=count(0), nargs="+", default=[4, 0], help="one run per value (sinks)")
    p.add_argument("--segment", type=count(), default=1024, help="tokens per reported perplexity")
    p.add_argument("--no_reference", action="store_true", help="skip the full-attention reference")
    p.add_argument("--out", default=None, help="write the results as JSON")
    p.add_argument("--overwrite", action="store_true")
    add_model_arguments(p, batch_flag=False)
    return p


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL of each target under float32 logits [n, vocab]."""
    return F.cross_entropy(logits.float(), targets, reduction="none")


def streaming_nll(model, ids: torch.Tensor, budget: int, global_tokens: int, step, desc: str) -> torch.Tensor:
    """NLL of tokens 1..N−1 [N−1] under a re-rotating recent_global cache of `budget` tokens."""
    n = ids.shape[1]
    config = cache_config(cache_strategy=["recent_global"], max_cache_length=[float(budget)],
                          global_tokens=global_tokens, rerotate_positions=True)
    check_lengths(budget, n - budget, model.args.context_length, rerotate_positions=True)
    attach_caches(model, config, budget, n - budget, quiet=False)
    model.reset_caches()
    nll = torch.empty(n - 1)
    with torch.inference_mode():
        # The first `budget` tokens fit the cache: one prefill, whose logits score them (nothing is evicted).
        logits = model(ids[:, :budget], torch.arange(budget, device=ids.device))[0]
        nll[: budget - 1] = token_nll(logits[:-1], ids[0, 1:budget])
        last = logits[-1:]
        for p in tqdm(range(budget, n), desc=desc, unit="tok", mininterval=10):
            nll[p - 1] = token_nll(last, ids[0, p : p + 1])[0]
            if p + 1 < n:
                last = step(model, ids[:, p : p + 1], torch.tensor([p], device=ids.device))
    model.remove_caches()
    return nll


def reference_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """NLL of tokens 1..n−1 under full attention (one cache-less forward, n ≤ the context)."""
    with torch.inference_mode():
        # 8192 × 49152 float32: 1.6 GB for the bundled model
        logits = model(ids, torch.arange(ids.shape[1], device=ids.device))[0]
        rows = range(0, ids.shape[1] - 1, 1024)  # log-softmax by rows, not a second copy of all of it
        return torch.cat([token_nll(logits[s : s + 1024][: ids.shape[1] - 1 - s], ids[0, s + 1 : s + 1025])
                          for s in rows])


def per_segment(nll: torch.Tensor, segment: int) -> list[dict]:
    """Perplexity per `segment` tokens of the sequence (token t's NLL is nll[t − 1]; token 0 is unscored)."""
    rows = []
    for start in range(0, nll.shape[0] + 1, segment):
        part = nll[max(start - 1, 0) : start + segment - 1]
        if part.numel():
            rows.append({"tokens": f"{start}-{start + segment - 1}", "n": part.numel(),
                         "perplexity": round(math.exp(float(part.double().mean())), 3)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_compile_scope_read(explicit_dests(parser, sys.argv[1:] if argv is None else argv), args)
    if args.tokens is not None and args.tokens <= args.budget:
        raise UserError(f"--tokens {args.tokens} must exceed --budget {args.budget}: nothing would stream past it")
    for g in args.global_tokens:
        if g >= args.budget:
            raise UserError(f"--global_tokens {g} leaves no slot of the --budget {args.budget} for recent tokens")
    device = resolve_device(args.device)
    model, tokenizer = load_checkpoint(args.checkpoint_path, device, parse_dtype(args.dtype, device),
                                       allow_non_finite=args.allow_non_finite_weights)
    context = model.args.context_length
    tokens = args.tokens or 2 * context
    ids = tokenizer.encode(pydoc_corpus())[args.text_offset : args.text_offset + tokens]
    if len(ids) < tokens or tokens <= args.budget:
        raise UserError(f"need {tokens} tokens after --text_offset (> --budget), the text has {len(ids)}")
    ids = torch.tensor([ids], device=device)
    step = compile_decode_step(scope=args.compile_scope) if args.compile else decode_one_token
    runs, started = {}, time.perf_counter()
    for g in args.global_tokens:
        t0 = time.perf_counter()
        nll = streaming_nll(model, ids, args.budget, g, step, f"global_tokens={g}")
        runs[f"global_tokens={g}"] = {"segments": per_segment(nll, args.segment),
                                      "perplexity": round(math.exp(float(nll.double().mean())), 3),
                                      "seconds": round(time.perf_counter() - t0, 1)}
    reference = None
    if not args.no_reference:
        ref = reference_nll(model, ids[:, : min(tokens, context)])
        reference = {"segments": per_segment(ref, args.segment), "perplexity": round(math.exp(float(ref.mean())), 3)}
    result = {"config": {**vars(args), "tokens": tokens, "context_length": context,
                         "threads": torch.get_num_threads()},
              "runs": runs, "full_attention_within_context": reference,
              "seconds": round(time.perf_counter() - started, 1)}
    print(format_table(result, args.segment))
    if args.out:
        write_json_atomic(args.out, result, overwrite=args.overwrite)
    return result


def format_table(result: dict, segment: int) -> str:
    names = list(result["runs"])
    ref = result["full_attention_within_context"]
    header = ["tokens", *names] + (["full attention"] if ref else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, row in enumerate(result["runs"][names[0]]["segments"]):
        cells = [row["tokens"]] + [f"{result['runs'][n]['segments'][i]['perplexity']:.2f}" for n in names]
        if ref:
            cells.append(f"{ref['segments'][i]['perplexity']:.2f}" if i < len(ref["segments"]) else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
