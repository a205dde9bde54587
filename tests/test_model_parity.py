"""The model against independent references on the same weights.

Reference 1: Hugging Face transformers' Llama, loading the same bundled GGUF offline (its own GGUF
dequantizer, its own un-permutation of q/k, its own RoPE and attention).
Reference 2: a naive per-head attention written here, for the grouped-attention kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention import grouped_attention
from model import ModelArgs
from rope import apply_rope, rope_tables

LOGIT_ATOL = 1e-3  # float32 on both sides; measured max |Δlogit| ≈ 1e-4


def test_logits_match_transformers_on_the_bundled_gguf(bundled, hf_bundled):
    model, tokenizer = bundled
    hf_model = hf_bundled
    import pydoc_data.topics

    text = pydoc_data.topics.topics["with"][:1500]
    ids = tokenizer.encode(text)[:200]
    assert len(ids) >= 128
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf_model(x).logits.float()
        ours = model(x, torch.arange(len(ids)))
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def naive_attention(q, k, v, mask):
    """Per query head, K/V of its group copied explicitly; one row at a time."""
    B, H, T, D = q.shape
    rep = H // k.shape[1]
    out = torch.zeros_like(q)
    for h in range(H):
        kh, vh = k[:, h // rep], v[:, h // rep]
        for t in range(T):
            s = torch.einsum("bd,bld->bl", q[:, h, t], kh) / math.sqrt(D)
            s = s.masked_fill(~mask[:, h // rep, 0], float("-inf"))
            out[:, h, t] = torch.einsum("bl,bld->bd", torch.softmax(s, -1), vh)
    return out


def test_grouped_attention_matches_naive_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 16), torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 16)
    mask = torch.rand(2, 3, 1, 10) > 0.3
    mask[..., 0] = True
    out, probs = grouped_attention(q, k, v, mask)
    torch.testing.assert_close(out, naive_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5)
    assert (probs.masked_select(~mask.expand_as(probs)) == 0).all()


def test_rope_rotate_half_matches_complex_rotation():
    args = ModelArgs(n_layer=1, n_head=1, n_kv_head=1, dim=8, intermediate_size=8, vocab_size=8,
                     rope_base=100.0, context_length=16)
    cos, sin = rope_tables(args)
    x = torch.randn(1, 1, 16, 8)
    ours = apply_rope(x, cos, sin)
    # Reference: pair dimension i with i + D/2 as a complex number and rotate by position × freq_i.
    freqs = 1.0 / (100.0 ** (torch.arange(0, 8, 2).double() / 8))
    angles = torch.arange(16).double()[:, None] * freqs
    z = torch.complex(x[..., :4].double(), x[..., 4:].double()) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(ours, torch.cat([z.real, z.imag], -1).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_elements", [1, 2**10, 2**26], ids=["row-blocks", "blocks", "one-block"])
def test_masked_attention_in_blocks_matches_the_grouped_product(max_elements):
    """A later prompt chunk's attention off the CPU (SDPA over blocks of queries, K/V repeated per query head)
    equals the grouped product the CPU uses, under per-KV-head masks (head-specific caches), rows that see a
    single key included; float32, 1e-5."""
    from chunk_attention import masked_attention_in_blocks

    g = torch.Generator().manual_seed(0)
    B, H, n_kv, T, L, D = 2, 6, 2, 7, 11, 8
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, n_kv, L, D, generator=g), torch.randn(
        B, n_kv, L, D, generator=g)
    visible = torch.rand(B, n_kv, T, L, generator=g) < 0.5
    visible[..., 0] = True  # every query sees at least one key
    visible[0, 1, 3] = False
    visible[0, 1, 3, 4] = True
    want, _ = grouped_attention(q, k, v, visible.repeat(1, 1, H // n_kv, 1))
    torch.testing.assert_close(masked_attention_in_blocks(q, k, v, visible, max_elements), want, atol=1e-5, rtol=1e-5)
