"""How a cache stores the keys and values of its slots (docs/DESIGN.md §5): dense, quantized per token
(`--cache_bits`), KIVI's residual scheme (`--cache_quantization kivi`), or ThinK's channel-pruned keys
(`--think_ratio`, think_storage.py).

Storage is independent of eviction: a strategy decides *which slot* a token goes to (and so which token
leaves); the storage decides how the slot's K/V are kept. Every strategy runs on every storage.

    write(slots [B, H, n], k, v, queries)   n > 1: the prompt into an empty cache, with its queries
                                            [B, n_head, T, D] (ThinK scores channels by them); n == 1 and
                                            no queries: one decode step
    keys(), values()               [B, H, L, D] in the cache dtype, what attention reads
    attend(q, mask)                (out, probabilities) of a decode step's query rows [B, H, R, D] read from
                                   the stored form itself, or None: attention then reads keys(), values()
    full_precision_slots()         [B, H, L] bool: slots whose K/V are kept whole (unquantized, unpruned)
    dense_equivalent(held)         [B, H]: the dense tokens the held slots' K/V are worth (compression ratio)
    attention_bytes()              bytes one decode step reads to rebuild K/V (the bench's bound)

KIVI (Liu et al., arXiv 2402.02750; also transformers' QuantizedCache) quantizes keys *per channel*,
grouping `q_group_size` consecutive tokens that share one scale and zero per channel (keys have outlier
channels, so a per-token range is dominated by them), and values *per token* in groups of
`q_group_size` channels. The most recent `residual_length` tokens stay in full precision; when that
residual is full it is flushed into the quantized store, `residual_length / q_group_size` key groups
at a time.

Eviction meets grouping here. A strategy may evict any token, from the residual (its entry is dropped
and never quantized) or from the quantized store (its codes are simply no longer attended; the rest of
its group keeps using the group's scales). So tokens are never requantized, and a key group is a row of
a group table, referenced by a per-slot group id, not a fixed block of slots. A group is built once
from the residual tokens still held at flush time (a partial group when some were evicted) and is
never reused, so the table is sized for every group the sequence can create, about
capacity / q_group_size rows. Its cost is honest: with scattered evictions each held token may be the
last one of its group, and then the per-channel scales cost more than the codes (reported in the
cache bytes and the README).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import cpu_bf16_kernels
from quantization_utils import dequantize, dequantize_codes, pack_codes, quantize, quantize_codes, unpack_codes

SCHEMES = ("per_token", "kivi")


@dataclass(frozen=True)
class StorageSpec:
    bits: int = 16  # 16 = unquantized
    scheme: str = "per_token"  # how quantized K/V are grouped: per_token or kivi
    q_group_size: int = 64  # kivi: tokens per key group, channels per value group
    residual_length: int = 128  # kivi: most recent tokens kept in full precision
    think_ratio: float = 0.0  # ThinK: fraction of key channels pruned per KV head (0: keys whole)
    think_window: int = 32  # ThinK: the last prompt queries that score the channels
    think_recent: int = 0  # ThinK: the newest tokens whose keys stay whole

    def describe(self) -> str:
        if self.bits == 16:
            text = "16"
        elif self.scheme == "kivi":
            text = f"{self.bits} kivi g{self.q_group_size} r{self.residual_length}"
        else:
            text = str(self.bits)
        if self.think_ratio:
            text += f" think{self.think_ratio:g} w{self.think_window}" + \
                (f" r{self.think_recent}" if self.think_recent else "")
        return text


DENSE = StorageSpec()
# The ThinK fields of a spec: records of a spec without ThinK leave them out, as runs recorded before they existed.
THINK_FIELDS = ("think_ratio", "think_window", "think_recent")

def make_storage(spec: StorageSpec, batch_size: int, n_kv_heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, capacity_needed: int) -> Storage:
    shape = (batch_size, n_kv_heads, slots, head_dim)
    if spec.think_ratio:
        if spec.bits != 16:
            raise ValueError("ThinK's pruned keys are stored in the cache dtype: no --cache_bits with it")
        from think_storage import ChannelPrunedKeyStorage  # here: think_storage builds on this module's Storage
        return ChannelPrunedKeyStorage(shape, spec, dtype, device)
    if spec.bits == 16:
        return DenseStorage(shape, dtype, device)
    if spec.scheme == "per_token":
        return PerTokenQuantizedStorage(shape, spec.bits, dtype, device)
    if spec.scheme == "kivi":
        return ResidualQuantizedStorage(shape, spec, dtype, device, capacity_needed)
    raise ValueError(f"unknown cache quantization scheme {spec.scheme!r}; available: {', '.join(SCHEMES)}")


class Storage(nn.Module):
    # What a chunked prefill keeps exact for the held tokens ("keys", "values"): what a re-prefill would lose
    # again from the stored form (ThinK's channels, KIVI's key groups re-quantized over other tokens).
    exact_in_chunks: tuple[str, ...] = ()

    def reset(self) -> None:
        for buf in self.buffers():
            buf.zero_()

    def statistics(self, held: Tensor) -> dict[str, Tensor]:
        """Storage-specific statistics given the held slots [B, H, L], each [H]."""
        return {}

    def attend(self, q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor] | None:
        """A decode step's attention (cpu_bf16_kernels.torch_attention's contract: q [B, H, R, D], mask
        broadcastable to [B, H, R, L]) computed from the stored form, where that beats rebuilding K and V;
        None (every storage but per-token codes on the CPU) when attention should read keys() and values()."""
        return None

    def write_prefix(self, k: Tensor, v: Tensor, queries: Tensor | None = None) -> None:
        """Store k, v [B, H, n, D] in slots 0..n-1 (the prompt): `write` at those slots, unless a storage
        has a cheaper way."""
        B, H, n = k.shape[:3]
        self.write(torch.arange(n, device=k.device).view(1, 1, n).expand(B, H, n), k, v, queries)

    def add_to_values(self, slots: Tensor, delta: Tensor, values: Tensor | None = None) -> None:
        """The values of `slots` [B, H, m] (distinct, but for entries whose delta is zero) += delta [B, H, m, D]:
        read, added to and written back (re-quantized where the storage quantizes values). `values`: this
        storage's `values()` when the caller has just read them (not read again)."""
        self.write_values(slots, gather_rows(self.values() if values is None else values, slots) + delta)

    def write_values(self, slots: Tensor, v: Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot rewrite held values")

    def write_keys(self, slots: Tensor, k: Tensor) -> None:
        """The keys of held `slots` [B, H, m] (distinct) become k [B, H, m, D], their slots otherwise untouched (a
        merge into held tokens: strategies/d2o.py); stored as this storage stores a key."""
        raise NotImplementedError(f"{type(self).__name__} cannot rewrite held keys")

    def dense_equivalent(self, held: Tensor) -> Tensor:
        """The dense tokens the held slots [B, H, L] are worth, [B, H] (float64): a held token costs
        bits/16 of a dense one, one kept whole (a KIVI residual token) a whole one. Scales, zero points
        and indices are left out (cache_kv_bytes counts them)."""
        exact = (held & self.full_precision_slots()).sum(-1).double()
        return exact + (held.sum(-1).double() - exact) * (self.bits / 16.0)


def rows_over_entries(rows: Tensor, entry_slot: Tensor, slots: Tensor, src: Tensor) -> Tensor:
    """rows [B, H, R, D] of a side store whose entry r holds slot entry_slot[b, h, r] (−1: none), with the entries
    holding one of `slots` [B, H, m] (distinct) replaced by the matching src [B, H, m, D] rows (KIVI's residual,
    ThinK's ring of whole keys)."""
    match = entry_slot[..., :, None] == slots[..., None, :]  # [B, H, R, m]
    new = torch.einsum("bhrm,bhmd->bhrd", match.to(src.dtype), src)
    return torch.where(match.any(-1)[..., None], new.to(rows.dtype), rows)


def scatter_slots(buf: Tensor, dim: int, index: Tensor, src: Tensor | float | bool) -> None:
    """`buf.scatter_(dim, index, src)` for the per-step writes into a cache's per-slot state (positions, mask,
    scores): `index` has buf's number of dimensions, sizes at most buf's; `src` a tensor of index's shape or
    a scalar.

    Compiled, an index_put_: inductor writes it in place, while it turns a scatter_ into a copy of the whole
    buffer plus the new entries, copied back after the step (two passes over every slot per layer and step,
    read in inductor's output code, for each buffer written so). Eager, the scatter_: an index_put_ there
    costs ~5x its dispatch, and a decode step makes 60 or more writes."""
    if not torch.compiler.is_compiling():
        buf.scatter_(dim, index, src)
        return
    dims = range(index.dim())
    indices = tuple(index if d == dim else torch.arange(index.shape[d], device=index.device).view(
        [-1 if e == d else 1 for e in dims]) for d in dims)
    value = src.to(buf.dtype) if isinstance(src, Tensor) else torch.tensor(src, dtype=buf.dtype, device=buf.device)
    buf.index_put_(indices, value)


def gather_rows(buf: Tensor, slots: Tensor) -> Tensor:
    """buf[b, h, slots[b, h, i]] along dim 2: [B, H, m, D] rows of buf [B, H, L, D]."""
    return buf.gather(2, slots[..., None].expand(*slots.shape, buf.shape[-1]))


def scatter_rows(buf: Tensor, slots: Tensor, src: Tensor) -> None:
    """buf[b, h, slots[b, h, i]] = src[b, h, i] along dim 2 (rows of any trailing width): scatter_slots with
    the rows' trailing dimensions taken whole when compiled (one index per row, not per element)."""
    if torch.compiler.is_compiling():
        B, H = slots.shape[:2]
        rows = torch.arange(B, device=slots.device).view(B, 1, 1)
        heads = torch.arange(H, device=slots.device).view(1, H, 1)
        buf.index_put_((rows, heads, slots), src[:B, :H, : slots.shape[2]].to(buf.dtype))
        return
    index = slots.view(*slots.shape, *([1] * (buf.dim() - 3))).expand(*slots.shape, *buf.shape[3:])
    buf.scatter_(2, index, src.to(buf.dtype))


class DenseStorage(Storage):
    bits = 16

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))

    def write(self, slots: Tensor, k: Tensor, v: Tensor, queries: Tensor | None = None) -> None:
        scatter_rows(self.k_cache, slots, k)
        scatter_rows(self.v_cache, slots, v)

    def write_values(self, slots: Tensor, v: Tensor) -> None:
        scatter_rows(self.v_cache, slots, v)

    def write_keys(self, slots: Tensor, k: Tensor) -> None:
        scatter_rows(self.k_cache, slots, k)

    def write_prefix(self, k: Tensor, v: Tensor, queries: Tensor | None = None) -> None:
        # A slice copy: the scatter over an index costs a 1k-token prompt's prefill ~1% on the CPU.
        n = k.shape[2]
        self.k_cache[:, :, :n].copy_(k)
        self.v_cache[:, :, :n].copy_(v)

    def keys(self) -> Tensor:
        return self.k_cache

    def values(self) -> Tensor:
        return self.v_cache

    def full_precision_slots(self) -> Tensor:
        return torch.ones(self.k_cache.shape[:3], dtype=torch.bool, device=self.k_cache.device)

    def attention_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.k_cache, self.v_cache))


class PerTokenQuantizedStorage(Storage):
    """`--cache_bits` alone: each token row quantized on its own (quantization_utils explains why), so a
    slot is written with one scatter and nothing else is requantized."""

    def __init__(self, shape: tuple[int, ...], bits: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        B, H, L, D = shape
        self.bits, self.dtype = bits, dtype
        for name in ("k", "v"):
            self.register_buffer(f"{name}_codes", torch.zeros(B, H, L, D * bits // 8, dtype=torch.uint8, device=device))
            # Scales and zero points in the cache dtype (rounded up there by quantize: see its bound).
            self.register_buffer(f"{name}_scale", torch.zeros(B, H, L, 1, dtype=dtype, device=device))
            self.register_buffer(f"{name}_zero", torch.zeros(B, H, L, 1, dtype=dtype, device=device))

    def write(self, slots: Tensor, k: Tensor, v: Tensor, queries: Tensor | None = None) -> None:
        for name, x in (("k", k), ("v", v)):
            self._write_rows(name, slots, x)

    def write_values(self, slots: Tensor, v: Tensor) -> None:
        self._write_rows("v", slots, v)

    def write_keys(self, slots: Tensor, k: Tensor) -> None:
        self._write_rows("k", slots, k)

    def _write_rows(self, name: str, slots: Tensor, x: Tensor) -> None:
        for suffix, src in zip(("codes", "scale", "zero"), quantize(x, self.bits), strict=True):
            scatter_rows(getattr(self, f"{name}_{suffix}"), slots, src)

    def keys(self) -> Tensor:
        return dequantize(self.k_codes, self.k_scale, self.k_zero, self.bits, self.dtype)

    def values(self) -> Tensor:
        return dequantize(self.v_codes, self.v_scale, self.v_zero, self.bits, self.dtype)

    def attend(self, q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor] | None:
        # Dequantizing every slot each step cost more than the attention itself (several passes over a
        # full-size K and V); the CPU kernel reads the codes in registers (cpu_quantized_attention.c).
        return cpu_bf16_kernels.per_token_decode_attention(
            q, (self.k_codes, self.k_scale, self.k_zero), (self.v_codes, self.v_scale, self.v_zero), mask, self.bits)

    def full_precision_slots(self) -> Tensor:
        return torch.zeros(self.k_codes.shape[:3], dtype=torch.bool, device=self.k_codes.device)

    def attention_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


def quantize_key_groups(k: Tensor, live: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """KIVI keys: per-channel quantization over groups of tokens. k [..., n_groups, G, D], live [..., n_groups, G]
    (tokens evicted before the flush take no part in their group's range).

    Returns codes [..., n_groups, G, D] (unpacked), scale and zero [..., n_groups, D].
    """
    live = live[..., None]
    x = k.float()
    low = torch.where(live, x, float("inf")).amin(dim=-2, keepdim=True)
    low = torch.where(torch.isinf(low), 0.0, low)  # a group with no live token: any finite range
    # Dead tokens take the group minimum so they neither widen the range nor need a mask below.
    filled = torch.where(live, x, low).to(k.dtype)
    codes, scale, zero = quantize_codes(filled.transpose(-1, -2), bits)  # rows = one channel of one group
    return codes.transpose(-1, -2), scale.squeeze(-1), zero.squeeze(-1)


def quantize_value_groups(v: Tensor, group: int, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """KIVI values: per-token quantization in groups of `group` channels. v [..., D] -> codes [..., D]
    (unpacked), scale and zero [..., D // group]."""
    grouped = v.view(*v.shape[:-1], v.shape[-1] // group, group)
    codes, scale, zero = quantize_codes(grouped, bits)
    return codes.flatten(-2), scale.squeeze(-1), zero.squeeze(-1)


class ResidualQuantizedStorage(Storage):
    """KIVI: a full-precision residual of the newest tokens, flushed into a quantized store in groups. A
    chunked prefill keeps the held tokens' exact K/V (`exact_in_chunks`): re-quantizing dequantized keys in
    other groups at every chunk compounded the error (fidelity KL 0.658 chunked against 0.422 one shot at 2
    bits; 0.391 chunked from exact K/V).

    Buffers (L slots plus one scratch row L, where masked-off writes land so every step is static):
      k_codes, v_codes [B, H, L+1, D·bits/8]  packed codes of the slots' quantized K/V
      k_group [B, H, L+1] int32               key group id of each slot (a row of k_scale / k_zero)
      k_scale, k_zero [B, H, n_groups+1, D]   per-channel scale / zero point of each key group
      v_scale, v_zero [B, H, L+1, D/Gv]       per-token scale / zero point of each value channel group
      k_res, v_res [B, H, R, D]               the residual, in full precision
      res_slot [B, H, R]                      slot held by each residual entry (-1: empty or evicted)
      slot_res [B, H, L+1] int32              residual entry of each slot (-1: quantized or empty)
      res_fill, next_group [B]                residual entries used; first unused key group (per row: rows keep
                                              prompts of different lengths, so they flush at different steps)
    """

    exact_in_chunks = ("keys", "values")

    def __init__(self, shape: tuple[int, ...], spec: StorageSpec, dtype: torch.dtype,
                 device: torch.device | str, capacity_needed: int) -> None:
        super().__init__()
        B, H, L, D = shape
        G, R = spec.q_group_size, spec.residual_length
        if G < 1 or R < G or R % G:
            raise ValueError(f"kivi needs residual_length a positive multiple of q_group_size, got {R} and {G}")
        if capacity_needed > 1 << 40:
            raise ValueError("a kivi cache needs capacity_needed (prompt + new tokens) to size its group table")
        self.value_group = min(G, D)
        if D % self.value_group:
            raise ValueError(f"kivi value groups of {self.value_group} channels do not divide head_dim {D}")
        self.bits, self.dtype, self.slots, self.head_dim = spec.bits, dtype, L, D
        self.group_size, self.residual_length = G, R
        # Every group the sequence can create: the prompt's full groups, then R/G per R decoded tokens.
        self.n_groups = math.ceil(capacity_needed / G) + R // G
        packed = D * spec.bits // 8
        kw = dict(device=device)
        self.register_buffer("k_codes", torch.zeros(B, H, L + 1, packed, dtype=torch.uint8, **kw))
        self.register_buffer("v_codes", torch.zeros(B, H, L + 1, packed, dtype=torch.uint8, **kw))
        self.register_buffer("k_group", torch.zeros(B, H, L + 1, dtype=torch.int32, **kw))
        self.register_buffer("k_scale", torch.zeros(B, H, self.n_groups + 1, D, dtype=dtype, **kw))
        self.register_buffer("k_zero", torch.zeros(B, H, self.n_groups + 1, D, dtype=dtype, **kw))
        self.register_buffer("v_scale", torch.zeros(B, H, L + 1, D // self.value_group, dtype=dtype, **kw))
        self.register_buffer("v_zero", torch.zeros(B, H, L + 1, D // self.value_group, dtype=dtype, **kw))
        self.register_buffer("k_res", torch.zeros(B, H, R, D, dtype=dtype, **kw))
        self.register_buffer("v_res", torch.zeros(B, H, R, D, dtype=dtype, **kw))
        self.register_buffer("res_slot", torch.full((B, H, R), -1, dtype=torch.long, **kw))
        self.register_buffer("slot_res", torch.full((B, H, L + 1), -1, dtype=torch.int32, **kw))
        self.register_buffer("res_fill", torch.zeros(B, dtype=torch.long, **kw))
        self.register_buffer("next_group", torch.zeros(B, dtype=torch.long, **kw))

    def reset(self) -> None:
        for name, buf in self.named_buffers():
            buf.fill_(-1) if name in ("res_slot", "slot_res") else buf.zero_()

    # ---- writing ---------------------------------------------------------------------------------------

    def write(self, slots: Tensor, k: Tensor, v: Tensor, queries: Tensor | None = None) -> None:
        if slots.shape[-1] == 1:
            self._insert(slots, k, v)
        else:
            self._write_prompt(slots, k, v)

    def _write_prompt(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """The kept prompt (in position order) into the empty cache: whole groups from the oldest tokens
        quantized, the newest n - q (at most R) left in the residual."""
        n, G, R = slots.shape[-1], self.group_size, self.residual_length
        q = G * math.ceil(max(0, n - R) / G)
        if q:
            B, H = slots.shape[:2]
            live = torch.ones(B, H, q // G, G, dtype=torch.bool, device=k.device)
            first_group = torch.zeros(1, dtype=torch.long, device=k.device)
            self._quantize_into(slots[..., :q], k[:, :, :q], v[:, :, :q], live, first_group)
        self.next_group.fill_(q // G)
        r = n - q
        entries = torch.arange(r, device=k.device).expand(*slots.shape[:2], r)
        self.k_res[:, :, :r] = k[:, :, q:].to(self.dtype)
        self.v_res[:, :, :r] = v[:, :, q:].to(self.dtype)
        self.res_slot[:, :, :r] = slots[..., q:]
        scatter_rows(self.slot_res, slots[..., q:], entries)
        self.res_fill.fill_(r)

    def _quantize_into(self, slots: Tensor, k: Tensor, v: Tensor, live: Tensor, first_group: Tensor) -> None:
        """Quantize n tokens (n a multiple of G) into `slots` [B, H, n], key groups first_group + i.
        Slots of tokens that are not live must already point at the scratch row L."""
        B, H, n, D = k.shape
        G = self.group_size
        first_group = first_group.view(-1, 1, 1)  # [1 or B, 1, 1]: each row's first group
        codes, scale, zero = quantize_key_groups(k.reshape(B, H, n // G, G, D), live, self.bits)
        scatter_rows(self.k_codes, slots, pack_codes(codes.reshape(B, H, n, D), self.bits))
        groups = first_group + torch.arange(n // G, device=k.device)  # [1 or B, 1, n // G]
        # A group with no live token (every group of a masked-off flush) writes into the scratch row.
        groups = torch.where(live.any(-1), groups, self.n_groups)  # [B, H, n // G]
        scatter_rows(self.k_scale, groups, scale)
        scatter_rows(self.k_zero, groups, zero)
        scatter_rows(self.k_group, slots, (first_group + torch.arange(n, device=k.device) // G).expand(B, H, n))
        v_codes, v_scale, v_zero = quantize_value_groups(v, self.value_group, self.bits)
        scatter_rows(self.v_codes, slots, pack_codes(v_codes, self.bits))
        scatter_rows(self.v_scale, slots, v_scale)
        scatter_rows(self.v_zero, slots, v_zero)
        self.slot_res.scatter_(2, slots, -1)

    def _flush_if_full(self) -> None:
        """When the residual is full, quantize its live entries into new groups and empty it. Written as
        a masked update (targets redirected to the scratch row) so the decode step has no branch."""
        full = self.res_fill == self.residual_length  # [B]
        if full.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(full.any()):
            # Eager on the CPU a branch is free (no device to wait for): the masked update would only write the
            # scratch rows, and it cost about a quarter of a 4-bit KIVI step (batch 4, 1024 slots).
            return
        live = (self.res_slot >= 0) & full.view(-1, 1, 1)  # [B, H, R]
        B, H, R = live.shape
        targets = torch.where(live, self.res_slot, self.slots)
        self._quantize_into(targets, self.k_res, self.v_res, live.view(B, H, R // self.group_size, -1),
                            self.next_group)
        self.res_slot.masked_fill_(full.view(-1, 1, 1), -1)
        self.next_group.add_(full.long() * (R // self.group_size))
        self.res_fill.masked_fill_(full, 0)

    def _insert(self, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """One decode token into slot [B, H, 1] (which may hold a token being evicted)."""
        self._flush_if_full()
        # The evicted token, if it sat in the residual, leaves it without ever being quantized.
        evicted_entry = self.slot_res.gather(2, slot)  # [B, H, 1], -1 when quantized or empty
        entries = torch.arange(self.residual_length, device=slot.device)
        self.res_slot.masked_fill_(entries == evicted_entry, -1)
        entry = self.res_fill.view(-1, 1, 1).expand_as(slot)
        scatter_rows(self.k_res, entry, k)
        scatter_rows(self.v_res, entry, v)
        self.res_slot.scatter_(2, entry, slot)
        scatter_rows(self.slot_res, slot, entry)
        self.res_fill.add_(1)

    def add_to_values(self, slots: Tensor, delta: Tensor, values: Tensor | None = None) -> None:
        # Every slot's codes are rewritten from its values + delta (for a slot in the residual: stale codes, which
        # a flush overwrites); a slot in the residual gains delta there (an accumulating put: the entries of
        # slots outside it add zero to entry 0).
        v = gather_rows(self.values() if values is None else values, slots) + delta
        entry = self.slot_res.gather(2, slots)  # [B, H, m], -1 outside the residual
        B, H, m = slots.shape
        rows = torch.arange(B, device=slots.device).view(B, 1, 1).expand(B, H, m)
        heads = torch.arange(H, device=slots.device).view(1, H, 1).expand(B, H, m)
        in_residual = (entry >= 0)[..., None]
        self.v_res.index_put_((rows, heads, entry.clamp(min=0).long()),
                              torch.where(in_residual, delta, 0).to(self.v_res.dtype), accumulate=True)
        codes, scale, zero = quantize_value_groups(v, self.value_group, self.bits)
        scatter_rows(self.v_codes, slots, pack_codes(codes, self.bits))
        scatter_rows(self.v_scale, slots, scale)
        scatter_rows(self.v_zero, slots, zero)

    def write_keys(self, slots: Tensor, k: Tensor) -> None:
        """A slot in the residual takes the key there, exact (its codes are written at the next flush); a
        quantized slot's key is encoded with its group's per-channel scale and zero point, clamped to the group's
        range: re-quantizing the group would move the other keys of the group."""
        B, H, m = slots.shape
        group = self.k_group.gather(2, slots).long()
        b = torch.arange(B, device=slots.device).view(B, 1, 1)
        h = torch.arange(H, device=slots.device).view(1, H, 1)
        scale, zero = self.k_scale[b, h, group].float(), self.k_zero[b, h, group].float()
        codes = ((k.float() - zero) / scale).round().clamp(0, (1 << self.bits) - 1).to(torch.uint8)
        scatter_rows(self.k_codes, slots, pack_codes(codes, self.bits))
        self.k_res.copy_(rows_over_entries(self.k_res, self.res_slot, slots, k))

    # ---- reading ---------------------------------------------------------------------------------------

    def _with_residual(self, dequantized: Tensor, residual: Tensor) -> Tensor:
        """All L+1 dequantized rows with the residual's full-precision rows written over their slots (R rows
        scattered, cheaper than gathering L); dropped entries land on the scratch row, which is cut off."""
        target = torch.where(self.res_slot >= 0, self.res_slot, self.slots)
        scatter_rows(dequantized, target, residual)
        return dequantized[:, :, : self.slots]

    def keys(self) -> Tensor:
        B, H = self.k_group.shape[:2]
        codes = unpack_codes(self.k_codes, self.bits, self.head_dim)
        # Each slot's key group row, by advanced indexing (measured ~3x faster than gather here).
        b = torch.arange(B, device=codes.device).view(B, 1, 1)
        h = torch.arange(H, device=codes.device).view(1, H, 1)
        group = self.k_group.long()
        keys = dequantize_codes(codes, self.k_scale[b, h, group], self.k_zero[b, h, group], self.dtype)
        return self._with_residual(keys, self.k_res)

    def values(self) -> Tensor:
        D, Gv = self.head_dim, self.value_group
        codes = unpack_codes(self.v_codes, self.bits, D).unflatten(-1, (D // Gv, Gv))
        values = dequantize_codes(codes, self.v_scale[..., None], self.v_zero[..., None], self.dtype).flatten(-2)
        return self._with_residual(values, self.v_res)

    def attend(self, q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor] | None:
        # Rebuilding K and V (a group-row gather per slot, the residual scattered over them) cost ~2x the dense
        # step; the CPU kernel dequantizes one slot at a time in L1 (cpu_quantized_attention.c).
        return cpu_bf16_kernels.kivi_decode_attention(
            q, (self.k_codes, self.k_group, self.k_scale, self.k_zero), (self.v_codes, self.v_scale, self.v_zero),
            (self.k_res, self.v_res, self.slot_res), mask, self.bits)

    def full_precision_slots(self) -> Tensor:
        return self.slot_res[:, :, : self.slots] >= 0

    def statistics(self, held: Tensor) -> dict[str, Tensor]:
        """How fragmented the key groups are: held quantized tokens per key group still in use (G when no
        group lost a token; 1 when every held token is the last of its group), and residual tokens held."""
        exact = held & self.full_precision_slots()
        quantized = held & ~exact
        members = torch.zeros_like(self.k_scale[..., 0], dtype=torch.long)  # [B, H, n_groups + 1]
        members.scatter_add_(2, self.k_group[:, :, : self.slots].long(), quantized.long())
        per_group = quantized.sum(-1) / (members > 0).sum(-1).clamp(min=1)
        return {"kivi_tokens_per_key_group": per_group.double().mean(0),
                "kivi_residual_tokens": exact.sum(-1).double().mean(0)}

    def attention_bytes(self) -> int:
        """Codes and per-slot scales of every slot, the residual, and the key groups in use (those rows
        are gathered by group id, so at most one group per slot is read)."""
        read = ("k_codes", "v_codes", "k_group", "v_scale", "v_zero", "k_res", "v_res", "slot_res")
        total = sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in read)
        rows = min(self.n_groups, self.slots)
        return total + 2 * self.k_scale[:, :, :rows].numel() * self.k_scale.element_size()
