"""LagKV with a chunked prefill (--prefill_chunk): a re-prefill partitions held tokens + the chunk by true position,
scores partition p against the tokens of p + 1 present once p + 1 is complete, and a held token keeps the score
its partition got in an earlier chunk (LagKV scores a partition once, as at decode).

Against LagKV's definition written out here (layer 0, whose keys and values depend on the tokens only), after
every chunk: each held token's score, and that the kept tokens are a best choice by those scores (ties in rank
scores are common, so the choice is checked, not replayed). The registry-wide chunk tests cover lagkv's
one-chunk equality, budgets, rows, re-rotation and adakv.
"""

from __future__ import annotations

import pytest
import torch

from generate import chunked_prefill, decode_one_token
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, attach, cache_args, token_ids
from tests.test_chunked_prefill import BUDGET, layer0_qkv

LAG = 4  # the matrix's --lag_size


def naive_partition_scores(k, v, members: list[int], ref: list[int], h: int) -> list[float]:
    """LagKV's ranks of `members` (one partition) against `ref` (the next one): per state, each token min-max
    normalised per channel by ref, the std over channels, softmax over the partition; the mean of K and V;
    rank within the partition / lag."""
    total = torch.zeros(len(members))
    for s in (k, v):
        lo, hi = s[h, ref].min(0).values, s[h, ref].max(0).values
        spread = torch.stack([((s[h, x] - lo) / (hi - lo).clamp(min=1e-6)).std() for x in members])
        total += spread.softmax(0)
    return ((total / 2).argsort().argsort().float() / LAG).tolist()


@pytest.mark.parametrize("chunk", [5, 6, 9])
def test_lagkv_scores_partitions_once_by_position_and_keeps_a_best_choice(chunk):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("lagkv", BUDGET, "dense"))
    c, budget = caches[0], int(BUDGET)
    heads = model.args.n_kv_head
    with torch.inference_mode():
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        held = [[] for _ in range(heads)]
        scored = [{} for _ in range(heads)]  # position -> its partition's rank score, set once
        for start in range(0, PROMPT, chunk):
            end = min(start + chunk, PROMPT)
            model.reset_caches()
            chunked_prefill(model, ids[:, :end], chunk, decode_one_token)
            for h in range(heads):
                cand = held[h] + list(range(start, end))
                part = {x: (x - GLOBAL) // LAG for x in cand if x >= GLOBAL}
                for p in range((end - GLOBAL) // LAG - 1):
                    members = [x for x in cand if part.get(x) == p]
                    if members and not all(x in scored[h] for x in members):
                        ref = [x for x in cand if part.get(x) == p + 1]
                        scored[h].update(zip(members, naive_partition_scores(k, v, members, ref, h), strict=True))
                slots = c.mask[0, h, 0].nonzero()[:, 0].tolist()
                kept = {int(c.pos[0, h, s]): float(c.lag_score[0, h, s]) for s in slots}
                for x, got in kept.items():
                    assert got == pytest.approx(scored[h].get(x, -1.0), abs=1e-6), (start, h, x)
                score = {x: scored[h].get(x, 1 + x / (end + 1)) for x in cand}
                protected = {x for x in cand if x < GLOBAL} | set(cand[-RECENT:])
                assert protected <= set(kept) and len(kept) == min(budget, len(cand))
                others = [score[x] for x in set(kept) - protected]
                evicted = [score[x] for x in set(cand) - set(kept)]
                assert not evicted or not others or min(others) >= max(evicted)
                held[h] = sorted(kept)
    assert any(len(s) for s in scored)  # partitions were scored
