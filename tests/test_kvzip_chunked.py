"""KVzip under --prefill_chunk (strategies/kvzip.ChunkedReconstruction): each prefill chunk is reconstructed over
what the layers hold, its tokens scored by their repeat input's queries, the held tokens keeping the scores
their own chunk's pass gave them.

- Layer 0 (whose queries and keys depend on the tokens and positions only) keeps after every chunk what a naive
  chunk-by-chunk KVzip written here from the definition keeps: for each chunk, each repeat query's softmax over
  the held tokens at positions below 4, the chunk (its part, with --kvzip_chunk) and the repeat input up to
  itself; the maximum over the repeat queries and the KV group's query heads; the budget's best of held + chunk.
- Every layer: when nothing was evicted before the last chunk, the scores the caches get equal the one-shot
  scorer's (`reconstruction_scores`, itself checked against its oracle in test_strategies_more): the first
  chunk's from a pass over that chunk alone, the last chunk's from the paper's chunked pass over the whole
  context (float32, atol 1e-5), with and without repeat prompts, whole and in parts.
- With a pool (--budget_allocation adakv): layer 0 keeps after every chunk what the naive KVzip keeps when each
  head scores its chunk over its own held sinks and the layer's heads·budget best (head, token) pairs stay, the
  protected ones and each head's floor first (Ada-KV's choice).
- One chunk equals the one-shot prefill and every chunk leaves the budget: the registry-wide matrices in
  test_chunked_prefill and, pooled, test_chunked_adakv (kvzip and debug_kvzip join them).
"""

from __future__ import annotations

import math

import pytest
import torch

from generate import chunked_prefill, decode_one_token
from rope import apply_rope
from strategies.kvzip import ChunkedReconstruction, RepeatPrompts, reconstruction_scores, rule_users
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, attach, cache_args, held_positions, token_ids

BUDGET = 10
SINKS = 4  # KVzip's scoring sinks: the context's first 4 tokens
FLOOR = 0.2  # Ada-KV's safeguard: every head keeps its 0.2·BUDGET best


def layer0_qk_at(model, ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's queries [H, n, D] and keys [n_kv, n, D] of tokens `ids` rotated at `positions`."""
    a = model.layers[0].attention
    x = model.layers[0].attention_norm(model.tok_embeddings(torch.tensor([ids])))
    n = len(ids)
    q = a.wq(x).view(1, n, a.n_head, a.head_dim).transpose(1, 2)
    k = a.wk(x).view(1, n, a.n_kv_head, a.head_dim).transpose(1, 2)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    return apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0]


def naive_part_scores(model, ids: list[int], held: list[int], start: int, end: int, part: tuple[int, int],
                      h: int) -> dict[int, float]:
    """KVzip's score of each position of the part [start + a, start + b) of chunk [start, end), KV head h, by
    the definition: the repeat input (the part's tokens again, right after the chunk) scores it."""
    a, b = part
    sinks = [p for p in held if p < SINKS] + [p for p in range(start, start + a) if p < SINKS]
    scored = list(range(start + a, start + b))
    repeat_pos = list(range(end, end + b - a))
    keys_ids = [ids[p] for p in sinks + scored] + [ids[p] for p in scored]
    q, k = layer0_qk_at(model, keys_ids, sinks + scored + repeat_pos)
    rep = q.shape[0] // k.shape[0]
    first = len(sinks) + len(scored)
    best = {p: 0.0 for p in scored}
    for j in range(b - a):  # repeat row j sees the sinks, the part and the repeat input up to itself
        row = first + j
        for head in range(h * rep, (h + 1) * rep):
            logits = torch.stack([q[head, row] @ k[h, c] for c in range(row + 1)]) / math.sqrt(q.shape[-1])
            probs = torch.softmax(logits, 0)
            for i, p in enumerate(scored):
                best[p] = max(best[p], float(probs[len(sinks) + i]))
    return best


def naive_kvzip_chunked(model, ids: list[int], chunk: int, part: int, heads: int,
                        pooled: bool = False) -> list[list[set[int]]]:
    """Chunk by chunk: each head keeps the budget's best of held + chunk by KVzip's scores (the held tokens'
    from their own chunk's pass), the first GLOBAL and last RECENT protected; what each head holds after each
    chunk. A prompt within the budget is never scored (as the one-shot prefill's). `pooled`: Ada-KV's choice
    instead, the layer's heads·BUDGET best (head, token) pairs, the protected ones and each head's FLOOR·BUDGET
    best first (heads then hold different tokens, and each scores its chunk over its own sinks)."""
    held = [[] for _ in range(heads)]
    score = [{} for _ in range(heads)]
    history = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        cands = []
        for h in range(heads):
            step = part or end - start
            for a in range(0, end - start, step):
                score[h].update(naive_part_scores(model, ids, held[h], start, end, (a, min(a + step, end - start)),
                                                  h))
            cands.append(held[h] + list(range(start, end)))
        pairs = []  # (kept first, score, head, position)
        for h, cand in enumerate(cands):
            protected = set(cand[:GLOBAL]) | set(cand[-RECENT:])
            order = sorted(cand, key=lambda p: (p not in protected, -score[h][p]))
            if not pooled:
                held[h] = sorted(order[:BUDGET])
            first = protected | set(order[: int(FLOOR * BUDGET)])
            pairs += [(p in first, score[h][p], h, p) for p in cand]
        if pooled and sum(map(len, cands)) > heads * BUDGET:
            chosen = sorted(pairs, key=lambda pair: (not pair[0], -pair[1]))[: heads * BUDGET]
            held = [sorted(p for _, _, head, p in chosen if head == h) for h in range(heads)]
        elif pooled:
            held = cands
        history.append([set(x) for x in held])
    return history


@pytest.mark.parametrize("part", [0, 4])
@pytest.mark.parametrize("chunk", [5, 6, 9])
def test_layer0_keeps_what_the_naive_chunk_by_chunk_kvzip_keeps(chunk, part):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("kvzip", str(BUDGET), "dense", "--prefill_chunk", str(chunk),
                                      "--kvzip_chunk", str(part)))
    heads = model.args.n_kv_head
    with torch.inference_mode():
        expected = naive_kvzip_chunked(model, ids[0, :PROMPT].tolist(), chunk, part, heads)
        for i, n in enumerate(range(chunk, PROMPT + chunk, chunk)):  # the prompt cut after each chunk
            n = min(n, PROMPT)
            if n <= BUDGET:  # fits: no pass, nothing to compare but that everything is held
                continue
            model.reset_caches()
            chunked_prefill(model, ids[:, :n], chunk, decode_one_token)
            assert held_positions(caches[0])[:heads] == expected[i], n


@pytest.mark.parametrize("part", [0, 4])
@pytest.mark.parametrize("chunk", [5, 6, 9])
def test_a_pools_layer0_keeps_the_naive_adaptive_chunked_kvzip_choice(chunk, part):
    """--budget_allocation adakv: the heads hold different tokens (their own sinks too) and share the pool."""
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("kvzip", str(BUDGET), "dense", "--budget_allocation", "adakv",
                                      "--prefill_chunk", str(chunk), "--kvzip_chunk", str(part)))
    heads = model.args.n_kv_head
    with torch.inference_mode():
        expected = naive_kvzip_chunked(model, ids[0, :PROMPT].tolist(), chunk, part, heads, pooled=True)
        for i, n in enumerate(range(chunk, PROMPT + chunk, chunk)):
            n = min(n, PROMPT)
            if n <= BUDGET:
                continue
            model.reset_caches()
            chunked_prefill(model, ids[:, :n], chunk, decode_one_token)
            assert held_positions(caches[0]) == expected[i], n


@pytest.mark.parametrize("part", [0, 4])
def test_the_pooled_oracle_cases_hold_different_counts_and_sinks_per_head(part):
    """What a pool changes is exercised (chunks of 5): the heads hold different counts, and different held
    tokens below position SINKS (each scores the next chunk over its own) before a later chunk."""
    model = make_tiny_model()
    with torch.inference_mode():
        steps = naive_kvzip_chunked(model, token_ids()[0, :PROMPT].tolist(), 5, part, model.args.n_kv_head, True)
    assert any(len({len(h) for h in step}) > 1 for step in steps)
    assert any(len({frozenset(p for p in h if p < SINKS) for h in step}) > 1 for step in steps[:-1])


@pytest.mark.parametrize("prompts", [RepeatPrompts(), RepeatPrompts((5, 6, 7), (8, 9), (10,))],
                         ids=["no prompt", "prompts"])
@pytest.mark.parametrize("part", [0, 4])
def test_every_layers_scores_are_the_one_shot_scorers_passes(prompts, part, monkeypatch):
    model = make_tiny_model()
    ids = token_ids()[:, :PROMPT]
    half = PROMPT // 2
    # A budget of one chunk: the first chunk fits whole, the second compresses held + chunk.
    caches = attach(model, cache_args("kvzip", str(half), "dense", "--prefill_chunk", str(half),
                                      "--kvzip_chunk", str(part)))
    for _, user in rule_users(caches):
        user.kvzip_prompts = prompts
    given = []
    give = ChunkedReconstruction.give

    def recording_give(self, layer, users):
        give(self, layer, users)
        given.append((layer, [user.reconstruction_scores.clone() for user in users]))

    monkeypatch.setattr(ChunkedReconstruction, "give", recording_give)
    with torch.inference_mode():
        model.reset_caches()
        chunked_prefill(model, ids, half, decode_one_token)
        first = reconstruction_scores(model, ids[:, :half], prompts, part)
        whole = reconstruction_scores(model, ids, prompts, part or half)
    layers = len(model.layers)
    assert [layer for layer, _ in given] == list(range(layers)) * 2
    for layer in range(layers):
        (at_first,), (at_second,) = given[layer][1], given[layers + layer][1]
        torch.testing.assert_close(at_first, first[layer], atol=1e-5, rtol=0)
        expected = torch.cat([first[layer], whole[layer][..., half:]], dim=-1)
        torch.testing.assert_close(at_second, expected, atol=1e-5, rtol=0)
