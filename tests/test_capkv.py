"""Naive CapKV: its score re-computed here from the definition with plain loops over the layer-0 keys, values and
queries of a full-cache run (float64; the anchor a plain mean, cosines one key at a time, the capacity matrix
summed token by token and inverted explicitly), and compared with what the cache kept at prefill and evicted at
every decode step (budget 16 of a 24-token prompt + 16 new tokens, 2 sinks, a 4-token recent window)."""

from __future__ import annotations

import math

import pytest
import torch

from errors import UserError
from tests.strategy_matrix import GLOBAL, PROMPT, TOTAL
from tests.test_strategies import evictions, layer0_queries, reference_kv
from tests.test_strategies_recent import BUDGET, Score, assert_evicts_lowest, assert_prompt_kept_best


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / math.sqrt(float(a @ a) * float(b @ b))


def naive_capacity(group: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scored: list[int],
                   tau: float = 5.0):
    """CapKV's score of a position x by its definition, statistics over the `scored` positions: w_x · v_xᵀ A⁻¹ v_x,
    w_x = exp(τ (cos(μ, k_x) − the largest cosine over `scored`)), μ the mean of the group's queries group
    [rep, T, d] over `scored`, A = I + Σ (w + 1e-6) v vᵀ over `scored`."""
    mu = sum(group[j, x].double() for j in range(group.shape[0]) for x in scored) / (group.shape[0] * len(scored))
    top = max(cosine(mu, keys[x].double()) for x in scored)

    def weight(x: int) -> float:
        return math.exp(tau * (cosine(mu, keys[x].double()) - top))

    capacity = torch.eye(keys.shape[-1], dtype=torch.float64)
    for x in scored:
        capacity += (weight(x) + 1e-6) * torch.outer(values[x].double(), values[x].double())
    inverse = torch.linalg.inv(capacity)
    return lambda x: weight(x) * float(values[x].double() @ inverse @ values[x].double())


def capkv_oracle(model, ids, tau: float = 5.0) -> Score:
    """Prompt tokens past the sinks and decoded tokens, all against the prompt's statistics (`naive_capacity`)."""
    ref_k, ref_v = reference_kv(model, ids)
    q = layer0_queries(model, ids).double()
    rep = q.shape[0] // ref_k.shape[0]
    scored = list(range(GLOBAL, PROMPT))
    table = []
    for h in range(ref_k.shape[0]):
        score = naive_capacity(q[h * rep : (h + 1) * rep], ref_k[h], ref_v[h], scored, tau)
        table.append({x: score(x) for x in range(GLOBAL, TOTAL)})
    return lambda p, h, held, x: table[h][x]


@pytest.mark.parametrize("tau", [5.0, 0.0, 40.0])  # the default, no query relevance, a sharp one
def test_capkv_keeps_and_evicts_by_the_naive_weighted_capacity_leverage(tau):
    model, ids, steps = evictions("capkv", str(BUDGET), "--capkv_tau", str(tau))
    score = capkv_oracle(model, ids, tau)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


def test_capkv_decodes_by_its_rule_whatever_rule_chose_the_prompt():
    model, ids, steps = evictions("capkv", str(BUDGET), "--prompt_compression_strategy", "l2")
    assert assert_evicts_lowest(steps, capkv_oracle(model, ids)) > 0


def test_capkv_prompt_rule_needs_its_own_cache():
    with pytest.raises(UserError, match="capkv"):
        evictions("l2", str(BUDGET), "--prompt_compression_strategy", "capkv")


def test_capkv_drops_the_prompts_values_after_prefill():
    """A prompt's values are the size of its keys: held past the prefill they would double its K/V."""
    model, _, _ = evictions("capkv", str(BUDGET))
    assert all(cache.prompt_values is None for cache in model.caches())
