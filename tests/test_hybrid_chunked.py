"""FastGen (`hybrid`) under --prefill_chunk: the profile accumulates over every chunk's queries and each head's
policy is chosen again after each chunk, over what the head holds plus the chunk (strategies/hybrid.py).

- Layer 0 (whose queries and keys depend on the tokens and positions only) holds after every chunk, and chooses,
  what a naive chunk-by-chunk FastGen written here from the paper's definitions holds and chooses: for each chunk,
  each of its queries' softmax over the head's held tokens and the chunk up to itself (the mean of the KV group's
  query heads); each policy's recovered mass of those maps (its special / punctuation / frequent columns, with
  `local` each query's window i − j < ceil(r_l·(i + 1))) added to what it recovered in earlier chunks; the first
  policy recovering T of every map so far; then the policy's tokens of held + chunk, the frequent ones the top
  ceil(r_f·seen) by the attention summed over every query, at most the budget (special and punctuation first, then
  by that sum, ties to the newest). Chunks of 5, 6, 9 at thresholds where the heads take two policies.
- One chunk equals the one-shot prefill, every chunk leaves the budget, every storage, batched rows, re-rotation:
  the registry-wide matrices (test_chunked_prefill, test_chunked_storage, test_batching,
  test_chunked_rerotation), which hybrid and debug_hybrid join.
- A one-token prompt (decoded, never profiled) holds its tokens: an unprofiled head takes the last policy.
"""

from __future__ import annotations

import math

import pytest
import torch

from generate import chunked_prefill, decode_one_token, prefill
from strategies.hybrid import DEFAULT_HYBRID_POLICIES
from tests.conftest import make_tiny_model
from tests.strategy_matrix import PROMPT, TOKEN_CLASSES, attach, cache_args, held_positions, inner, token_ids
from tests.test_chunked_prefill import attention_from, layer0_qkv, run_prompt

BUDGET = 10
RECENT_FRAC, HEAVY_FRAC = 0.3, 0.3  # the strategy's defaults
POLICIES = [p.split("+") for p in DEFAULT_HYBRID_POLICIES]


def naive_chunked_fastgen(q, k, ids: list[int], chunk: int, recovery: float,
                          budget: int = BUDGET) -> list[tuple[list[set], list[int]]]:
    """Chunk by chunk, per KV head: (the positions held if the prompt ended there, the policy index) after every
    chunk."""
    special = {j for j, t in enumerate(ids) if TOKEN_CLASSES["special"][t]}
    punct = {j for j, t in enumerate(ids) if TOKEN_CLASSES["punct"][t]}
    heads = [{"held": [], "got": {}, "in_window": {}, "policy": -1} for _ in range(k.shape[0])]
    history = []
    for start in range(0, PROMPT, chunk):
        new = list(range(start, min(start + chunk, PROMPT)))
        seen = new[-1] + 1
        for h, head in enumerate(heads):
            cand = head["held"] + new
            got = {j: head["got"].get(j, 0.0) for j in cand}  # every query's attention so far, by key
            in_window = {j: head["in_window"].get(j, 0.0) for j in cand}
            for i in new:
                keys = [j for j in cand if j <= i]
                for j, w in zip(keys, attention_from(q, k, i, keys, h).tolist(), strict=True):
                    got[j] += w
                    if i - j < math.ceil(RECENT_FRAC * (i + 1)):
                        in_window[j] += w
            ranked = sorted(got.values(), reverse=True)
            kth = ranked[min(math.ceil(HEAVY_FRAC * seen), len(ranked)) - 1]
            component = {"special": special & set(cand), "punct": punct & set(cand),
                         "frequent": {j for j in cand if got[j] >= kth},
                         "local": {j for j in cand if j >= seen - math.ceil(RECENT_FRAC * seen)}, "full": set(cand)}
            total = sum(got.values())
            for index, policy in enumerate(POLICIES):
                columns = set().union(*(component[c] for c in policy if c != "local"))
                mass = sum(got[j] for j in columns)
                if "local" in policy:
                    mass += sum(in_window[j] for j in cand if j not in columns)
                if index == len(POLICIES) - 1 or mass >= recovery * total:
                    head["policy"] = index
                    break
            # While the prompt comes in, the budget's best: the policy's tokens first, then the others.
            head["keep"] = set().union(*(component[c] for c in POLICIES[head["policy"]]))
            ranked = sorted(cand, key=lambda j: (j in head["keep"], j in special or j in punct, got[j], j),
                            reverse=True)
            head["held"] = sorted(ranked[:budget])
            head["got"] = {j: got[j] for j in head["held"]}
            head["in_window"] = {j: in_window[j] for j in head["held"]}
        # Once the prompt ends here, each head keeps what its policy keeps of what it holds.
        history.append(([set(head["held"]) & head["keep"] for head in heads], [head["policy"] for head in heads]))
    return history


# Thresholds where the tiny model's heads take two policies or more, and change policy from one chunk to the next.
@pytest.mark.parametrize(("chunk", "recovery"), [(5, 0.85), (6, 0.85), (9, 0.85), (6, 0.75), (9, 0.9)])
def test_layer0_holds_and_chooses_what_a_naive_chunked_fastgen_does(chunk, recovery):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("hybrid", str(BUDGET), "dense", "--prefill_chunk", str(chunk),
                                      "--min_recovery_frac", str(recovery)))
    with torch.inference_mode():
        q, k, _ = layer0_qkv(model, ids[:, :PROMPT])
        expected = naive_chunked_fastgen(q, k, ids[0, :PROMPT].tolist(), chunk, recovery)
        policies = set()
        for n in range(chunk, PROMPT + chunk, chunk):  # the same prompt cut after each chunk
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            held, chosen = expected[n // chunk - 1]
            assert held_positions(caches[0]) == held, n
            assert caches[0].policy[0].tolist() == chosen, n
            policies |= set(chosen)
    assert len(policies) >= 2  # the heads do not all take one policy: the recovery sums are really compared


def test_a_one_token_prompt_holds_its_tokens():
    """A prompt of one token goes straight to decoding, unprofiled: every head keeps what it is given (the last
    policy, full) until the budget, where it evicts by the attention summed over its steps."""
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("hybrid", str(BUDGET), "dense"))
    with torch.inference_mode():
        model.reset_caches()
        logits = prefill(model, ids[:, :1])
        for p in range(1, 6):
            logits = decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]))
    assert torch.isfinite(logits).all()
    assert all(held == set(range(6)) for cache in caches for held in held_positions(inner(cache)))
    assert all(cache.policy.eq(len(POLICIES) - 1).all() for cache in caches)




def chunked_and_one_shot(recovery: float) -> list[tuple[torch.Tensor, list, list]]:
    """(logits after the prompt, every layer's held positions, every layer's policies) with budget 18 of 24 tokens,
    in chunks of 6, then one shot."""
    model = make_tiny_model()
    ids = token_ids()
    results = []
    for extra in (("--prefill_chunk", "6"), ()):
        caches = attach(model, cache_args("hybrid", "18", "dense", "--min_recovery_frac", str(recovery), *extra))
        with torch.inference_mode():
            model.reset_caches()
            logits = prefill(model, ids[:, :PROMPT])
        results.append((logits, [held_positions(c) for c in caches], [c.policy[0].tolist() for c in caches]))
    return results


@pytest.mark.parametrize("recovery", [0.75, 0.85, 0.95])
def test_while_the_budget_held_every_token_the_chunks_equal_the_one_shot_prefill(recovery):
    """The first three chunks fit the budget, so the last one's profile sums over the map the one-shot prefill's
    does (every query over every key before it), and every layer chooses and keeps what the one-shot prefill
    does (the sums in another order: float32, logits within 1e-4)."""
    (chunked, chunked_held, chunked_policy), (whole, whole_held, whole_policy) = chunked_and_one_shot(recovery)
    assert chunked_policy == whole_policy and chunked_held == whole_held
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


def test_those_prefills_take_several_policies():
    policies = {p for r in (0.75, 0.85, 0.95) for layer in chunked_and_one_shot(r)[1][2] for p in layer}
    assert len(policies) >= 2


@pytest.mark.parametrize("storage", ["dense", "4bit", "kivi4", "think"])
def test_one_chunk_equals_the_one_shot_prefill_where_policies_keep_less_than_the_budget(storage):
    """The registry-wide matrix runs at the default threshold, where the tiny model's heads take `full`; here
    their policies keep 10 to 17 of 24 tokens at a budget of 18, so the cut at the prompt's end (dense, per-token
    codes) or at the chunk (KIVI, ThinK) is what decides (float32, 1e-5)."""
    model = make_tiny_model()
    flags = ("--min_recovery_frac", "0.75")
    attach(model, cache_args("hybrid", "18", storage, *flags, "--prefill_chunk", str(PROMPT)))
    chunked = run_prompt(model, token_ids(), PROMPT)
    attach(model, cache_args("hybrid", "18", storage, *flags))
    whole = run_prompt(model, token_ids(), None)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=0)
    assert chunked[1:] == whole[1:]
    assert any(len(held) < 18 for layer in whole[2] for held in layer)
