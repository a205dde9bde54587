"""FastGen's profile (strategies/hybrid.py) against a naive oracle on hand-made attention maps.

The oracle is written from the paper's policy definitions (Ge et al., arXiv 2310.01801), entry by entry of
the attention map: a policy keeps the entry (query i, key j) when j is a special or punctuation token it
keeps, one of its frequent tokens (the top r_f of the prompt by attention summed over the prompt's
queries), or, with `local`, within query i's own window (i − j < ceil(r_l·(i + 1))). A head takes the
first policy, cheapest first, whose kept entries hold at least T of the map's mass. Each head's map is
built so that the right policy is known by construction; the oracle confirms it and the cache must agree.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from strategies import hybrid
from strategies.hybrid import DEFAULT_HYBRID_POLICIES, HybridCache

T = 20  # prompt length
RECENT, HEAVY, THRESHOLD = 0.3, 0.3, 0.9
SPECIAL_ID, PUNCT_ID = 0, 1
PUNCT_AT = (5, 10, 15)
BACKGROUND = 0.05  # every row spreads this much uniformly over the keys it sees: no ties in the ranks
EXPECTED = ["special", "special+punct", "special+punct+frequent", "special+punct+frequent+local", "full"]


def prompt_ids() -> Tensor:
    ids = torch.tensor([2 + (i % 5) for i in range(T)])
    ids[0] = SPECIAL_ID
    ids[list(PUNCT_AT)] = PUNCT_ID
    return ids


def classes() -> dict[str, Tensor]:
    special, punct = torch.zeros(8, dtype=torch.bool), torch.zeros(8, dtype=torch.bool)
    special[SPECIAL_ID], punct[PUNCT_ID] = True, True
    return {"special": special, "punct": punct}


def row(i: int, targets: list[int]) -> list[float]:
    """Query i's attention: 1 − BACKGROUND shared by `targets` (keys ≤ i), BACKGROUND over keys 0..i."""
    out = [BACKGROUND / (i + 1) if j <= i else 0.0 for j in range(T)]
    for j in targets:
        out[j] += (1 - BACKGROUND) / len(targets)
    return out


def hand_made_maps() -> Tensor:
    """[1, 5, T, T]: head h is built to need policy EXPECTED[h]."""
    heads = [
        [row(i, [0]) for i in range(T)],  # the first (special) token only
        [row(i, [0, *[p for p in PUNCT_AT if p <= i]]) for i in range(T)],  # special and punctuation
        [row(i, [min(i, 1), 2] if i >= 2 else [i]) for i in range(T)],  # two ordinary tokens, always
        [row(i, [i]) for i in range(T)],  # itself: a local head
        [[1.0 / (i + 1) if j <= i else 0.0 for j in range(T)] for i in range(T)],  # uniform: nothing stands out
    ]
    return torch.tensor(heads).unsqueeze(0)


def oracle_policy(attn: list[list[float]], ids: Tensor, global_local: bool = False) -> str:
    """The paper's choice for one head, from its map alone. `global_local`: the local component as one set of
    keys for every query (the last r_l of the prompt), the reading the profile must not use."""
    received = [sum(attn[i][j] for i in range(T)) for j in range(T)]
    k = math.ceil(HEAVY * T)
    frequent = set(sorted(range(T), key=lambda j: -received[j])[:k])
    total = sum(received)
    for policy in DEFAULT_HYBRID_POLICIES:
        parts = policy.split("+")
        mass = 0.0
        for i in range(T):
            for j in range(i + 1):
                if "full" in parts \
                        or ("special" in parts and ids[j] == SPECIAL_ID) \
                        or ("punct" in parts and ids[j] == PUNCT_ID) \
                        or ("frequent" in parts and j in frequent) \
                        or ("local" in parts and (j >= T - math.ceil(RECENT * T) if global_local
                                                  else i - j < math.ceil(RECENT * (i + 1)))):
                    mass += attn[i][j]
        if mass >= THRESHOLD * total:
            return policy
    raise AssertionError("full recovers everything")


def make_cache(length: int = T, policies: tuple[str, ...] = DEFAULT_HYBRID_POLICIES,
               recovery: float = THRESHOLD) -> HybridCache:
    cache = HybridCache(1, 5, 4, length, torch.float32, "cpu", min_recovery_frac=recovery,
                        hybrid_policies=policies, hybrid_recent_frac=RECENT, hybrid_heavy_frac=HEAVY)
    cache.configure(token_classes=classes())
    return cache


def prefill_with_map(cache: HybridCache, maps: Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's prefill with its attention replaced by `maps` (any q and k then do)."""
    monkeypatch.setattr(hybrid, "causal_attention_blocks",
                        lambda q, k, **_: [(torch.arange(maps.shape[2]), maps[:, :, None])])
    n = maps.shape[2]
    k, v, q = (torch.randn(1, 5, n, 4) for _ in range(3))
    cache.observe_tokens(prompt_ids()[None, :n])
    cache.prefill(torch.arange(n), k, v, q)


def test_the_hand_made_heads_need_the_policies_they_were_built_for() -> None:
    maps, ids = hand_made_maps(), prompt_ids()
    torch.testing.assert_close(maps.sum(-1), torch.ones(1, 5, T))  # every query's attention sums to 1
    assert [oracle_policy(maps[0, h].tolist(), ids) for h in range(5)] == EXPECTED
    # One set of local keys for every query leaves the self-attending head nothing cheaper than full.
    assert oracle_policy(maps[0, 3].tolist(), ids, global_local=True) == "full"


def test_each_head_takes_the_policy_the_paper_defines(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = make_cache()
    prefill_with_map(cache, hand_made_maps(), monkeypatch)
    assert [DEFAULT_HYBRID_POLICIES[i] for i in cache.policy[0].tolist()] == EXPECTED
    # After the prompt the local head keeps the last query's window (and its punctuation, frequent tokens).
    held = {int(p) for p in cache.pos[0, 3] if p >= 0}
    window = set(range(T - math.ceil(RECENT * T), T))
    assert window <= held and {0, *PUNCT_AT} <= held
    assert {int(p) for p in cache.pos[0, 0] if p >= 0} == {0}  # the special head holds only the special token


def test_decode_evicts_the_least_summed_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frequent-only heads at decode: each step gives the token just admitted 0.6 of the attention (a high
    mean over the one step it was held) and the others the rest. The summed attention ranks: where the held
    prompt tokens gathered more than 0.6 over the prompt, the new token goes, though its mean is the highest."""
    n = 10
    maps = hand_made_maps()[:, :, :n, :n]  # the first n queries see only the first n keys
    cache = make_cache(length=n, policies=("frequent", "full"), recovery=0.01)
    prefill_with_map(cache, maps, monkeypatch)
    assert cache.policy[0].tolist() == [0] * 5
    summed = {h: {j: float(maps[0, h, :, j].sum()) for j in range(n)} for h in range(5)}
    held = {h: {int(p) for p in cache.pos[0, h] if p >= 0} for h in range(5)}
    assert all(len(s) == math.ceil(HEAVY * n) for s in held.values())  # the top r_f of the prompt
    newest_evicted = 0
    for step, position in enumerate(range(n, n + 3)):
        cache.observe_tokens(torch.tensor([[2]]))
        cache.insert(torch.tensor([position]), torch.randn(1, 5, 1, 4), torch.randn(1, 5, 1, 4))
        now = {h: {int(p) for p in cache.pos[0, h, : cache.max_cache_length] if p >= 0} for h in range(5)}
        for h in range(5):
            added = now[h] - held[h]
            assert added == {position}
            evicted = held[h] - now[h]
            if step == 0:  # ceil(0.3 × 11) = 4 slots allowed, 3 held: it grows
                assert not evicted
            else:  # full allowance: the least summed attention among the held goes
                least = min(held[h], key=lambda j: summed[h][j])
                assert evicted == {least}, (h, step)
                summed[h].pop(least)
                newest_evicted += least == position - 1
            held[h] = now[h]
        # This step's attention: 0.6 on the newest token, the rest over the others it holds.
        probs = torch.zeros(1, 5, 1, cache.max_cache_length + 1)
        for h in range(5):
            slots = [s for s in range(cache.max_cache_length) if int(cache.pos[0, h, s]) >= 0]
            for s in slots:
                p = int(cache.pos[0, h, s])
                share = 0.6 if p == position else 0.4 / (len(slots) - 1)
                probs[0, h, 0, s] = share
                summed[h][p] = summed[h].get(p, 0.0) + share
        cache.update_state(probs)
    assert newest_evicted > 0  # a mean would have kept those (0.6 over one step against < 0.2 per step)
