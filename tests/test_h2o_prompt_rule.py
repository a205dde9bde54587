"""heavy_hitter's h2o prompt rule (`--heavy_hitter_prompt_rule h2o`, kvpress's ObservedAttentionPress): a prompt
token's score is the attention it received from every prompt query at or after it, averaged over the KV group's
query heads and divided by the number of those queries; the top scores stay, after the sinks and the recent
window. Checked against a naive implementation written here from that definition, chunk by chunk:

- its own cache (one shot, and chunks of 5, 6, 9 and 24 tokens): a held token's sum goes on from the earlier
  chunks (the queries it met when they came, over what was held then), so the choice after every chunk is the
  naive accumulation's, also where nothing is evicted after the prompt (the kvpress protocols);
- another cache's prompt rule (tova): the held tokens and the chunk are scored as one prompt by their own
  queries (nothing is carried);
- the rule's pass over the prompt's attention runs once a prefill, its sums seeding H2O's decode statistics.
"""

from __future__ import annotations

import pytest
import torch

import prompt_compression
from generate import chunked_prefill, decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, attach, cache_args, held_positions, token_ids
from tests.test_chunked_prefill import attention_from, layer0_qkv

BUDGET = 10
H2O = ["--heavy_hitter_prompt_rule", "h2o"]


def naive_top(scores: dict[int, float], cand: list[int], budget: int) -> list[int]:
    """The sinks and the RECENT newest of `cand` (sorted), then the best scores, `budget` in all, sorted."""
    n = len(cand)
    protected = set(cand[:GLOBAL]) | set(cand[n - RECENT :])
    order = sorted(cand, key=lambda p: (p not in protected, -scores[p]))
    return sorted(order[:budget])


def naive_h2o_chunked(q, k, chunk: int, heads: int, carried: bool,
                      weight: torch.Tensor | None = None) -> list[list[set[int]]]:
    """Layer 0's kept positions per head after every chunk. `carried`: the cache's own rule, each held token's
    sum of the attention every query gave it when that query came; else (another cache's rule) held + chunk are
    one prompt whose own queries vote. `weight` [heads, T]: each score times its token's weight (VATP's value
    norms)."""
    held = [[] for _ in range(heads)]
    sums = [dict() for _ in range(heads)]
    history = []
    for start in range(0, PROMPT, chunk):
        new = list(range(start, min(start + chunk, PROMPT)))
        end = new[-1] + 1
        for h in range(heads):
            cand = held[h] + new
            if not carried:
                sums[h] = {}
            voters = new if carried else cand
            for i, query in enumerate(voters):
                seen = cand[: len(held[h]) + i + 1] if carried else cand[: i + 1]
                for p, a in zip(seen, attention_from(q, k, query, seen, h).tolist(), strict=True):
                    sums[h][p] = sums[h].get(p, 0.0) + a
            if carried:
                scores = {p: sums[h][p] / (end - p) for p in cand}  # every query since p entered
            else:
                scores = {p: sums[h][p] / (len(cand) - i) for i, p in enumerate(cand)}  # the virtual prompt's
            if weight is not None:
                scores = {p: score * float(weight[h, p]) for p, score in scores.items()}
            held[h] = cand if len(cand) <= BUDGET else naive_top(scores, cand, BUDGET)
            sums[h] = {p: sums[h][p] for p in held[h]}
        history.append([set(x) for x in held])
    return history


def kept_after_each_chunk(model, ids, caches, chunk: int | None) -> list[list[set[int]]]:
    got = []
    step = chunk or PROMPT
    for n in range(step, PROMPT + step, step):  # the same prompt cut after each chunk
        model.reset_caches()
        if chunk:
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
        else:
            prefill(model, ids[:, :PROMPT])
        got.append(held_positions(caches[0]))
    return got


@pytest.mark.parametrize("evicts_after_prompt", [True, False], ids=["decode_evicts", "kvpress_protocol"])
@pytest.mark.parametrize("chunk", [None, 5, 6, 9, PROMPT])
def test_its_own_cache_keeps_the_naive_accumulations_choice(chunk, evicts_after_prompt):
    model = make_tiny_model()
    ids = token_ids()
    chunking = ["--prefill_chunk", str(chunk)] if chunk else []
    caches = attach(model, cache_args("heavy_hitter", str(BUDGET), "dense", *H2O, *chunking))
    for cache in caches:
        cache.configure(evicts_after_prompt=evicts_after_prompt)
    with torch.inference_mode():
        q, k, _ = layer0_qkv(model, ids[:, :PROMPT])
        expected = naive_h2o_chunked(q, k, chunk or PROMPT, model.args.n_kv_head, carried=True)
        assert kept_after_each_chunk(model, ids, caches, chunk) == expected


@pytest.mark.parametrize("chunk", [None, 6])
def test_as_another_caches_rule_the_held_tokens_and_the_chunk_are_one_prompt(chunk):
    model = make_tiny_model()
    ids = token_ids()
    chunking = ["--prefill_chunk", str(chunk)] if chunk else []
    caches = attach(model, cache_args("tova", str(BUDGET), "dense", "--prompt_compression_strategy", "heavy_hitter",
                                      *H2O, *chunking))
    with torch.inference_mode():
        q, k, _ = layer0_qkv(model, ids[:, :PROMPT])
        expected = naive_h2o_chunked(q, k, chunk or PROMPT, model.args.n_kv_head, carried=False)
        assert kept_after_each_chunk(model, ids, caches, chunk) == expected


def test_the_snapkv_rule_keeps_other_tokens():
    """The two rules differ on this prompt, so the naive test above could not pass on SnapKV's choice."""
    model = make_tiny_model()
    ids = token_ids()
    kept = []
    for rule in (["--heavy_hitter_prompt_rule", "snapkv"], H2O):
        caches = attach(model, cache_args("heavy_hitter", str(BUDGET), "dense", *rule))
        with torch.inference_mode():
            kept.append(kept_after_each_chunk(model, ids, caches, None))
    assert kept[0] != kept[1]


def test_one_pass_over_the_prompts_attention_scores_and_seeds(monkeypatch):
    model = make_tiny_model()
    ids = token_ids()
    calls = []
    original = prompt_compression.prompt_attention_received

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(prompt_compression, "prompt_attention_received", counting)
    for rule, passes in ((H2O, 1), (["--heavy_hitter_prompt_rule", "snapkv"], 1)):
        caches = attach(model, cache_args("heavy_hitter", str(BUDGET), "dense", *rule))
        calls.clear()
        with torch.inference_mode():
            model.reset_caches()
            prefill(model, ids[:, :PROMPT])
        assert len(calls) == passes * len(caches), rule
        # the decode rule's sums are the prompt rule's: the kept tokens' scores rank as they were chosen
        c = caches[0]
        assert (c.attn_steps[0, :, :BUDGET] == PROMPT - c.pos[0, :, :BUDGET]).all()
