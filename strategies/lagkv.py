"""`lagkv`: LagKV (Liang et al. 2025, "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important", arXiv 2504.04704). Attention-free: it reads keys and values only.

After the sinks (the first `global_tokens`), the sequence is cut into partitions of `--lag_size` tokens. A
partition is scored against the next one (its "lag" partition): each key is min-max normalised per channel
by the next partition's keys, x̄ = (x − min_ref) / (max_ref − min_ref), and its score is the softmax, over
its partition, of the standard deviation of x̄ across channels (a token unlike what follows it carries
information); the same for values, and the token's score is the mean of the two. Tokens are then ranked
within their partition (score = rank / lag_size), so every partition is compressed at the same ratio, as
in the paper. A partition whose successor is not complete yet (the tail) is not scored: it is kept, the
newest first, with score 1 + position / (seen + 1), above every scored token.

- Prompt: every partition followed by a complete one is scored and ranked; the best `budget` tokens stay.
- Decode: when a token completes a partition, the partition before it is scored against it, once, from
  the held keys and values (the storage's, dequantized), and keeps those scores (slot state); the lowest
  is evicted. Tail tokens wait unscored, so the reference partition is whole when it is used.

Where this differs from the paper: LagKV compresses a partition to a fixed ratio as soon as it is scored
(its cache length follows the sequence); here one token is evicted when the budget is full, the lowest rank
first, so the budget fixes the ratio and partitions thin out together (each holds one token of every rank).
Heads that share a pool (--budget_allocation adakv) need scores comparable across heads, which ranks are not
(every head has the same ranks): they use the softmax scores unranked, as the reference implementation's
`cross_scoring` option for Ada-KV does. The prompt rule reads the prompt's values only in a lagkv cache's
own prefill: another cache using `lagkv` as its --prompt_compression_strategy, and a pooled cache
(--budget_allocation adakv), score the prompt's keys alone. A channel whose reference range is 0 is divided
by 1e-6. The standard deviation is the sample one (n − 1), as the reference implementation's torch.std.

With --prefill_chunk a re-prefill's virtual prompt (the held tokens + the chunk) is partitioned by true
position, a partition is scored against the tokens of the next one that are present once that one is
complete, and a held token keeps the score its partition got in an earlier chunk: a partition is scored
once, as at decode (its tokens are all present then, unless the unscored tail outgrew the budget).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy, row_positions
from kv_storage import scatter_slots

LAG = Setting("lag_size", 128, low=2, help="tokens per partition; each is scored against the next one")
RANGE_FLOOR = 1e-6


def relative_spread(x: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Std across channels of x min-max normalised by the reference's [lo, hi] per channel: x [..., D]."""
    return ((x.float() - lo) / (hi - lo).clamp(min=RANGE_FLOOR)).std(dim=-1)


def prompt_lag_scores(states: list[Tensor], sinks: int, lag: int, ranked: bool = True) -> Tensor:
    """LagKV's scores of a prompt's tokens from its keys (and values): states [B, H, T, D] each -> [B, H, T]:
    rank / lag within the partition for scored tokens (`ranked`; else the softmax score itself, comparable
    across heads), 1 + position / (T + 1) for sinks and the tail."""
    B, H, T, _ = states[0].shape
    pos = torch.arange(T, device=states[0].device)
    scores = (1 + pos.float() / (T + 1)).expand(B, H, T).clone()
    complete = max(T - sinks, 0) // lag
    if complete < 2:
        return scores
    total = 0
    for x in states:
        parts = x[:, :, sinks : sinks + complete * lag].unflatten(2, (complete, lag))  # [B, H, n, lag, D]
        target, ref = parts[:, :, :-1], parts[:, :, 1:].float()
        spread = relative_spread(target, ref.amin(dim=3, keepdim=True), ref.amax(dim=3, keepdim=True))
        total = total + spread.softmax(dim=-1)
    score = total / len(states)  # [B, H, n - 1, lag]
    if ranked:
        score = score.argsort(dim=-1).argsort(dim=-1).float() / lag
    scores[:, :, sinks : sinks + (complete - 1) * lag] = score.flatten(2)
    return scores


def partition_lag_scores(states: list[Tensor], target: Tensor, ref: Tensor, lag: int, ranked: bool = True) -> Tensor:
    """Scores of the held slots `target` [B, H, L] bool against the held slots `ref` (the next partition),
    from states [B, H, L, D] each: rank / lag among the targets (else the softmax score), [B, H, L]
    (meaningless elsewhere)."""
    total = 0
    for x in states:
        xf = x.float()
        lo = xf.masked_fill(~ref[..., None], float("inf")).amin(dim=2, keepdim=True)
        hi = xf.masked_fill(~ref[..., None], float("-inf")).amax(dim=2, keepdim=True)
        spread = relative_spread(xf, lo, hi).masked_fill(~target, float("-inf"))
        total = total + spread.softmax(dim=-1)
    if not ranked:
        return total / len(states)
    key = (total / len(states)).masked_fill(~target, float("inf"))
    return key.argsort(dim=-1).argsort(dim=-1).float() / lag  # targets sort first: their rank among themselves


def virtual_lag_scores(states: list[Tensor], positions: Tensor, end: int, sinks: int, lag: int, ranked: bool,
                       carried: Tensor | None) -> Tensor:
    """`prompt_lag_scores` of a virtual prompt whose tokens sit at `positions` [B, 1 or H, N] (sorted, with gaps)
    out of `end` seen: partitions are cut by position, and partition p is scored against the tokens of p + 1
    present once p + 1 is complete (rank / lag among p's present tokens). `carried` [B, H, n]: the scores of
    the first n tokens (held ones) from earlier chunks, −1 where unscored; a scored one keeps its score."""
    B, H, N, _ = states[0].shape
    pos = positions.expand(B, H, N)
    scores = 1 + pos.float() / (end + 1)
    part = torch.div(pos - sinks, lag, rounding_mode="floor")
    body = pos >= sinks
    fresh = torch.ones_like(body)
    if carried is not None:
        fresh[:, :, : carried.shape[-1]] = carried < 0
    for p in range((end - sinks) // lag - 1):  # partitions followed by a complete one
        target = body & (part == p) & fresh
        if not bool(target.any()):
            continue
        ranks = partition_lag_scores(states, target, body & (part == p + 1), lag, ranked)
        scores = torch.where(target, ranks, scores)
    if carried is not None:
        n = carried.shape[-1]
        scores[:, :, :n] = torch.where(carried >= 0, carried, scores[:, :, :n])
    return scores


def when_closing(completes: Tensor, rescore: Callable, unchanged: Callable, operands: tuple[Tensor, ...]):
    """rescore(*operands), the decode step's partition scoring, which changes scores only where a row closes a
    partition (`completes`). A compiled CPU step branches on that under `torch.cond` (inductor evaluates it in
    the generated code, no graph break), running `unchanged` (the same outputs, untouched) the other lag − 1
    steps in lag; a GPU's step stays branch-free (a CUDA graph replays it, and the condition would need the
    host)."""
    if torch.compiler.is_compiling() and operands[0].device.type == "cpu":
        return torch.cond(completes.any(), rescore, unchanged, operands)
    return rescore(*operands)


@register_strategy
class LagKVCache(KVCache):
    name = "lagkv"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (LAG,)
    head_specific = True
    # Each slot's rank score once its partition is scored; −1 while it waits in the tail.
    slot_buffers = ("lag_score",)
    # --prefill_chunk: a re-prefill's virtual prompt (held tokens + the chunk) is partitioned by true position
    # (`virtual_lag_scores`), and a held token whose partition was scored in an earlier chunk keeps that
    # score (`carried_lag`): LagKV scores a partition once, when the next one is complete, as at decode.
    carried_lag: Tensor | None = None

    # The scores of the last prompt this cache prefilled, from its keys and values, [B, n_kv, T] (eager; T
    # floats per head, kept until the next prefill or reset): the prompt rule needs the values, which reach
    # only this cache's own prefill.
    prompt_lag: Tensor | None = None

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.lag = int(self.setting(LAG))

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        self.prompt_lag = self.lag_scores(self, [k, v])
        super().prefill(input_pos, k, v, q, k_store)

    @staticmethod
    def lag_scores(cache: KVCache, states: list[Tensor]) -> Tensor:
        """The prompt rule's scores of `cache`'s prompt (a chunked prefill's virtual prompt: by position)."""
        lag, ranked = int(cache.setting(LAG)), not cache.pooled
        held = cache.scored_held_tokens(states[0])
        if not held:
            return prompt_lag_scores(states, cache.global_tokens, lag, ranked)
        carried = getattr(cache, "carried_lag", None)
        return virtual_lag_scores(states, cache.scored_positions(states[0]), cache.scored_length(states[0]),
                                  cache.global_tokens, lag, ranked, carried if isinstance(cache, LagKVCache) else None)

    def carry_over(self, n: int) -> object:
        return self.lag_score[:, :, :n].clone()

    def take_over(self, carried: object) -> None:
        self.carried_lag = carried

    def reset(self) -> None:
        super().reset()
        self.prompt_lag = None

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        own = getattr(cache, "prompt_lag", None)
        if own is not None and own.shape == k.shape[:3]:
            return own
        return cls.lag_scores(cache, [k])

    def token_scores(self, input_pos: Tensor) -> Tensor:
        tail = 1 + self.pos.float() / (row_positions(input_pos).float() + 1)
        return torch.where(self.lag_score < 0, tail, self.lag_score)

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        scores = self.prompt_scores(self, k, q)
        scored = torch.where(scores < 1, scores, torch.full_like(scores, -1.0))
        self.lag_score[:, :, : keep.shape[-1]] = scored.gather(2, keep)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.lag_score, 2, slot[..., None], -1.0)
        newest = row_positions(input_pos)  # [1 or B, 1, 1]
        seen = newest + 1 - self.global_tokens
        completes = (seen > 0) & (seen % self.lag == 0)  # this token closes partition `seen // lag − 1`
        closed = seen // self.lag - 1
        held = self.mask[:, :, 0]
        if held.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(completes.any()):
            # An eager CPU step that closes no partition (lag − 1 steps in lag) changes no score: skip the
            # scoring (a compiled CPU step branches in when_closing; a GPU's would pay a sync).
            return
        pos = self.pos.expand_as(held)
        part = torch.div(pos - self.global_tokens, self.lag, rounding_mode="floor")
        body = held & (pos >= self.global_tokens)
        target, ref = body & (part == closed - 1), body & (part == closed)
        keys, values = self.keys(), self.values()
        if keys.shape[1] != held.shape[1]:  # a pooled cache: one K/V head of pool slots, masked per head
            keys, values = keys.expand(-1, held.shape[1], -1, -1), values.expand(-1, held.shape[1], -1, -1)
        if 2 * self.lag < held.shape[-1]:
            self.score_closed_partition(keys, values, target, ref, completes)
        else:
            self.score_every_slot(keys, values, target, ref, completes)

    def score_every_slot(self, keys: Tensor, values: Tensor, target: Tensor, ref: Tensor, completes: Tensor) -> None:
        """`after_insert`'s scoring over every slot (2 · lag slots or more would not be fewer)."""
        lag, ranked = self.lag, not self.pooled

        def rescore(keys: Tensor, values: Tensor, target: Tensor, ref: Tensor, completes: Tensor,
                    scores: Tensor) -> Tensor:
            ranks = partition_lag_scores([keys, values], target, ref, lag, ranked)
            return torch.where(completes & target & ref.any(dim=-1, keepdim=True), ranks, scores)

        def unchanged(keys: Tensor, values: Tensor, target: Tensor, ref: Tensor, completes: Tensor,
                      scores: Tensor) -> Tensor:
            return scores.clone()  # a branch of torch.cond may not return its input itself

        self.lag_score.copy_(when_closing(completes, rescore, unchanged, (keys, values, target, ref, completes,
                                                                          self.lag_score)))

    def score_closed_partition(self, keys: Tensor, values: Tensor, target: Tensor, ref: Tensor,
                               completes: Tensor) -> None:
        """`after_insert`'s scoring over the two partitions' slots only: a partition holds at most `lag`
        tokens, so `lag` slots each (their members first, then slots masked out) carry every score the rule
        reads, and a step reads 2 · lag slots' keys and values instead of every slot's (the same ranks).

        Under when_closing, so a compiled CPU step's other lag − 1 steps in lag only rewrite `lag` scores with
        themselves."""
        lag, ranked = self.lag, not self.pooled

        def rescore(keys: Tensor, values: Tensor, target: Tensor, ref: Tensor, completes: Tensor,
                    scores: Tensor) -> tuple[Tensor, Tensor]:
            t_slots, r_slots = (m.float().topk(lag, dim=-1).indices for m in (target, ref))  # [B, H, lag]
            slots = torch.cat([t_slots, r_slots], dim=-1)
            states = [x.gather(2, slots[..., None].expand(*slots.shape, x.shape[-1])) for x in (keys, values)]
            t_in, r_in = target.gather(2, t_slots), ref.gather(2, r_slots)
            neither = torch.zeros_like(t_in)
            ranks = partition_lag_scores(states, torch.cat([t_in, neither], dim=-1),
                                         torch.cat([neither, r_in], dim=-1), lag, ranked)[..., :lag]
            update = completes & t_in & r_in.any(dim=-1, keepdim=True)
            return t_slots, torch.where(update, ranks, scores.gather(2, t_slots))

        def unchanged(keys: Tensor, values: Tensor, target: Tensor, ref: Tensor, completes: Tensor,
                      scores: Tensor) -> tuple[Tensor, Tensor]:
            slots = torch.arange(lag, device=scores.device).expand(*target.shape[:2], lag).contiguous()
            return slots, scores.gather(2, slots)

        slots, new = when_closing(completes, rescore, unchanged, (keys, values, target, ref, completes,
                                                                  self.lag_score))
        scatter_slots(self.lag_score, 2, slots, new)
