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
from tests.test_chunked_prefill import attention_from, layer0_qkv

BUDGET = 10
RECENT_FRAC, HEAVY_FRAC = 0.3, 0.3  # the strategy's defaults
POLICIES = [p.split("+") for p in DEFAULT_HYBRID_POLICIES]


def naive_chunked_fastgen(q, k, ids: list[int], chunk: int, recovery: float) -> list[tuple[list[set], list[int]]]:
    """Chunk by chunk, per KV head: (the positions held, the policy index) after every chunk."""
    special = {j for j, t in enumerate(ids) if TOKEN_CLASSES["special"][t]}
    punct = {j for j, t in enumerate(ids) if TOKEN_CLASSES["punct"][t]}
    heads = [{"held": [], "summed": {}, "recovered": [0.0] * len(POLICIES), "total": 0.0, "policy": -1}
             for _ in range(k.shape[0])]
    history = []
    for start in range(0, PROMPT, chunk):
        new = list(range(start, min(start + chunk, PROMPT)))
        seen = new[-1] + 1
        for h, head in enumerate(heads):
            cand = head["held"] + new
            got, in_window = dict.fromkeys(cand, 0.0), dict.fromkeys(cand, 0.0)
            for i in new:
                keys = [j for j in cand if j <= i]
                for j, w in zip(keys, attention_from(q, k, i, keys, h).tolist(), strict=True):
                    got[j] += w
                    if i - j < math.ceil(RECENT_FRAC * (i + 1)):
                        in_window[j] += w
            summed = {j: head["summed"].get(j, 0.0) + got[j] for j in cand}
            ranked = sorted(summed.values(), reverse=True)
            kth = ranked[min(math.ceil(HEAVY_FRAC * seen), len(ranked)) - 1]
            component = {"special": special & set(cand), "punct": punct & set(cand),
                         "frequent": {j for j in cand if summed[j] >= kth},
                         "local": {j for j in cand if j >= seen - math.ceil(RECENT_FRAC * seen)}, "full": set(cand)}
            for index, policy in enumerate(POLICIES):
                columns = set().union(*(component[c] for c in policy if c != "local"))
                mass = sum(got[j] for j in columns)
                if "local" in policy:
                    mass += sum(in_window[j] for j in cand if j not in columns)
                head["recovered"][index] += mass
            head["total"] += sum(got.values())
            head["policy"] = next(i for i, r in enumerate(head["recovered"])
                                  if i == len(POLICIES) - 1 or r >= recovery * head["total"])
            keep = set().union(*(component[c] for c in POLICIES[head["policy"]]))
            ranked_keep = sorted(keep, key=lambda j: (j in special or j in punct, summed[j], j), reverse=True)
            head["held"] = sorted(ranked_keep[:BUDGET])
            head["summed"] = {j: summed[j] for j in head["held"]}
        history.append(([set(head["held"]) for head in heads], [head["policy"] for head in heads]))
    return history


# Thresholds where the tiny model's heads take two policies (and at 0.75 switch policy from one chunk to the next).
@pytest.mark.parametrize(("chunk", "recovery"), [(5, 0.75), (6, 0.75), (9, 0.75), (6, 0.9), (9, 0.85)])
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
