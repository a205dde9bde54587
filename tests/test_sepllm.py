"""sepllm (SepLLM's training-free cache, arXiv 2412.12094) against a naive implementation written from its
definition: the sinks and the recent window stay; of the rest the separators outrank every other token and the
newer outrank the older, so a full cache drops its oldest non-separator, and its oldest separator only when
nothing else is left. Replayed over a whole run (prompt compressed, then every decode step), chunk by chunk,
with the separators read from the token ids the model was given; and the separator class of the bundled
tokenizer checked against SepLLM's list (clause marks alone or with whitespace, whitespace alone)."""

from __future__ import annotations

import pytest
import torch

from generate import chunked_prefill, decode_one_token, prefill
from strategies.token_ids import token_classes
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    GLOBAL,
    PROMPT,
    RECENT,
    TOKEN_CLASSES,
    TOTAL,
    attach,
    cache_args,
    held_positions,
    run,
    token_ids,
)

BUDGET = 12


def naive_keep(candidates: list[int], separators: set[int], budget: int) -> list[int]:
    """The sinks and the RECENT newest of `candidates` (sorted positions), then separators before the rest, the
    newest first within each: `budget` in all, sorted."""
    n = len(candidates)
    protected = set(candidates[:GLOBAL]) | set(candidates[n - RECENT :])
    order = sorted(candidates, key=lambda p: (p not in protected, p not in separators, -p))
    return sorted(order[:budget])


def naive_run(ids: torch.Tensor) -> list[set[int]]:
    """The held positions after the prefill and after each decode step (the rule needs no heads: one set)."""
    separators = {p for p in range(TOTAL) if TOKEN_CLASSES["separator"][ids[0, p]]}
    held = naive_keep(list(range(PROMPT)), separators, BUDGET)
    trace = [set(held)]
    for p in range(PROMPT, TOTAL):
        if len(held) == BUDGET:
            candidates = [x for x in held if GLOBAL <= x <= p - RECENT]
            held.remove(min(candidates, key=lambda x: (x in separators, x)))
        held = sorted([*held, p])
        trace.append(set(held))
    return trace


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sepllm_keeps_what_the_naive_rule_keeps_over_a_whole_run(seed):
    model = make_tiny_model()
    ids = token_ids(seed)
    caches = attach(model, cache_args("sepllm", str(BUDGET)))
    ours = []
    with torch.inference_mode():
        run(model, ids, decode_one_token, lambda p: ours.append(held_positions(caches[0])))
    expected = naive_run(ids)
    assert [heads[0] for heads in ours] == expected
    assert all(len(set(map(frozenset, heads))) == 1 for heads in ours)  # every KV head holds the same tokens
    # the run evicted separators and non-separators both, so both ranks were exercised
    separators = {p for p in range(TOTAL) if TOKEN_CLASSES["separator"][ids[0, p]]}
    evicted = set(range(TOTAL)) - expected[-1]
    assert evicted & separators or seed != 0
    assert evicted - separators


@pytest.mark.parametrize("chunk", [5, 9])
def test_a_chunked_prefill_keeps_the_naive_choice_after_every_chunk(chunk):
    model = make_tiny_model()
    ids = token_ids()
    separators = {p for p in range(PROMPT) if TOKEN_CLASSES["separator"][ids[0, p]]}
    caches = attach(model, cache_args("sepllm", str(BUDGET), "dense", "--prefill_chunk", str(chunk)))
    held: list[int] = []
    with torch.inference_mode():
        for n in range(chunk, PROMPT + chunk, chunk):  # the same prompt cut after each chunk
            candidates = held + list(range(n - chunk, min(n, PROMPT)))
            held = candidates if len(candidates) <= BUDGET else naive_keep(candidates, separators, BUDGET)
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            assert held_positions(caches[0])[0] == set(held), n


def test_the_separators_decide_what_stays():
    """With no token a separator the rule is recent_global's, so the naive test above could not pass by accident."""
    model = make_tiny_model()
    ids = token_ids()
    kept = {}
    for name in ("sepllm", "recent_global"):
        caches = attach(model, cache_args(name, str(BUDGET)))
        with torch.inference_mode():
            model.reset_caches()
            prefill(model, ids[:, :PROMPT])
        kept[name] = held_positions(caches[0])[0]
    assert kept["sepllm"] != kept["recent_global"]


def test_the_bundled_tokenizers_separators_are_sepllms(bundled):
    _, tokenizer = bundled
    separator = token_classes(tokenizer, tokenizer.vocab_size)["separator"]

    def is_separator(text: str) -> bool:
        (token,) = tokenizer.encode(text)
        return bool(separator[token])

    for text in (".", ",", "?", "!", ";", ":", "\n", " ", "\n\n"):
        assert is_separator(text), repr(text)
    for text in ("a", "(", "-", "the", "1"):
        assert not is_separator(text), repr(text)
    assert not separator[tokenizer.special_token_ids()].any()
