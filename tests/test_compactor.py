"""Naive Compactor: its blended score re-computed here from the definition with plain loops over the layer-0
keys, values and queries of a full-cache run (float64; an explicit inverse of the Gram matrix, a softmax per
query), and compared with what the cache kept at prefill and evicted at every decode step (budget 16 of a
24-token prompt + 16 new tokens, 2 sinks, a 4-token recent window)."""

from __future__ import annotations

import statistics

import pytest
import torch

from errors import UserError
from tests.strategy_matrix import GLOBAL, PROMPT, TOTAL
from tests.test_strategies import evictions, layer0_queries, reference_kv
from tests.test_strategies_recent import BUDGET, Score, assert_evicts_lowest, assert_prompt_kept_best


def z_scores(values: dict[int, float]) -> dict[int, float]:
    mean, std = statistics.mean(values.values()), statistics.stdev(values.values())
    return {x: (v - mean) / std for x, v in values.items()}


def naive_leverage(keys: torch.Tensor, scored: list[int]) -> dict[int, float]:
    """(k − μ)ᵀ (Σ (kᵢ − μ)(kᵢ − μ)ᵀ + ridge)⁻¹ (k − μ) of every position, μ and Σ over `scored` (the ridge is
    1e-6 × the mean eigenvalue, trace / d)."""
    mu = sum(keys[x] for x in scored) / len(scored)
    gram = sum(torch.outer(keys[x] - mu, keys[x] - mu) for x in scored)
    d = keys.shape[-1]
    inverse = torch.linalg.inv(gram + 1e-6 * torch.trace(gram) / d * torch.eye(d, dtype=torch.float64))
    return {x: float((keys[x] - mu) @ inverse @ (keys[x] - mu)) for x in range(keys.shape[0])}


def naive_chunk_attention(q: torch.Tensor, keys: torch.Tensor, scored: list[int], chunk: int) -> dict[int, float]:
    """Σ over the queries of x's chunk (consecutive `chunk` scored positions, non-causal) of their softmax over
    the chunk's keys of the logits q·k (unscaled, as kvpress's and the authors' code), averaged over the query
    heads q [rep, T, d] of the group."""
    attention = dict.fromkeys(scored, 0.0)
    for first in range(0, len(scored), chunk):
        members = scored[first : first + chunk]
        for head in q:
            for y in members:
                logits = torch.tensor([float(head[y] @ keys[x]) for x in members])
                for x, p in zip(members, torch.softmax(logits, 0).tolist(), strict=True):
                    attention[x] += p / q.shape[0]
    return attention


def compactor_oracle(model, ids, chunk: int = 256, blend: float | None = None) -> Score:
    """The prompt's tokens score λ·z(leverage) + z(smoothed attention × ‖v‖) over the positions after the sinks,
    each z-score's mean and std over every KV head's scored tokens of the layer (kvpress's and the authors' code);
    a decoded token λ·(its leverage against its head's prompt keys − that mean) / that std."""
    ref_k, ref_v = reference_kv(model, ids)
    q = layer0_queries(model, ids).double()
    n_kv = ref_k.shape[0]
    rep = q.shape[0] // n_kv
    lam = 1 - BUDGET / PROMPT if blend is None else blend
    scored = list(range(GLOBAL, PROMPT))
    levs, smooths = [], []
    for h in range(n_kv):
        keys = ref_k[h].double()
        levs.append(naive_leverage(keys, scored))
        raw = naive_chunk_attention(q[h * rep : (h + 1) * rep], keys, scored, chunk)
        weighted = {x: raw[x] * float(ref_v[h, x].double().norm()) for x in scored}
        smooths.append({x: (weighted.get(x - 1, 0.0) + weighted[x] + weighted.get(x + 1, 0.0)) / 3 for x in scored})
    every_lev = [lev[x] for lev in levs for x in scored]
    mean, std = statistics.mean(every_lev), statistics.stdev(every_lev)
    attention = z_scores({(h, x): s[x] for h, s in enumerate(smooths) for x in scored})
    table: list[dict[int, float]] = []
    for h, lev in enumerate(levs):
        row = {x: lam * (lev[x] - mean) / std + attention[(h, x)] for x in scored}
        row |= {x: lam * (lev[x] - mean) / std for x in range(PROMPT, TOTAL)}
        table.append(row)
    return lambda p, h, held, x: table[h][x]


@pytest.mark.parametrize("extra, chunk, blend", [
    ((), 256, None),
    (("--compactor_chunk", "8"), 8, None),  # chunks of 8, 8 and 6 scored tokens
    (("--compactor_blending", "2.5"), 256, 2.5),
])
def test_compactor_keeps_and_evicts_by_the_naive_blended_score(extra, chunk, blend):
    model, ids, steps = evictions("compactor", str(BUDGET), *extra)
    score = compactor_oracle(model, ids, chunk, blend)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


def test_compactor_decodes_by_leverage_whatever_rule_chose_the_prompt():
    """With another prompt rule (l2) the prompt's statistics still come from the whole prompt, so decoded tokens
    and held prompt tokens compare as in the oracle."""
    model, ids, steps = evictions("compactor", str(BUDGET), "--prompt_compression_strategy", "l2")
    assert assert_evicts_lowest(steps, compactor_oracle(model, ids)) > 0


def test_compactor_prompt_rule_needs_its_own_cache():
    with pytest.raises(UserError, match="compactor"):
        evictions("l2", str(BUDGET), "--prompt_compression_strategy", "compactor")
