"""Chunked prefill with head-adaptive budgets (--prefill_chunk with --budget_allocation adakv): after every chunk
each head's virtual prompt is what it holds (its own count) followed by the chunk, scored by the rule per head,
and the layer's n_kv·L slots go to the best (head, token) pairs over all heads (budget_allocation.PooledCache).

- one chunk (the prompt fits it) equals the one-shot pooled prefill, every poolable chunkable strategy and twin,
  dense and 4-bit storage: logits (atol 1e-5), greedy tokens and kept positions;
- several chunks against a naive Ada-KV written here (per-head rule scores from test_chunked_prefill's naive
  rules, protected tokens, the 0.2·L floor, the top n_kv·L pairs): layer 0's kept positions after every chunk,
  and a one-layer model's logits after the prompt;
- Compactor, whose z-scores take the layer's moments, against a naive Compactor over every head's virtual prompt;
- with --adakv_floor 1 (each head its own best L) the uniform chunks' kept positions and logits, every case but
  LagKV (whose pooled rule scores otherwise by design);
- every case, several chunks: the pool's invariants after each chunk, decoding afterwards;
- a rule that scores once for its after_prefill too (ScoredOnce) scores no head more often in a pool's chunks
  than in the uniform cache's.
Caches are built without --prefill_chunk and fed by chunked_prefill directly (the flag only tells
generate.prefill the chunk size).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from generate import chunked_prefill, decode_one_token
from prompt_compression import ScoredOnce
from strategies import CACHE_STRATEGIES
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    ADAKV,
    ADAKV_STORAGES,
    CHUNK_POOL_REFUSED,
    CHUNKABLE,
    GLOBAL,
    PROMPT,
    RECENT,
    attach,
    cache_args,
    held_positions,
    inner,
    token_ids,
)
from tests.test_chunked_prefill import ATOL, BUDGET, generate_chunk_runs, layer0_qkv, naive_scores, run_prompt
from tests.test_compactor import naive_chunk_attention, naive_leverage, z_scores

CASES = [s for s in ADAKV if s in CHUNKABLE and s not in CHUNK_POOL_REFUSED]
POOLED = ["--budget_allocation", "adakv", "--snapkv_window", "4", "--snapkv_kernel", "1"]
FLOOR = 0.2


def pooled_args(strategy: str, storage: str = "dense"):
    return cache_args(strategy, BUDGET, storage, *POOLED)


@pytest.mark.parametrize("storage", ADAKV_STORAGES)
@pytest.mark.parametrize("strategy", CASES)
def test_adakv_one_chunk_equals_the_one_shot_pooled_prefill(strategy, storage):
    model = make_tiny_model()
    attach(model, pooled_args(strategy, storage))
    chunked = run_prompt(model, token_ids(), PROMPT)
    whole = run_prompt(model, token_ids(), None)
    torch.testing.assert_close(chunked[0], whole[0], atol=ATOL, rtol=0)
    assert chunked[1:] == whole[1:]


def naive_adaptive_chunks(rule: str | None, q, k, v, chunk: int, budget: int, heads: int, prompt: int = PROMPT,
                          score_heads=None):
    """Ada-KV chunk by chunk, from its definition: head h's candidates are what it holds + the chunk; when the
    layer's candidates exceed heads·budget, the protected ones (sinks, the rule's recent window) and each head's
    floor·budget best stay, and the best pairs over all heads fill heads·budget. Each head scored alone by
    `rule`, or all together by `score_heads(candidates)` -> [(scores, recent window)] a head."""
    held = [[] for _ in range(heads)]
    history = []
    for start in range(0, prompt, chunk):
        new = list(range(start, min(start + chunk, prompt)))
        cands = [held[h] + new for h in range(heads)]
        if len({len(c) for c in cands}) == 1 and len(cands[0]) <= budget:
            held = cands
        else:
            pairs = []  # (priority, score, head, position): priority 1 for protected and floor pairs
            scored = score_heads(cands) if score_heads else [naive_scores(rule, c, budget, q, k, v, h)
                                                             for h, c in enumerate(cands)]
            for h, (cand, (score, recent)) in enumerate(zip(cands, scored, strict=True)):
                n = len(cand)
                protected = {i for i in range(n) if cand[i] < GLOBAL or i >= n - recent}
                ranked = sorted(range(n), key=lambda i: (i not in protected, -float(score[i])))
                floor = set(ranked[: int(FLOOR * budget)]) | protected
                pairs += [(i in floor, float(score[i]), h, cand[i]) for i in range(n)]
            chosen = sorted(pairs, key=lambda p: (not p[0], -p[1]))[: heads * budget]
            held = [sorted(p[3] for p in chosen if p[2] == h) for h in range(heads)]
        history.append([set(x) for x in held])
    return history


# The value-weighted rules (critical_kv, curdkv, capkv) get each head's own values (KVCache.observe_prompt_values).
ADAKV_RULES = ["tova", "l2", "heavy_hitter", "critical_kv", "curdkv", "capkv", "morphkv"]


@pytest.mark.parametrize("chunk", [5, 6, 9])
@pytest.mark.parametrize("strategy", ADAKV_RULES)
def test_adakv_layer0_keeps_the_naive_adaptive_choice_after_every_chunk(strategy, chunk):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, pooled_args(strategy))
    with torch.inference_mode():
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        expected = naive_adaptive_chunks(strategy, q, k, v, chunk, int(BUDGET), model.args.n_kv_head)
        for n in range(chunk, PROMPT + chunk, chunk):  # the same prompt cut after each chunk
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            assert held_positions(caches[0]) == expected[n // chunk - 1], n
    assert any(len({len(h) for h in step}) > 1 for step in expected)  # the heads really hold different counts


def naive_pooled_compactor(cands: list[list[int]], q, k, v, budget: int) -> list[tuple[list[float], int]]:
    """Compactor over every head's virtual prompt (its held positions + the chunk, in order), by its definition
    (tests/test_compactor.py's naive leverage and chunk attention, float64): each head's leverages and smoothed
    attention × ‖v‖ over its tokens after the sinks, z-normalised with the moments of every head's together, λ
    the layer's compression ratio (budget against the heads' mean virtual prompt); sinks first."""
    rep = q.shape[0] // len(cands)
    lam = 1 - budget * len(cands) / sum(map(len, cands))
    levs, smooths = [], []
    for h, cand in enumerate(cands):
        keys, scored = k[h, cand].double(), list(range(GLOBAL, len(cand)))
        levs.append(naive_leverage(keys, scored))
        raw = naive_chunk_attention(q[h * rep : (h + 1) * rep, cand].double(), keys, scored, 256)
        weighted = {i: raw[i] * float(v[h, cand[i]].double().norm()) for i in scored}
        smooths.append({i: (weighted.get(i - 1, 0.0) + weighted[i] + weighted.get(i + 1, 0.0)) / 3 for i in scored})
    every_lev = [lev[i] for h, lev in enumerate(levs) for i in range(GLOBAL, len(cands[h]))]
    mean, std = statistics.mean(every_lev), statistics.stdev(every_lev)
    attention = z_scores({(h, i): s[i] for h, s in enumerate(smooths) for i in s})
    blended = [[lam * (levs[h][i] - mean) / std + attention[h, i] for i in range(GLOBAL, len(c))]
               for h, c in enumerate(cands)]
    return [([math.inf] * GLOBAL + scores, RECENT) for scores in blended]


@pytest.mark.parametrize("chunk", [5, 6, 8, 9])  # at 8 a head's own λ would keep otherwise
def test_adakv_compactor_layer0_keeps_the_naive_choice_with_the_layers_moments(chunk):
    """A pool's heads are re-prefilled one at a time after a chunk, and Compactor's z-scores still take the
    moments (and λ) of every head's virtual prompt together, as its one-shot prefill takes the layer's."""
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, pooled_args("compactor"))
    heads = model.args.n_kv_head
    with torch.inference_mode():
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        expected = naive_adaptive_chunks(None, q, k, v, chunk, int(BUDGET), heads,
                                         score_heads=lambda cands: naive_pooled_compactor(cands, q, k, v, int(BUDGET)))
        for n in range(chunk, PROMPT + chunk, chunk):
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            assert held_positions(caches[0]) == expected[n // chunk - 1], n
    assert any(len({len(h) for h in step}) > 1 for step in expected)


@pytest.mark.parametrize("strategy", ["tova", "l2"])
def test_adakv_one_layer_logits_equal_a_naive_chunked_forward(strategy):
    """n_layer = 1: the last chunk's last query of query head j attends over what its KV head held before that
    chunk (its own count) and the chunk, then the rest of the block (written out here)."""
    chunk = 6
    model = make_tiny_model(n_layer=1)
    ids = token_ids()
    attach(model, pooled_args(strategy))
    with torch.inference_mode():
        model.reset_caches()
        got = chunked_prefill(model, ids[:, :PROMPT], chunk, decode_one_token)
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        heads = model.args.n_kv_head
        before_last = naive_adaptive_chunks(strategy, q, k, v, chunk, int(BUDGET), heads, prompt=PROMPT - chunk)[-1]
        assert len({len(h) for h in before_last}) > 1
        a, rep, last = model.layers[0].attention, q.shape[0] // k.shape[0], PROMPT - 1
        outs = []
        for j in range(q.shape[0]):
            h = j // rep
            keys = sorted(before_last[h] | set(range(PROMPT - chunk, PROMPT)))
            logits = torch.stack([q[j, last] @ k[h, p] for p in keys]) / math.sqrt(q.shape[-1])
            outs.append(torch.softmax(logits, 0) @ v[h, keys])
        x = model.tok_embeddings(ids[:, last])[0]
        block = model.layers[0]
        h1 = x + a.wo(torch.cat(outs))
        want = model.output(model.norm(h1 + block.feed_forward(block.ffn_norm(h1))))
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("storage", ADAKV_STORAGES)
@pytest.mark.parametrize("strategy", CASES)
def test_adakv_every_chunk_keeps_the_pool_and_decoding_follows(strategy, storage):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, pooled_args(strategy, storage))
    L = int(BUDGET)
    with torch.inference_mode():
        for n in range(10, PROMPT, 5):
            model.reset_caches()
            chunked_prefill(model, ids[:, :n], 5, decode_one_token)
            for cache in caches:
                c = inner(cache)
                assert int(c.quota.sum()) == c.pool_slots and bool((c.filled <= c.quota).all())
                assert int(c.held_tokens().sum()) == c.n_kv_heads * min(n, L) and int(c.inserted.min()) == n
                outside = c.mask[:, :, 0] & ~c.owned()
                assert not bool(outside.any())
                for h in held_positions(cache):
                    assert set(range(GLOBAL)) <= h and set(range(n - 4, n)) <= h
        logits, tokens, _ = run_prompt(model, ids, 5, steps=4)
    assert torch.isfinite(logits).all() and len(tokens) == 4


def test_generate_runs_adakv_chunks_and_one_chunk_is_the_one_shot_run(tiny_dir, tmp_path):
    """The flags end to end: generate.py with the tiny checkpoint, a 27-byte prompt, 8 slots per head."""
    base = ["--checkpoint_path", str(tiny_dir), "--prompt", "a prompt of twenty-seven by", "--max_new_tokens", "4",
            "--cache_strategy", "heavy_hitter", "--budget_allocation", "adakv", "--snapkv_window", "2",
            "--max_cache_length", "8", "--recent_window", "2", "--no-chat"]
    runs = generate_chunk_runs(base, tmp_path)
    assert runs["chunks"]["config"]["prefill_chunk"] == 5
    for layer in runs["chunks"]["cache_budget_per_head"]:
        assert sum(layer) == 8 * len(layer)


# Pooled, LagKV scores otherwise than uniform by design: it ranks nothing across heads (its pooled rule scores the
# keys alone, strategies/lagkv.py).
POOLED_OTHERWISE = ("lagkv",)


@pytest.mark.parametrize("strategy", [s for s in CASES if s.removeprefix("debug_") not in POOLED_OTHERWISE])
def test_a_floor_of_the_whole_budget_keeps_what_the_uniform_cache_keeps_chunk_by_chunk(strategy):
    """--adakv_floor 1: every head keeps its own best L of its virtual prompt, which is the uniform cache's choice,
    so the pool's chunks (each head re-prefilled alone over its own held tokens, in a head view) keep the uniform
    chunks' positions on every layer, and the logits and greedy tokens follow (atol 1e-5). (Found keyformer's
    noise drawn for the first KV head in every head view, and Compactor's z-scores normalised per head where the
    layer's heads are normalised together: `head_statistics`.)"""
    model = make_tiny_model()
    attach(model, cache_args(strategy, BUDGET, "dense", *POOLED[2:]))
    uniform = run_prompt(model, token_ids(), 5)
    attach(model, cache_args(strategy, BUDGET, "dense", *POOLED, "--adakv_floor", "1"))
    pooled = run_prompt(model, token_ids(), 5)
    assert pooled[2] == uniform[2]
    assert pooled[1] == uniform[1]
    torch.testing.assert_close(pooled[0], uniform[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("strategy", [s for s in CASES if s in CACHE_STRATEGIES and issubclass(CACHE_STRATEGIES[s],
                                                                                               ScoredOnce)])
def test_a_pools_chunks_score_each_head_once_a_chunk(strategy, monkeypatch):
    """A pool re-prefills its heads one at a time after a chunk: the scores its choice took are handed to each
    head's after_prefill (`restash_scoring`), as the uniform cache's are, rather than computed again. Counted as
    heads scored (`scoring`'s keys' head dimension, summed over its calls): equal to the uniform chunks'."""
    cls = CACHE_STRATEGIES[strategy]
    owner = next(c for c in cls.__mro__ if "scoring" in vars(c))
    scoring = vars(owner)["scoring"].__func__
    heads_scored = []

    def counted(c, cache, k, q):
        heads_scored.append(k.shape[1])
        return scoring(c, cache, k, q)

    monkeypatch.setattr(owner, "scoring", classmethod(counted))
    model = make_tiny_model()
    attach(model, cache_args(strategy, BUDGET, "dense", *POOLED[2:]))
    run_prompt(model, token_ids(), 5, steps=0)
    uniform = sum(heads_scored)
    heads_scored.clear()
    attach(model, pooled_args(strategy))
    run_prompt(model, token_ids(), 5, steps=0)
    assert uniform > 0 and sum(heads_scored) == uniform
