"""Stream past the model's context with re-rotated positions (StreamingLLM, arXiv 2309.17453 §3.2).

    OMP_NUM_THREADS=1 python -m benchmarks.streaming_past_context --out results/streaming.json
    python -m benchmarks.streaming_past_context --tokens 4096 --budget 512 --global_tokens 4 0
    python -m benchmarks.streaming_past_context --strategies recent_global lacache --global_tokens 4 --recent_window 32

Teacher-forces `--tokens` of CPython's pydoc text (default 2× the bundled SmolLM2's 8192-token context)
through a cache of `--budget` tokens with `--rerotate_positions`, once per strategy of `--strategies` (default
`recent_global`, StreamingLLM) and value of `--global_tokens` (4 attention sinks, and 0: a plain sliding window).
A strategy whose cache holds the whole sequence (`full`, a `debug_` twin) runs within the context only.
The first `--budget` tokens are one prefill (nothing evicted yet; its logits score them), every later token goes
one at a time through the decode path. Reported: perplexity per `--segment` tokens, and each run's mean NLL
against the first run's over the same tokens, past the context and within it, with a paired bootstrap interval over
blocks of `--block` tokens (neighbouring tokens' losses are not independent). Where the sequence fits the context,
the full-attention perplexity of the same tokens (one cache-less forward over the first context-length tokens) is
the reference; past the context there is none, which is the point.
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
from cache_setup import attach_caches, cache_config, cache_specs
from checkpoint import add_model_arguments, load_checkpoint, parse_dtype, resolve_device
from compiled_step import compile_decode_step
from errors import CliParser, UserError, run_cli
from eval.data import pydoc_corpus
from eval.uncertainty import bootstrap_mean
from flag_types import count, explicit_dests
from generate import check_lengths, decode_one_token
from ignored_flags import check_compile_scope_read


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="streaming_past_context.py", description=__doc__)
    p.add_argument("--tokens", type=count(3), default=None, help="tokens teacher-forced (default: 2× the context)")
    p.add_argument("--text_offset", type=count(0), default=0, help="first token of the pydoc text used")
    p.add_argument("--budget", type=count(2), default=1024, help="the cache's budget in tokens (≤ the context)")
    p.add_argument("--strategies", nargs="+", default=["recent_global"],
                   help="one run per strategy (and per --global_tokens value), each at its defaults")
    p.add_argument("--global_tokens", type=count(0), nargs="+", default=[4, 0], help="one run per value (sinks)")
    p.add_argument("--recent_window", type=count(0), default=10,
                   help="the recent window of the strategies that read one (recent_global holds all it can)")
    p.add_argument("--segment", type=count(), default=1024, help="tokens per reported perplexity")
    p.add_argument("--block", type=count(), default=256,
                   help="tokens per block of the paired bootstrap against the first run")
    p.add_argument("--no_reference", action="store_true", help="skip the full-attention reference")
    p.add_argument("--out", default=None, help="write the results as JSON")
    p.add_argument("--overwrite", action="store_true")
    add_model_arguments(p, batch_flag=False)
    return p


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL of each target under float32 logits [n, vocab]."""
    return F.cross_entropy(logits.float(), targets, reduction="none")


def streaming_config(strategy: str, budget: int, global_tokens: int, recent_window: int) -> argparse.Namespace:
    """The cache flags of one run: `strategy` at its defaults, re-rotating, `budget` tokens (a UserError for an
    unknown strategy)."""
    return cache_config(cache_strategy=[strategy], max_cache_length=[float(budget)], global_tokens=global_tokens,
                        recent_window=float(recent_window), rerotate_positions=True)


def streaming_nll(model, ids: torch.Tensor, config: argparse.Namespace, budget: int, step, desc: str) -> torch.Tensor:
    """NLL of tokens 1..N−1 [N−1] under a re-rotating cache of `budget` tokens (`config`: streaming_config)."""
    n = ids.shape[1]
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


def run_name(strategy: str, global_tokens: int, args: argparse.Namespace) -> str:
    """A run's name: its global_tokens value, with the strategy where --strategies names another than the default."""
    return f"global_tokens={global_tokens}" if args.strategies == ["recent_global"] else \
        f"{strategy}, global_tokens={global_tokens}"


def paired_against(nll: torch.Tensor, reference: torch.Tensor, context: int, block: int) -> dict:
    """Mean NLL of a run minus the first run's over the same tokens, within the context and past it: the paired
    bootstrap interval (eval.uncertainty) over blocks of `block` consecutive tokens' mean NLLs (whole blocks only)."""
    out = {}
    diff = (nll - reference).double()
    # nll[t − 1] is token t's: tokens 1..context−1 are within the context, context.. past it.
    for part, values in (("within_context", diff[: context - 1]), ("past_context", diff[context - 1 :])):
        blocks = values[: values.shape[0] // block * block].view(-1, block).mean(-1)
        if blocks.numel() < 2:
            continue
        interval = bootstrap_mean(blocks.numpy())
        out[part] = {"delta_mean_nll": round(interval.estimate, 4), "ci_low": round(interval.low, 4),
                     "ci_high": round(interval.high, 4), "blocks": blocks.numel()}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_compile_scope_read(explicit_dests(parser, sys.argv[1:] if argv is None else argv), args)
    if args.tokens is not None and args.tokens <= args.budget:
        raise UserError(f"--tokens {args.tokens} must exceed --budget {args.budget}: nothing would stream past it")
    for g in args.global_tokens:
        if g >= args.budget:
            raise UserError(f"--global_tokens {g} leaves no slot of the --budget {args.budget} for recent tokens")
    configs = {run_name(s, g, args): streaming_config(s, args.budget, g, args.recent_window)
               for s in dict.fromkeys(args.strategies) for g in args.global_tokens}
    device = resolve_device(args.device)
    model, tokenizer = load_checkpoint(args.checkpoint_path, device, parse_dtype(args.dtype, device),
                                       allow_non_finite=args.allow_non_finite_weights)
    context = model.args.context_length
    tokens = args.tokens or 2 * context
    ids = tokenizer.encode(pydoc_corpus())[args.text_offset : args.text_offset + tokens]
    if len(ids) < tokens or tokens <= args.budget:
        raise UserError(f"need {tokens} tokens after --text_offset (> --budget), the text has {len(ids)}")
    ids = torch.tensor([ids], device=device)
    for config in configs.values():  # every run's caches checked before the first runs (a full cache past the context)
        cache_specs(config, model.args, args.budget, tokens - args.budget)
    step = compile_decode_step(scope=args.compile_scope) if args.compile else decode_one_token
    runs, losses, started = {}, {}, time.perf_counter()
    for name, config in configs.items():
        t0 = time.perf_counter()
        losses[name] = streaming_nll(model, ids, config, args.budget, step, name)
        runs[name] = {"segments": per_segment(losses[name], args.segment),
                      "perplexity": round(math.exp(float(losses[name].double().mean())), 3),
                      "seconds": round(time.perf_counter() - t0, 1)}
    first = next(iter(losses))
    for name in list(losses)[1:]:
        runs[name]["against_first"] = paired_against(losses[name], losses[first], context, args.block)
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
    for name in names[1:]:
        for part, d in result["runs"][name].get("against_first", {}).items():
            lines.append(f"{name} − {names[0]}, {part.replace('_', ' ')}: mean NLL {d['delta_mean_nll']:+.4f} "
                         f"[{d['ci_low']:+.4f}, {d['ci_high']:+.4f}] ({d['blocks']} blocks)")
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
