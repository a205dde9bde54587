"""`lacache`: LaCache (Shi et al., ICML 2025, "LaCache: Ladder-Shaped KV Caching for Efficient Long-Context
Modeling of Large Language Models", arXiv 2507.14204; the rule read from the authors' code, `lacache/kv_cache.py`).

Every layer keeping the same tokens wastes the depth: LaCache gives each layer a different subset of the old
tokens, so that together the layers still cover far more of the past than any one holds, and it reads no
attention (it runs with any attention kernel). Old tokens are cut into blocks of `before` consecutive ones, and
layer i keeps the `after` consecutive tokens of each block that start at offset i mod (before − after + 1), so the
kept offsets climb with depth and repeat: a ladder. The authors size the ladder by a span S (how many layers keep
a token) and an overlap O, over the model's n layers:

    before = 1 + ⌈(n − S) / (S − O)⌉,    after = min(⌈S / (S − O)⌉, before),

for Llama's 32 layers at S = 16, O = 0: blocks of 2, each layer keeping 1 (the even layers the even tokens, the
odd layers the odd ones). `--lacache_span` defaults to half the layers (the authors' 16 of 32), `--lacache_overlap`
to 0. The layers counted, and the rung's index i, are those that hold a lacache cache: every layer of a Llama, but
only the global layers of a model whose sliding layers the sequence outgrows (Gemma 3's 3 of 18 past 512 tokens),
or a per-layer pattern's lacache layers,
so the rungs spread over the layers that compress.

Iterative compaction, as the authors' code runs it: a cursor sweeps the held tokens from the oldest, cutting the
next block and dropping what this layer does not keep there, only as fast as room is needed, so the newest tokens
stay whole until the sweep reaches them; when the next block would reach into the recent window (the authors
leave the newest tokens, as many as the layers, unswept), the sweep starts over from the sinks and ladders what it
compacted again, so older tokens grow sparser with every sweep. Here one token leaves per step at a fixed size: a
block's drops go one per step, oldest first, and the sinks (`--global_tokens`) and the recent window are kept as in
every cache. Since the ladder reads nothing but positions, the whole sequence of evictions is fixed by the
budget: `ladder_rank` holds, for every position of the run, the step at which the sweep evicts it when tokens are
fed one at a time (4 bytes a position per row and layer), and a full cache evicts its lowest. So a prompt
compressed at once, or chunk by chunk, keeps exactly what the token-by-token sweep holds at its end, and decoding
goes on with it.

Where this differs from the authors' code: their cache grows past its size and is cut back a few blocks at a time
(their size oscillates around the budget; a long prompt cut at once thins the compacted part by a larger ratio in
one startover), where this cache evicts one token per step; their unswept tail is the layer count, here the recent
window. Their runs keep the positions within the cache (`--rerotate_positions` here) to stream past the context.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from itertools import takewhile

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy
from errors import UserError


def ladder_shape(n_layers: int, span: int, overlap: int) -> tuple[int, int]:
    """(before, after): each block of `before` consecutive tokens keeps `after` of them in each layer (the
    authors' arithmetic)."""
    before = 1 + math.ceil((n_layers - span) / (span - overlap))
    return before, min(math.ceil(span / (span - overlap)), before)


@functools.lru_cache(maxsize=64)
def eviction_steps(length: int, budget: int, sinks: int, window: int, before: int, after: int, offset: int) -> Tensor:
    """The step at which the ladder's sweep evicts each of `length` positions fed one at a time into `budget`
    slots, [length] float32; a position never evicted gets length + p, a sink 2·length + p (kept above all)."""
    step = [float(length + p) for p in range(length)]
    step[:sinks] = [float(2 * length + p) for p in range(min(sinks, length))]
    swept: list[int] = []  # held tokens this sweep has passed, oldest first
    unswept: deque[int] = deque()  # held tokens ahead of the sweep, oldest first
    drops: deque[int] = deque()  # the current block's tokens this layer does not keep, leaving one per step
    held = min(sinks, length)
    for t in range(min(sinks, length), length):
        unswept.append(t)
        held += 1
        if held <= budget:
            continue
        if not drops:
            drops = next_block_drops(swept, unswept, t - window, before, after, offset)
        step[drops.popleft()] = float(t)
        held -= 1
    return torch.tensor(step, dtype=torch.float32)


def next_block_drops(swept: list[int], unswept: deque[int], newest_evictable: int, before: int, after: int,
                     offset: int) -> deque[int]:
    """Cut the next block ahead of the sweep (starting over from the oldest when no whole block of evictable
    tokens is left before the window): its kept tokens join `swept`, its others are returned, oldest first."""
    def whole_block() -> bool:
        return len(unswept) >= before and unswept[before - 1] <= newest_evictable

    if not whole_block():  # start over: what was swept is laddered again, from the oldest
        unswept.extendleft(reversed(swept))
        swept.clear()
    # A budget with no room past the sinks and the window (refused for the cache's own budget; a smaller prompt
    # target may have none) takes the oldest anyway: the cache's protection then keeps it.
    count = before if whole_block() else max(sum(1 for _ in takewhile(lambda p: p <= newest_evictable, unswept)), 1)
    block = [unswept.popleft() for _ in range(count)]
    kept = block[offset : offset + after]
    if len(kept) == len(block):  # a short last block holding only kept offsets: its oldest goes
        kept = block[1:]
    swept.extend(kept)
    return deque(p for p in block if p not in kept)


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
    prompt_rule_needs_own_cache = "ranks tokens by what only a lacache cache holds"
    setting_buffers = ("ladder_rank",)  # rebuilt when the budgets change, kept by reset

    def __init__(self, batch_size: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, *args, **kwargs)
        if self.capacity_needed >= 1 << 40:
            raise ValueError("a lacache cache ranks every position of the run: give it capacity_needed")
        # each row's eviction step of every position of the run (rows may have different budgets)
        self.register_buffer("ladder_rank", torch.zeros(batch_size, self.capacity_needed, device=self.pos.device))
        if self.setting(self.SPAN) is None:
            self.fill_ladder()  # the default span fits any depth; a given one waits for the model's (configure)

    def shape(self) -> tuple[int, int]:
        """The ladder's (before, after) over the layers holding a lacache cache (the model's layers, but for
        its sliding layers or a per-layer strategy pattern): the span's default is half of them; a single one
        has no ladder and gets the smallest, 1 of each 2."""
        layers = self.strategy_layers
        span, overlap = self.setting(self.SPAN), int(self.setting(self.OVERLAP))
        if span is None:
            span = max(layers // 2, 1)
            if layers < 2:
                return 2, 1
        if overlap >= span:
            raise UserError(f"--lacache_overlap {overlap} must be below --lacache_span {span}")
        before, after = ladder_shape(layers, int(span), overlap)
        if before <= after:
            raise UserError(f"--lacache_span {span} (overlap {overlap}) over {layers} lacache layers keeps every token "
                            f"in every layer ({after} of each {before}): give a span below the layer count")
        return before, after

    def fill_ladder(self) -> None:
        """`ladder_rank`: each row's eviction steps under its prompt target (the budget, or the kvpress protocol's
        prompt budget), built on the host (whichever rows a row context shows)."""
        before, after = self.shape()
        length = self.ladder_rank.shape[-1]
        offset = self.strategy_layer_idx % (before - after + 1)
        for r, budget in enumerate(self.row_budgets):
            target = min(self.prompt_budget, budget) if self.prompt_budget else budget
            steps = eviction_steps(length, target, self.global_tokens, self.recent_window, before, after, offset)
            self.ladder_rank[r].copy_(steps)

    def configure(self, **settings: object) -> None:
        super().configure(**settings)
        self.fill_ladder()  # the layer's rung and the number of lacache layers are known now

    def set_row_budgets(self, budgets: list[int], capacities: list[int]) -> None:
        super().set_row_budgets(budgets, capacities)
        self.fill_ladder()

    def steps_of(self, positions: Tensor) -> Tensor:
        """Each row's eviction step of `positions` [B, 1, N] (empty slots, −1, read position 0: protected)."""
        return self.ladder_rank.gather(1, positions.clamp(min=0).flatten(1)).view(positions.shape)

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.steps_of(self.pos)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return cache.steps_of(cache.scored_positions(k))
