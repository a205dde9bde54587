"""Prompts of different lengths prefilled together: packed into one sequence, one forward pass for all of
them, attention and the caches row by row (the "varlen" layout of packed training and serving).

Every token-wise part of a layer (norms, projections, RoPE at each token's own position, the MLP) runs once
over the packed tokens, with no padding to waste work on; attention runs over each row's own span, causal, as
the row alone would (Attention.attend_packed_rows); and each layer's cache takes each row's tokens in its row
context (KVCache.row), after that row's token ids and gates, so a row stores, scores and compresses exactly
what it does alone, at its own budget. Only the products' rounding differs from a row alone (their row count
does), which is why the CPU, whose products are otherwise batch-invariant, prefills rows alone instead
(generate.shares_prefill). The logits taken are each row's last token's.

Rows are grouped so a group holds at most PREFILL_BATCH_TOKENS tokens: a prompt that long already keeps a
device busy, and packing more would only raise the prefill's activation peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from cache_chunking import end_chunked_prefill

# The most tokens one packed forward pass takes; a longer prompt goes alone.
PREFILL_BATCH_TOKENS = 8192


@dataclass(frozen=True)
class PackedRows:
    """Prompts packed one after another: prompt i is ids[0, spans[i]], prefilled into cache row cache_rows[i],
    compressed to prompt_budgets[i] where that is not None (KVCache.prompt_budget, set in the row's turn; None
    leaves the caches' setting as it is). (KVzip's rule, whose prefill is a reconstruction pass over each
    prompt's own sequence, prefills row by row: generate.shares_prefill.)"""

    lengths: tuple[int, ...]
    ids: Tensor  # [1, sum(lengths)]
    cache_rows: tuple[int, ...]
    prompt_budgets: tuple[int | None, ...] = ()

    @cached_property
    def spans(self) -> list[slice]:  # read by every layer: computed once
        ends = torch.tensor(self.lengths).cumsum(0).tolist()
        return [slice(end - n, end) for n, end in zip(self.lengths, ends, strict=True)]


def store_row(cache: nn.Module, rows: PackedRows, i: int, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor,
              k_store: Tensor | None, log_gates: Tensor | None) -> None:
    """KVCache.prefill of row i's tokens (its span of k, v [1, n_kv, T, D], q [1, n_head, T, D], log_gates
    [1, n_kv, T]) in its row context, after what the cache observes before a prompt (row_turn)."""
    span = rows.spans[i]
    with cache.row(rows.cache_rows[i]):
        row_turn(cache, rows, i, log_gates)
        stored = {} if k_store is None else {"k_store": k_store[:, :, span]}
        cache.prefill(input_pos[span], k[:, :, span], v[:, :, span], q[:, :, span], **stored)


def row_turn(cache: nn.Module, rows: PackedRows, i: int, log_gates: Tensor | None, chunk: bool = False) -> None:
    """What row i's cache (in its row context) takes before its tokens: its prompt budget, its token ids and
    gates. A cache keeps the latest prompt's ids, gates and budget, so each row's go in just before its
    tokens. `chunk`: the tokens are a prompt chunk (KVCache.observe_tokens)."""
    span = rows.spans[i]
    if rows.prompt_budgets and rows.prompt_budgets[i] is not None:
        cache.configure(prompt_budget=rows.prompt_budgets[i])
    if cache.needs_token_ids:
        cache.observe_tokens(rows.ids[:, span], chunk)
    if log_gates is not None:
        cache.observe_gates(log_gates[..., span], chunk)


def packed_groups(lengths: list[int]) -> list[range]:
    """Consecutive rows grouped for one forward pass each, a group growing while it holds at most
    PREFILL_BATCH_TOKENS tokens. A one-token prompt goes alone: its prefill is a decode step, which packing
    would turn into a one-token prompt compression."""
    groups: list[range] = []
    start = 0
    for i, n in enumerate(lengths):
        joins = n > 1 and lengths[start] > 1 and sum(lengths[start:i + 1]) <= PREFILL_BATCH_TOKENS
        if i > start and not joins:
            groups.append(range(start, i))
            start = i
    if lengths:
        groups.append(range(start, len(lengths)))
    return groups


def prefill_packed(model: nn.Module, prompts: list[Tensor], cache_rows: list[int],
                   prompt_budgets: list[int | None] | None = None) -> Tensor:
    """prompts [T_i] (each at least 2 tokens) prefilled in one forward pass, prompt i into cache row
    cache_rows[i] (compressed to prompt_budgets[i] where given): each prompt's last token's logits, [rows, vocab]."""
    ids = torch.cat(prompts)[None]
    positions = torch.cat([torch.arange(len(p), device=ids.device) for p in prompts])
    rows = PackedRows(tuple(len(p) for p in prompts), ids, tuple(cache_rows), tuple(prompt_budgets or ()))
    return model(ids, positions, last_logits_only=True, rows=rows)[:, -1]


def prefill_packed_chunks(model: nn.Module, prompts: list[Tensor], cache_rows: list[int], chunk: int,
                          prompt_budgets: list[int | None] | None = None) -> Tensor:
    """prompts [T_i] prefilled `chunk` tokens at a time (--prefill_chunk), the rows' chunks packed: the j-th chunk
    of every prompt that has one goes through one forward pass (in groups of at most PREFILL_BATCH_TOKENS
    tokens), each row's chunk attended and compressed in its row context (model.Attention.forward_chunk), so a
    row holds what its chunks give it alone. A last chunk of one token is a decode step in its row, as alone.
    Each prompt's last token's logits, [rows, vocab]."""
    device = prompts[0].device
    budgets = prompt_budgets or [None] * len(prompts)
    logits: list[Tensor | None] = [None] * len(prompts)
    ended: set[int] = set()  # rows whose prefill has ended (their last chunk was one token, a decode step)
    try:
        for start in range(0, max(len(p) for p in prompts), chunk):
            pieces = {i: p[start : start + chunk] for i, p in enumerate(prompts) if len(p) > start}
            # (Under the kvpress protocol, a prompt budget set, it is a chunk: generate.last_token_is_a_step.)
            for i in [i for i, piece in pieces.items() if len(piece) == 1 and budgets[i] is None]:
                with model.cache_row(cache_rows[i]):  # the eager decode step, as generate.prefill feeds it alone
                    if start + 1 == len(prompts[i]):  # the row's first decode step: its prefill ends before it
                        end_chunked_prefill(model.caches())
                        ended.add(i)
                    logits[i] = model(pieces.pop(i).view(1, 1), torch.tensor([start], device=device))[0, -1]
            order = list(pieces)
            for group in packed_groups([len(pieces[i]) for i in order]):
                part = [order[g] for g in group]
                ids = torch.cat([pieces[i] for i in part])[None]
                positions = torch.cat([torch.arange(start, start + len(pieces[i]), device=device) for i in part])
                rows = PackedRows(tuple(len(pieces[i]) for i in part), ids, tuple(cache_rows[i] for i in part),
                                  tuple(budgets[i] for i in part))
                out = model(ids, positions, last_logits_only=True, chunk=True, rows=rows)[:, -1]
                for i, row_logits in zip(part, out, strict=True):
                    logits[i] = row_logits
    finally:
        for i, b in enumerate(cache_rows):
            if i not in ended:
                with model.cache_row(b):
                    end_chunked_prefill(model.caches())
    return torch.stack(logits)
