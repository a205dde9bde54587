"""lacache (LaCache's ladder, arXiv 2507.14204) against a naive implementation written from its definition, with
lists as the authors' code cuts them: the old tokens (after the sinks) in blocks of `before`, each layer keeping
the `after` of each block from offset layer mod (before − after + 1), the survivors cut again by the same rule;
a token's level is the pass that drops it, and a full cache evicts the lowest level, the oldest first. Replayed
over whole runs (prompt compressed, then every decode step) in every layer of 2- and 4-layer models and three
ladders, and chunk by chunk; the layers must differ (the ladder) and cover more together than one alone; bad
ladders are refused with one error line."""

from __future__ import annotations

import math

import pytest
import torch

import generate
from errors import UserError, run_cli
from generate import chunked_prefill, decode_one_token
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids

BUDGET = 12
PERMANENT = 1 << 30


def naive_levels(n_layers: int, span: int, overlap: int, layer: int, tokens: list[int]) -> dict[int, int]:
    """Each token's level in this layer's ladder: the pass that drops it (PERMANENT if none does)."""
    before = 1 + math.ceil((n_layers - span) / (span - overlap))
    after = min(math.ceil(span / (span - overlap)), before)
    offset = layer % (before - after + 1)
    level, current, step = {}, list(tokens), 1
    while True:
        blocks = [current[i : i + before] for i in range(0, len(current), before)]
        kept = [block[j] for block in blocks for j in range(offset, offset + after) if j < len(block)]
        for p in set(current) - set(kept):
            level[p] = step
        if kept == current:
            return level | dict.fromkeys(current, PERMANENT)
        current, step = kept, step + 1


def naive_keep(candidates: list[int], level: dict[int, int], budget: int) -> list[int]:
    """The sinks and the RECENT newest of `candidates`, then the highest levels, the newest first in each."""
    n = len(candidates)
    protected = set(candidates[:GLOBAL]) | set(candidates[n - RECENT :])
    order = sorted(candidates, key=lambda p: (p not in protected, -level.get(p, PERMANENT), -p))
    return sorted(order[:budget])


def naive_run(level: dict[int, int]) -> list[set[int]]:
    """Held positions after the prefill and after each decode step."""
    held = naive_keep(list(range(PROMPT)), level, BUDGET)
    trace = [set(held)]
    for p in range(PROMPT, TOTAL):
        if len(held) == BUDGET:
            held.remove(min((x for x in held if GLOBAL <= x <= p - RECENT), key=lambda x: (level[x], x)))
        held = sorted([*held, p])
        trace.append(set(held))
    return trace


LADDERS = [(2, None, None, 1, 0),  # the default span on 2 layers: 1 → blocks of 2, one kept (offsets 0, 1)
           (4, "1", None, 1, 0),  # blocks of 4, one kept: four rungs
           (4, "2", "1", 2, 1)]  # overlap: blocks of 3, two consecutive kept (offsets 0, 1)


def ladder_flags(span: str | None, overlap: str | None) -> list[str]:
    return [*(["--lacache_span", span] if span else []), *(["--lacache_overlap", overlap] if overlap else [])]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n_layer,span,overlap,naive_span,naive_overlap", LADDERS)
def test_lacache_keeps_what_the_naive_ladder_keeps_over_a_whole_run(n_layer, span, overlap, naive_span,
                                                                     naive_overlap, seed):
    model = make_tiny_model(seed, n_layer=n_layer)
    caches = attach(model, cache_args("lacache", str(BUDGET), "dense", *ladder_flags(span, overlap)))
    ours: list[list[set[int]]] = []
    with torch.inference_mode():
        run(model, token_ids(seed), decode_one_token, lambda p: ours.append([held_positions(c)[0] for c in caches]))
    levels_seen = set()
    for layer in range(n_layer):
        level = naive_levels(n_layer, naive_span, naive_overlap, layer, list(range(GLOBAL, TOTAL)))
        expected = naive_run(level)
        assert [step[layer] for step in ours] == expected, layer
        levels_seen |= {level[p] for p in set(range(GLOBAL, TOTAL)) - expected[-1]}
    assert {1, 2} <= levels_seen  # the run evicted on the first ladder and on a later pass
    assert all(len(set(map(frozenset, held_positions(c)))) == 1 for c in caches)  # every head of a layer alike


@pytest.mark.parametrize("chunk", [5, 9])
def test_a_chunked_prefill_keeps_the_naive_choice_after_every_chunk(chunk):
    model = make_tiny_model()
    caches = attach(model, cache_args("lacache", str(BUDGET), "dense", "--prefill_chunk", str(chunk)))
    ids = token_ids()
    held = [[], []]
    with torch.inference_mode():
        for n in range(chunk, PROMPT + chunk, chunk):  # the same prompt cut after each chunk
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            for layer in range(2):
                level = naive_levels(2, 1, 0, layer, list(range(GLOBAL, TOTAL)))
                candidates = held[layer] + list(range(n - chunk, min(n, PROMPT)))
                held[layer] = candidates if len(candidates) <= BUDGET else naive_keep(candidates, level, BUDGET)
                assert held_positions(caches[layer])[0] == set(held[layer]), (n, layer)


def test_the_layers_hold_different_rungs_and_cover_more_together():
    """The ladder is what decides: layers differ from each other and from recent_global, and together they
    hold more of the past than one layer does."""
    model = make_tiny_model(n_layer=4)
    ids = token_ids()
    held = {}
    for name, flags in (("lacache", ["--lacache_span", "1"]), ("recent_global", [])):
        caches = attach(model, cache_args(name, str(BUDGET), "dense", *flags))
        with torch.inference_mode():
            run(model, ids, decode_one_token, lambda p: None)
        held[name] = [held_positions(c)[0] for c in caches]
    layers = held["lacache"]
    assert len(set(map(frozenset, layers))) == 4 and layers[0] != held["recent_global"][0]
    assert len(set().union(*layers)) > BUDGET + 6


@pytest.mark.parametrize("flags,message", [
    (["--lacache_span", "2"], "keeps every token in every layer"),  # the tiny checkpoint has 2 layers
    (["--lacache_span", "1", "--lacache_overlap", "1"], "must be below --lacache_span"),
    (["--cache_strategy", "heavy_hitter", "--prompt_compression_strategy", "lacache"], "only a lacache cache holds"),
])
def test_bad_ladders_get_one_error_line_and_exit_2(flags, message, tiny_dir, capsys, tmp_path):
    stats = tmp_path / "stats.json"
    with pytest.raises(SystemExit) as exit_:
        run_cli(generate.main, ["--checkpoint_path", str(tiny_dir), "--prompt", "hello there", "--max_new_tokens",
                                "2", "--stats_json", str(stats), "--cache_strategy", "lacache", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not stats.exists()


def test_a_one_layer_model_gets_the_smallest_ladder_unless_a_span_is_given():
    model = make_tiny_model(n_layer=1)
    (cache,) = attach(model, cache_args("lacache", str(BUDGET)))
    level = naive_levels(2, 1, 0, 0, list(range(GLOBAL, TOTAL)))  # blocks of 2, one kept
    expected = sorted(range(TOTAL), key=lambda p: (p >= GLOBAL, -level.get(p, PERMANENT), -p), reverse=True)
    assert cache.ladder_rank.argsort().tolist() == expected
    with pytest.raises(UserError, match="keeps every token in every layer"):
        attach(model, cache_args("lacache", str(BUDGET), "dense", "--lacache_span", "1"))
