"""ThinK's pruned keys (--think_ratio) under a chunked prefill (--prefill_chunk), against references written
from the definition: each re-prefill is the one-shot prefill of its virtual prompt (the held tokens and the
chunk), so after the last chunk every KV head keeps the channels with the largest ‖Q_w[:, c]‖·‖K[:, c]‖ over
the held tokens' *whole* keys and the prompt's last window of queries, and every held key is its whole key
with the other channels zeroed (none pruned twice by earlier chunks' channel sets).

- layer 0 (its keys and queries depend on the token embeddings only, so a full-cache run gives them):
  the channel sets and the stored keys after chunks of 8 (the window, 8, within the last chunk), for
  strategies whose prompt rules differ;
- a cache that never compresses (full): the chunked run equals the one-shot run, every layer's channels
  and the logits after the prompt and of decoding (a chunk's queries attend over whole keys, as the
  one-shot prompt's do), float32, atol 1e-5;
- batched rows whose chunks are packed: each row decodes as alone (test_batching's check).
"""

from __future__ import annotations

import pytest
import torch

from generate import chunked_prefill, decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.strategy_matrix import BUDGETS, PROMPT, attach, cache_args, held_positions, inner, token_ids
from tests.test_batching import assert_rows_match
from tests.test_strategies import layer0_queries, reference_kv
from tests.test_think import RATIO, WINDOW, channel_sets, naive_kept_channels

CHUNK = 8  # three chunks of the 24-token prompt, the last one holding the prompt's last window
BUDGET = "10"


def chunked_layer0(strategy: str, ids: torch.Tensor):
    model = make_tiny_model()
    k_ref, _ = reference_kv(model, ids)
    q_ref = layer0_queries(model, ids)
    attach(model, cache_args(strategy, BUDGET, "think", "--prefill_chunk", str(CHUNK)))
    with torch.inference_mode():
        model.reset_caches()
        chunked_prefill(model, ids[:, :PROMPT], CHUNK, decode_one_token)
    return inner(model.layers[0].attention.kv_cache), k_ref, q_ref


@pytest.mark.parametrize("strategy", ["heavy_hitter", "recent_global", "tova", "l2", "full"])
def test_layer0_channels_and_keys_are_those_of_the_held_whole_keys(strategy):
    ids = token_ids(3)
    cache, k_ref, q_ref = chunked_layer0(strategy, ids)
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


def run_full(flags: list[str], chunk: int | None, steps: int = 4):
    model = make_tiny_model()
    attach(model, cache_args("full", "1.0", "think", *flags))
    ids = token_ids(5)
    with torch.inference_mode():
        model.reset_caches()
        prompt = ids[:, :PROMPT]
        logits = [chunked_prefill(model, prompt, chunk, decode_one_token) if chunk else prefill(model, prompt)]
        channels = [channel_sets(inner(c).storage) for c in model.caches()]
        for p in range(PROMPT, PROMPT + steps):
            logits.append(decode_one_token(model, logits[-1].argmax(-1, keepdim=True), torch.tensor([p])))
    return torch.stack(logits), channels


@pytest.mark.parametrize("recent", ["0", "4"])
def test_full_cache_chunked_equals_one_shot(recent):
    chunked, chunked_channels = run_full(["--think_recent", recent, "--prefill_chunk", str(CHUNK)], CHUNK)
    whole, whole_channels = run_full(["--think_recent", recent], None)
    assert chunked_channels == whole_channels
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["tova", "heavy_hitter"])
def test_rows_prefilled_in_packed_chunks_decode_as_alone(strategy):
    """Rows whose chunks go through the model packed take turns within each chunk: each row's held whole keys
    are its own between its turns."""
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"], "think", "--prefill_chunk", "5"), pack=True)
