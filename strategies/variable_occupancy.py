"""Caches whose heads may hold fewer tokens than their slots: a token can be released (its slot emptied,
masked) without a new one taking its place, as threshold eviction and DuoAttention's streaming heads do.

Shapes stay static: a released slot keeps its (stale) K/V, gets pos −1 and mask False, so attention and
the statistics (docs/DESIGN.md §6: compression is measured from the mask) no longer count it. The next
token reuses the first such hole before taking a fresh slot, so the budget L stays the most a head holds.
Per-slot state is [B, heads, L] and every decision is per row, so rows of a batch release independently.

A pooled cache (`--budget_allocation adakv`) is refused: Ada-KV's pool chooses its slots itself and would
never reuse a hole (a released slot stays empty for good), and its invariant that every head fills its
quota is what a variable budget gives up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache
from errors import UserError


class VariableOccupancy(KVCache):
    """Mixed in before a strategy class (it is not a strategy itself)."""

    # Heads may hold fewer tokens than their slots (what a head-adaptive pool cannot express).
    variable_occupancy = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        if self.pooled:
            raise UserError(f"--budget_allocation adakv cannot pool the {self.name} cache: its heads hold a "
                            "variable number of tokens (released slots are left empty)")

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
