"""Rows of different lengths prefilled together: the prompts right-padded to the longest, one causal forward
pass for all of them, and each layer's cache given each row's own tokens in its row context.

Right padding is exact for the rows' own tokens: attention is causal, so no real token attends to the padding
after it, and a row's queries, keys and values are those of the row alone (up to the batched products'
rounding). Only the caches must not see the padding: each row's prompt goes to `KVCache.prefill` in the row
context (KVCache.row), cut to its length, after its token ids and gates, so a row stores, scores and
compresses exactly what it does alone, at its own budget. The logits taken are each row's last real position.

Rows are grouped so that a group's padded tokens stay within PREFILL_BATCH_TOKENS: a prompt that long already
keeps a device busy, and batching it with others would only multiply the prefill's activation peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

# The most padded tokens (rows x the longest prompt) one forward pass takes; a longer row goes alone.
PREFILL_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class PaddedRows:
    """A prefill of right-padded rows: row i's prompt is ids[i, :lengths[i]], in cache row cache_rows[i]."""

    lengths: tuple[int, ...]
    ids: Tensor  # [rows, T] token ids, padded after each row's prompt
    cache_rows: tuple[int, ...]


def store_rows(cache: nn.Module, rows: PaddedRows, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor,
               k_store: Tensor | None, log_gates: Tensor | None) -> None:
    """KVCache.prefill of each row's own tokens (k, v [rows, n_kv, T, D], q [rows, n_head, T, D], log_gates
    [rows, n_kv, T]) in its row context, with what the cache observes before a prompt (its token ids, its
    gates) observed for that row just before: a cache keeps the latest prompt's ids and gates, not a batch's."""
    for i, n in enumerate(rows.lengths):
        one = slice(i, i + 1)
        with cache.row(rows.cache_rows[i]):
            if cache.needs_token_ids:
                cache.observe_tokens(rows.ids[one, :n])
            if log_gates is not None:
                cache.observe_gates(log_gates[one, :, :n])
            stored = {} if k_store is None else {"k_store": k_store[one, :, :n]}
            cache.prefill(input_pos[:n], k[one, :, :n], v[one, :, :n], q[one, :, :n], **stored)


def padded_groups(lengths: list[int]) -> list[range]:
    """Consecutive rows grouped for one forward pass each: a group grows while its padded size (rows x its
    longest prompt) stays within PREFILL_BATCH_TOKENS. A one-token prompt goes alone (its prefill is a decode
    step, which padding would turn into a one-token prompt compression)."""
    groups: list[range] = []
    start = 0
    for i, n in enumerate(lengths):
        widest = max(lengths[start:i + 1])
        joins = n > 1 and lengths[start] > 1 and (i + 1 - start) * widest <= PREFILL_BATCH_TOKENS
        if i > start and not joins:
            groups.append(range(start, i))
            start = i
    if lengths:
        groups.append(range(start, len(lengths)))
    return groups

def prefill_padded(model: nn.Module, prompts: list[Tensor], cache_rows: list[int]) -> Tensor:
    """prompts [T_i] (each at least 2 tokens) prefilled in one forward pass, prompt i into cache row
    cache_rows[i]: the logits of each row's last prompt token, [rows, vocab]."""
    lengths = [len(p) for p in prompts]
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long, device=prompts[0].device)
    for i, prompt in enumerate(prompts):
        ids[i, : len(prompt)] = prompt
    rows = PaddedRows(tuple(lengths), ids, tuple(cache_rows))
    return model(ids, torch.arange(ids.shape[1], device=ids.device), last_logits_only=True, rows=rows)[:, -1]
