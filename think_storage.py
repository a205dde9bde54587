"""ThinK's channel-pruned keys (`--think_ratio`; Xu et al., arXiv 2407.21018): a storage (kv_storage.py's
contract, docs/DESIGN.md §5) whose keys keep only the channels the prompt's queries use most.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kv_storage import Storage, StorageSpec, rows_over_entries, scatter_rows


def think_kept_channels(head_dim: int, ratio: float) -> int:
    """Key channels ThinK keeps: int(head_dim · ratio) are pruned, as in the authors' code and kvpress."""
    return head_dim - int(head_dim * ratio)


def think_channel_scores(k: Tensor, queries: Tensor, window: int) -> Tensor:
    """ThinK's greedy channel scores (Xu et al., arXiv 2407.21018): for KV head h and channel c,
    ‖Q_w[:, c] K[:, c]ᵀ‖_F = ‖Q_w[:, c]‖ · ‖K[:, c]‖, with Q_w the last `window` queries of every query head of
    h's group stacked (the GQA grouping of kvpress's ThinKPress, whose mean over the group ranks the same).
    k [B, H, n, D] (the kept prompt tokens' keys), queries [B, H·rep, T, D]; returns the squared score [B, H, D]
    (same ranking, no square roots)."""
    B, H, _, D = k.shape
    q = queries[:, :, -window:].float()
    q_energy = q.pow(2).sum(2).view(B, H, -1, D).sum(2)
    return q_energy * k.float().pow(2).sum(2)


class ChannelPrunedKeyStorage(Storage):
    """ThinK (Xu et al., arXiv 2407.21018): the keys' least important channels are pruned, values kept whole.

    At the prompt's write each KV head scores its key channels by the query-key interaction over the
    observation window (think_channel_scores) and keeps the top (1 − λ)·D; every key, the prompt's and each
    decoded token's, is then stored as those channels only (`k_kept`, compact: the key bytes really shrink),
    and attention reads keys with zeros in the pruned channels, so q·k sums over the kept channels
    (the paper's q·(S k) with S the channel mask). Keys are post-RoPE, as in the paper and kvpress (both prune
    the rotated keys); `--rerotate_positions` (pre-RoPE keys) is refused. The channel set is chosen once per
    sequence, from the keys the prompt rule kept (the authors prune after SnapKV/H2O compression) and the
    prompt's last `think_window` queries. A chunked prefill writes the prompt again at every chunk, from whole
    keys the cache keeps meanwhile (`exact_in_chunks`), so the last chunk's channel set is the one kept.

    New tokens: the paper's method stores every key thin with the prompt's channel set, which is the default
    (think_recent 0). The authors' implementation keeps the newest prompt tokens (recent_size 32) and every
    decoded token whole, which in a fixed budget could fill it with whole keys; `think_recent R` keeps the newest
    R tokens whole instead, in a ring (`k_recent`) whose rows overwrite their slots' thin keys when read: a
    token leaving the ring (R newer writes) falls back to its thin key, stored when it was written. So with
    R > 0 a key can change after its write (whole, then thin): a chunk appended in one forward step (the kvpress
    protocol's question) attends over the ring as it is after the whole chunk, where feeding the chunk token
    by token would have seen its earlier tokens still whole; R = 0 keeps every key as written. A sequence
    whose prompt is never prefilled (one token, decoded directly) keeps the first channels.

    Buffers: k_kept [B, H, L, D'] (D' kept channels), channels [B, H, D'] int16 (sorted), v_cache [B, H, L, D],
    k_recent [B, H, R, D], recent_slot [B, H, R] (slot of each ring entry, −1 empty), recent_next [B].
    """

    bits = 16
    exact_in_chunks = ("keys",)

    def __init__(self, shape: tuple[int, ...], spec: StorageSpec, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        B, H, L, D = shape
        if not 0 < spec.think_ratio < 1 or spec.think_window < 1 or spec.think_recent < 0:
            raise ValueError(f"ThinK needs a ratio in (0, 1), a window ≥ 1 and recent ≥ 0, got {spec}")
        self.kept = think_kept_channels(D, spec.think_ratio)
        self.window, self.recent, self.slots, self.head_dim = spec.think_window, spec.think_recent, L, D
        R, kw = spec.think_recent, dict(device=device)
        self.register_buffer("k_kept", torch.zeros(B, H, L, self.kept, dtype=dtype, **kw))
        self.register_buffer("channels", torch.zeros(B, H, self.kept, dtype=torch.int16, **kw))
        self.register_buffer("v_cache", torch.zeros(B, H, L, D, dtype=dtype, **kw))
        self.register_buffer("k_recent", torch.zeros(B, H, R, D, dtype=dtype, **kw))
        self.register_buffer("recent_slot", torch.full((B, H, R), -1, dtype=torch.long, **kw))
        self.register_buffer("recent_next", torch.zeros(B, dtype=torch.long, **kw))
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.recent_slot.fill_(-1)
        self.channels.copy_(torch.arange(self.kept, device=self.channels.device).expand_as(self.channels))

    def write(self, slots: Tensor, k: Tensor, v: Tensor, queries: Tensor | None = None) -> None:
        if queries is not None:  # the prompt: choose each head's channels
            top = think_channel_scores(k, queries, self.window).topk(self.kept, dim=-1).indices
            self.channels.copy_(top.sort(dim=-1).values)
        index = self.channels.long()[:, :, None, :].expand(*k.shape[:3], self.kept)
        scatter_rows(self.k_kept, slots, k.gather(3, index))
        scatter_rows(self.v_cache, slots, v)
        if self.recent:
            self._keep_whole(slots, k)

    def _keep_whole(self, slots: Tensor, k: Tensor) -> None:
        """The newest of the written tokens into the ring of whole keys (a masked update: no branch)."""
        R = self.recent
        r = min(R, slots.shape[-1])
        # Entries whose slot is being overwritten (its token evicted) leave the ring.
        stale = (self.recent_slot[..., :, None] == slots[..., None, :]).any(-1)
        self.recent_slot.masked_fill_(stale, -1)
        entries = (self.recent_next.view(-1, 1, 1) + torch.arange(r, device=k.device)) % R
        entries = entries.expand(*slots.shape[:2], r)
        scatter_rows(self.k_recent, entries, k[:, :, -r:])
        self.recent_slot.scatter_(2, entries, slots[..., -r:])
        self.recent_next.add_(r).remainder_(R)

    def keys(self) -> Tensor:
        B, H, L, _ = self.k_kept.shape
        keys = torch.zeros(B, H, L + 1, self.head_dim, dtype=self.k_kept.dtype, device=self.k_kept.device)
        index = self.channels.long()[:, :, None, :].expand(B, H, L, self.kept)
        keys[:, :, :L].scatter_(3, index, self.k_kept)
        if self.recent:  # whole keys over their slots; empty entries land on the scratch row L, cut off
            scatter_rows(keys, torch.where(self.recent_slot >= 0, self.recent_slot, L), self.k_recent)
        return keys[:, :, :L]

    def values(self) -> Tensor:
        return self.v_cache

    def write_values(self, slots: Tensor, v: Tensor) -> None:
        scatter_rows(self.v_cache, slots, v)

    def write_keys(self, slots: Tensor, k: Tensor) -> None:
        """The kept channels of each new key, and the whole key where the slot is in the ring."""
        index = self.channels.long()[:, :, None, :].expand(*k.shape[:3], self.kept)
        scatter_rows(self.k_kept, slots, k.gather(3, index))
        if self.recent:
            self.k_recent.copy_(rows_over_entries(self.k_recent, self.recent_slot, slots, k))

    def full_precision_slots(self) -> Tensor:
        B, H, L, _ = self.k_kept.shape
        whole = torch.zeros(B, H, L + 1, dtype=torch.bool, device=self.k_kept.device)
        if self.recent:
            whole.scatter_(2, torch.where(self.recent_slot >= 0, self.recent_slot, L), True)
        return whole[:, :, :L]

    def dense_equivalent(self, held: Tensor) -> Tensor:
        """A thin token costs (D' + D) / 2D of a dense one (its pruned key and whole value)."""
        whole = (held & self.full_precision_slots()).sum(-1).double()
        thin = (self.kept + self.head_dim) / (2 * self.head_dim)
        return whole + (held.sum(-1).double() - whole) * thin

    def statistics(self, held: Tensor) -> dict[str, Tensor]:
        """Key channels kept per head, and held tokens whose keys are whole (the ring)."""
        whole = (held & self.full_precision_slots()).sum(-1).double().mean(0)
        return {"think_key_channels": torch.full_like(whole, self.kept), "think_whole_key_tokens": whole}

    def attention_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())
