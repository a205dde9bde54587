"""Naive CaM: a whole run re-played here from the definition with plain loops over layer 0 (float64; the
layer-0 keys, values and queries of a full-cache run, which depend on the token ids only): the cumulative
attention A of every held token per KV head (the prompt's queries included), the eviction of the lowest average
A / (queries that saw it) over heads (H2O's score), and each head's merge of the evicted value into its window
with probability min(1, D_e / mean D of the window), D the attention received since decoding began. Compared at
every step with what the cache holds: the positions, and the values of every held slot (within 1e-5), which
merging changes (budget 16 of a 24-token prompt + 16 new tokens, 2 sinks, a 4-token recent window)."""

from __future__ import annotations

import math

import pytest
import torch

from generate import decode_one_token
from prompt_compression import hashed_scores
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids
from tests.test_strategies import layer0_queries, naive_probs, reference_kv

BUDGET = 16


def naive_prompt_attention(q: torch.Tensor, keys: torch.Tensor) -> list[dict[int, float]]:
    """A after the prompt: the attention each prompt key received from every prompt query at or after it (each
    query's softmax over keys 0..t), averaged over the KV group's query heads: per KV head {position: A}."""
    n_kv = keys.shape[0]
    received = [dict.fromkeys(range(PROMPT), 0.0) for _ in range(n_kv)]
    for t in range(PROMPT):
        for pos, a in naive_probs(q[:, t].double(), keys.double(), list(range(t + 1)), n_kv).items():
            for h in range(n_kv):
                received[h][pos] += float(a[h])
    return received


def uniform_draw(position: int, head: int) -> float:
    """The merge's Bernoulli draw (seed 0, layer 0): the cache's hashed uniform, the random source both share."""
    return float(hashed_scores(torch.tensor(position), torch.tensor(head), 0)) / 2**32


def naive_cam(model, ids, window: int) -> tuple[list[tuple[set[int], list[dict[int, torch.Tensor]]]], int]:
    """The held positions and the values by position per head after the prefill and each decode step, and
    the number of merges."""
    ref_k, ref_v = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    n_kv = ref_k.shape[0]
    attn = naive_prompt_attention(q, ref_k)
    protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
    steps = {x: PROMPT - x for x in range(PROMPT)}  # the queries that saw each token

    def average(x: int) -> float:
        return sum(attn[h][x] for h in range(n_kv)) / max(steps[x], 1)

    others = sorted(set(range(PROMPT)) - protected, key=lambda x: -average(x))
    held = protected | set(others[: BUDGET - len(protected)])
    values = [{x: ref_v[h, x].double() for x in range(TOTAL)} for h in range(n_kv)]
    decoded = [dict.fromkeys(held, 0.0) for _ in range(n_kv)]  # D: the attention received since decoding began
    trace, merges = [(set(held), [dict(v) for v in values])], 0
    for p in range(PROMPT, TOTAL):
        if len(held) == BUDGET:
            candidates = [x for x in held if GLOBAL <= x <= p - RECENT]
            evicted = min(candidates, key=average)
            held.remove(evicted)
            for h in range(n_kv):
                after = sorted(x for x in held if x > evicted)[:window]
                targets = after + [p] if len(after) < window else after
                mean = sum(decoded[h].get(x, 0.0) for x in targets) / len(targets)  # the incoming token's: 0
                a = decoded[h][evicted]
                chance = min(1.0, a / mean) if mean > 0 else float(a > 0)
                if uniform_draw(evicted, h) < chance:
                    merges += 1
                    for x in targets:
                        values[h][x] = values[h][x] + values[h][evicted] / len(targets)
        held.add(p)
        steps[p] = 0
        for h in range(n_kv):
            attn[h][p] = decoded[h][p] = 0.0
        for x in held:
            steps[x] += 1
        for pos, a in naive_probs(q[:, p].double(), ref_k.double(), sorted(held), n_kv).items():
            for h in range(n_kv):
                attn[h][pos] += float(a[h])
                decoded[h][pos] = decoded[h].get(pos, 0.0) + float(a[h])
        trace.append((set(held), [dict(v) for v in values]))
    return trace, merges


def cache_run(window: int, *extra: str) -> tuple[object, torch.Tensor, list]:
    """The cam cache's held positions and held values by position (layer 0) after the prefill and each step."""
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("cam", str(BUDGET), "dense", "--cam_merge_window", str(window), *extra))
    trace = []

    def record(p: int) -> None:
        c = caches[0]
        pos, vals = c.pos[0, 0].tolist(), c.values()[0].double()
        trace.append((held_positions(c), [{x: vals[h, s] for s, x in enumerate(pos) if x >= 0}
                                          for h in range(c.n_kv_heads)]))

    with torch.inference_mode():
        run(model, ids, decode_one_token, record)
    return model, ids, trace


@pytest.mark.parametrize("window", [32, 3, 1])  # the default (every later token), a few, one
def test_cam_keeps_and_merges_as_the_naive_rule(window):
    model, ids, ours = cache_run(window)
    expected, merges = naive_cam(model, ids, window)
    assert merges > 0
    for step, ((held, values), (want_held, want_values)) in enumerate(zip(ours, expected, strict=True)):
        for h, head_held in enumerate(held):
            assert head_held == want_held, f"step {step} head {h}"
            for x in head_held:
                torch.testing.assert_close(values[h][x], want_values[h][x], atol=1e-5, rtol=0,
                                           msg=lambda m, s=step, h=h, x=x: f"step {s} head {h} position {x}: {m}")


def test_without_merging_the_values_stay_the_tokens_own_and_the_evictions_the_same():
    """--cam_no_merge (the ablation): the same held positions at every step (eviction reads only A, which the
    values do not change at layer 0), every held value its token's own."""
    model, ids, merging = cache_run(32)
    _, _, dropping = cache_run(32, "--cam_no_merge")
    _, ref_v = reference_kv(model, ids)
    assert [held for held, _ in merging] == [held for held, _ in dropping]
    for held, values in dropping:
        for h, head_held in enumerate(held):
            for x in head_held:
                torch.testing.assert_close(values[h][x], ref_v[h, x].double(), atol=1e-6, rtol=0)


def test_a_merge_can_be_declined():
    """With the default window not every eviction merges in every head: the probability is below one for a
    token that received less attention than its window's mean."""
    model, ids, _ = cache_run(32)
    _, merges = naive_cam(model, ids, 32)
    evictions = (TOTAL - PROMPT) * model.args.n_kv_head
    assert 0 < merges < evictions


def test_merge_probability_follows_the_press_for_a_zero_mean():
    from strategies.cam import merge_probability

    evicted = torch.tensor([0.0, 0.5, 0.2, 3.0])
    mean = torch.tensor([0.0, 0.0, 0.4, 1.0])
    assert merge_probability(evicted, mean).tolist() == [0.0, 1.0, 0.5, 1.0]
    assert math.isclose(uniform_draw(5, 1), uniform_draw(5, 1)) and uniform_draw(5, 1) != uniform_draw(5, 0)


@pytest.mark.parametrize("storage", ["dense", "4bit", "8bit", "kivi4", "think"])
def test_every_storage_adds_to_held_values(storage):
    """Storage.add_to_values: the targeted slots' values gain the delta (KIVI: slots in its residual and in
    its quantized store), the others are untouched; repeated slots with a zero delta change nothing. Within
    one quantization step of the new values' range where values are quantized."""
    model = make_tiny_model(n_layer=1)
    caches = attach(model, cache_args("cam", str(BUDGET), storage))
    with torch.inference_mode():
        model.reset_caches()
        model(token_ids()[:, :PROMPT], torch.arange(PROMPT))
        store = caches[0].storage
        before = store.values().clone()
        H, D = before.shape[1], before.shape[-1]
        # KIVI (residual 8): slot 1 quantized, 9 and 14 in the residual
        slots = torch.tensor([1, 9, 14, 3, 3]).view(1, 1, 5).expand(1, H, 5)
        delta = torch.randn(1, H, 5, D, generator=torch.Generator().manual_seed(0)) * 4
        delta[:, :, 3:] = 0
        store.add_to_values(slots.contiguous(), delta)
        after = store.values()
    expected = before.clone()
    expected[:, :, [1, 9, 14]] += delta[:, :, :3]
    bits = {"4bit": 4, "8bit": 8, "kivi4": 4}.get(storage)
    step = 0.0 if bits is None else float((expected.amax(-1) - expected.amin(-1)).max()) / (2**bits - 1)
    torch.testing.assert_close(after, expected, atol=step + 1e-5, rtol=0)
    untouched = [s for s in range(BUDGET) if s not in (1, 9, 14)]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched]), "a slot outside the targets changed"


def naive_chunked_cam(model, ids, chunk: int) -> list[set[int]]:
    """--prefill_chunk: the held tokens after each chunk. Each chunk's queries add their attention (over the held
    tokens and the chunk up to themselves) to A, which accumulates over the chunks; past the budget the sinks,
    the last RECENT tokens and the best others by A / (the queries that saw them), summed over heads, stay."""
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    n_kv = ref_k.shape[0]
    held, attn, history = [], [{} for _ in range(n_kv)], []
    for start in range(0, PROMPT, chunk):
        cand = held + list(range(start, min(start + chunk, PROMPT)))
        for t in cand[len(held):]:
            for pos, a in naive_probs(q[:, t].double(), ref_k.double(), [x for x in cand if x <= t], n_kv).items():
                for h in range(n_kv):
                    attn[h][pos] = attn[h].get(pos, 0.0) + float(a[h])
        if len(cand) > BUDGET:
            protected = set(cand[:GLOBAL]) | set(cand[-RECENT:])
            end = cand[-1] + 1  # every query from a token on saw it

            def average(x: int, end: int = end) -> float:
                return sum(attn[h][x] for h in range(n_kv)) / (end - x)

            others = sorted(set(cand) - protected, key=lambda x: -average(x))
            cand = sorted(protected | set(others[: BUDGET - len(protected)]))
        held = cand
        history.append(set(held))
    return history


@pytest.mark.parametrize("chunk", [5, 9])
def test_a_chunked_prefill_accumulates_attention_over_the_chunks(chunk):
    from generate import chunked_prefill

    model = make_tiny_model()
    ids = token_ids()
    expected = naive_chunked_cam(model, ids, chunk)  # before the caches: its reference run attaches full caches
    caches = attach(model, cache_args("cam", str(BUDGET), "dense", "--prefill_chunk", str(chunk)))
    with torch.inference_mode():
        for i, n in enumerate(range(chunk, PROMPT + chunk, chunk)):  # the same prompt cut after each chunk
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            assert held_positions(caches[0])[0] == expected[i], n
