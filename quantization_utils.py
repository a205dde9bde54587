"""Building blocks for quantized KV-cache storage (`--cache_bits 2|4|8`, docs/DESIGN.md §5; used by kv_storage.py):
pure tensor ops.

Why asymmetric, per token
-------------------------
Keys and values are stored as small unsigned integers plus, for every row of `head_dim` values, a
scale and a zero point (KIVI, arXiv 2402.02750, and most KV-cache quantizers since). The quantization is
*asymmetric* (min/max): a row's values are rarely centred on 0 (keys after RoPE carry large
per-channel offsets), and a symmetric grid can waste up to half its levels on a range the row never uses,
which hurts most at 2 bits, where there are only 4 levels.

`--cache_quantization per_token` applies this to one row = one token in one KV head (the last dimension):
a decode step then writes one token into any slot with a single scatter, without requantizing the other
tokens. KIVI quantizes keys per *channel* (grouped over tokens) and values per token in channel groups;
kv_storage.ResidualQuantizedStorage builds that from the same functions, applied to transposed groups.
Per-token keys pay for outlier channels (the outlier widens the whole row's range).

Conventions
-----------
For a row `x` of `D` values and `qmax = 2**bits - 1`:

    zero  = min(x)                                   (the value code 0 stands for)
    scale = max((max(x) - zero) / qmax, tiny)        (tiny = smallest normal number of x.dtype)
    code  = clamp(round((x - zero) / scale), 0, qmax)          (round half to even)
    x_hat = code * scale + zero

so `zero` is the zero point expressed in the value domain (the row minimum), not an integer offset:
with `x_hat = code * scale + zero`, a constant row gets codes 0 and reconstructs *exactly*, and no
division by a zero range can happen (the `tiny` floor).

`scale` and `zero` have shape `[..., 1]` and are stored in the input's dtype (bf16 for a bf16 cache,
float32 for a float32 cache): `zero` is then an element of the row, so it is exact. All arithmetic runs
in float32 (float64 for float64 inputs); `scale` is rounded *up* to the storage dtype with integer bit
operations (not a float round trip: `torch.compile` may elide a `.to(bf16).to(float32)` pair and compute
the codes with an unrounded scale) and the codes are computed from the stored scale, so every
`(x - zero) / scale` lies in `[0, qmax]` and the clamp never bites, eager and compiled alike.

Error bound: with round-to-nearest and no clamping, every element satisfies

    |x - x_hat| <= scale / 2

(plus float32 rounding of the arithmetic, a few ulps, and the final rounding of `x_hat` to a low
precision output dtype such as bf16, up to half an ulp of x_hat). For a row of D = 64 Gaussian values
the range is about 4.8 standard deviations, so the relative RMS error is about
`4.8 / qmax / sqrt(12)` (0.54 %, 9.2 %, 46 % at 8, 4, 2 bits);
measured on Gaussian data ([1, 4, 256, 64], tests/test_quantization.py): 0.53 % at 8 bits, 9.0 % at
4 bits, 45 % at 2 bits. On the real keys / values of SmolLM2-135M (bf16, all 30 layers, 512 tokens
of pydoc text, measured once) it is 0.78 / 0.57 % at 8 bits, 13 / 9.7 % at 4 bits and 65 / 48 % at
2 bits: per-token keys suffer from their outlier channels, as KIVI observed.

Storage
-------
Codes are packed into uint8 along the last dimension: 4 two-bit codes or 2 four-bit codes per byte;
8-bit codes are the bytes themselves. Code `j` of a group of `8 // bits` consecutive codes sits in bits
`[bits*j, bits*(j+1))` of its byte (least significant first). A cache keeps, per K and per V,

    packed [B, H, L, D * bits // 8] uint8,  scale [B, H, L, 1],  zero [B, H, L, 1]

and writes one token's slot with three scatters over dim 2 of `quantize(k_token, bits)`.

Everything here is compile-friendly: tensor ops only, shapes depend only on the input shape and the
(Python int) bit width, no `.item()` and no host synchronisation. Inputs must be finite (an inf or NaN
spoils its own row only).
"""

from __future__ import annotations

import torch
from torch import Tensor

SUPPORTED_BITS: tuple[int, ...] = (2, 4, 8)
# Stored mantissa bits of the supported input dtypes (torch.finfo(dtype).eps == 2 ** -bits).
_MANTISSA_BITS: dict[torch.dtype, int] = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"cache bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return 8 // bits  # codes per byte


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes one row of `head_dim` codes packs into: head_dim * bits / 8 (ValueError if not whole)."""
    per_byte = _check_bits(bits)
    if head_dim <= 0 or head_dim % per_byte:
        raise ValueError(f"head_dim {head_dim} must be a positive multiple of {per_byte} for {bits}-bit packing")
    return head_dim // per_byte


def bytes_per_token_per_head(head_dim: int, bits: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one token occupies in one KV head of *one* of K or V: packed codes + its scale + its zero.

    `dtype` is the cache (input) dtype, in which scale and zero are stored. E.g. head_dim 64 in bf16:
    20 B at 2 bits, 36 B at 4 bits, 68 B at 8 bits (128 B unquantized). Double it for K and V together.
    """
    return packed_dim(head_dim, bits) + 2 * torch.empty((), dtype=dtype).element_size()


def _round_up_to(value: Tensor, dtype: torch.dtype) -> Tensor:
    """Positive finite `value` rounded up to the nearest number representable in `dtype` (a normal number
    there), returned in value's own dtype: clears the extra mantissa bits of the IEEE representation,
    carrying into the exponent when needed."""
    drop = _MANTISSA_BITS[value.dtype] - _MANTISSA_BITS[dtype]
    if drop <= 0:
        return value
    if value.dtype != torch.float32:
        raise ValueError(f"cannot round {value.dtype} to {dtype}")  # unreachable: compute is float32 here
    low = (1 << drop) - 1
    return ((value.view(torch.int32) + low) & ~low).view(torch.float32)


def quantize_codes(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric per-row quantization of the last dimension of `x` ([..., D], floating point).

    Returns (codes, scale, zero): codes uint8 [..., D] in [0, 2**bits - 1] (not packed); scale and zero
    [..., 1] in x.dtype, with x ≈ codes * scale + zero (zero = row minimum, scale = row range / qmax
    rounded up, at least the smallest normal number of x.dtype).
    """
    _check_bits(bits)
    if x.dtype not in _MANTISSA_BITS:
        raise ValueError(f"quantize expects a float64/float32/bfloat16/float16 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize expects a tensor with a last dimension to quantize")
    compute = torch.promote_types(x.dtype, torch.float32)
    qmax = (1 << bits) - 1
    xc = x.to(compute)
    zero = xc.amin(dim=-1, keepdim=True)  # an element of x: exact in x.dtype
    span = xc.amax(dim=-1, keepdim=True) - zero
    scale = _round_up_to((span / qmax).clamp(min=torch.finfo(x.dtype).tiny), x.dtype)
    codes = ((xc - zero) / scale).round().clamp(0, qmax).to(torch.uint8)
    return codes, scale.to(x.dtype), zero.to(x.dtype)


def dequantize_codes(codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """codes * scale + zero, computed in float32 (or wider) and returned in `dtype` (default: zero.dtype)."""
    compute = torch.promote_types(torch.promote_types(scale.dtype, zero.dtype), torch.float32)
    x_hat = codes.to(compute) * scale.to(compute) + zero.to(compute)
    return x_hat.to(zero.dtype if dtype is None else dtype)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes [..., D] (values in [0, 2**bits - 1]) into uint8 [..., D * bits / 8].

    8-bit codes are returned as uint8 (the same tensor when they already are). Out-of-range codes are
    masked to their low `bits` bits so they cannot corrupt their neighbours.
    """
    if codes.dim() == 0:
        raise ValueError("pack_codes expects a tensor with a last dimension of codes")
    packed_dim(codes.shape[-1], bits)  # validates bits and the divisibility of D
    per_byte = 8 // bits
    c = codes.to(torch.uint8)
    if bits == 8:
        return c
    c = (c & ((1 << bits) - 1)).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    packed = c[..., 0]
    for j in range(1, per_byte):  # 1 or 3 static steps, one per bit field
        packed = packed | (c[..., j] << (bits * j))
    return packed


def unpack_codes(packed: Tensor, bits: int, head_dim: int) -> Tensor:
    """Inverse of `pack_codes`: uint8 [..., head_dim * bits / 8] -> uint8 codes [..., head_dim]."""
    n_bytes = packed_dim(head_dim, bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.dim() == 0 or packed.shape[-1] != n_bytes:
        raise ValueError(f"{bits}-bit codes of head_dim {head_dim} pack into {n_bytes} bytes, got shape "
                         f"{tuple(packed.shape)}")
    if bits == 8:
        return packed
    mask = (1 << bits) - 1
    fields = [(packed >> (bits * j)) & mask for j in range(8 // bits)]
    return torch.stack(fields, dim=-1).reshape(*packed.shape[:-1], head_dim)


def quantize(x: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize and pack x [..., D]: (packed uint8 [..., D*bits/8], scale [..., 1], zero [..., 1]).

    scale and zero are in x.dtype. Rows are independent, so quantizing one token alone gives exactly
    the bytes it gets when quantized together with others.
    """
    codes, scale, zero = quantize_codes(x, bits)
    return pack_codes(codes, bits), scale, zero


def dequantize(packed: Tensor, scale: Tensor, zero: Tensor, bits: int, dtype: torch.dtype | None = None) -> Tensor:
    """Unpack and dequantize: x_hat [..., D] (D = packed.shape[-1] * 8 / bits) in `dtype` (default zero.dtype)."""
    _check_bits(bits)
    codes = unpack_codes(packed, bits, packed.shape[-1] * 8 // bits)
    return dequantize_codes(codes, scale, zero, dtype)
