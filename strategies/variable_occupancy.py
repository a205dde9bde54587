"""Caches whose heads may hold fewer tokens than their slots: a token can be released (its slot emptied,
masked) without a new one taking its place, as threshold eviction and DuoAttention's streaming heads do.

Shapes stay static: a released slot keeps its (stale) K/V, gets pos −1 and mask False, so attention and
the statistics (docs/DESIGN.md §6: compression is measured from the mask) no longer count it. The next
token reuses the first such hole before taking a fresh slot, so the budget L stays the most a head holds.
Per-slot state is [B, heads, L] and every decision is per row, so rows of a batch release independently.

A pooled cache (`--budget_allocation adakv`) chooses its slots itself and does not reuse holes: there a
released slot stays empty until the head's quota is used up, then its argmin eviction goes on as usual
(holes have pos −1 and are never evicted), so a head still holds at most its quota.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache


class VariableOccupancy(KVCache):
    """Mixed in before a strategy class (it is not a strategy itself)."""

    def release(self, drop: Tensor) -> None:
        """Empty the slots `drop` [B, pos_heads, L] (bool; only held, unprotected slots should be given)."""
        B, H = self.mask.shape[:2]
        self.pos.masked_fill_(drop, -1)
        self.mask.masked_fill_(drop.expand(B, H, -1)[:, :, None], False)

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """A released slot (a hole below `filled`) first, else the base choice (next fresh slot or argmin)."""
        slot = super().choose_slot(input_pos)
        slots = torch.arange(self.pos.shape[-1], device=self.pos.device)
        holes = (self.pos < 0) & (slots < self.filled[..., None])
        return torch.where(holes.any(dim=-1), holes.long().argmax(dim=-1), slot)

    def evictable(self, input_pos: Tensor) -> Tensor:
        """Held slots outside the protected sinks and recent window, [B, pos_heads, L] (input_pos: the newest
        held token's position, [1] or one per row [B])."""
        return (self.pos >= 0) & ~self.protected(input_pos)
