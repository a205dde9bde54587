"""Naive VATP (H2O w/ VATP, arXiv 2406.12335): a whole run re-played here from the paper's definition with plain
loops over layer 0 (float64; the layer-0 keys, values and queries of a full-cache run, which depend on the token
ids only). A token's score is the attention it received, averaged over its KV group's query heads and over the
queries since it entered (heavy_hitter's H2O average), times the l1 norm of its value; the prompt keeps the sinks,
the recent window and the top scores (H2O's prompt rule); each step evicts the lowest score outside the sinks and
the recent window, then the new query's attention over what is held adds to every held token's sum. Compared at
every step: the held positions and their scores (rtol 1e-4; budget 16 of a 24-token prompt + 16 new tokens, 2
sinks, a 4-token recent window). Under SnapKV's prompt rule (the default) the prompt scores are heavy_hitter's
SnapKV votes times the same norms."""

from __future__ import annotations

import pytest
import torch

from generate import decode_one_token
from strategies.heavy_hitter import HeavyHitterCache
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids
from tests.test_chunked_prefill import layer0_qkv
from tests.test_h2o_prompt_rule import BUDGET as H2O_BUDGET
from tests.test_h2o_prompt_rule import kept_after_each_chunk, naive_h2o_chunked
from tests.test_strategies import layer0_queries, naive_probs, reference_kv
from tests.test_strategy_rules import prompt_cache

BUDGET = 16
H2O = ("--heavy_hitter_prompt_rule", "h2o")


def naive_vatp(model, ids) -> list[tuple[list[set[int]], list[dict[int, float]]]]:
    """Per KV head, the held positions and their scores after the prefill and after each decode step."""
    ref_k, ref_v = (x.double() for x in reference_kv(model, ids))
    q = layer0_queries(model, ids).double()
    n_kv = ref_k.shape[0]
    l1 = ref_v.abs().sum(-1)  # [n_kv, TOTAL]
    sums = [dict.fromkeys(range(TOTAL), 0.0) for _ in range(n_kv)]
    counts = [dict.fromkeys(range(TOTAL), 0) for _ in range(n_kv)]

    def attend(query: int, positions: list[int]) -> None:
        for p, a in naive_probs(q[:, query], ref_k, positions, n_kv).items():
            for h in range(n_kv):
                sums[h][p] += float(a[h])
                counts[h][p] += 1

    def score(h: int, p: int) -> float:
        return sums[h][p] / counts[h][p] * float(l1[h, p])

    for t in range(PROMPT):
        attend(t, list(range(t + 1)))
    held = []
    for h in range(n_kv):
        protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
        others = sorted(set(range(PROMPT)) - protected, key=lambda x: -score(h, x))
        held.append(protected | set(others[: BUDGET - len(protected)]))
    trace = [([set(x) for x in held], [{x: score(h, x) for x in held[h]} for h in range(n_kv)])]
    for p in range(PROMPT, TOTAL):
        for h in range(n_kv):
            if len(held[h]) == BUDGET:
                held[h].remove(min((x for x in held[h] if GLOBAL <= x <= p - RECENT), key=lambda x: score(h, x)))
            held[h].add(p)
        # one query per step; each KV head attends over what it holds
        for h in range(n_kv):
            positions = sorted(held[h])
            for x, a in naive_probs(q[:, p], ref_k, positions, n_kv).items():
                sums[h][x] += float(a[h])
                counts[h][x] += 1
        trace.append(([set(x) for x in held], [{x: score(h, x) for x in held[h]} for h in range(n_kv)]))
    return trace


def test_vatp_keeps_and_scores_as_the_naive_rule():
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("vatp", str(BUDGET), "dense", *H2O))
    ours = []

    def record(p: int) -> None:
        c = caches[0]
        scores = c.token_scores(torch.tensor([p]))
        ours.append((held_positions(c), [{int(x): float(scores[0, h, s]) for s, x in enumerate(c.pos[0, h])
                                          if x >= 0} for h in range(c.n_kv_heads)]))

    with torch.inference_mode():
        run(model, ids, decode_one_token, record)
    expected = naive_vatp(model, ids)
    for step, ((held, scores), (want_held, want_scores)) in enumerate(zip(ours, expected, strict=True)):
        assert held == want_held, f"step {step}"
        for h, head_scores in enumerate(scores):
            for x, s in head_scores.items():
                assert s == pytest.approx(want_scores[h][x], rel=1e-4, abs=1e-7), f"step {step} head {h} pos {x}"


def test_the_value_norms_change_what_is_kept():
    """heavy_hitter under the same flags keeps other tokens on this run, so the naive test tells the two apart."""
    model = make_tiny_model()
    ids = token_ids()
    kept = {}
    for name in ("vatp", "heavy_hitter"):
        caches = attach(model, cache_args(name, str(BUDGET), "dense", *H2O))
        trace = []
        with torch.inference_mode():
            run(model, ids, decode_one_token, lambda p, c=caches[0], t=trace: t.append(held_positions(c)))
        kept[name] = trace
    assert kept["vatp"] != kept["heavy_hitter"]


@pytest.mark.parametrize("flags", [(), ("--snapkv_pool_per_query_head",), H2O], ids=["snapkv", "per_head", "h2o"])
def test_prompt_scores_are_heavy_hitters_times_the_l1_norms(flags):
    cache, seen = prompt_cache("vatp", *flags)
    got = type(cache).prompt_scores(cache, seen["k"], seen["q"])
    plain, _ = HeavyHitterCache.scoring(cache, seen["k"], seen["q"])
    want = plain.double() * seen["v"].double().abs().sum(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [None, 5, 9])
def test_a_chunked_prefill_keeps_the_naive_weighted_accumulations_choice(chunk):
    """H2O's sums carried across chunks (tests/test_h2o_prompt_rule.py's naive accumulation), each held token's
    score times its value's l1 norm: the choice after every chunk is the naive one."""
    model = make_tiny_model()
    ids = token_ids()
    chunking = ["--prefill_chunk", str(chunk)] if chunk else []
    caches = attach(model, cache_args("vatp", str(H2O_BUDGET), "dense", *H2O, *chunking))
    with torch.inference_mode():
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        expected = naive_h2o_chunked(q, k, chunk or PROMPT, model.args.n_kv_head, carried=True,
                                     weight=v.abs().sum(-1))
        assert kept_after_each_chunk(model, ids, caches, chunk) == expected
