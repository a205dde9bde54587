"""Storages whose stored form loses what a re-prefill would lose again (Storage.exact_in_chunks: ThinK's pruned
keys, KIVI's quantized key groups) under a chunked prefill (--prefill_chunk), against references written from
the definitions: each re-prefill is the one-shot prefill of its virtual prompt (the held tokens and the chunk)
from their exact K/V, so no key is pruned or quantized twice.

- ThinK, layer 0 (its keys and queries depend on the token embeddings only, so a full-cache run gives them):
  after chunks of 8 (the window, 8, within the last chunk) every KV head keeps the channels with the largest
  ‖Q_w[:, c]‖·‖K[:, c]‖ over the held tokens' whole keys and the prompt's last window, and every held key is
  its whole key with the other channels zeroed, for strategies whose prompt rules differ;
- KIVI, layer 0: the held tokens' stored K/V are a naive KIVI prompt write of their exact K/V (per-channel key
  groups of G from the oldest, the newest in the full-precision residual, per-token value groups);
- a cache that never compresses (full): the chunked run equals the one-shot run, ThinK's channels and the logits
  after the prompt and of decoding (a chunk's queries attend over exact K/V, as the one-shot prompt's do),
  float32, atol 1e-5;
- batched rows whose chunks are packed: each row decodes as alone (test_batching's check).
"""

from __future__ import annotations

import pytest
import torch

from generate import chunked_prefill, decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.strategy_matrix import BUDGETS, PROMPT, STORAGES, attach, cache_args, held_positions, inner, token_ids
from tests.test_batching import ATOL, QUANTIZED_ATOL, assert_rows_match
from tests.test_kivi import naive_quantize
from tests.test_strategies import layer0_queries, reference_kv
from tests.test_think import RATIO, WINDOW, channel_sets, naive_kept_channels

CHUNK = 8  # three chunks of the 24-token prompt, the last one holding the prompt's last window
BUDGET = "10"


def chunked_layer0(strategy: str, ids: torch.Tensor, storage: str = "think"):
    model = make_tiny_model()
    k_ref, v_ref = reference_kv(model, ids)
    q_ref = layer0_queries(model, ids)
    attach(model, cache_args(strategy, BUDGET, storage, "--prefill_chunk", str(CHUNK)))
    with torch.inference_mode():
        model.reset_caches()
        chunked_prefill(model, ids[:, :PROMPT], CHUNK, decode_one_token)
    return inner(model.layers[0].attention.kv_cache), (k_ref, v_ref), q_ref


@pytest.mark.parametrize("strategy", ["heavy_hitter", "recent_global", "tova", "l2", "full"])
def test_layer0_channels_and_keys_are_those_of_the_held_whole_keys(strategy):
    ids = token_ids(3)
    cache, (k_ref, _), q_ref = chunked_layer0(strategy, ids)
    held = [sorted(h) for h in held_positions(cache)]
    held_k = torch.stack([k_ref[h, positions] for h, positions in enumerate(held)])  # [n_kv, n, D]
    want = naive_kept_channels(q_ref[:, :PROMPT], held_k, WINDOW, RATIO)
    assert channel_sets(cache.storage) == want
    keys, pos = cache.keys()[0], cache.pos[0].expand(cache.n_kv_heads, -1)
    for h, channels in enumerate(want):
        pruned = [c for c in range(k_ref.shape[-1]) if c not in channels]
        for slot in torch.nonzero(cache.mask[0, h, 0]).flatten().tolist():
            expected = k_ref[h, int(pos[h, slot])].clone()
            expected[pruned] = 0
            torch.testing.assert_close(keys[h, slot], expected, atol=1e-5, rtol=0)


def test_the_chunks_changed_the_channel_sets():
    """The case above is not vacuous: the channels chosen after the first chunk are not all the last ones."""
    ids = token_ids(3)
    model = make_tiny_model()
    attach(model, cache_args("heavy_hitter", BUDGET, "think", "--prefill_chunk", str(CHUNK)))
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :CHUNK])
        first = channel_sets(inner(model.layers[0].attention.kv_cache).storage)
    cache, _, _ = chunked_layer0("heavy_hitter", ids)
    assert channel_sets(cache.storage) != first


def naive_kivi_prompt(k: torch.Tensor, v: torch.Tensor, G: int, R: int, bits: int) -> tuple[torch.Tensor, ...]:
    """KIVI's prompt write of k, v [n, D] (one KV head, position order), dequantized: the oldest whole groups of
    G tokens quantized per channel (keys) and per token in groups of G channels (values), the newest n − q
    (at most R) kept exact; plain loops, float64."""
    n, D = k.shape
    q = G * max(0, -(-(n - R) // G))
    k_out, v_out = k.double().clone(), v.double().clone()
    for start in range(0, q, G):
        for c in range(D):
            k_out[start : start + G, c] = torch.tensor(naive_quantize(k[start : start + G, c].tolist(), bits))
    for t in range(q):
        for c0 in range(0, D, min(G, D)):
            group = slice(c0, c0 + min(G, D))
            v_out[t, group] = torch.tensor(naive_quantize(v[t, group].tolist(), bits))
    return k_out, v_out


@pytest.mark.parametrize("strategy", ["heavy_hitter", "tova", "l2"])
def test_kivi_layer0_holds_a_kivi_prompt_write_of_the_held_tokens_exact_kv(strategy):
    flags = STORAGES["kivi4"]
    bits, G, R = (int(flags[flags.index(f) + 1]) for f in ("--cache_bits", "--q_group_size", "--residual_length"))
    cache, (k_ref, v_ref), _ = chunked_layer0(strategy, token_ids(3), "kivi4")
    keys, values, pos = cache.keys()[0], cache.values()[0], cache.pos[0].expand(cache.n_kv_heads, -1)
    for h, positions in enumerate(held_positions(cache)):
        order = sorted(positions)
        slots = [int(torch.nonzero(pos[h] == p)[0]) for p in order]
        want_k, want_v = naive_kivi_prompt(k_ref[h, order], v_ref[h, order], G, R, bits)
        torch.testing.assert_close(keys[h, slots].double(), want_k, atol=1e-5, rtol=0)
        torch.testing.assert_close(values[h, slots].double(), want_v, atol=1e-5, rtol=0)


def run_full(flags: list[str], chunk: int | None, steps: int = 4, storage: str = "think"):
    model = make_tiny_model()
    attach(model, cache_args("full", "1.0", storage, *flags))
    ids = token_ids(5)
    with torch.inference_mode():
        model.reset_caches()
        prompt = ids[:, :PROMPT]
        logits = [chunked_prefill(model, prompt, chunk, decode_one_token) if chunk else prefill(model, prompt)]
        channels = [channel_sets(inner(c).storage) for c in model.caches()] if storage == "think" else []
        for p in range(PROMPT, PROMPT + steps):
            logits.append(decode_one_token(model, logits[-1].argmax(-1, keepdim=True), torch.tensor([p])))
    return torch.stack(logits), channels


@pytest.mark.parametrize("recent", ["0", "4"])
def test_full_cache_chunked_equals_one_shot(recent):
    chunked, chunked_channels = run_full(["--think_recent", recent, "--prefill_chunk", str(CHUNK)], CHUNK)
    whole, whole_channels = run_full(["--think_recent", recent], None)
    assert chunked_channels == whole_channels
    # float32 sums in other orders (a chunk's products have other shapes, so other blockings): 1.7e-5 seen
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


def test_full_kivi_cache_chunked_equals_one_shot():
    chunked, _ = run_full(["--prefill_chunk", str(CHUNK)], CHUNK, storage="kivi4")
    whole, _ = run_full([], None, storage="kivi4")
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)  # as above


@pytest.mark.parametrize(("strategy", "storage"), [("tova", "think"), ("heavy_hitter", "think"), ("tova", "kivi4")])
def test_rows_prefilled_in_packed_chunks_decode_as_alone(strategy, storage):
    """Rows whose chunks go through the model packed take turns within each chunk: each row's held exact K/V
    are its own between its turns."""
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"], storage, "--prefill_chunk", "5"), pack=True,
                      atol=QUANTIZED_ATOL if storage == "kivi4" else ATOL)
