"""Foundation numbers: load time, prefill tok/s at 2048 tokens, decode tok/s with 256 and 4096 cached
tokens, eager vs compiled, float32 vs bfloat16 (full cache, bundled model, one sequence).

    python -m benchmarks.foundation_speed
"""

from __future__ import annotations

import json
import time

import torch

from cache_setup import attach_caches, cache_config
from checkpoint import load_checkpoint
from compiled_step import compile_decode_step
from errors import CliParser, run_cli
from eval.data import pydoc_corpus
from generate import decode_one_token, generate, prefill


def corpus_ids(tokenizer, n: int) -> list[int]:
    text = pydoc_corpus()
    return tokenizer.encode(text[: 8 * n])[:n]


def main(argv: list[str] | None = None) -> None:
    CliParser(prog="python -m benchmarks.foundation_speed", description=__doc__).parse_args(argv)
    steps = 32
    for dtype in (torch.float32, torch.bfloat16):
        t = time.perf_counter()
        model, tokenizer = load_checkpoint(None, "cpu", dtype)
        row = {"dtype": str(dtype).removeprefix("torch."), "load_seconds": round(time.perf_counter() - t, 2)}
        ids = corpus_ids(tokenizer, 4096 + steps)
        attach_caches(model, cache_config(), 2048, 0)
        with torch.inference_mode():
            model.reset_caches()
            prefill(model, torch.tensor([ids[:2048]]))
            t = time.perf_counter()
            model.reset_caches()
            prefill(model, torch.tensor([ids[:2048]]))
            row["prefill_2048_tokens_per_second"] = round(2048 / (time.perf_counter() - t), 1)
        for context in (256, 4096):
            prompt = ids[:context]
            attach_caches(model, cache_config(), context, steps)
            r = generate(model, prompt, steps, [], decode_one_token)
            row[f"decode_{context}_eager"] = round(r.decode_steps / r.decode_seconds, 2)
            torch._dynamo.reset()
            step = compile_decode_step()
            t = time.perf_counter()
            generate(model, prompt, 3, [], step)
            row[f"compile_seconds_{context}"] = round(time.perf_counter() - t, 1)
            r = generate(model, prompt, steps, [], step)
            row[f"decode_{context}_compiled"] = round(r.decode_steps / r.decode_seconds, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    run_cli(main)
