"""`threshold`: evict every token whose score falls under a threshold (the fixed-threshold mode of KVzap
and of Dynamic Memory Sparsification, DMS, Łańcucki et al. 2025, arXiv 2506.05345), so the number of held
tokens varies with the text and the compression is an outcome, measured, not a setting.

The score is TOVA's (strategies/tova.py): the attention the latest query gave each held token, here
relative to uniform attention over what that query attended (attention × the number of tokens it
attended over), so one threshold τ means the same in every head and at every length: a token that drew
less than τ times its uniform share is released. DMS learns a per-token eviction decision and KVzap a
per-token score with a small surrogate model; neither ships weights for the bundled model here, so the
rule thresholds the attention itself, which is what both learn to approximate (DMS distils it from the
attention of the uncompressed model).

- Decode: when a token is inserted, every unprotected held token whose relative attention from the
  previous query was below τ is released (its slot emptied, masked: strategies/variable_occupancy.py).
  Released slots are reused first. The budget L stays a hard maximum: a full cache evicts TOVA's argmin.
- Prompt: kept as the budget allows, by TOVA's prompt rule (the last prompt query's attention); the
  prompt tokens under the threshold are released when the first decoded token arrives, judged by that
  same last prompt query (decode's "previous query"). Releasing at prefill would make the prompt rule
  differ from the decode rule.
- A new token is never judged before a query has attended to it (its score starts at +∞ relative).

Where this differs from DMS and KVzap beyond the score: they judge a token once (DMS: its learned decision, from
its own hidden state, applied when it leaves a 128-token sliding window), where here every held token is judged
again by each step's query, so a token survives only while every query gives it its share; the window is
`--recent_window`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import Setting, finite_float, register_strategy
from kv_storage import scatter_slots
from strategies.tova import TovaCache
from strategies.variable_occupancy import VariableOccupancy


@register_strategy
class ThresholdCache(VariableOccupancy, TovaCache):
    name = "threshold"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (
        THRESHOLD := Setting("eviction_threshold", 0.01, type=finite_float, low=0.0, high=1.0,
                             help="release every token that drew less than this fraction of uniform "
                                  "attention from the latest query (0: never; the budget stays the maximum)"),
    )

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        self.threshold = float(self.setting(self.THRESHOLD))
        # Tokens the latest query attended over, per row and head: its uniform share is 1 / this.
        self.register_buffer("attended", torch.zeros(batch_size, n_kv_heads, device=self.pos.device))

    def update_state(self, probs: Tensor) -> None:
        super().update_state(probs)
        self.attended.copy_(self.held_tokens().float())

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        super().after_prefill(keep, input_pos, k, q)
        self.attended.fill_(k.shape[2])  # the last prompt query attended over the whole prompt

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.last_attention, 2, slot[..., None], float("inf"))  # not yet attended: not judged
        relative = self.last_attention * self.attended[..., None]
        self.release(self.evictable(input_pos) & (relative < self.threshold))

    def extra_statistics(self) -> dict[str, Tensor]:
        """Tokens held at the end per KV head, as a fraction of the slots (the variable budget's use)."""
        return {"slots_used": (self.held_tokens().float() / self.max_cache_length).mean(dim=0)}

