"""lacache (LaCache's ladder, arXiv 2507.14204) against a naive implementation written from its definition: the
ladder's shape from the authors' arithmetic (blocks of `before` old tokens, each layer keeping the `after` from
offset layer mod (before − after + 1)), and their iterative compaction as a cursor over the held positions: when
the cache is over its budget, the next block past the cursor loses what the layer does not keep there, one token a
step, oldest first; when no whole block of tokens outside the recent window is left past the cursor, the cursor
starts over from the sinks. Replayed over whole runs (prompt compressed, then every decode step) in every layer
of 2- and 4-layer models and three ladders, and chunk by chunk; the layers must differ (the ladder) and cover more
together than one alone; bad ladders are refused with one error line."""

from __future__ import annotations

import math

import pytest
import torch

import generate
from errors import UserError, run_cli
from generate import chunked_prefill, decode_one_token
from strategies.lacache import eviction_steps
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids

BUDGET = 12


def naive_ladder(n_layers: int, span: int, overlap: int, layer: int) -> tuple[int, int, int]:
    """(before, after, offset) of this layer's ladder."""
    before = 1 + math.ceil((n_layers - span) / (span - overlap))
    after = min(math.ceil(span / (span - overlap)), before)
    return before, after, layer % (before - after + 1)


def naive_sweep(ladder: tuple[int, int, int], total: int, budget: int = BUDGET, sinks: int = GLOBAL,
                window: int = RECENT) -> tuple[list[set[int]], dict, int]:
    """Tokens fed one at a time: the held positions after each, each position's eviction step, and how many
    times the cursor started over with compacted tokens behind it."""
    before, after, offset = ladder
    held, cursor, drops, evicted, restarts, trace = [], sinks - 1, [], {}, 0, []
    for t in range(total):
        held.append(t)
        if len(held) > budget:
            if not drops:
                ahead = [p for p in held if p > cursor and p >= sinks]
                if not (len(ahead) >= before and ahead[before - 1] <= t - window):
                    restarts += cursor >= sinks
                    cursor = sinks - 1
                    ahead = [p for p in held if p >= sinks]
                whole = len(ahead) >= before and ahead[before - 1] <= t - window
                block = ahead[:before] if whole else [p for p in ahead if p <= t - window]
                kept = block[offset : offset + after]
                if len(kept) == len(block):
                    kept = block[1:]
                drops, cursor = [p for p in block if p not in kept], block[-1]
            victim = drops.pop(0)
            held.remove(victim)
            evicted[victim] = t
        trace.append(set(held))
    return trace, evicted, restarts


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
    for layer in range(n_layer):
        trace, _, restarts = naive_sweep(naive_ladder(n_layer, naive_span, naive_overlap, layer), TOTAL)
        assert [step[layer] for step in ours] == trace[PROMPT - 1 :], layer
        assert restarts >= 1  # the sweep laddered compacted tokens again
    assert all(len(set(map(frozenset, held_positions(c)))) == 1 for c in caches)  # every head of a layer alike


@pytest.mark.parametrize("chunk", [5, 9])
def test_a_chunked_prefill_keeps_what_the_token_by_token_sweep_holds_after_every_chunk(chunk):
    model = make_tiny_model()
    caches = attach(model, cache_args("lacache", str(BUDGET), "dense", "--prefill_chunk", str(chunk)))
    ids = token_ids()
    with torch.inference_mode():
        for n in range(chunk, PROMPT + chunk, chunk):  # the same prompt cut after each chunk
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            for layer in range(2):
                trace, _, _ = naive_sweep(naive_ladder(2, 1, 0, layer), min(n, PROMPT))
                assert held_positions(caches[layer])[0] == trace[-1], (n, layer)


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
    assert len(set().union(*layers)) > BUDGET


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
    caches = attach(model, cache_args("lacache", str(BUDGET)))
    ours = []
    with torch.inference_mode():
        run(model, token_ids(), decode_one_token, lambda p: ours.append(held_positions(caches[0])[0]))
    assert ours == naive_sweep((2, 1, 0), TOTAL)[0][PROMPT - 1 :]  # blocks of 2, the first kept
    with pytest.raises(UserError, match="keeps every token in every layer"):
        attach(model, cache_args("lacache", str(BUDGET), "dense", "--lacache_span", "1"))


LADDER_SHAPES = [(2, 1, 0), (2, 1, 1), (3, 2, 0), (3, 2, 1)] + [(4, 1, offset) for offset in range(4)]


@pytest.mark.parametrize("sinks,window", [(GLOBAL, RECENT), (0, 1), (4, 10)])
@pytest.mark.parametrize("ladder", LADDER_SHAPES)
def test_the_eviction_steps_are_the_naive_sweeps_at_every_budget(ladder, sinks, window):
    """The table the cache ranks by, against the naive sweep, down to budgets with no whole block outside the
    window (a short block at each start-over), with and without sinks."""
    total = 60
    for budget in range(sinks + window + 1, 30):
        steps = eviction_steps(total, budget, sinks, window, *ladder).tolist()
        _, evicted, _ = naive_sweep(ladder, total, budget, sinks, window)
        assert {p: int(s) for p, s in enumerate(steps) if s < total} == evicted, budget
        assert sorted(range(total), key=lambda p: steps[p])[total - sinks :] == list(range(sinks))  # sinks last


def test_the_kvpress_protocols_prompt_budget_is_the_sweeps_budget():
    """A prompt compressed to a smaller prompt budget (the kvpress protocols; nothing evicted after it) keeps what
    the sweep into that budget holds."""
    model = make_tiny_model()
    caches = attach(model, cache_args("lacache", str(8 + TOTAL - PROMPT)))  # slots for the prompt's 8 and the rest
    for c in caches:
        c.configure(evicts_after_prompt=False, prompt_budget=8)
    ours = []
    with torch.inference_mode():
        run(model, token_ids(), decode_one_token, lambda p: ours.append([held_positions(c)[0] for c in caches]))
    for layer in range(2):
        prompt_kept = naive_sweep(naive_ladder(2, 1, 0, layer), PROMPT, budget=8)[0][-1]
        assert ours[0][layer] == prompt_kept
        assert ours[-1][layer] == prompt_kept | set(range(PROMPT, TOTAL))  # the rest appended, nothing evicted


def test_the_ladder_spreads_over_the_layers_that_hold_lacache():
    """With a per-layer pattern (or a model's sliding layers) only some layers are lacache: the rungs and the
    ladder's shape count those layers, so every other layer of `repeat` (0 and 2 of 4) takes rungs 0 and 1."""
    model = make_tiny_model(n_layer=4)
    caches = attach(model, cache_args("lacache", str(BUDGET), "dense", "--cache_strategy", "lacache", "recent_global",
                                      "--cache_strategy_pattern", "repeat"))
    assert [type(c).name for c in caches] == ["lacache", "recent_global"] * 2
    ours = []
    with torch.inference_mode():
        run(model, token_ids(), decode_one_token, lambda p: ours.append([held_positions(caches[i])[0] for i in (0, 2)]))
    for rung, layer in enumerate((0, 2)):
        assert [step[rung] for step in ours] == naive_sweep((2, 1, rung), TOTAL)[0][PROMPT - 1 :], layer
