"""Each strategy at several budgets on a ~1k-token pydoc prompt: decode tok/s (compiled), measured
compression ratio, and the debug_ attention loss (eager). One process, one model load.

    python benchmarks/strategy_report.py --budgets 0.5 0.25 0.1 --out results/strategy_report.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache import cache_statistics  # noqa: E402
from cache_spec import add_cache_arguments, resolve_cache_spec  # noqa: E402
from checkpoint import load_checkpoint  # noqa: E402
from eval.data import pydoc_corpus  # noqa: E402
from generate import compile_decode_step, decode_one_token, generate, setup_caches, write_json_atomic  # noqa: E402
from strategies import CACHE_STRATEGIES  # noqa: E402
from strategies.debug import attention_loss_curve  # noqa: E402


def pydoc_prompt(tokenizer, n_tokens: int) -> list[int]:
    text = pydoc_corpus()
    return tokenizer.encode(text)[:n_tokens]


def run(model, tokenizer, ids, strategy: str, budget: float, new: int, compiled: bool) -> dict:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    args = parser.parse_args(["--cache_strategy", strategy, "--max_cache_length", str(budget)])
    specs = resolve_cache_spec(args, model.args.n_layer, len(ids), new)
    setup_caches(model, specs, len(ids) + new, tokenizer)
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budgets", nargs="+", type=float, default=[0.5, 0.25, 0.1])
    p.add_argument("--strategies", nargs="+", default=[s for s in CACHE_STRATEGIES if s != "full"])
    p.add_argument("--prompt_tokens", type=int, default=1024)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--out", default="results/strategy_report.json")
    a = p.parse_args()
    model, tokenizer = load_checkpoint(None, "cpu", getattr(torch, a.dtype))
    ids = pydoc_prompt(tokenizer, a.prompt_tokens)
    rows = []
    t0 = time.time()
    compiled = not a.no_compile
    rows.append(run(model, tokenizer, ids, "full", 1.0, a.max_new_tokens, compiled))
    print(json.dumps(rows[-1]), flush=True)
    for strategy in a.strategies:
        for budget in a.budgets:
            speed = run(model, tokenizer, ids, strategy, budget, a.max_new_tokens, compiled)
            debug = run(model, tokenizer, ids, f"debug_{strategy}", budget, a.max_new_tokens, False)
            speed["attention_loss_mean"] = debug["attention_loss_mean"]
            speed["attention_loss_curve"] = debug["attention_loss_curve"]
            rows.append(speed)
            print(json.dumps(speed), flush=True)
    write_json_atomic(a.out, {"rows": rows, "seconds": round(time.time() - t0, 1), "dtype": a.dtype,
                              "prompt_tokens": len(ids), "max_new_tokens": a.max_new_tokens}, overwrite=True)


if __name__ == "__main__":
    main()
