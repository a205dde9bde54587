"""`simlayerkv`: SimLayerKV (Zhang et al. 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache
Reduction", arXiv 2410.13846).

Some layers are "lazy": their latest queries attend almost only to the first tokens (attention sinks) and the
most recent ones, so the rest of their cache is dead weight. SimLayerKV decides it per layer from the prompt
and trims only the lazy layers, to the sinks and a recent window; the other layers keep everything.

Here, per row and per layer (every KV head of a layer in the same role), at prefill:
- the attention of the prompt's last `--simlayer_last` queries (1: the decode-time variant, as kvpress's
  press), averaged over them and over the layer's query heads, is summed over the first `global_tokens` and
  the last `recent_window` positions (the query's own key among them, as the authors' code; kvpress's window
  stops one short); the layer is lazy if that mass exceeds `--simlayer_threshold`. A prompt of
  at most global_tokens + recent_window + simlayer_last tokens leaves the layer as it is (nothing to trim);
- a lazy layer holds the sinks and the `recent_window` newest tokens: its other tokens are released when the
  next token arrives (strategies/variable_occupancy.py, as DuoAttention's streaming heads), so compression is
  measured, not set; a non-lazy layer holds every token up to its budget (the paper's full cache when the
  budget covers the sequence; a smaller budget evicts the oldest unprotected token first).

Where this differs from the paper: the paper keeps 1024 recent tokens in lazy layers and tunes the threshold
per model family (kvpress recommends 0.9 for Llama 3, 0.65 for Llama 2, 0.8 for Mistral, 0.85 for Qwen); here
the window is the shared `--recent_window` (the preset sets a quarter of the budget) and the threshold defaults
to Llama 3's, the family closest to the bundled SmolLM2. The prompt's own attention is full causal attention in
every layer (the paper's lazy layers also prefill with streaming attention). Decisions are per row of a batch,
where kvpress averages over the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import Setting, finite_float, register_strategy
from prompt_compression import prompt_attention
from strategies.duo_attention import StreamingHeads

THRESHOLD = Setting("simlayer_threshold", 0.9, type=finite_float, low=0.0, high=1.0,
                    help="a layer is lazy when its last queries give the sinks + recent window more than this "
                         "share of their attention (0.9: kvpress's value for Llama 3)")
LAST = Setting("simlayer_last", 1, low=1, help="the prompt's last queries whose attention decides laziness")


def sinks_and_window_mass(q: Tensor, k: Tensor, sinks: int, window: int, last: int) -> Tensor:
    """The attention the prompt's last `last` queries give the first `sinks` and the last `window` positions,
    averaged over those queries and every query head: [B] float32 (q [B, n_head, T, d], k [B, n_kv, T, d])."""
    T = k.shape[2]
    probs = prompt_attention(q, k, min(last, T))  # [B, n_kv, last, T], the group mean
    pos = torch.arange(T, device=k.device)
    kept = (pos < sinks) | (pos >= T - window)
    return (probs * kept).sum(-1).mean(dim=(1, 2))


@register_strategy
class SimLayerKVCache(StreamingHeads):
    name = "simlayerkv"
    settings = (THRESHOLD, LAST)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.retrieval.fill_(1.0)  # a cache never prefilled (a one-token prompt) keeps everything

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        T = k.shape[2]
        last = int(self.setting(LAST))
        if T <= self.global_tokens + self.recent_window + last:
            self.retrieval.fill_(1.0)
            return
        mass = sinks_and_window_mass(q, k, self.global_tokens, self.recent_window, last)
        lazy = mass > float(self.setting(THRESHOLD))
        self.retrieval.copy_((~lazy).float()[:, None].expand_as(self.retrieval))

    def reset(self) -> None:
        super().reset()
        self.retrieval.fill_(1.0)  # a cache never prefilled (a one-token prompt) keeps everything
