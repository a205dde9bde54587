"""Naive MorphKV (arXiv 2503.00979): a whole run re-played here from the paper's definition with plain loops over
layer 0 (float64; the layer-0 keys and queries of a full-cache run, which depend on the token ids only).

Every query's attention is recorded as it was given: a prompt query's over the prompt up to itself, a decode
query's over what its KV head held then (its group's mean). Before a token enters at position p, a KV head's
distant tokens are those held outside the sinks and the recent window (positions ≤ p − R); each of the last W
queries' attention restricted to them is renormalised there, the shares summed (or maxed) over the W queries,
and the lowest is evicted. The prompt keeps the sinks, the last R tokens and the best by the same score for
p = T. Compared at every step: the held positions and the distant tokens' scores (rtol 1e-4; budget 16 of a
24-token prompt + 16 new tokens, 2 sinks, a 4-token recent window)."""

from __future__ import annotations

import pytest
import torch

from generate import decode_one_token, prefill
from prompt_compression import stashed_scoring
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids
from tests.test_strategies import layer0_queries, naive_probs, reference_kv

BUDGET = 16


def naive_morphkv(model, ids, observers: int, fusion: str) -> list[tuple[list[set[int]], list[dict[int, float]]]]:
    """Per KV head, the held positions and the distant tokens' scores (for the next token) after the prefill
    and after each decode step."""
    ref_k, _ = reference_kv(model, ids)
    ref_k, q = ref_k.double(), layer0_queries(model, ids).double()
    n_kv = ref_k.shape[0]
    given = {}  # query position -> per KV head {key position: the attention it gave}

    def attend(query: int, positions_per_head: list[list[int]]) -> None:
        given[query] = [{p: float(a[h]) for p, a in naive_probs(q[:, query], ref_k, positions, n_kv).items()}
                        for h, positions in enumerate(positions_per_head)]

    def scores(h: int, held: set[int], p: int) -> dict[int, float]:
        distant = [x for x in held if GLOBAL <= x <= p - RECENT]
        shares = {x: [] for x in distant}
        for j in range(max(0, p - observers), p):
            mass = sum(given[j][h].get(x, 0.0) for x in distant)
            for x in distant:
                shares[x].append(given[j][h].get(x, 0.0) / mass if mass > 0 else 0.0)
        return {x: sum(s) if fusion == "sum" else max(s) for x, s in shares.items()}

    for t in range(PROMPT):
        attend(t, [list(range(t + 1))] * n_kv)
    held = []
    for h in range(n_kv):
        protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
        score = scores(h, set(range(PROMPT)), PROMPT)
        others = sorted(set(range(PROMPT)) - protected, key=lambda x: -score[x])
        held.append(protected | set(others[: BUDGET - len(protected)]))
    trace = [([set(x) for x in held], [scores(h, held[h], PROMPT) for h in range(n_kv)])]
    for p in range(PROMPT, TOTAL):
        for h in range(n_kv):
            if len(held[h]) == BUDGET:
                score = scores(h, held[h], p)
                held[h].remove(min(score, key=score.get))
            held[h].add(p)
        attend(p, [sorted(x) for x in held])  # each KV head attends over what it holds
        trace.append(([set(x) for x in held], [scores(h, held[h], p + 1) for h in range(n_kv)]))
    return trace


def our_trace(model, ids, *flags: str) -> list[tuple[list[set[int]], list[dict[int, float]]]]:
    caches = attach(model, cache_args("morphkv", str(BUDGET), "dense", *flags))
    trace = []

    def record(p: int) -> None:
        c = caches[0]
        scores = c.token_scores(torch.tensor([p + 1]))
        distant = c.mask[0, :, 0] & (c.pos[0] >= GLOBAL) & (c.pos[0] <= p + 1 - RECENT)
        trace.append((held_positions(c), [{int(c.pos[0, h, s]): float(scores[0, h, s]) for s in range(c.pos.shape[-1])
                                           if distant[h, s]} for h in range(c.n_kv_heads)]))

    with torch.inference_mode():
        run(model, ids, decode_one_token, record)
    return trace


@pytest.mark.parametrize(("fusion", "observers"), [("sum", None), ("max", None), ("sum", 7)],
                         ids=["sum", "max", "more_observers_than_the_window"])
def test_morphkv_keeps_and_scores_as_the_naive_rule(fusion, observers):
    """W defaults to the recent window's tokens before the entering one (R − 1 = 3); W = 7 > R − 1 makes some
    observers older than some distant tokens, which they gave nothing (the ring's entries zeroed as they entered)."""
    model = make_tiny_model()
    ids = token_ids()
    flags = ["--morphkv_fusion", fusion] + (["--morphkv_window", str(observers)] if observers else [])
    ours = our_trace(model, ids, *flags)
    expected = naive_morphkv(model, ids, observers or RECENT - 1, fusion)
    evicted = 0
    for step, ((held, scores), (want_held, want_scores)) in enumerate(zip(ours, expected, strict=True)):
        assert held == want_held, f"step {step}"
        for h, head_scores in enumerate(scores):
            assert head_scores.keys() == want_scores[h].keys(), f"step {step} head {h}"
            for x, s in head_scores.items():
                assert s == pytest.approx(want_scores[h][x], rel=1e-4, abs=1e-7), f"step {step} head {h} pos {x}"
        evicted += step > 0 and held != ours[step - 1][0]
    assert evicted  # the decode steps did evict (the budget is below the sequence)


def test_fusion_renormalisation_and_the_window_change_what_is_kept():
    """The run tells the settings apart, and MorphKV from TOVA (the latest query alone) and H2O (every query's sum):
    the naive test above would notice a rule that dropped either the renormalisation or the window."""
    model = make_tiny_model()
    ids = token_ids()
    runs = {"sum": our_trace(model, ids), "max": our_trace(model, ids, "--morphkv_fusion", "max"),
            "wide": our_trace(model, ids, "--morphkv_window", "7")}
    for other in ("tova", "heavy_hitter"):
        caches = attach(model, cache_args(other, str(BUDGET), "dense"))
        trace = []
        with torch.inference_mode():
            run(model, ids, decode_one_token, lambda p, c=caches[0], t=trace: t.append(held_positions(c)))
        runs[other] = [(held, None) for held in trace]
    held = {name: [h for h, _ in trace] for name, trace in runs.items()}
    names = list(held)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert held[a] != held[b], (a, b)


def test_a_prompt_shorter_than_the_window_seeds_fewer_observers():
    """A 2-token prompt leaves W − 2 rows of the ring empty: the first steps score by the queries there are, and
    the ring's next row follows the last prompt row."""
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("morphkv", str(BUDGET), "dense", "--morphkv_window", "5"))
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :2])
    c = caches[0]
    assert c.step.eq(2).all()
    assert c.window_attention[:, :, 2:].eq(0).all() and c.window_attention[:, :, :2, :2].gt(0).any()
    # the last prompt query's row is its attention over the two prompt tokens: a distribution per KV head
    torch.testing.assert_close(c.window_attention[0, :, 1, :2].sum(-1), torch.ones(c.n_kv_heads))


def test_under_the_kvpress_protocols_no_prompt_scoring_stays_on_the_cache():
    """Where nothing is evicted after the prompt the ring is never read: the compressed prompt's scoring (its keys
    and the observers' rows) must not stay stashed on the cache while it decodes."""
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("morphkv", str(BUDGET), "dense"))
    for evicts in (False, True):
        for c in caches:
            c.configure(evicts_after_prompt=evicts, prompt_budget=BUDGET // 2 if not evicts else None)
        with torch.inference_mode():
            model.reset_caches()
            prefill(model, ids[:, :PROMPT])
        assert all(stashed_scoring(c) is None for c in caches)
        assert bool(caches[0].window_attention.any()) is evicts  # the ring is seeded only where it is read
