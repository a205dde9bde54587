"""Throughput of transformers' `generate` under this tool's caches: one left-padded batch against the same
prompts one at a time.

transformers' model of the bundled GGUF (float32, the CPU) decodes `--prompts` prompts of different lengths
(pydoc text, `--min_tokens` tokens and up) under `make_cache` with one strategy, greedy, `--max_new_tokens`
each (no EOS stop, so every row decodes the same number of tokens): once as one batch (one row per prompt,
each with the budget its own length gives), once prompt by prompt, and, for reference, once as one batch
with transformers' own cache (no eviction). The three alternate for `--rounds` rounds, the order rotating
every round, in one process. Reported: generated tokens per second of each (median round), the batch's
speed-up over one by one, and whether every row's tokens equal the prompt's alone (they must: the batched
cache prefills each row without its padding). With `--prefill_chunk N` every arm feeds its prompts through
transformers' chunked prefill (`prefill_chunk_size=N`), the eviction caches made with `--prefill_chunk N`
(a padded batch's rows each cut at their own chunk boundaries). Numbers are reported, never asserted.

    OMP_NUM_THREADS=2 python -m benchmarks.adapter_batching --prompts 8 --max_new_tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomic_files import check_writable, write_json_atomic
from errors import CliParser, UserError, run_cli
from flag_types import count, real


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m benchmarks.adapter_batching", description=__doc__,
                       allow_abbrev=False)
    parser.add_argument("--cache_strategy", default="heavy_hitter")
    parser.add_argument("--max_cache_length", type=real(0, 1, low_open=True), default=0.25,
                        help="each row's budget, a fraction of its prompt + new tokens")
    parser.add_argument("--prompts", type=count(), default=8, help="rows of the batch")
    parser.add_argument("--min_tokens", type=count(), default=96, help="the shortest prompt; each next is 16 longer")
    parser.add_argument("--max_new_tokens", type=count(), default=32)
    parser.add_argument("--rounds", type=count(), default=3, help="batched and one-by-one runs, alternating")
    parser.add_argument("--prefill_chunk", type=count(2), default=None,
                        help="prompts through transformers' chunked prefill, this many tokens at a time")
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def load_model():
    """transformers' model and tokenizer of the bundled GGUF; a clear error without transformers."""
    try:
        from transformers_adapter import load_gguf_model
    except ImportError as e:
        raise UserError(f"this benchmark needs transformers (pip install -r requirements-dev.txt): {e}") from None
    return load_gguf_model()


def prompts_of(tokenizer, n: int, shortest: int) -> list[list[int]]:
    """n pydoc passages of shortest, shortest + 16, ... tokens."""
    import pydoc_data.topics

    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text).input_ids
    step = shortest + 16 * n
    return [ids[i * step : i * step + shortest + 16 * i] for i in range(n)]


def generate_rows(model, prompts: list[list[int]], cache, new: int, chunk: int | None = None) -> list[list[int]]:
    """One generate call over the prompts, left-padded with id 0 (masked); the prompt `chunk` tokens at a time
    (None: at once)."""
    from transformers_adapter import left_padded

    x, mask = left_padded(prompts)
    T = x.shape[1]
    with torch.inference_mode():
        out = model.generate(x, attention_mask=mask, cache=cache, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0, prefill_chunk_size=chunk)
    return out[:, T:].tolist()


def alternate(arms: dict, rounds: int) -> list[dict]:
    """Each round runs every arm once (seconds, rows), the order rotating from round to round so a slow phase
    of the machine falls on all alike; per round the seconds of each arm and whether the batched rows equal
    the one-by-one rows."""
    names, out = list(arms), []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        results = {name: arms[name]() for name in order}
        out.append({f"{name}_s": results[name][0] for name in names}
                   | {"same_tokens": results["batched"][1] == results["one_by_one"][1]})
        print(f"round {r}: " + ", ".join(f"{name} {results[name][0]:.2f} s" for name in names)
              + f", same tokens {out[-1]['same_tokens']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    from transformers_adapter import make_cache, parse_cache_flags

    chunk = args.prefill_chunk
    flags = parse_cache_flags(["--cache_strategy", args.cache_strategy, "--max_cache_length",
                               str(args.max_cache_length), *(["--prefill_chunk", str(chunk)] if chunk else [])])
    model, tokenizer = load_model()
    prompts = prompts_of(tokenizer, args.prompts, args.min_tokens)
    new = args.max_new_tokens

    def timed(run) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        rows = run()
        return time.perf_counter() - t0, rows

    def cache_for(lengths: int | list[int]):  # the tokenizer: sepllm and hybrid need its token classes
        return make_cache(model, flags, lengths, new, tokenizer=tokenizer)

    def batched() -> tuple[float, list[list[int]]]:
        cache = cache_for([len(p) for p in prompts])
        return timed(lambda: generate_rows(model, prompts, cache, new, chunk))

    def one_by_one() -> tuple[float, list[list[int]]]:
        caches = [cache_for(len(p)) for p in prompts]
        return timed(lambda: [generate_rows(model, [p], c, new, chunk)[0]
                              for p, c in zip(prompts, caches, strict=True)])

    def full_batched() -> tuple[float, list[list[int]]]:  # transformers' own cache (no eviction): the reference
        return timed(lambda: generate_rows(model, prompts, None, new, chunk))

    generate_rows(model, prompts[:1], cache_for(len(prompts[0])), 2, chunk)  # warm-up, not counted
    rounds = alternate({"batched": batched, "one_by_one": one_by_one, "full_batched": full_batched}, args.rounds)
    tokens = len(prompts) * new

    def tok_s(arm: str) -> float:
        return tokens / statistics.median(r[f"{arm}_s"] for r in rounds)

    report = {"cache_strategy": args.cache_strategy, "max_cache_length": args.max_cache_length,
              "prefill_chunk": chunk, "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
              "max_new_tokens": new,
              "threads": torch.get_num_threads(), "batched_tok_s": tok_s("batched"),
              "one_by_one_tok_s": tok_s("one_by_one"), "transformers_cache_batched_tok_s": tok_s("full_batched"),
              "median_speedup": statistics.median(r["one_by_one_s"] / r["batched_s"] for r in rounds),
              "same_tokens": all(r["same_tokens"] for r in rounds), "rounds": rounds}
    print(f"{args.cache_strategy} at {args.max_cache_length}, {len(prompts)} prompts of "
          f"{min(report['prompt_tokens'])}-{max(report['prompt_tokens'])} tokens, {new} new each: batched "
          f"{report['batched_tok_s']:.1f} tok/s, one by one {report['one_by_one_tok_s']:.1f} tok/s, median "
          f"speed-up {report['median_speedup']:.2f}x, every row equal to its prompt alone: {report['same_tokens']}; "
          f"transformers' own cache (no eviction), batched: {report['transformers_cache_batched_tok_s']:.1f} tok/s")
    if args.out:
        write_json_atomic(args.out, report, overwrite=args.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
