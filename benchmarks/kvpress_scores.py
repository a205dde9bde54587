"""Our prompt scores against kvpress's own presses on the same keys and values: every layer of the bundled model.

A strategy whose prompt rule is a kvpress press's score (`curdkv` and kvpress's CURPress, `l2` and its
KnormPress) is checked here against kvpress's code itself, not a re-implementation: one prefill of a pydoc
prompt through our model, and at every layer the keys and values it gives the cache are scored by our rule and
by the press's `score`. Reported per press: the largest relative difference of the scores past the sinks
(kvpress pins the first 4 tokens' scores; ours keeps them as `--global_tokens`), and the share of the tokens
kvpress's top-k keeps at each compression ratio that ours keeps too (sinks pinned on both sides), over every
layer and KV head.

Needs kvpress beside this project's torch (`pip install kvpress`; only `kvpress.presses` is imported and its
scorers read nothing but the keys and values, so transformers' version does not matter). Numbers are
reported, never asserted.

    PYTHONPATH=<kvpress> python -m benchmarks.kvpress_scores --press cur --tokens 1024
"""

from __future__ import annotations

import argparse
import importlib
import pydoc

import torch
from torch import Tensor

from atomic_files import check_writable, write_json_atomic
from cache_setup import attach_caches, cache_config
from checkpoint import load_checkpoint
from errors import CliParser, UserError, run_cli
from flag_types import count, real
from generate import prefill
from strategies import get_strategy

SINKS = 4  # kvpress's num_sinks for CURPress; ours keeps them as --global_tokens
# press -> (our strategy, kvpress's module and class, whether kvpress pins the first SINKS tokens)
PRESSES = {"cur": ("curdkv", "cur_press", "CURPress", True), "knorm": ("l2", "knorm_press", "KnormPress", False)}


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m benchmarks.kvpress_scores", description=__doc__,
                       allow_abbrev=False)
    parser.add_argument("--press", choices=sorted(PRESSES), default="cur")
    parser.add_argument("--tokens", type=count(SINKS + 2), default=1024, help="prompt tokens (pydoc text)")
    parser.add_argument("--compression_ratios", type=real(0, 1, low_open=True, high_open=True), nargs="+",
                        default=[0.5, 0.75, 0.9], help="kvpress's: the fraction of the prompt removed")
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def kvpress_press(name: str):
    _, module, cls, _ = PRESSES[name]
    try:
        press_module = importlib.import_module(f"kvpress.presses.{module}")
    except ImportError as e:
        raise UserError(f"this benchmark needs kvpress beside this torch (pip install kvpress): {e}") from None
    return getattr(press_module, cls)()


def kept_overlap(ours: Tensor, theirs: Tensor, n_kept: int, pinned: int) -> float:
    """Of the tokens kvpress's top-k of `theirs` [H, T] keeps, the share ours keeps (the first `pinned` pinned)."""
    ours = ours.clone()
    ours[:, :pinned] = float("inf")
    a, b = theirs.topk(n_kept, dim=-1).indices, ours.topk(n_kept, dim=-1).indices
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b, strict=True)) / a.numel()


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    strategy, _, cls, pins = PRESSES[args.press]
    press = kvpress_press(args.press)
    torch.set_num_threads(1)
    model, tokenizer = load_checkpoint(None, "cpu", torch.float32)
    ids = tokenizer.encode(pydoc.render_doc(str, renderer=pydoc.plaintext))[: args.tokens]
    if len(ids) < args.tokens:
        raise UserError(f"--tokens {args.tokens}: the pydoc prompt has only {len(ids)} tokens")
    config = cache_config(cache_strategy=[strategy], max_cache_length=[1.0], global_tokens=SINKS, recent_window=0)
    attach_caches(model, config, len(ids), 1, tokenizer)
    rule, pinned = get_strategy(strategy), SINKS if pins else 0
    layers = []
    for layer, cache in enumerate(model.caches()):
        def record(input_pos, k, v, q, k_store=None, cache=cache, layer=layer, original=cache.prefill) -> None:
            original(input_pos, k, v, q, k_store)  # hands the values to a rule that reads them
            ours = rule.prompt_scores(cache, k, q)[0].float()
            theirs = press.score(None, None, k.float(), v.float(), None, None)[0].float()
            diff = ((ours - theirs)[:, pinned:].abs() / theirs[:, pinned:].abs().clamp(min=1e-30)).max().item()
            layers.append({"layer": layer, "max_relative_difference": diff,
                           "kept_overlap": {str(r): kept_overlap(ours, theirs, int(len(ids) * (1 - r)), pinned)
                                            for r in args.compression_ratios}})
        cache.prefill = record
    with torch.inference_mode():
        prefill(model, torch.tensor([ids]))
    report = {"press": args.press, "strategy": strategy, "tokens": len(ids), "layers": layers,
              "max_relative_difference": max(x["max_relative_difference"] for x in layers),
              "min_kept_overlap": {str(r): min(x["kept_overlap"][str(r)] for x in layers)
                                   for r in args.compression_ratios}}
    print(f"{strategy} against kvpress's {cls}, {len(ids)} tokens, {len(layers)} layers: largest "
          f"relative score difference {report['max_relative_difference']:.2e}")
    for r, share in report["min_kept_overlap"].items():
        print(f"  compression {r}: kvpress's kept tokens that ours keeps, worst layer {share:.4f}")
    if args.out:
        write_json_atomic(args.out, report, overwrite=args.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
