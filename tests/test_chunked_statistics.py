"""Statistics accumulated across a chunked prefill's chunks (--prefill_chunk): H2O's attention sums
(heavy_hitter) are sums over every query, so after the prompt a held token's sum is the attention it received
from every prompt query that saw it, each query attending over what its layer held when its chunk came plus the
chunk up to itself; its step count is the number of those queries. Checked against that definition written out
here, for layer 0 (its queries and keys depend on the tokens only): plain and thresholded sums (steps with at
least uniform attention), uniform and head-adaptive (adakv) budgets, the debug_ twin's shadow.
"""

from __future__ import annotations

import pytest
import torch

from generate import chunked_prefill, decode_one_token
from tests.conftest import make_tiny_model
from tests.strategy_matrix import PROMPT, attach, cache_args, inner, token_ids
from tests.test_chunked_adakv import POOLED, naive_adaptive_chunks
from tests.test_chunked_prefill import BUDGET, RULE_FLAGS, attention_from, layer0_qkv, naive_chunked


def naive_sums(q, k, held_history: list[list[set[int]]], chunk: int, heads: int, thresholding: bool):
    """Per KV head, position -> (sum over the prompt's queries of the attention it gave the position, or the
    count of queries that gave it at least uniform attention; the number of queries that saw it)."""
    sums = [{} for _ in range(heads)]
    for c, start in enumerate(range(0, PROMPT, chunk)):
        for i in range(start, min(start + chunk, PROMPT)):
            for h in range(heads):
                before = held_history[c - 1][h] if c else set()
                visible = sorted(before | set(range(start, i + 1)))
                attn = attention_from(q, k, i, visible, h)
                for p, a in zip(visible, attn.tolist(), strict=True):
                    got = float(a >= 1.0 / len(visible)) if thresholding else a
                    total, steps = sums[h].get(p, (0.0, 0))
                    sums[h][p] = (total + got, steps + 1)
    return sums


CASES = {"heavy_hitter": [], "thresholded": ["--attn_thresholding"], "adakv": POOLED,
         "debug_heavy_hitter": []}


@pytest.mark.parametrize("chunk", [5, 9])
@pytest.mark.parametrize("case", sorted(CASES))
def test_heavy_hitter_sums_accumulate_over_every_chunk(case, chunk):
    model = make_tiny_model()
    ids = token_ids()
    strategy = "debug_heavy_hitter" if case == "debug_heavy_hitter" else "heavy_hitter"
    caches = attach(model, cache_args(strategy, BUDGET, "dense", *RULE_FLAGS["heavy_hitter"], *CASES[case]))
    with torch.inference_mode():
        model.reset_caches()
        chunked_prefill(model, ids[:, :PROMPT], chunk, decode_one_token)
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        heads = model.args.n_kv_head
        held = (naive_adaptive_chunks if case == "adakv" else naive_chunked)(
            "heavy_hitter", q, k, v, chunk, int(BUDGET), heads)
        want = naive_sums(q, k, held, chunk, heads, case == "thresholded")
    c = inner(caches[0])
    for h in range(heads):
        slots = c.mask[0, h, 0].nonzero()[:, 0].tolist()
        assert {int(c.pos[0, h, s]) for s in slots} == held[-1][h]
        for s in slots:
            total, steps = want[h][int(c.pos[0, h, s])]
            assert float(c.attn_sum[0, h, s]) == pytest.approx(total, abs=1e-5)
            assert float(c.attn_steps[0, h, s]) == steps
