"""Naive oracles of the strategies from the recent literature (tova, keydiff, expected_attention): each
rule re-computed here from the layer-0 keys and queries of a full-cache run, and compared with what the
cache evicted at every decode step and kept at prefill (budget 16 of a 24-token prompt + 16 new tokens)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.strategy_matrix import GLOBAL, PROMPT, RECENT
from tests.test_strategies import evictions, layer0_queries, naive_probs, reference_kv, unprotected

BUDGET = 16


def assert_evicts_lowest(steps, score) -> int:
    """Every full decode step evicts the lowest `score(p, h, held_before, x)` unprotected token (near-ties
    allowed), and the prefill kept the protected tokens + the best others by `score(PROMPT, h, prompt, x)`."""
    prompt = set(range(PROMPT))
    for h, kept in enumerate(steps[0][1]):
        protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
        others = sorted(prompt - protected, key=lambda x, h=h: -score(PROMPT, h, prompt, x))
        expected = protected | set(others[: BUDGET - len(protected)])
        assert kept == expected, f"prefill, head {h}: kept {sorted(kept)}, expected {sorted(expected)}"
    checked = 0
    for p, before, after in steps:
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            if len(b) == BUDGET:
                scores = {x: score(p, h, b, x) for x in unprotected(b, p)}
                lowest = min(scores.values())
                ties = {x for x, v in scores.items() if v <= lowest + 1e-6}
                evicted = b - a
                assert len(evicted) == 1 and evicted <= ties, f"step {p} head {h}: {evicted} not in {ties}"
                checked += 1
    return checked


def test_tova_evicts_the_token_the_latest_query_attends_to_least():
    """Naive TOVA: the query of the previous position, softmax over what the cache held when it attended
    (the whole prompt for the last prompt query), averaged over the query heads of each KV group."""
    model, ids, steps = evictions("tova", str(BUDGET))
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    n_kv = model.args.n_kv_head
    cache: dict[tuple[int, int], dict[int, torch.Tensor]] = {}

    def score(p: int, h: int, held: set[int], x: int) -> float:
        # At step p the latest query is p − 1; at prefill it attended over the whole prompt.
        attended = sorted(set(range(PROMPT)) if p == PROMPT else held)
        if (p, h) not in cache:
            cache[(p, h)] = naive_probs(q[:, p - 1], ref_k, attended, n_kv)
        return cache[(p, h)][x][h].item()

    checked = assert_evicts_lowest(steps, score)
    assert checked > 0


def test_keydiff_evicts_the_key_closest_to_the_mean_key_direction():
    """Naive KeyDiff: the anchor is the mean of the unit keys the head holds (the whole prompt at prefill);
    the held key with the highest cosine similarity to it is evicted."""
    model, ids, steps = evictions("keydiff", str(BUDGET))
    ref_k, _ = reference_kv(model, ids)

    def score(p: int, h: int, held: set[int], x: int) -> float:
        anchor = torch.stack([ref_k[h, y] / ref_k[h, y].norm() for y in sorted(held)]).mean(0)
        return -F.cosine_similarity(ref_k[h, x], anchor, dim=0).item()

    assert assert_evicts_lowest(steps, score) > 0


@pytest.mark.parametrize(("window", "covariance"), [(64, "full"), (8, "full"), (8, "diagonal"), (8, "none")])
def test_expected_attention_evicts_the_lowest_expected_logit(window, covariance):
    """Naive expected attention: per query head, the mean and covariance of its last `window` prompt queries;
    averaged over each KV group's heads; a key's expected logit is μ·k/√d + kᵀΣk/(2d)."""
    model, ids, steps = evictions("expected_attention", str(BUDGET), "--expected_attention_window", str(window),
                                  "--expected_attention_covariance", covariance)
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)  # [n_head, TOTAL, d]
    n_kv, d = model.args.n_kv_head, model.args.head_dim
    rep = q.shape[0] // n_kv
    stats = []
    for g in range(n_kv):
        means, covs = [], []
        for head in range(g * rep, (g + 1) * rep):
            rows = [q[head, j] for j in range(max(0, PROMPT - window), PROMPT)]
            mean = sum(rows) / len(rows)
            cov = sum(torch.outer(r - mean, r - mean) for r in rows) / len(rows)
            means.append(mean)
            covs.append(cov)
        cov = sum(covs) / rep
        cov = {"full": cov, "diagonal": torch.diag(torch.diag(cov)), "none": torch.zeros_like(cov)}[covariance]
        stats.append((sum(means) / rep, cov))

    def score(p: int, h: int, held: set[int], x: int) -> float:
        mean, cov = stats[h]
        k = ref_k[h, x]
        return (mean @ k / math.sqrt(d) + k @ cov @ k / (2 * d)).item()

    assert assert_evicts_lowest(steps, score) > 0


def test_expected_logit_is_the_log_of_the_expected_attention_weight_of_a_gaussian_query():
    """E[exp(qᵀk/√d)] for q ~ N(μ, Σ), by Monte Carlo, is exp of the expected logit the rule ranks by."""
    from cache_expected_attention import expected_logit

    gen = torch.Generator().manual_seed(0)
    d = 8
    mean = torch.randn(d, generator=gen, dtype=torch.float64) * 0.5
    a = torch.randn(d, d, generator=gen, dtype=torch.float64) * 0.3
    cov = a @ a.T
    k = torch.randn(3, d, generator=gen, dtype=torch.float64)
    samples = mean + torch.randn(400_000, d, generator=gen, dtype=torch.float64) @ a.T
    monte_carlo = torch.exp(samples @ k.T / math.sqrt(d)).mean(0).log()
    ours = expected_logit(k.view(1, 1, 3, d), mean.view(1, 1, d).float(), cov.view(1, 1, d, d).float())[0, 0]
    torch.testing.assert_close(ours.double(), monte_carlo, atol=0.02, rtol=0)
