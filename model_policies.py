"""Cache policies a model imposes on its own layers, composed with the user's per-layer cache spec.

A sliding-window layer (Gemma 3's local layers, every layer of Mistral or Phi-3 with `sliding_window`)
attends to its newest `window` tokens only: that is itself an eviction policy, the `recent_global` cache
with no sink tokens and a budget of the window. When the window is shorter than the sequence, such a
layer gets that cache whatever the user asked for, and the user's strategy runs on the global layers.
These layers' real budgets enter the compression ratio like any other cache: a model with local layers
compresses its KV cache by itself, and the statistics say so (compare a strategy against
`--cache_strategy full` on the same model, which has the same local layers, to isolate the strategy).
"""

from __future__ import annotations

import sys

from cache_spec import LayerCacheSpec
from model import ModelArgs

WINDOW_STRATEGY = "recent_global"  # with global_tokens=0: exactly the newest `window` tokens


def apply_model_layer_policies(
    specs: list[LayerCacheSpec], model_args: ModelArgs, prompt_length: int, max_new_tokens: int,
    quiet: bool = False,
) -> list[LayerCacheSpec]:
    """The specs with every sliding layer whose window is shorter than the sequence given its window
    cache (the user's storage settings kept). Unless `quiet`, a note on stderr names those layers."""
    total = prompt_length + max_new_tokens
    out, windowed, replaced = [], [], []
    for spec in specs:
        window = model_args.layer_window(spec.layer)
        if not window or window >= total:
            out.append(spec)  # a window the sequence never fills changes nothing
            continue
        windowed.append(spec.layer)
        if spec.strategy.removeprefix("debug_") != "full":
            replaced.append(spec.layer)
        # Re-rotation carries over: a window of contiguous tokens at ranks 0..n-1 has the same relative
        # positions as at its original ones, so it changes nothing inside the window. So does the prompt's
        # chunking: a model whose every layer slides would otherwise prefill in one shot (its whole prompt's
        # activations at once), and a quantized window's later chunks read its held keys dequantized.
        out.append(LayerCacheSpec(spec.layer, WINDOW_STRATEGY, window, {"global_tokens": 0}, WINDOW_STRATEGY,
                                  spec.storage, rerotate_positions=spec.rerotate_positions,
                                  prefill_chunk=spec.prefill_chunk, sliding_window=window))
    if windowed and not quiet:
        note = f" instead of the requested strategy on layers {', '.join(map(str, replaced))}" if replaced else ""
        print(f"note: {len(windowed)} of {len(specs)} layers attend to a sliding window of "
              f"{model_args.sliding_window} tokens; their cache is that window (recent_global, no sink tokens)"
              f"{note}", file=sys.stderr)
    return out
