"""Head-adaptive budgets: `--budget_allocation adakv` (Ada-KV, Feng et al. 2024, arXiv 2407.11550).

With the default `uniform` allocation every KV head of a layer holds at most L tokens (buffers
[B, n_kv, L, ...]). Ada-KV gives the layer one budget of n_kv·L tokens and lets the heads share it by
score mass: at prefill the best n_kv·L (head, token) pairs of the layer are kept, with every head keeping
at least `--adakv_floor` × L of its own best (prompt_compression.adaptive_prompt_tokens). Heads whose
attention is concentrated then hold fewer tokens and heads whose attention is spread hold more.

The memory is really shared, not a masked uniform buffer (kvpress's AdaKVPress masks evicted keys and
saves nothing): the K/V storage of a pooled cache has one "head" of P = n_kv·L slots, [B, 1, P, D], so
it holds exactly the bytes of the uniform [B, n_kv, L, D] (dense and per-token-quantized storage work
unchanged). Each slot is owned by one head: head h owns the contiguous slots
[offset_h, offset_h + quota_h), with Σ quota_h = P.

- `pos` [B, n_kv, P] and `mask` [B, n_kv, 1, P] are per head over the pool (−1 / False outside the head's
  own slots). The strategy's own per-slot state has the same layout ([B, n_kv, P]: a row per head, read
  only at its slots), so every head-specific strategy runs unchanged: its hooks index slots of the pool.
  That bookkeeping is n_kv × the uniform cache's (statistics report `cache_kv_bytes` apart from
  `cache_bytes`; tests assert the bound).
- Decode: attention of KV head h runs over the whole pool with a mask of h's slots (model.py builds the
  per-query-head mask), so attention computes n_kv × the dot products of the uniform cache while reading
  the same K/V bytes; update_state still gets probabilities [B, n_kv, rep, P] (zero outside the head's
  slots). Each head fills its empty slots, then evicts its own lowest-scoring unprotected slot: quotas are
  fixed after prefill. Slot choice is tensor ops on fixed shapes, as for every cache.
- Allocation happens at prefill, when the prompt exceeds the per-head target (L, or the kvpress
  protocol's `prompt_budget`); a prompt within it gives every head L slots (uniform). Slots left for
  what follows the prompt (L − target per head) are shared out equally, so every head has room for an
  appended chunk (`append`), which every head receives whole.

Refused (`check_budget_allocation`, before anything loads): strategies that are not head-specific (one
score per token: nothing to allocate by), `hybrid` (FastGen sizes its heads by its own policies), prompt
rules that are not head-specific, KIVI storage (its key groups share per-channel scales over consecutive
slots of one head and its residual flushes per head, which a pool of mixed heads breaks), and
`--feed_long_prompts` (its prefill fits the budget, so nothing would ever be allocated).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from cache import KVCache, row_positions
from cache_chunking import Rerotation
from errors import UserError
from kv_storage import scatter_slots
from prompt_compression import adaptive_prompt_tokens, restash_scoring, stashed_scoring
from strategies import CACHE_STRATEGIES, get_strategy
from strategies.debug import DebugCache, debug_strategy

ALLOCATIONS = ("uniform", "adakv")
# Ada-KV's safeguard α as kvpress's AdaKVPress applies it (`alpha_safeguard`, 0.2): every head keeps at least
# this fraction of its budget, forced in before the layer's best pairs. Ada-KV's own code blends instead: a head
# gets (1 − α) × its share of the layer's top pairs + α × the budget.
DEFAULT_FLOOR = 0.2

_POOLED_CLASSES: dict[type[KVCache], type[KVCache]] = {}


class PooledCache(KVCache):
    """The pooled layer cache; mixed in before a head-specific strategy by `adakv_strategy`."""

    pooled = True

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, max_cache_length: int, *args: object,
                 **kwargs: object) -> None:
        # The strategy sizes its buffers by max_cache_length: the pool, P = n_kv·L slots (the rest of
        # KVCache's arguments pass through unchanged).
        pool = n_kv_heads * max_cache_length
        super().__init__(batch_size, n_kv_heads, head_dim, pool, *args, **kwargs)
        self.max_cache_length = max_cache_length  # the per-head budget L: the average quota
        self.pool_slots = pool  # the buffers' pool; a row with a smaller budget uses its first n_kv·L_b slots
        self.set_row_budgets([max_cache_length] * batch_size, self.row_capacities)
        self.floor_fraction = float(self.hparams.get("adakv_floor", DEFAULT_FLOOR))
        kw = dict(dtype=torch.long, device=self.pos.device)
        self.register_buffer("quota", torch.zeros(batch_size, n_kv_heads, **kw))  # slots each head owns
        self.register_buffer("offset", torch.zeros(batch_size, n_kv_heads, **kw))  # its first slot
        self.uniform_quotas()

    def uniform_quotas(self) -> None:
        """L slots per head, head h from slot h·L: the layout of a prompt within the budget."""
        L = self.max_cache_length
        self.quota.fill_(L)
        self.offset.copy_(torch.arange(self.n_kv_heads, device=self.pos.device).expand_as(self.offset) * L)

    def reset(self) -> None:
        super().reset()
        self.uniform_quotas()  # a step on reset caches (compile warm-up) then behaves as an empty cache

    def owned(self) -> Tensor:
        """Which pool slots each head owns, [B, n_kv, P]."""
        slots = torch.arange(self.pool_slots, device=self.pos.device)
        start = self.offset[..., None]
        return (slots >= start) & (slots < start + self.quota[..., None])

    def head_budgets(self) -> Tensor:
        return self.quota.clone()

    def room(self) -> int:
        return int((self.quota - self.filled).min())

    # ---- prefill: the allocation --------------------------------------------------------------------------

    def select_pairs(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        """The (head, token) pairs kept from a prompt longer than the per-head target: [B, n_kv, T] bool."""
        rule = self.prompt_compressor
        scores = None if rule is None else rule.prompt_scores(self, k, q)
        if scores is None or scores.shape[1] != k.shape[1]:
            name = "full" if rule is None else rule.name
            raise UserError(f"--budget_allocation adakv needs head-specific prompt scores; prompt compression "
                            f"'{name}' gives none (choose a head-specific --prompt_compression_strategy)")
        target = self.prompt_target()
        return adaptive_prompt_tokens(scores, self.global_tokens, rule.prompt_protected_window(self), target,
                                      int(self.floor_fraction * target))

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        if k_store is not None:  # keys to store before RoPE: --rerotate_positions, refused with adakv
            raise ValueError("a pooled cache does not store keys for re-rotation")
        B, H, T, D = k.shape
        self.observe_prompt_values(v)
        L, P, target = self.max_cache_length, self.pool_slots, self.prompt_target()
        n = min(T, target)  # tokens kept per head on average
        if T > target:
            keep = self.select_pairs(input_pos, k, v, q)
        else:
            keep = torch.ones(B, H, T, dtype=torch.bool, device=k.device)
        counts = keep.sum(-1)  # [B, H]
        # Each head owns what it keeps plus an equal share of the slots left for what follows the prompt.
        self.quota.copy_(counts + (L - n))
        self.offset.copy_(self.quota.cumsum(-1) - self.quota)
        # The H·n kept pairs in head-major, position order (a sort, not nonzero: fixed shapes, any device);
        # pair i of head h goes to slot offset_h + its rank in h, which is i + h·(L − n).
        m = H * n
        flat = torch.arange(H * T, device=k.device).expand(B, -1)
        pairs = torch.where(keep.flatten(1), flat, flat + H * T).sort(dim=-1).values[:, :m]  # [B, m]
        head, token = pairs // T, pairs % T
        slot = torch.arange(m, device=k.device) + head * (L - n)
        rows = pairs[..., None].expand(B, m, D)
        k_kept, v_kept = (x.flatten(1, 2).gather(1, rows)[:, None] for x in (k, v))  # [B, 1, m, D]
        self.storage.write(slot[:, None], k_kept, v_kept)
        cell = head * P + slot  # (head, slot) in the flattened per-head buffers
        self.pos.view(B, H * P).scatter_(1, cell, input_pos[token])
        self.mask.view(B, H * P).scatter_(1, cell, True)
        self.inserted.fill_(T)
        self.filled.copy_(counts)
        # Strategy hooks write per-slot state as state[:, :, :n] = per_token.gather(2, keep): give them, for
        # every head's row, the prompt token each pool slot holds (rows of other heads are never read;
        # empty slots get token 0 and are initialised by after_insert when they receive a token).
        slot_token = torch.zeros(B, P, dtype=torch.long, device=k.device).scatter(1, slot, token)
        self.after_prefill(slot_token[:, None].expand(B, H, P), input_pos, k, q)

    # ---- decode: each head evicts within its own slots ---------------------------------------------------------

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """Per head [B, n_kv]: its next empty slot while it has one, else its lowest-scoring unprotected slot."""
        empty = self.offset + self.filled
        if self.never_full:
            return empty  # never full: skip scoring
        blocked = self.protected(input_pos) | ~self.owned()
        # A head's quota exceeds its protected tokens (it keeps them, and its prompt target exceeds them).
        scores = self.token_scores(input_pos).masked_fill(blocked, float("inf"))
        return torch.where(self.filled < self.quota, empty, scores.argmin(dim=-1))

    def insert(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        self.observe_token_values(v)
        slot = self.choose_slot(input_pos)  # [B, n_kv]: distinct slots, each in its head's range
        B, H = k.shape[:2]
        self.storage.write(slot[:, None], k.transpose(1, 2), v.transpose(1, 2))  # H rows of the one pool head
        scatter_slots(self.pos, 2, slot[..., None], row_positions(input_pos).expand(B, H, 1))
        scatter_slots(self.mask, 3, slot[..., None, None], True)
        self.inserted += 1
        self.filled += (self.filled < self.quota).long()
        self.after_insert(slot, input_pos, k)


    # ---- chunked prefill (--prefill_chunk): each head's own held tokens + the chunk ------------------------

    def keep_chunk_queries(self, q: Tensor, positions: Tensor) -> None:
        """The queries of the token each pool slot holds, those of its owner head's group: [B, rep, P, D],
        the bytes of the uniform cache's held queries (positions [B, n_kv, T], sorted, as in the base)."""
        B, n_head, T, D = q.shape
        H, P = self.n_kv_heads, self.pool_slots
        rep = n_head // H
        index = torch.searchsorted(positions.contiguous(), self.pos.clamp(min=0).contiguous()).clamp(max=T - 1)
        owner = self.owned().long().argmax(dim=1)  # [B, P]: the head owning each slot (Σ quota = P: all owned)
        grouped = q.reshape(B, H, rep, T, D)
        rows = owner[:, None, :].expand(B, rep, P) * rep + torch.arange(rep, device=q.device)[None, :, None]
        token = index.gather(1, owner[:, None, :])[:, 0]  # [B, P]: the slot's token, in its owner's row
        flat = grouped.reshape(B, H * rep, T, D)
        self.chunk_queries = flat[torch.arange(B, device=q.device)[:, None, None], rows, token[:, None, :]]

    @contextmanager
    def head_view(self, b: int, h: int, slots: slice | None = None) -> Iterator[PooledCache]:
        """Inside it the cache is row b's head h alone (n_kv = 1): every [B, n_kv, ...] buffer and tensor
        attribute is viewed at [b, h] (in-place writes land in the pool's buffers), and with `slots` the
        per-slot buffers (pos, mask, the strategy's slot buffers) at the head's slots, so hooks that read
        slots 0..n−1 (`carry_over`) read the head's held tokens; `first_kv_head` is h. Attributes set inside are
        undone on exit."""
        B, H = self.inserted.shape
        per_slot = {"pos", "mask", *self.slot_buffers}
        # The plain attributes are swapped in the instance dict directly: a pool's chunk opens several views a
        # head, and nn.Module.__setattr__ (each name looked up among parameters, buffers and modules) took
        # over half of their cost.
        attributes = self.__dict__
        swapped, saved = [], {key: value for key, value in attributes.items() if not key.startswith("_")}
        for name, buf in list(self._buffers.items()):
            if buf is None or buf.dim() < 2 or buf.shape[:2] != (B, H) or name in self.row_shared_buffers:
                continue
            view = buf[b : b + 1, h : h + 1]
            self._buffers[name] = view[..., slots] if slots is not None and name in per_slot else view
            swapped.append((name, buf))
        for key, value in saved.items():
            if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[:2] == (B, H):
                attributes[key] = value[b : b + 1, h : h + 1]
        attributes["n_kv_heads"], attributes["first_kv_head"] = 1, h
        try:
            yield self
        finally:
            for name, buf in swapped:
                self._buffers[name] = buf
            for key in [key for key in attributes if not key.startswith("_") and key not in saved]:
                delattr(self, key)
            attributes.update(saved)

    def reprefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, rerotation: Rerotation | None) -> None:
        """Ada-KV after a chunk: head h's virtual prompt is the tokens it holds (its own count) followed by the
        chunk; its rule scores it alone (a head view), and the layer's n_kv·target slots go to the best
        (head, token) pairs over all heads, protected tokens and the per-head floor as at a prefill
        (`adaptive_prompt_tokens`); then every head's `after_prefill` runs over its own virtual prompt."""
        if rerotation is not None:
            raise ValueError("a pooled cache does not store keys for re-rotation")
        B, H, T, D = k.shape
        end, rep = int(input_pos[-1]) + 1, q.shape[1] // H
        counts, offsets = self.filled.tolist(), self.offset.tolist()
        pool_k, pool_v = self.keys()[:, 0], self.values()[:, 0]  # [B, P, D]
        heads = {}  # (b, h) -> positions [N], keys [N, D], values [N, D], queries [rep, N, D], carried inputs
        for b in range(B):
            for h in range(H):
                held = slice(offsets[b][h], offsets[b][h] + counts[b][h])
                with self.head_view(b, h, held):
                    carried = self.carry_over(counts[b][h])
                cat = lambda held_part, chunk_part, dim=0: torch.cat([held_part, chunk_part], dim)  # noqa: E731
                heads[b, h] = (cat(self.pos[b, h, held], input_pos), cat(pool_k[b, held], k[b, h]),
                               cat(pool_v[b, held], v[b, h]),
                               cat(self.chunk_queries[b, :, held], q[b, h * rep : (h + 1) * rep], 1), carried)
        seen = self.inserted + T
        self.reset()
        layer = self.gather_layer_statistics(heads, end, T)
        keep, scorings = self.chunk_pairs(heads, end, T, layer)  # (b, h) -> sorted indices into its virtual prompt
        self.write_pairs(heads, keep, seen)
        for (b, h), head in heads.items():
            positions, keys, _, queries, _ = head
            slot_token = torch.zeros(self.pool_slots, dtype=torch.long, device=k.device)
            start = int(self.offset[b, h])
            slot_token[start : start + len(keep[b, h])] = keep[b, h]
            head_keys = keys[None, None]
            with self.virtual_head(b, h, head, end, T, layer):
                restash_scoring(self, scorings.get((b, h)), head_keys)
                self.after_prefill(slot_token.view(1, 1, -1), positions.view(1, 1, -1), head_keys, queries[None])

    @contextmanager
    def virtual_head(self, b: int, h: int, head: tuple, end: int, chunk: int,
                     layer: dict[int, dict] | None = None) -> Iterator[PooledCache]:
        """Inside: row b's head h alone (`head_view`) with its virtual prompt `head` (positions, keys, values,
        queries, carried inputs): the carried inputs taken over, the positions, end and held count that
        `scored_positions`, `scored_length` and `scored_held_tokens` answer, its values observed, and
        `layer_statistics` row b's of `layer` (`gather_layer_statistics`)."""
        positions, _, values, _, carried = head
        with self.head_view(b, h):
            self.take_over(carried)
            self.scored_pos, self.scored_end, self.scored_held = positions.view(1, 1, -1), end, len(positions) - chunk
            self.observe_prompt_values(values[None, None])
            if layer:
                self.layer_statistics = layer[b]
            yield self

    def gather_layer_statistics(self, heads: dict, end: int, chunk: int) -> dict[int, dict]:
        """What a rule takes over the layer's heads together (Compactor's z-scores' moments), from every head's
        virtual prompt: row b -> name -> the heads' parts (the rule's `head_statistics`) joined along their last
        dimension, and "heads" -> each head's own; {} when the rule takes nothing so. Inside `virtual_head` it is
        the `layer_statistics` attribute, so a head scored alone is scored as in a prefill of all heads together."""
        rule = self.prompt_compressor
        if rule is None:
            return {}
        parts = {}
        for (b, h), head in heads.items():
            _, keys, _, queries, _ = head
            with self.virtual_head(b, h, head, end, chunk):
                got = rule.head_statistics(self, keys[None, None], queries[None])
            if got is None:
                return {}
            parts[b, h] = got
        B, H = self.inserted.shape
        # "heads": each head's own parts too, so that scoring a head alone need not compute them again.
        return {b: {**{name: torch.cat([parts[b, h][name] for h in range(H)], dim=-1) for name in parts[b, 0]},
                    "heads": [parts[b, h] for h in range(H)]} for b in range(B)}

    def chunk_pairs(self, heads: dict, end: int, chunk: int,
                    layer: dict[int, dict]) -> tuple[dict[tuple[int, int], Tensor], dict]:
        """The (head, token) pairs kept out of every head's virtual prompt: (b, h) -> sorted indices; and what
        each head's rule computed scoring it (`stashed_scoring`), which its after_prefill takes back rather than
        scoring the head once more."""
        sizes = {len(p) for p, *_ in heads.values()}
        target = self.prompt_target()
        if len(sizes) == 1 and sizes.pop() <= target:  # every head holds the whole prompt so far, and it fits
            return {key: torch.arange(len(p), device=p.device) for key, (p, *_) in heads.items()}, {}
        rule = self.prompt_compressor
        window = rule.prompt_protected_window(self)
        B, H = self.inserted.shape
        longest = max(len(p) for p, *_ in heads.values())
        scores = torch.full((B, H, longest), float("-inf"), device=self.pos.device)  # −inf: past a head's prompt
        scorings = {}
        for (b, h), head in heads.items():
            positions, keys, _, queries, _ = head
            with self.virtual_head(b, h, head, end, chunk, layer):
                got = rule.prompt_scores(self, keys[None, None], queries[None])
                scorings[b, h] = stashed_scoring(self)
            if got is None or got.shape[1] != 1:
                raise UserError(f"--budget_allocation adakv needs head-specific prompt scores; prompt compression "
                                f"'{rule.name}' gives none")
            protected = (positions < self.global_tokens) | (positions >= end - window)
            scores[b, h, : len(positions)] = got[0, 0].float().masked_fill(protected, float("inf"))
        chosen = adaptive_prompt_tokens(scores, 0, 0, target, int(self.floor_fraction * target))
        return {(b, h): chosen[b, h, : len(p)].nonzero()[:, 0] for (b, h), (p, *_) in heads.items()}, scorings

    def write_pairs(self, heads: dict, keep: dict, seen: Tensor) -> None:
        """The kept pairs into the pool, head h from its new offset, in position order; quotas as at a
        prefill: what each head keeps plus an equal share of the slots left for what follows the prompt."""
        B, H = self.inserted.shape
        counts = torch.tensor([[len(keep[b, h]) for h in range(H)] for b in range(B)], device=self.pos.device)
        self.quota.copy_(counts + self.max_cache_length - counts.sum(-1, keepdim=True) // H)
        self.offset.copy_(self.quota.cumsum(-1) - self.quota)
        rep, D = heads[0, 0][3].shape[0], heads[0, 0][3].shape[-1]
        queries = heads[0, 0][3].new_zeros(B, rep, self.pool_slots, D)
        offsets, device = self.offset.tolist(), self.pos.device
        for b in range(B):  # one write a row: its heads' kept pairs, each head's from its offset on
            kept = [keep[b, h] for h in range(H)]
            slots = torch.cat([torch.arange(offsets[b][h], offsets[b][h] + len(kept[h]), device=device)
                               for h in range(H)])
            owner = torch.repeat_interleave(torch.arange(H, device=device), counts[b])
            parts = [[part[kept[h]] for part in heads[b, h][:3]] for h in range(H)]
            positions, keys, values = (torch.cat(column) for column in zip(*parts, strict=True))
            with self.row(b):
                self.storage.write(slots.view(1, 1, -1), keys[None, None], values[None, None])
            self.pos[b, owner, slots] = positions
            self.mask[b, owner, 0, slots] = True
            queries[b, :, slots] = torch.cat([heads[b, h][3][:, kept[h]] for h in range(H)], dim=1)
        self.filled.copy_(counts)
        self.inserted.copy_(seen)
        self.chunk_queries = queries


def adakv_strategy(inner: type[KVCache]) -> type[KVCache]:
    """The pooled class of a head-specific strategy, made once; it reads the strategy's flags and
    `adakv_floor`, and keeps its name (statistics, the spec table and debug_ twins name the strategy)."""
    if not inner.head_specific or inner.profiles_prompt or issubclass(inner, (DebugCache, PooledCache)):
        raise UserError(f"--budget_allocation adakv cannot pool the {inner.name} cache")
    if inner not in _POOLED_CLASSES:
        _POOLED_CLASSES[inner] = type(
            f"AdaKV{inner.__name__}", (PooledCache, inner),
            {"hyperparameters": (*inner.hyperparameters, "adakv_floor"),
             "__doc__": f"`{inner.name}` with head-adaptive budgets over one K/V pool (budget_allocation.py)."},
        )
    return _POOLED_CLASSES[inner]


def with_allocation(cls: type[KVCache], allocation: str) -> type[KVCache]:
    """The cache class of a layer: `cls` itself (uniform), or its pooled class (a debug_ twin pools its shadow)."""
    if allocation == "uniform":
        return cls
    if allocation != "adakv":
        raise UserError(f"unknown --budget_allocation {allocation!r}; available: {', '.join(ALLOCATIONS)}")
    if issubclass(cls, DebugCache):
        return debug_strategy(adakv_strategy(cls.shadow_class))
    return adakv_strategy(cls)


def check_budget_allocation(args: argparse.Namespace) -> None:
    """The --budget_allocation / --adakv_floor flags against the rest, before anything loads: one line each."""
    allocation = getattr(args, "budget_allocation", "uniform")
    floor = getattr(args, "adakv_floor", DEFAULT_FLOOR)
    if allocation not in ALLOCATIONS:
        raise UserError(f"unknown --budget_allocation {allocation!r}; available: {', '.join(ALLOCATIONS)}")
    if allocation == "uniform":
        if floor != DEFAULT_FLOOR:
            raise UserError("--adakv_floor applies to --budget_allocation adakv only")
        return
    if not 0 <= floor <= 1:
        raise UserError(f"--adakv_floor is a fraction of the per-head budget in [0, 1], got {floor:g}")
    pooled = sorted(n for n, c in CACHE_STRATEGIES.items() if c.head_specific and not c.profiles_prompt
                    and not getattr(c, "variable_occupancy", False) and not c.merges_keys)
    for name in dict.fromkeys(args.cache_strategy):
        own = getattr(get_strategy(name), "shadow_class", get_strategy(name))
        twin = "debug_" if own is not get_strategy(name) else ""  # a debug_ twin is told the poolable twins
        choices = ", ".join(twin + n for n in pooled)
        if own.profiles_prompt:
            raise UserError(f"--budget_allocation adakv: the {name} cache sizes its heads by its own policies "
                            f"(FastGen); use one of: {choices}")
        if getattr(own, "variable_occupancy", False):
            raise UserError(f"--budget_allocation adakv: the {name} cache holds a variable number of tokens per head "
                            f"(a pool never reuses released slots); use one of: {choices}")
        if own.merges_keys:
            raise UserError(f"--budget_allocation adakv: the {name} cache merges what it evicts into the tokens it "
                            f"keeps, which a pool's heads do not do; use one of: {choices}")
        if not own.head_specific:
            raise UserError(f"--budget_allocation adakv shares a layer's budget between KV heads by their own "
                            f"scores, but the {name} cache keeps the same tokens in every head; use one of: {choices}")
    for name in dict.fromkeys(args.prompt_compression_strategy):
        if name not in ("auto", "full") and not get_strategy(name).head_specific:
            raise UserError(f"--budget_allocation adakv allocates by per-head prompt scores, and prompt compression "
                            f"'{name}' scores tokens alike in every head; use auto or one of: {', '.join(pooled)}")
    if getattr(args, "cache_bits", 16) < 16 and getattr(args, "cache_quantization", "per_token") == "kivi":
        raise UserError("--budget_allocation adakv pools the heads' slots, which KIVI cannot do (its key groups "
                        "share per-channel scales over consecutive slots of one head); use --cache_quantization "
                        "per_token")
    if getattr(args, "rerotate_positions", False):
        raise UserError("--budget_allocation adakv and --rerotate_positions do not combine: a pooled slot's key would "
                        "need its owner head's rank, and the pool is rotated as one row")
    if getattr(args, "feed_long_prompts", False):
        raise UserError("--budget_allocation adakv allocates when a prefill exceeds the budget, and "
                        "--feed_long_prompts prefills only what fits it: nothing would be allocated")

