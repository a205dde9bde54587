"""Cache policies a model imposes on its own layers, composed with the user's per-layer cache spec.

A sliding-window layer (Gemma 3's local layers, every layer of Mistral or Phi-3 with `sliding_window`)
attends to its newest `window` tokens only: that is itself an eviction policy, the `recent` cache with
no sink tokens. When the window is shorter than the sequence, such a layer gets that cache (strategy
`sliding_window`, budget = the window) whatever the user asked for, and the user's strategy runs on the
global layers. The layers' real budgets then enter the compression ratio like any other cache: a model
with local layers compresses its KV cache by itself, and the statistics say so rather than crediting it
to the user's strategy (compare against `--cache_strategy full` on the same model).
"""

from __future__ import annotations

import sys

from cache import RecentGlobalCache, register_strategy
from cache_spec import LayerCacheSpec
from model import ModelArgs


@register_strategy
class SlidingWindowCache(RecentGlobalCache):
    """The newest `max_cache_length` tokens, no sinks: a sliding-window attention layer's own memory."""

    name = "sliding_window"
    hyperparameters = ()


def apply_model_layer_policies(
    specs: list[LayerCacheSpec], model_args: ModelArgs, prompt_length: int, max_new_tokens: int,
    quiet: bool = False,
) -> list[LayerCacheSpec]:
    """The specs with every sliding layer whose window is shorter than the sequence replaced by its
    window cache (the user's storage settings kept). A note on stderr lists layers whose requested
    strategy was replaced, unless `quiet`."""
    total = prompt_length + max_new_tokens
    out, replaced = [], []
    for spec in specs:
        window = model_args.layer_window(spec.layer)
        if not window or window >= total:
            out.append(spec)  # a window the sequence never fills changes nothing
            continue
        if spec.strategy.removeprefix("debug_") != "full":
            replaced.append(spec.layer)
        out.append(LayerCacheSpec(spec.layer, SlidingWindowCache.name, window, {}, "recent_global", spec.storage))
    if replaced and not quiet:
        print(f"note: layers {', '.join(map(str, replaced))} attend to a sliding window of "
              f"{model_args.sliding_window} tokens and use it as their cache instead of the requested strategy",
              file=sys.stderr)
    return out
