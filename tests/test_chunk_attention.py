"""A later prompt chunk's attention (chunk_attention.py) against attention written from its definition: query t
of the chunk sees the held slots that hold a token at a position before its own (within the window, if any)
and the chunk's tokens up to itself. Both ways of computing it (one SDPA call aligned to the bottom right when
every row and head holds the same slots, masks per KV head otherwise) are checked, and which one a case takes."""

import pytest
import torch

from chunk_attention import chunk_attention, shared_preceding_slots

B, H, N_KV, T, L, D = 2, 6, 2, 5, 9, 8


def naive_chunk_attention(q, held_k, held_v, k, v, held_valid, held_pos, input_pos, window):
    """Float64, one query at a time, from the definition."""
    held_pos = held_pos.expand(held_valid.shape)
    out = torch.zeros(q.shape, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            g = h // rep
            keys = torch.cat([held_k[b, g], k[b, g]]).double()
            values = torch.cat([held_v[b, g], v[b, g]]).double()
            pos = torch.cat([held_pos[b, g], input_pos])
            valid = torch.cat([held_valid[b, g], torch.ones(len(input_pos), dtype=torch.bool)])
            for t, p in enumerate(input_pos.tolist()):
                seen = valid & (pos <= p)
                if window:
                    seen &= p - pos < window
                scores = keys[seen] @ q[b, h, t].double() / D**0.5
                out[b, h, t] = torch.softmax(scores, 0) @ values[seen]
    return out


def case(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    held_k, held_v = torch.randn(B, N_KV, L, D, generator=g), torch.randn(B, N_KV, L, D, generator=g)
    k, v = torch.randn(B, N_KV, T, D, generator=g), torch.randn(B, N_KV, T, D, generator=g)
    # Each row and head holds its own earlier tokens (a head-specific cache), in any order of position.
    held_pos = torch.stack([torch.randperm(2 * L, generator=g)[:L] for _ in range(B * N_KV)]).view(B, N_KV, L)
    input_pos = torch.arange(2 * L, 2 * L + T)
    return q, held_k, held_v, k, v, held_pos, input_pos


@pytest.mark.parametrize("held", ["every slot", "empty slots", "per-head slots", "per-row slots", "no slot"])
@pytest.mark.parametrize("window", [None, 4])
def test_chunk_attention_matches_the_definition(held, window):
    q, held_k, held_v, k, v, held_pos, input_pos = case()
    valid = torch.ones(B, N_KV, L, dtype=torch.bool)
    if held == "empty slots":  # the same gaps in every row and head (a cache not yet full)
        valid[..., [1, 4, 8]] = False
    elif held == "per-head slots":  # head-specific caches
        valid[:, 1, [0, 2]] = False
    elif held == "per-row slots":  # rows of a batch at different fills
        valid[1, :, 5:] = False
    elif held == "no slot":
        valid[:] = False
    got = chunk_attention(q, held_k, held_v, k, v, valid, held_pos, input_pos, window)
    want = naive_chunk_attention(q, held_k, held_v, k, v, valid, held_pos, input_pos, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bottom_right_causal_path_only_for_shared_slots_that_precede_the_chunk():
    _, _, _, _, _, held_pos, input_pos = case()
    valid = torch.ones(B, N_KV, L, dtype=torch.bool)
    assert shared_preceding_slots(valid, held_pos, input_pos).tolist() == list(range(L))
    valid[..., [1, 4]] = False
    assert shared_preceding_slots(valid, held_pos, input_pos).tolist() == [0, 2, 3, 5, 6, 7, 8]
    valid[0, 1, 0] = False
    assert shared_preceding_slots(valid, held_pos, input_pos) is None
    valid[0, 1, 0] = True
    later = held_pos.clone()
    later[..., 0] = input_pos[2]  # a held token at a position inside the chunk: not all of it is visible
    assert shared_preceding_slots(valid, later, input_pos) is None
    later[..., 1] = input_pos[2]  # ... unless that slot holds no token
    later[..., 0] = held_pos[..., 0]
    assert shared_preceding_slots(valid, later, input_pos) is not None


def test_held_tokens_after_the_chunk_start_are_masked_by_position():
    """The fallback keeps the definition when a held token's position is not before the chunk."""
    q, held_k, held_v, k, v, held_pos, input_pos = case(1)
    held_pos = held_pos.clone()
    held_pos[..., 3] = input_pos[2]
    valid = torch.ones(B, N_KV, L, dtype=torch.bool)
    got = chunk_attention(q, held_k, held_v, k, v, valid, held_pos, input_pos, None)
    want = naive_chunk_attention(q, held_k, held_v, k, v, valid, held_pos, input_pos, None)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
