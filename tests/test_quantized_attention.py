"""A decode step's attention read straight from per-token quantized K/V (cpu_quantized_attention.c, through
PerTokenQuantizedStorage.attend), against the float64 definition of the stored tensors and against the
path it replaces (dequantize every slot, then attend).

Tolerances: float32 probabilities within 1e-6 and outputs within 1e-5 of the float64 attention over the
dequantized K/V (measured ~1e-7 and ~3e-6); a bf16 output within one bf16 ulp of it; through the model, the
same kept positions at every step as the dequantizing path and logits within 1e-4 (float32).
"""

from __future__ import annotations

import math

import pytest
import torch

import cpu_bf16_kernels as kernels
from generate import decode_one_token, prefill
from kv_storage import PerTokenQuantizedStorage
from quantization_utils import dequantize, quantize
from tests.conftest import make_tiny_model
from tests.strategy_matrix import PROMPT, STRATEGIES, TOTAL, attach, cache_args, held_positions, token_ids

ULP = 2.0**-7


def exact(q, kq, vq, mask, bits):
    """The definition: attention in float64 over the K/V the codes stand for."""
    k, v = dequantize(*kq, bits, torch.float64), dequantize(*vq, bits, torch.float64)
    scores = (q.double() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return probs @ v, probs


def quantized(shape, bits, dtype, g, offset=0.0):
    # Keys with per-channel offsets (as RoPE'd keys have), so a row's zero point and scale both matter.
    x = torch.randn(*shape, generator=g) + offset * torch.randn(shape[-1], generator=g)
    return quantize(x.to(dtype), bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("b,h,r,length,d", [(2, 3, 3, 300, 64), (1, 2, 5, 7, 128), (3, 1, 1, 513, 64),
                                            (1, 4, 9, 256, 32)])
def test_attention_from_codes_matches_the_definition(b, h, r, length, d, bits, dtype):
    g = torch.Generator().manual_seed(b * 1000 + length + bits)
    q = torch.randn(b, h, r, d, generator=g).to(dtype)
    kq, vq = quantized((b, h, length, d), bits, dtype, g, offset=3.0), quantized((b, h, length, d), bits, dtype, g)
    mask = torch.rand(b, h, r, length, generator=g) > 0.3
    mask[..., 0] = True
    with torch.inference_mode():
        out, probs = kernels.quantized_decode_attention(q, kq, vq, mask, bits)
    exact_out, exact_probs = exact(q, kq, vq, mask, bits)
    assert out.dtype == dtype and probs.dtype == torch.float32
    assert (probs.double() - exact_probs).abs().max() < 1e-6
    assert torch.equal(probs == 0, ~mask)  # masked slots get exactly nothing
    if dtype == torch.float32:
        assert (out.double() - exact_out).abs().max() < 1e-5
    else:
        assert ((out.double() - exact_out).abs() <= ULP * exact_out.abs() + 1e-5).all()


def test_attention_from_codes_reads_broadcast_masks_and_row_views():
    # A row context's buffers are views of the batch's (batch stride kept), and the model's mask is [B, H, 1, L].
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2, 4, 64, generator=g)
    kq, vq = quantized((3, 2, 40, 64), 4, torch.float32, g), quantized((3, 2, 40, 64), 4, torch.float32, g)
    mask = (torch.rand(3, 2, 1, 40, generator=g) > 0.5) | (torch.arange(40) == 0)
    row = (slice(1, 2),)
    with torch.inference_mode():
        out, probs = kernels.quantized_decode_attention(
            q[row], tuple(t[row] for t in kq), tuple(t[row] for t in vq), mask[row], 4)
    exact_out, exact_probs = exact(q[row], tuple(t[row] for t in kq), tuple(t[row] for t in vq), mask[row], 4)
    assert (probs.double() - exact_probs).abs().max() < 1e-6 and (out.double() - exact_out).abs().max() < 1e-5


def test_a_batch_equals_each_row_alone_on_any_number_of_threads():
    # Fixed chunks of slots, summed in order: a row's result is bit for bit the same alone, in a batch, on any
    # number of threads (what lets a batch of rows equal each row decoded alone).
    g = torch.Generator().manual_seed(11)
    for length in (40, 600):
        q = torch.randn(3, 2, 4, 64, generator=g)
        kq, vq = quantized((3, 2, length, 64), 4, torch.float32, g), quantized((3, 2, length, 64), 4, torch.float32, g)
        mask = torch.rand(3, 2, 1, length, generator=g) > 0.3
        threads = torch.get_num_threads()
        with torch.inference_mode():
            batch = kernels.quantized_decode_attention(q, kq, vq, mask, 4)
            try:
                torch.set_num_threads(1 if threads > 1 else 2)
                other = kernels.quantized_decode_attention(q, kq, vq, mask, 4)
            finally:
                torch.set_num_threads(threads)
            rows = [kernels.quantized_decode_attention(q[i:i + 1], tuple(t[i:i + 1] for t in kq),
                                                       tuple(t[i:i + 1] for t in vq), mask[i:i + 1], 4)
                    for i in range(3)]
        for got in (other, tuple(torch.cat(parts) for parts in zip(*rows, strict=True))):
            assert all(torch.equal(a, b) for a, b in zip(batch, got, strict=True))


def test_a_row_with_every_slot_masked_is_nan_as_in_torch():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 2, 64, generator=g)
    kq, vq = quantized((1, 1, 10, 64), 8, torch.float32, g), quantized((1, 1, 10, 64), 8, torch.float32, g)
    mask = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    mask[0, 0, 1, 3] = True
    with torch.inference_mode():
        out, probs = kernels.quantized_decode_attention(q, kq, vq, mask, 8)
    assert probs[0, 0, 0].isnan().all() and out[0, 0, 0].isnan().all()
    assert probs[0, 0, 1, 3] == 1.0 and not out[0, 0, 1].isnan().any()


@pytest.mark.parametrize("rows,d,bits", [(kernels.MAX_QUERY_ROWS + 1, 64, 4), (3, 16, 2), (3, 264, 8)])
def test_prompt_blocks_and_head_sizes_it_cannot_unpack_are_left_to_dequantization(rows, d, bits):
    g = torch.Generator().manual_seed(1)
    kq, vq = quantized((1, 1, 20, d), bits, torch.float32, g), quantized((1, 1, 20, d), bits, torch.float32, g)
    with torch.inference_mode():
        got = kernels.quantized_decode_attention(torch.randn(1, 1, rows, d), kq, vq, torch.ones(1, 1, 1, 20,
                                                                                               dtype=torch.bool), bits)
    assert got is None


def test_compiled_calls_equal_eager_calls():
    def step(q, kq, vq, mask):
        return kernels.quantized_decode_attention(q, kq, vq, mask, 4)

    g = torch.Generator().manual_seed(3)
    args = (torch.randn(1, 2, 3, 64, generator=g), quantized((1, 2, 30, 64), 4, torch.float32, g),
            quantized((1, 2, 30, 64), 4, torch.float32, g), torch.rand(1, 2, 1, 30, generator=g) > 0.2)
    with torch.inference_mode():
        eager = step(*args)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(*args)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


# ---- through the model: every strategy, against the path that dequantizes ---------------------------------------

def decode_trace(model, ids, args) -> tuple[list, list]:
    """Kept positions of every layer after each step, and each step's logits."""
    caches = attach(model, args)
    kept, logits = [], []
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :PROMPT])
        for p in range(PROMPT, TOTAL):
            logits.append(decode_one_token(model, ids[:, p:p + 1], torch.tensor([p])))
            kept.append([held_positions(c) for c in caches])
    return kept, logits


@pytest.mark.parametrize("storage", ["4bit", "8bit"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decoding_from_codes_keeps_what_dequantizing_keeps(strategy, storage, monkeypatch):
    # The tiny model's 16-wide heads: 4 and 8 bits take the kernel (2 bits cannot unpack 16 codes in 8 bytes).
    # (A debug_ twin decodes with its dense full cache; its quantized shadow is never attended.)
    model, ids = make_tiny_model(), token_ids(3)
    args = cache_args(strategy, "0.5", storage)
    calls = []
    attend = PerTokenQuantizedStorage.attend
    monkeypatch.setattr(PerTokenQuantizedStorage, "attend", lambda self, q, m: calls.append(1) or attend(self, q, m))
    kept, logits = decode_trace(model, ids, args)
    assert calls  # the kernel's path ran
    monkeypatch.setattr(PerTokenQuantizedStorage, "attend", lambda self, q, m: None)
    ref_kept, ref_logits = decode_trace(model, ids, args)
    assert kept == ref_kept
    assert max((a - b).abs().max().item() for a, b in zip(logits, ref_logits, strict=True)) < 1e-4


def test_the_bundled_model_decodes_from_codes_as_from_dequantized_keys(bundled, monkeypatch):
    # 64-wide heads, real keys with outlier channels; heavy_hitter reads the probabilities every step. float32:
    # in bf16 the dequantizing path rounds every rebuilt key to bf16 (the kernel never does), so near-ties in
    # H2O's sums go either way there; the bf16 kernel is held to one ulp of the definition above.
    from cache_setup import attach_caches, cache_config

    model, tokenizer = bundled
    ids = tokenizer.encode("The key-value cache of a transformer holds one key and one value per token. " * 6)
    config = cache_config(cache_strategy=["heavy_hitter"], max_cache_length=[0.5], cache_bits=4)
    runs = []
    for attend in (PerTokenQuantizedStorage.attend, lambda self, q, m: None):
        monkeypatch.setattr(PerTokenQuantizedStorage, "attend", attend)
        attach_caches(model, config, len(ids), 12, tokenizer)
        with torch.inference_mode():
            logits = [prefill(model, torch.tensor([ids]))]
            for i in range(12):
                token = logits[-1].argmax(-1).view(1, 1)
                logits.append(decode_one_token(model, token, torch.tensor([len(ids) + i])))
        runs.append((torch.stack(logits).float(), [c.pos[c.mask[:, :, 0]].tolist() for c in model.caches()]))
    (fused, fused_kept), (ref, ref_kept) = runs
    assert fused_kept == ref_kept
    assert (fused - ref).abs().max() < 1e-3
