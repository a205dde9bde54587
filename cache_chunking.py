"""Chunked prefill (`--prefill_chunk N`): the part of the KV cache contract (cache.py) that takes a prompt N
tokens at a time, as a mixin of `cache.KVCache`.

The prompt goes through the model N tokens at a time. The first chunk is a prefill; for each later one the
chunk's queries attend over the held tokens and the chunk (causally: `model.Attention.forward_chunk`), then
the layer is re-prefilled with a virtual prompt, the held tokens (K, V, their queries, true positions)
followed by the chunk, so its own prompt rule keeps at most the budget and its `after_prefill` sets its
per-slot state over that virtual prompt. The prompt rule, not the decode rule, because it is the rule each
strategy defines for choosing among many new tokens at once; a chunk of one token is a decode step.

- Positions: rules read them through `scored_positions` / `scored_length`, never the index.
- Statistics: by default recomputed over the virtual prompt's queries (the held tokens' and the chunk's;
  those of evicted tokens are gone), which is the method for statistics of the latest queries (SnapKV's
  window, TOVA's last query). Statistics that accumulate over every query (H2O's sums) carry the held
  tokens' values over (`carry_over` / `take_over`) and add what the chunk's queries give, the entries from
  `scored_held_tokens` on; LagKV keeps a partition's score once scored.
- Head-adaptive budgets (budget_allocation.PooledCache) override `reprefill`: each head's own held tokens
  + the chunk, the pool shared over all heads' pairs.
- Re-rotation (`Rerotation`): keys and queries are kept before RoPE and the virtual prompt is rotated at its
  ranks, so the prompt may run past the model's context at a fixed budget.
- FastGen's `hybrid` overrides `reprefill` too: its heads hold different counts, so each head's virtual prompt is
  its own held tokens + the chunk, and its profile accumulates over every chunk's queries; its policies' cut waits
  for `finish_chunked_prefill`, the hook `end_chunked_prefill` calls on every cache (strategies/hybrid.py).
- A strategy whose prefill could not take a virtual prompt would declare `chunked_prefill_refusal`, and one that
  takes chunks with some flags only would answer `chunked_prefill_conflict` (none does either).
  KVzip's model-level reconstruction pass runs once per chunk (strategies/kvzip.py, ChunkedReconstruction).
- A storage whose stored form loses what a re-prefill would lose again (`Storage.exact_in_chunks`: ThinK's
  keys, whose pruned channels a new channel set would prune further; KIVI's keys and values, whose key groups
  would be re-quantized over other tokens) hands a re-prefill exact copies instead: the cache keeps the held
  tokens' exact keys / values beside their queries (`chunk_keys`, `chunk_values`, until
  `end_chunked_prefill`), the chunk attends over them and the re-prefill scores and stores from them, so each
  re-prefill is the one-shot prefill of its virtual prompt (ThinK's channels chosen over its kept keys and
  last window, KIVI's groups quantized from exact keys). A cache that never compresses (full, a debug_
  twin's own part) rewrites its storage from every token's exact K/V at each chunk, with the chunk's queries.
  Per-token quantization re-prefills from its dequantized K/V: in float32 they quantize to themselves again;
  in bfloat16 the scales round again at each chunk (no fidelity cost measured at 4 bits, docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rerotation:
    """A chunk's keys and queries before RoPE and `rope(x, ranks)`, which rotates x [B, heads, N, D] at ranks
    [1 or B, 1 or heads, N] (--rerotate_positions: model.Attention.forward_chunk passes them)."""

    k_plain: Tensor
    q_plain: Tensor
    rope: Callable[[Tensor, Tensor], Tensor]


def over_held_slots(stored: Tensor, exact: Tensor | None) -> Tensor:
    """stored [B, H, L, D] with its first n slots replaced by `exact` [B, H, n, D] (None: stored as it is)."""
    return stored if exact is None else torch.cat([exact, stored[:, :, exact.shape[2] :]], dim=2)


class ChunkedPrefill:
    """The chunked-prefill methods and state of a `KVCache` (which provides prefill, reset, keys, values,
    the buffers pos / mask / filled / inserted and the hooks)."""

    # --prefill_chunk (cache_spec): the prompt goes through the model this many tokens at a time (0: at once).
    prefill_chunk: int = 0
    # Why this strategy cannot compress a prompt chunk by chunk (None: it can; cache_spec refuses the flag).
    chunked_prefill_refusal: ClassVar[str | None] = None

    @classmethod
    def chunked_prefill_conflict(cls, args: object) -> str | None:
        """Why this strategy cannot take chunks together with the other flags in `args` (None: it can)."""
        return None
    # During a chunked prefill: the held tokens' queries (prefill_chunk_tokens), and the true positions of
    # the virtual prompt a re-prefill scores (scored_positions), its end and its held tokens' count.
    chunk_queries: Tensor | None = None
    # The held tokens' exact keys / values [B, n_kv, n, D] in slot order, where the storage asks for them.
    chunk_keys: Tensor | None = None
    chunk_values: Tensor | None = None
    scored_pos: Tensor | None = None
    scored_end: int | None = None
    scored_held: int = 0

    def prefill_chunk_tokens(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor,
                             rerotation: Rerotation | None = None) -> None:
        """One chunk of a prompt fed `prefill_chunk` tokens at a time (input_pos [T] true positions; k, v, q
        as `prefill`). The first chunk is a prefill. Every later one re-prefills the layer with a virtual
        prompt: the tokens it holds (their K, V, queries and true positions, in position order) followed by
        the chunk, so the strategy's own prompt rule and `after_prefill` choose what stays and set its
        per-slot state, exactly as if that virtual prompt had been the whole prompt. Memory is the budget
        plus one chunk (and the held tokens' queries until `end_chunked_prefill`). With `rerotation`
        (--rerotate_positions) keys and queries are kept before RoPE and the virtual prompt is rotated at its
        ranks 0..n+T−1, so no position past the budget plus a chunk reaches RoPE (the prompt may exceed the
        model's context)."""
        if self.chunk_queries is None:
            self.prefill(input_pos, k, v, q, None if rerotation is None else rerotation.k_plain)
            kept = q if rerotation is None else rerotation.q_plain
            for cache in self.modules():
                if isinstance(cache, ChunkedPrefill):
                    positions = input_pos.view(1, 1, -1).expand(k.shape[0], cache.pos.shape[1], -1)
                    cache.keep_chunk_queries(kept, positions)
                    cache.keep_exact_kv(k if rerotation is None else rerotation.k_plain, v, positions)
            return
        shadows = [c for c in self.children() if isinstance(c, ChunkedPrefill)]
        for shadow in shadows:  # a debug cache's shadow compresses as it would alone
            shadow.prefill_chunk_tokens(input_pos, k, v, q, rerotation)
        if shadows or self.name == "full":  # never compresses: the chunk goes into the next empty slots
            self.write_chunk(input_pos, k if rerotation is None else rerotation.k_plain, v, q)
            return
        self.reprefill(input_pos, k, v, q, rerotation)

    def reprefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, rerotation: Rerotation | None) -> None:
        """`prefill` over the held tokens (slots 0..n−1, in position order: every prefill writes them so)
        followed by the chunk; `inserted` then counts every token seen."""
        B, _, T, _ = k.shape
        n = int(self.filled.max())
        if int(self.filled.min()) != n or int(self.held_tokens().min()) != n:
            raise ValueError(f"a chunked prefill needs every head of the {self.name} cache to hold the same tokens "
                             "count after a chunk")
        P = self.pos.shape[1]
        held_pos = self.pos[:, :, :n]
        stored_k, held_v = self.chunk_held_keys()[:, :, :n], self.chunk_held_values()[:, :, :n]
        # The virtual prompt, copied out of the buffers before the reset clears them.
        positions = torch.cat([held_pos, input_pos.view(1, 1, T).expand(B, P, T)], dim=2)
        values = torch.cat([held_v, v], 2)
        if rerotation is None:
            keys, queries, stored, kept = torch.cat([stored_k, k], 2), torch.cat([self.chunk_queries, q], 2), None, None
        else:  # before RoPE: scored at the ranks 0..n+T−1 of the virtual prompt, kept unrotated
            stored = torch.cat([stored_k, rerotation.k_plain], 2)
            kept = torch.cat([self.chunk_queries, rerotation.q_plain], 2)
            ranks = torch.arange(n + T, device=k.device).view(1, 1, -1)
            keys, queries = rerotation.rope(stored, ranks), rerotation.rope(kept, ranks)
        seen = self.inserted + T
        carried = self.carry_over(n)
        self.reset()
        self.take_over(carried)
        self.scored_pos, self.scored_end, self.scored_held = positions, int(input_pos[-1]) + 1, n
        try:
            self.prefill(positions, keys, values, queries, stored)
        finally:
            self.scored_pos, self.scored_end, self.scored_held = None, None, 0
        self.inserted.copy_(seen)
        self.keep_chunk_queries(queries if kept is None else kept, positions)
        self.keep_exact_kv(keys if stored is None else stored, values, positions)

    def keep_chunk_queries(self, q: Tensor, positions: Tensor) -> None:
        """The queries of the tokens this cache now holds (found by position in `positions` [B, pos_heads, T],
        sorted), for the next chunk's virtual prompt: [B, n_head, n, D]. A cache with a shadow (debug_) keeps
        none: its own part never compresses."""
        if any(isinstance(c, ChunkedPrefill) for c in self.children()):
            self.chunk_queries = q[:, :, :0]
            return
        B, H, T, D = q.shape
        index = self.held_index(positions)
        n = index.shape[-1]
        grouped = q.reshape(B, self.n_kv_heads, H // self.n_kv_heads, T, D)
        index = index[:, :, None, :, None].expand(B, self.n_kv_heads, H // self.n_kv_heads, n, D)
        self.chunk_queries = grouped.gather(3, index).reshape(B, H, n, D)

    def keep_exact_kv(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """The exact keys / values (k, v [B, n_kv, T, D], as stored) of the tokens this cache now holds, found
        as the queries are, where the storage asks for them (`exact_in_chunks`; until `end_chunked_prefill`)."""
        exact = self.storage.exact_in_chunks
        if not exact:
            return
        index = self.held_index(positions)
        index = index[..., None].expand(k.shape[0], k.shape[1], index.shape[-1], k.shape[-1])
        self.chunk_keys = k.gather(2, index) if "keys" in exact else None
        self.chunk_values = v.gather(2, index) if "values" in exact else None

    def chunk_state(self) -> tuple[Tensor | None, ...]:
        """What a chunked prefill keeps between chunks (KVCache.row keeps it per row)."""
        return self.chunk_queries, self.chunk_keys, self.chunk_values

    def held_index(self, positions: Tensor) -> Tensor:
        """Where each held token (slots 0..n−1) is in `positions` [B, pos_heads, T] (sorted): [B, pos_heads, n]."""
        n = int(self.filled.max())
        return torch.searchsorted(positions.contiguous(), self.pos[:, :, :n].contiguous())

    def chunk_held_keys(self) -> Tensor:
        """The keys a later chunk attends over and re-prefills from, [B, n_kv, L, D]: the stored ones, exact
        where the cache keeps them (`chunk_keys` over slots 0..n−1, which a prefill fills)."""
        return over_held_slots(self.keys(), self.chunk_keys)

    def chunk_held_values(self) -> Tensor:
        """As chunk_held_keys, for the values."""
        return over_held_slots(self.values(), self.chunk_values)

    def end_chunked_prefill(self) -> None:
        """The prompt is in: drop the held tokens' queries and exact K/V (decoding never reads them); each cache
        (a debug twin's shadow too) finishes its prefill (`finish_chunked_prefill`)."""
        for cache in self.modules():
            if isinstance(cache, ChunkedPrefill):
                cache.chunk_queries = cache.chunk_keys = cache.chunk_values = None
                cache.finish_chunked_prefill()

    def finish_chunked_prefill(self) -> None:
        """Hook: what a strategy does once the whole prompt is in (hybrid applies its policies' cut)."""

    def write_chunk(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> None:
        """The chunk into the next empty slots, nothing evicted (a cache that never compresses). A storage that
        asks for exact K/V in chunks is rewritten whole from every held token's exact K/V, as one prompt with
        the chunk's queries (ThinK's channels chosen again over every key it holds)."""
        B, H, T, _ = k.shape
        start = int(self.filled.max())
        if start + T > self.pos.shape[-1]:
            raise ValueError(f"a {self.name} cache of {self.pos.shape[-1]} slots has no room for a chunk of {T}")
        exact = self.storage.exact_in_chunks
        if exact:
            keys = torch.cat([self.chunk_held_keys()[:, :, :start], k], dim=2)
            values = torch.cat([self.chunk_held_values()[:, :, :start], v], dim=2)
            self.storage.reset()
            self.storage.write_prefix(keys, values, q)
        else:
            slots = torch.arange(start, start + T, device=k.device).view(1, 1, T).expand(B, H, T)
            self.storage.write(slots, k, v)
        self.pos[:, :, start : start + T] = input_pos
        self.mask[:, :, 0, start : start + T] = True
        self.inserted += T
        self.filled += T
        if exact:
            self.keep_exact_kv(keys, values, self.pos[:, :, : start + T])

    def carry_over(self, n: int) -> object:
        """Hook: per-token inputs of the n held tokens a re-prefill needs besides K/V/queries (read before the
        cache is reset); `take_over` gets them back after the reset."""
        return None

    def take_over(self, carried: object) -> None:
        """Hook: see `carry_over`."""

    def scored_positions(self, k: Tensor) -> Tensor:
        """True positions of the prompt tokens being scored, [B, 1 or pos_heads, T]: 0..T−1 for a prefill,
        the held tokens' and the chunk's during a chunked prefill's re-prefill (prompt rules that read
        positions use this, not the index)."""
        if self.scored_pos is not None and self.scored_pos.shape[-1] == k.shape[2]:
            return self.scored_pos
        return torch.arange(k.shape[2], device=k.device).view(1, 1, -1).expand(k.shape[0], 1, -1)

    def scored_held_tokens(self, k: Tensor) -> int:
        """How many of the prompt tokens being scored are held tokens ahead of a chunk (0 for a prefill): a
        re-prefill's first n entries, whose queries attended in earlier chunks. A strategy whose statistics
        accumulate over the prompt's queries (H2O's attention sums) carries the held tokens' sums over
        (`carry_over` / `take_over`) and adds what the chunk's queries, entries n.., give them; one whose
        statistics are those of the latest queries (SnapKV's window, TOVA's last query) recomputes them."""
        if self.scored_pos is not None and self.scored_pos.shape[-1] == k.shape[2]:
            return self.scored_held
        return 0

    def scored_length(self, k: Tensor) -> int:
        """The position after the last prompt token scored (the prompt's length for a prefill). A Python int
        known without reading a tensor: the one-shot prefill stays free of host syncs (and runs on meta)."""
        if self.scored_pos is not None and self.scored_pos.shape[-1] == k.shape[2]:
            return self.scored_end
        return k.shape[2]


def end_chunked_prefill(caches: Iterable[ChunkedPrefill]) -> None:
    """The chunked prompt is in: every cache drops its held queries and finishes its prefill (hybrid applies its
    policies' cut then), once, before the first decode step. A last chunk of one token is that step, as
    transformers' chunked prefill feeds it, so generate.py's loops end the prefill before it, as the transformers
    adapter does."""
    for cache in caches:
        cache.end_chunked_prefill()
