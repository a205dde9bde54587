"""`lacache`: LaCache (Shi et al., ICML 2025, "LaCache: Ladder-Shaped KV Caching for Efficient Long-Context
Modeling of Large Language Models", arXiv 2507.14204; the rule read from the authors' code, `lacache/kv_cache.py`).

Every layer keeping the same tokens wastes the depth: LaCache gives each layer a different subset of the old
tokens, so that together the layers still cover far more of the past than any one holds, and it reads no
attention (it runs with any attention kernel). The old tokens are cut into blocks of `before` consecutive ones;
layer i keeps the `after` consecutive tokens of each block that start at offset i mod (before − after + 1), so
the kept offsets climb with depth and repeat: a ladder. The authors size the ladder by a span S (how many layers
keep a token) and an overlap O, over the model's n layers:

    before = 1 + ⌈(n − S) / (S − O)⌉,    after = min(⌈S / (S − O)⌉, before),

for Llama's 32 layers at S = 16, O = 0: blocks of 2, each layer keeping 1 (the even layers the even tokens, the
odd layers the odd ones). `--lacache_span` defaults to half the layers (the authors' 16 of 32), `--lacache_overlap`
to 0.

Iterative compaction, for answers longer than any budget: the tokens a layer keeps are laddered again by the
same rule (its kept tokens, in order, cut into blocks of `before`), and again, so the older part of the cache
grows sparser. A token's *level* is the first pass that drops it from this layer; the cache evicts the lowest
level first and, within a level, the oldest: the first ladder is applied to each token as it leaves the recent
window, and once that leaves too many, the second ladder thins the oldest of what is left, and so on. The
sinks (`--global_tokens`) and the recent window are kept, as in every cache; the ladder counts from the first
token after the sinks. A prompt longer than the budget is compressed by the same order.

The order is a fixed function of the position (no statistics, no per-slot state): `ladder_rank` holds it for
every position of the run (4 bytes each), one lookup per step. Where this differs from the authors' code: their
cache grows past its size and is cut back a few blocks at a time, with a cursor that sweeps the old tokens and
starts over from the sinks once it reaches the newest (re-laddering the whole compacted part at once); this
cache evicts one token per step at a fixed size, and its later passes thin the oldest tokens first. Both apply
the same first ladder, tokens leave in the same order within a pass, and older tokens end up sparser. Their
runs keep the positions within the cache (`--rerotate_positions` here) to stream past the context.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy
from errors import UserError


def ladder_shape(n_layers: int, span: int, overlap: int) -> tuple[int, int]:
    """(before, after): each block of `before` consecutive tokens keeps `after` of them in each layer (the
    authors' arithmetic)."""
    before = 1 + math.ceil((n_layers - span) / (span - overlap))
    return before, min(math.ceil(span / (span - overlap)), before)


def ladder_levels(count: int, before: int, after: int, offset: int) -> Tensor:
    """The level of each of `count` tokens (the ladder's index 0 = the first token after the sinks): the first
    pass of the ladder that drops it, [count] long. A token no pass drops (it settles at an index below `after`
    at offset 0) gets one level above every other."""
    index = torch.arange(count)  # the token's index in the list the current pass cuts
    level = torch.zeros(count, dtype=torch.long)
    alive = torch.ones(count, dtype=torch.bool)
    step = 1
    # Every pass lowers a surviving index (by at least the offset, or by a block's reduction), so the loop ends
    # once only the fixed points are left: offset 0 and an index below `after`.
    while (alive & ((index >= after) | (offset > 0))).any():
        inner = index % before - offset
        kept = (inner >= 0) & (inner < after)
        level[alive & ~kept] = step
        alive &= kept
        index = torch.where(alive, index // before * after + inner, index)
        step += 1
    return level.masked_fill(alive, step)


@register_strategy
class LaCacheCache(KVCache):
    name = "lacache"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (
        SPAN := Setting("lacache_span", None, low=1,
                        help="how many layers keep each old token, S (default: half the layers, the authors' 16 "
                             "of 32); the ladder keeps ⌈S/(S−O)⌉ of each 1 + ⌈(layers − S)/(S − O)⌉ tokens per layer"),
        OVERLAP := Setting("lacache_overlap", 0, low=0,
                           help="the ladder's overlap O between the layer groups (below the span)"),
    )
    # One rank per position of the run (`ladder_rank`), the same for every row.
    row_shared_buffers = ("ladder_rank",)
    prompt_rule_needs_own_cache = True
    n_layers: int = 1

    def __init__(self, batch_size: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, *args, **kwargs)
        if self.capacity_needed >= 1 << 40:
            raise ValueError("a lacache cache ranks every position of the run: give it capacity_needed")
        self.register_buffer("ladder_rank", torch.zeros(self.capacity_needed, device=self.pos.device))
        if self.setting(self.SPAN) is None:
            self.fill_ladder()  # the default span fits any depth; a given one waits for the model's (configure)

    def shape(self) -> tuple[int, int]:
        """The ladder's (before, after) for this model: the span's default is half the layers; a model too
        shallow for any ladder (one layer) gets the smallest, 1 of each 2."""
        span, overlap = self.setting(self.SPAN), int(self.setting(self.OVERLAP))
        if span is None:
            span = max(self.n_layers // 2, 1)
            if self.n_layers < 2:
                return 2, 1
        if overlap >= span:
            raise UserError(f"--lacache_overlap {overlap} must be below --lacache_span {span}")
        before, after = ladder_shape(self.n_layers, int(span), overlap)
        if before <= after:
            raise UserError(f"--lacache_span {span} (overlap {overlap}) on a {self.n_layers}-layer model keeps every "
                            f"token in every layer ({after} of each {before}): give a span below the layer count")
        return before, after

    def fill_ladder(self) -> None:
        """`ladder_rank`: each position's place in the eviction order (level, then position), lowest first.
        Built on the host (the pass loop asks whether anything is left) for the run's whole length, whichever
        row a row context shows."""
        before, after = self.shape()
        length = self.ladder_rank.numel()
        sinks = min(self.global_tokens, length)
        offset = self.layer_idx % (before - after + 1)
        level = torch.cat([torch.full((sinks,), 1 << 20), ladder_levels(length - sinks, before, after, offset)])
        rank = torch.empty(length)
        rank[torch.argsort(level * length + torch.arange(length))] = torch.arange(length, dtype=torch.float32)
        self.ladder_rank.copy_(rank)

    def configure(self, **settings: object) -> None:
        super().configure(**settings)
        self.fill_ladder()  # the layer's rung and the model's depth are known now

    def reset(self) -> None:
        super().reset()
        self.fill_ladder()

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.ladder_rank[self.pos.clamp(min=0)]

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return cache.ladder_rank[cache.scored_positions(k)]
