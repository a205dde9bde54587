"""Naive oracles of the strategies from the recent literature (tova, keydiff, expected_attention): each
rule re-computed here from the layer-0 keys and queries of a full-cache run, and compared with what the
cache evicted at every decode step and kept at prefill (budget 16 of a 24-token prompt + 16 new tokens),
also when the rule compresses the prompt of another cache or another rule compressed its prompt."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.strategy_matrix import GLOBAL, PROMPT, RECENT
from tests.test_strategies import evictions, layer0_queries, naive_probs, reference_kv, unprotected

BUDGET = 16
# score(p, h, held, x): the rule's score of position x in KV head h when the token at p arrives and the
# head holds `held` (at prefill: p = PROMPT, held = the whole prompt); the lowest is evicted.
Score = Callable[[int, int, set[int], int], float]


def tova_oracle(model, ids) -> Score:
    """Naive TOVA: the query of the previous position, softmax over what the cache held when it attended
    (the whole prompt for the last prompt query), averaged over the query heads of each KV group."""
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    memo: dict[tuple[int, int], dict[int, torch.Tensor]] = {}

    def score(p: int, h: int, held: set[int], x: int) -> float:
        attended = sorted(set(range(PROMPT)) if p == PROMPT else held)
        if (p, h) not in memo:
            memo[(p, h)] = naive_probs(q[:, p - 1], ref_k, attended, model.args.n_kv_head)
        return memo[(p, h)][x][h].item()

    return score


def keydiff_oracle(model, ids) -> Score:
    """Naive KeyDiff: the anchor is the mean of the unit keys the head holds (the whole prompt at prefill);
    the held key with the highest cosine similarity to it is evicted."""
    ref_k, _ = reference_kv(model, ids)

    def score(p: int, h: int, held: set[int], x: int) -> float:
        anchor = torch.stack([ref_k[h, y] / ref_k[h, y].norm() for y in sorted(held)]).mean(0)
        return -F.cosine_similarity(ref_k[h, x], anchor, dim=0).item()

    return score


def expected_attention_oracle(model, ids, window: int = 64, covariance: str = "full") -> Score:
    """Naive expected attention: per query head, the mean and covariance of its last `window` prompt queries;
    averaged over each KV group's heads; a key's expected logit is μ·k/√d + kᵀΣk/(2d)."""
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
            means.append(mean)
            covs.append(sum(torch.outer(r - mean, r - mean) for r in rows) / len(rows))
        cov = sum(covs) / rep
        cov = {"full": cov, "diagonal": torch.diag(torch.diag(cov)), "none": torch.zeros_like(cov)}[covariance]
        stats.append((sum(means) / rep, cov))

    def score(p: int, h: int, held: set[int], x: int) -> float:
        mean, cov = stats[h]
        k = ref_k[h, x]
        return (mean @ k / math.sqrt(d) + k @ cov @ k / (2 * d)).item()

    return score


ORACLES = {"tova": tova_oracle, "keydiff": keydiff_oracle, "expected_attention": expected_attention_oracle}


def assert_prompt_kept_best(steps, score: Score) -> None:
    """The prefill kept the protected tokens + the best others by `score(PROMPT, h, prompt, x)`."""
    prompt = set(range(PROMPT))
    protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
    for h, kept in enumerate(steps[0][1]):
        others = sorted(prompt - protected, key=lambda x, h=h: -score(PROMPT, h, prompt, x))
        expected = protected | set(others[: BUDGET - len(protected)])
        assert kept == expected, f"prefill, head {h}: kept {sorted(kept)}, expected {sorted(expected)}"


def assert_evicts_lowest(steps, score: Score) -> int:
    """Every full decode step evicts the lowest-scoring unprotected token (near-ties allowed); returns the
    number of evictions checked."""
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
    model, ids, steps = evictions("tova", str(BUDGET))
    score = tova_oracle(model, ids)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


def test_keydiff_evicts_the_key_closest_to_the_mean_key_direction():
    model, ids, steps = evictions("keydiff", str(BUDGET))
    score = keydiff_oracle(model, ids)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


@pytest.mark.parametrize(("window", "covariance"), [(64, "full"), (8, "full"), (8, "diagonal"), (8, "none")])
def test_expected_attention_evicts_the_lowest_expected_logit(window, covariance):
    model, ids, steps = evictions("expected_attention", str(BUDGET), "--expected_attention_window", str(window),
                                  "--expected_attention_covariance", covariance)
    score = expected_attention_oracle(model, ids, window, covariance)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


@pytest.mark.parametrize("rule", sorted(ORACLES))
def test_rule_compresses_the_prompt_of_another_cache(rule):
    """As --prompt_compression_strategy of an l2 cache, the rule keeps the prompt tokens it keeps for itself."""
    model, ids, steps = evictions("l2", str(BUDGET), "--prompt_compression_strategy", rule)
    assert_prompt_kept_best(steps, ORACLES[rule](model, ids))


@pytest.mark.parametrize("strategy", sorted(ORACLES))
def test_strategy_decodes_by_its_rule_after_another_prompt_rule(strategy):
    """After SnapKV (heavy_hitter's prompt rule) chose the prompt tokens, decode evicts by the strategy's rule."""
    model, ids, steps = evictions(strategy, str(BUDGET), "--prompt_compression_strategy", "heavy_hitter")
    assert assert_evicts_lowest(steps, ORACLES[strategy](model, ids)) > 0


def test_expected_logit_is_the_log_of_the_expected_attention_weight_of_a_gaussian_query():
    """E[exp(qᵀk/√d)] for q ~ N(μ, Σ), by Monte Carlo, is exp of the expected logit the rule ranks by."""
    from strategies.expected_attention import expected_logit

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
    diagonal = expected_logit(k.view(1, 1, 3, d), mean.view(1, 1, d).float(), cov.diagonal().view(1, 1, d).float())
    expected = k @ mean / math.sqrt(d) + (k.square() * cov.diagonal()).sum(-1) / (2 * d)
    torch.testing.assert_close(diagonal[0, 0].double(), expected, atol=1e-5, rtol=0)
