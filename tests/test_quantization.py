"""quantization_utils against independent naive references: per-row numpy quantization (rounding the scale
up with a float cast + nextafter, not the module's bit operations) and bit-by-bit packing with Python ints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_storage import StorageSpec, make_storage
from quantization_utils import (
    SUPPORTED_BITS,
    bytes_per_token_per_head,
    dequantize,
    dequantize_codes,
    pack_codes,
    packed_dim,
    quantize,
    quantize_codes,
    unpack_codes,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = ["f32", "bf16", "f16"]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def varied_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes over 4 decades and offsets, like keys with outlier heads."""
    g = gen(seed)
    x = torch.randn(shape, generator=g)
    magnitude = 10.0 ** torch.empty(*shape[:-1], 1).uniform_(-2, 2, generator=g)
    offset = torch.randn(*shape[:-1], 1, generator=g) * magnitude
    return (x * magnitude + offset).to(dtype)


# ---- naive references ---------------------------------------------------------------------------------


def reference_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row at a time, in numpy float32; the scale is rounded up to x.dtype by a cast and nextafter."""
    qmax = np.float32(2**bits - 1)
    rows = x.float().reshape(-1, x.shape[-1]).numpy()
    codes, scales, zeros = [], [], []
    for row in rows:
        lo, hi = row.min(), row.max()
        s = max(np.float32((hi - lo) / qmax), np.float32(torch.finfo(x.dtype).tiny))
        stored = torch.tensor(float(s), dtype=torch.float32).to(x.dtype)
        if stored.float().item() < s:
            stored = torch.nextafter(stored, torch.tensor(float("inf"), dtype=x.dtype))
        s = np.float32(stored.float().item())
        assert s >= (hi - lo) / qmax
        codes.append(np.clip(np.rint((row - lo) / s), 0, qmax).astype(np.uint8))  # rint: half to even
        scales.append(s)
        zeros.append(lo)
    shape = (*x.shape[:-1], 1)
    return (torch.from_numpy(np.stack(codes)).reshape(x.shape),
            torch.tensor(scales).reshape(shape).to(x.dtype), torch.tensor(zeros).reshape(shape).to(x.dtype))


def reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Code j of each group of 8/bits goes to bits [bits*j, bits*(j+1)) of its byte, with explicit shifts."""
    per = 8 // bits
    flat = [int(c) for c in codes.reshape(-1).tolist()]
    out = []
    for start in range(0, len(flat), per):
        byte = 0
        for j in range(per):
            byte |= flat[start + j] << (bits * j)
        out.append(byte)
    return torch.tensor(out, dtype=torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per)


def reference_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    flat = [(int(b) >> (bits * j)) & mask for b in packed.reshape(-1).tolist() for j in range(per)]
    return torch.tensor(flat, dtype=torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * per)


# ---- packing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_matches_reference_and_round_trips(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 16), generator=gen(bits), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(packed, reference_pack(codes, bits))
    assert torch.equal(unpack_codes(packed, bits, 16), codes)
    assert torch.equal(pack_codes(codes.long(), bits), packed)  # any integer dtype in


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_unpack_every_byte_value(bits):
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(64, 4)
    head_dim = 4 * 8 // bits
    codes = unpack_codes(every_byte, bits, head_dim)
    assert codes.shape == (64, head_dim) and int(codes.max()) <= 2**bits - 1
    assert torch.equal(codes, reference_unpack(every_byte, bits))
    assert torch.equal(pack_codes(codes, bits), every_byte)


def test_pack_masks_out_of_range_codes():
    codes = torch.tensor([[7, 0, 1, 2]])  # 7 does not fit in 2 bits: keep its low bits, spare its neighbours
    assert torch.equal(unpack_codes(pack_codes(codes, 2), 2, 4), torch.tensor([[3, 0, 1, 2]], dtype=torch.uint8))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="bits"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(8), 16)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_codes(torch.zeros(2, 6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        quantize(torch.zeros(2, 5), 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 2, 6)
    with pytest.raises(ValueError, match="pack into 4 bytes"):
        unpack_codes(torch.zeros(2, 3, dtype=torch.uint8), 4, 8)
    with pytest.raises(ValueError, match="uint8"):
        unpack_codes(torch.zeros(2, 4, dtype=torch.int32), 4, 8)
    with pytest.raises(ValueError, match="float"):
        quantize(torch.zeros(2, 8, dtype=torch.int64), 8)
    assert packed_dim(64, 2) == 16 and packed_dim(64, 4) == 32 and packed_dim(64, 8) == 64
    assert packed_dim(6, 8) == 6


# ---- quantization -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_quantize_matches_reference(bits, dtype):
    x = varied_rows((2, 3, 5, 16), dtype, seed=bits)
    x[0, 0, 0] = 1.5  # a constant row
    codes, scale, zero = quantize_codes(x, bits)
    ref_codes, ref_scale, ref_zero = reference_quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.dtype == zero.dtype == dtype and scale.shape == zero.shape == (2, 3, 5, 1)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(zero, ref_zero)
    assert torch.equal(codes, ref_codes)
    packed, scale2, zero2 = quantize(x, bits)
    assert torch.equal(packed, reference_pack(ref_codes, bits))
    assert torch.equal(scale2, scale) and torch.equal(zero2, zero)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_error_at_most_half_a_step(bits, dtype):
    """|x - x_hat| <= scale/2 per element (computed in float32; tolerance: a few float32 ulps)."""
    x = varied_rows((4, 3, 32, 64), dtype, seed=10 + bits)
    packed, scale, zero = quantize(x, bits)
    x_hat = dequantize(packed, scale, zero, bits, torch.float32)
    xf, s, z = x.float(), scale.float(), zero.float()
    err = (xf - x_hat).abs()
    ulps = 4 * torch.finfo(torch.float32).eps * (xf.abs() + z.abs() + (2**bits - 1) * s)
    assert bool((err <= s / 2 + ulps).all()), float((err / s).max())
    assert float((err / s).max()) > 0.45  # the bound is tight: it is not vacuous
    # The low-precision result is the float32 one rounded once.
    assert torch.equal(dequantize(packed, scale, zero, bits), x_hat.to(dtype))


RELATIVE_RMS_BOUND = {8: 0.01, 4: 0.10, 2: 0.50}  # measured: 0.0053, 0.0895, 0.449 (float32 and bf16 alike)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=DTYPE_IDS[:2])
def test_relative_error_on_gaussian_data(dtype):
    x = torch.randn(1, 4, 256, 64, generator=gen(0)).to(dtype)
    rel = {}
    for bits in SUPPORTED_BITS:
        x_hat = dequantize(*quantize(x, bits), bits, torch.float32)
        rel[bits] = float((x.float() - x_hat).norm() / x.float().norm())
        assert rel[bits] < RELATIVE_RMS_BOUND[bits], rel
    # Each doubling of bits divides the error by about qmax ratio (5x for 2->4, 17x for 4->8).
    assert rel[2] > 3 * rel[4] > 30 * rel[8], rel


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_constant_rows_are_exact(bits, dtype):
    values = [0.0, -3.25, 1.0 / 3.0, 2.0**-20, 60000.0] + ([1e30, -1e-30] if dtype != torch.float16 else [])
    x = torch.tensor(values, dtype=dtype)[:, None].expand(-1, 8).contiguous()
    packed, scale, zero = quantize(x, bits)
    assert torch.equal(dequantize(packed, scale, zero, bits), x)
    assert bool((scale > 0).all()) and bool(torch.isfinite(scale).all())
    assert torch.equal(unpack_codes(packed, bits, 8), torch.zeros_like(x, dtype=torch.uint8))


def test_bf16_input():
    x = varied_rows((2, 3, 7, 64), torch.bfloat16, seed=3)
    packed, scale, zero = quantize(x, 4)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 7, 32)
    assert scale.dtype == zero.dtype == torch.bfloat16
    x_hat = dequantize(packed, scale, zero, 4)
    assert x_hat.dtype == torch.bfloat16 and x_hat.shape == x.shape
    # The scale is the smallest bf16 number covering the range: codes reach the top level or one below.
    top = unpack_codes(packed, 4, 64).amax(dim=-1)
    assert bool((top >= 14).all())


def test_codes_round_trip_without_packing():
    x = varied_rows((3, 16), torch.float32, seed=4)
    codes, scale, zero = quantize_codes(x, 8)
    assert torch.equal(dequantize_codes(codes, scale, zero), dequantize(pack_codes(codes, 8), scale, zero, 8))


# ---- the cache's use: write one token's slot -----------------------------------------------------------


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_write_one_slot_leaves_the_others(bits):
    B, H, L, D = 2, 3, 8, 16
    cache = varied_rows((B, H, L, D), torch.float32, seed=5)
    k_packed, k_scale, k_zero = quantize(cache, bits)
    before = [t.clone() for t in (k_packed, k_scale, k_zero)]
    token = varied_rows((B, H, 1, D), torch.float32, seed=6)
    slot = torch.randint(0, L, (B, H), generator=gen(7))
    packed, scale, zero = quantize(token, bits)
    k_packed.scatter_(2, slot[..., None, None].expand(B, H, 1, packed.shape[-1]), packed)
    k_scale.scatter_(2, slot[..., None, None], scale)
    k_zero.scatter_(2, slot[..., None, None], zero)

    written = torch.zeros(B, H, L, dtype=torch.bool).scatter_(2, slot[..., None], True)
    for new, old in zip((k_packed, k_scale, k_zero), before, strict=True):
        assert torch.equal(new[~written], old[~written])
    x_hat = dequantize(k_packed, k_scale, k_zero, bits)
    assert torch.equal(x_hat[written], dequantize(packed, scale, zero, bits).reshape(B * H, D))
    # Rows are independent: a token quantized alone gets the bytes it gets inside a batch.
    assert torch.equal(quantize(cache[:, :, 3:4], bits)[0], quantize(cache, bits)[0][:, :, 3:4])


def test_bytes_per_token_per_head():
    assert [bytes_per_token_per_head(64, b) for b in (2, 4, 8)] == [20, 36, 68]
    assert bytes_per_token_per_head(64, 2, torch.float32) == 24
    with pytest.raises(ValueError):
        bytes_per_token_per_head(66, 2)
    x = torch.zeros(1, 2, 5, 64, dtype=torch.float16)
    for bits in SUPPORTED_BITS:
        stored = sum(t.numel() * t.element_size() for t in quantize(x, bits))
        assert stored == 2 * 5 * bytes_per_token_per_head(64, bits, torch.float16)


# ---- compilation ---------------------------------------------------------------------------------------


def test_compiles_fullgraph_and_matches_eager():
    """One tiny compile (a few seconds): no graph breaks, and bit-identical to eager (the scale rounding
    uses integer bit operations, which inductor cannot elide as it does a bf16 -> float32 cast pair)."""

    def round_trip(x: torch.Tensor):
        packed, scale, zero = quantize(x, 2)
        return packed, scale, zero, dequantize(packed, scale, zero, 2)

    x = varied_rows((1, 2, 8, 16), torch.bfloat16, seed=8)
    compiled = torch.compile(round_trip, fullgraph=True)
    for got, want in zip(compiled(x), round_trip(x), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


PROMPT_STORAGES = {"dense": StorageSpec(), "int4": StorageSpec(bits=4),
                   "kivi2": StorageSpec(bits=2, scheme="kivi", q_group_size=4, residual_length=4),
                   "think": StorageSpec(think_ratio=0.5, think_window=4)}


@pytest.mark.parametrize("spec", PROMPT_STORAGES.values(), ids=PROMPT_STORAGES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_storing_a_prompt_equals_writing_it_at_its_slots(spec: StorageSpec, dtype: torch.dtype) -> None:
    """write_prefix (a prompt into slots 0..n-1; dense storage copies a slice) stores exactly what write at
    those slots stores, into a cache with slots to spare, float32 K/V into either cache dtype."""
    B, H, L, D, n = 2, 3, 16, 8, 11
    k, v = torch.randn(B, H, n, D, generator=gen(1)), torch.randn(B, H, n, D, generator=gen(2))
    queries = torch.randn(B, 2 * H, n, D, generator=gen(3))
    by_slots, by_prefix = (make_storage(spec, B, H, L, D, dtype, "cpu", L) for _ in range(2))
    for s in (by_slots, by_prefix):
        s.reset()
    by_slots.write(torch.arange(n).view(1, 1, n).expand(B, H, n), k, v, queries)
    by_prefix.write_prefix(k, v, queries)
    for (name, a), (_, b) in zip(by_slots.named_buffers(), by_prefix.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(by_slots.keys(), by_prefix.keys()) and torch.equal(by_slots.values(), by_prefix.values())
