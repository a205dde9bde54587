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
from kv_storage import PerTokenQuantizedStorage, ResidualQuantizedStorage, StorageSpec, make_storage
from quantization_utils import dequantize, quantize
from tests.conftest import make_tiny_model
from tests.strategy_matrix import PROMPT, STRATEGIES, TOTAL, attach, cache_args, held_positions, token_ids

ULP = 2.0**-7


def exact_over(q, k, v, mask):
    """Attention in float64 over the given K/V."""
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return probs @ v.double(), probs


def exact(q, kq, vq, mask, bits):
    """The definition: attention in float64 over the K/V the codes stand for."""
    return exact_over(q, dequantize(*kq, bits, torch.float64), dequantize(*vq, bits, torch.float64), mask)


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
        out, probs = kernels.per_token_decode_attention(q, kq, vq, mask, bits)
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
        out, probs = kernels.per_token_decode_attention(
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
            batch = kernels.per_token_decode_attention(q, kq, vq, mask, 4)
            try:
                torch.set_num_threads(1 if threads > 1 else 2)
                other = kernels.per_token_decode_attention(q, kq, vq, mask, 4)
            finally:
                torch.set_num_threads(threads)
            rows = [kernels.per_token_decode_attention(q[i:i + 1], tuple(t[i:i + 1] for t in kq),
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
        out, probs = kernels.per_token_decode_attention(q, kq, vq, mask, 8)
    assert probs[0, 0, 0].isnan().all() and out[0, 0, 0].isnan().all()
    assert probs[0, 0, 1, 3] == 1.0 and not out[0, 0, 1].isnan().any()


@pytest.mark.parametrize("rows,d,bits", [(kernels.MAX_QUERY_ROWS + 1, 64, 4), (3, 16, 2), (3, 264, 8)])
def test_prompt_blocks_and_head_sizes_it_cannot_unpack_are_left_to_dequantization(rows, d, bits):
    g = torch.Generator().manual_seed(1)
    kq, vq = quantized((1, 1, 20, d), bits, torch.float32, g), quantized((1, 1, 20, d), bits, torch.float32, g)
    with torch.inference_mode():
        got = kernels.per_token_decode_attention(torch.randn(1, 1, rows, d), kq, vq, torch.ones(1, 1, 1, 20,
                                                                                               dtype=torch.bool), bits)
    assert got is None


def test_compiled_calls_equal_eager_calls():
    def step(q, kq, vq, mask):
        return kernels.per_token_decode_attention(q, kq, vq, mask, 4)

    g = torch.Generator().manual_seed(3)
    args = (torch.randn(1, 2, 3, 64, generator=g), quantized((1, 2, 30, 64), 4, torch.float32, g),
            quantized((1, 2, 30, 64), 4, torch.float32, g), torch.rand(1, 2, 1, 30, generator=g) > 0.2)
    with torch.inference_mode():
        eager = step(*args)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(*args)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


# ---- KIVI: group scales, value channel groups, the residual --------------------------------------------------

@pytest.mark.parametrize(("G", "R", "prompt"), [(4, 8, 13), (8, 8, 20), (2, 4, 3)])
def test_kivi_attention_matches_the_naive_kivi_through_flushes_and_evictions(G, R, prompt):
    # tests/test_kivi.py's naive KIVI (8-wide heads, so 8 bits; value groups of 2 and 4 channels take the
    # kernel's narrow-group path, of 8 its vector path): every step's attention over the slots in use against
    # the float64 attention over the naive store's keys and values, residual tokens whole.
    from tests.test_kivi import B, D, H, through_flushes_and_evictions

    L = 24
    for storage, naive, used in through_flushes_and_evictions(8, G, R, prompt, L, steps=40, seed=G * 10 + R):
        q, mask = torch.randn(B, H, 3, D), (torch.arange(L) < used).view(1, 1, 1, L).expand(B, H, 1, L)
        with torch.inference_mode():
            out, probs = storage.attend(q, mask)
        want_k, want_v = naive.keys_values(list(range(used)))
        exact_out, exact_probs = exact_over(q, want_k[None], want_v[None], mask[..., :used])
        assert (probs[..., :used].double() - exact_probs).abs().max() < 1e-6 and not probs[..., used:].any()
        assert (out.double() - exact_out).abs().max() < 1e-5


def rebuilt_exactly(storage) -> tuple[torch.Tensor, torch.Tensor]:
    """keys() and values() dequantized into float64, as the kernel computes them (the storage's own rebuild
    rounds them to the cache dtype, bf16's 8 bits)."""
    dtype, storage.dtype = storage.dtype, torch.float64
    try:
        return storage.keys(), storage.values()
    finally:
        storage.dtype = dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_attention_at_a_models_head_size_matches_attention_over_its_rebuilt_keys(bits, dtype):
    # 64-wide heads in groups of 16 tokens and channels, a residual of 32: attention from the kernel against
    # the float64 attention over keys() / values() rebuilt in float64 (the path it replaces, held to the naive
    # KIVI above).
    L, G = 200, 16
    g = torch.Generator().manual_seed(bits)
    storage = make_storage(StorageSpec(bits, "kivi", G, 2 * G), 2, 3, L, 64, dtype, "cpu", L + 40)
    offsets = 4 * torch.randn(64, generator=g)
    prompt = (torch.randn(2, 3, 150, 64, generator=g) + offsets).to(dtype)
    storage.write(torch.arange(150).expand(2, 3, 150), prompt, torch.randn(2, 3, 150, 64, generator=g).to(dtype))
    for step in range(40):  # past a flush, then evicting slots of both stores
        slot = torch.full((2, 3, 1), 150 + step) if step < 30 else torch.randint(0, L, (2, 3, 1), generator=g)
        storage.write(slot, (torch.randn(2, 3, 1, 64, generator=g) + offsets).to(dtype),
                      torch.randn(2, 3, 1, 64, generator=g).to(dtype))
    q = torch.randn(2, 3, 3, 64, generator=g).to(dtype)
    mask = torch.rand(2, 3, 1, L, generator=g) > 0.2
    with torch.inference_mode():
        out, probs = storage.attend(q, mask)
    exact_out, exact_probs = exact_over(q, *rebuilt_exactly(storage), mask)
    assert storage.full_precision_slots().any() and (~storage.full_precision_slots()).any()
    assert (probs.double() - exact_probs).abs().max() < 1e-6
    if dtype == torch.float32:
        assert (out.double() - exact_out).abs().max() < 1e-5
    else:
        assert ((out.double() - exact_out).abs() <= ULP * exact_out.abs() + 1e-5).all()


# ---- through the model: every strategy, against the path that dequantizes ---------------------------------------

QUANTIZED = (PerTokenQuantizedStorage, ResidualQuantizedStorage)


def checked_attend(monkeypatch, calls: list) -> None:
    """Every quantized storage's attend computes both ways on the same buffers, compares them and returns the
    kernel's: through a model the per-step comparison is exact where an end-to-end one is not (a 1e-6
    difference in a hidden state can flip a 4-bit code of a later token, rightly)."""
    for cls in QUANTIZED:
        def attend(self, q, mask, original=cls.attend):
            got = original(self, q, mask)
            if got is not None:
                want = kernels.torch_attention(q.double(), *rebuilt_exactly(self), mask)
                # Relative to the call's largest output (values grow to ~30 in the bundled model's late layers).
                calls.append(max(((a.double() - b).abs().max() / b.abs().max().clamp(min=1)).item()
                                 for a, b in zip(got, want, strict=True)))
            return got
        monkeypatch.setattr(cls, "attend", attend)


def decode_trace(model, ids, args) -> list:
    """Kept positions of every layer after each step."""
    caches = attach(model, args)
    kept = []
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :PROMPT])
        for p in range(PROMPT, TOTAL):
            decode_one_token(model, ids[:, p:p + 1], torch.tensor([p]))
            kept.append([held_positions(c) for c in caches])
    return kept


@pytest.mark.parametrize("storage", ["4bit", "8bit", "kivi4"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decoding_from_codes_keeps_what_dequantizing_keeps(strategy, storage, monkeypatch):
    # The tiny model's 16-wide heads: 4 and 8 bits take the kernel (2 bits cannot unpack 16 codes in 8 bytes);
    # kivi4's value groups of 4 channels its narrow-group path. (A debug_ twin decodes with its dense full cache;
    # its quantized shadow is never attended.)
    model, ids = make_tiny_model(), token_ids(3)
    args = cache_args(strategy, "0.5", storage)
    calls: list = []
    with monkeypatch.context() as patch:
        checked_attend(patch, calls)
        kept = decode_trace(model, ids, args)
    assert calls and max(calls) < 1e-5  # the kernel's path ran, and attended as the rebuilt K/V would
    for cls in QUANTIZED:
        monkeypatch.setattr(cls, "attend", lambda self, q, m: None)
    assert kept == decode_trace(model, ids, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [[], ["--cache_quantization", "kivi", "--q_group_size", "16",
                                                "--residual_length", "32"]], ids=["per_token", "kivi"])
def test_the_bundled_model_attends_from_codes_as_over_rebuilt_keys(bundled, quantization, dtype, monkeypatch):
    # 64-wide heads, real keys with outlier channels; heavy_hitter reads the probabilities every step; KIVI
    # flushes its residual of 32 twice in 40 steps. Every call against the float64 attention over the rebuilt
    # K/V: float32 within 1e-5 of the call's largest output, bf16 within its output's rounding.
    from cache_setup import attach_caches, cache_config
    from checkpoint import load_checkpoint

    model, tokenizer = bundled if dtype == torch.float32 else load_checkpoint(None, "cpu", dtype)
    ids = tokenizer.encode("The key-value cache of a transformer holds one key and one value per token. " * 6)
    config = cache_config(["--cache_strategy", "heavy_hitter", "--max_cache_length", "0.5", "--cache_bits", "4",
                           *quantization])
    calls: list = []
    checked_attend(monkeypatch, calls)
    attach_caches(model, config, len(ids), 40, tokenizer)
    with torch.inference_mode():
        logits = prefill(model, torch.tensor([ids]))
        for i in range(40):
            logits = decode_one_token(model, logits.argmax(-1).view(1, 1), torch.tensor([len(ids) + i]))
    assert len(calls) == 40 * model.args.n_layer
    assert max(calls) < (1e-5 if dtype == torch.float32 else ULP)


def test_the_benchmark_reports_the_three_ways_and_their_agreement(tmp_path, capsys):
    from benchmarks.quantized_attention import main

    out = tmp_path / "quantized.json"
    report = main(["--slots", "40", "300", "--batch", "2", "--q_group_size", "16", "--residual_length", "32",
                   "--repeats", "2", "--out", str(out)])
    assert [(r["scheme"], r["slots"]) for r in report["rows"]] == [("per_token", 40), ("per_token", 300),
                                                                    ("kivi", 40), ("kivi", 300)]
    assert all(r["max_relative_difference"] < 1e-5 and r["codes_ms"] > 0 for r in report["rows"])
    assert "| kivi | 300 |" in capsys.readouterr().out and out.exists()
