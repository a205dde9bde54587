"""One matrix over the strategy registry: every registered strategy (and its debug_ shadow) ×
{unquantized, 4-bit per token, 4-bit KIVI} storage and {fraction, absolute} budgets, eager, and compiled on
two of those cases, checked after every step.

A strategy joins this matrix the moment it is registered. Invariants are checked on every layer;
oracles (naive re-computations written here) on layer 0, whose keys do not depend on what earlier
layers kept, so they can be compared with a full-cache reference run.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from cache import KVCache
from generate import compile_decode_step, decode_one_token, prefill
from rope import apply_rope
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    ALL,
    BUDGETS,
    COMPILED_CASES,
    GLOBAL,
    PROMPT,
    RECENT,
    STORAGE_BUDGETS,
    STRATEGIES,
    TOKEN_CLASSES,
    TOTAL,
    TRAIT_REPRESENTATIVES,
    attach,
    cache_args,
    held_positions,
    inner,
    run,
    token_ids,
)


def reference_kv(model, ids):
    """Layer-0 keys and values of every position [H, TOTAL, D], from a full-cache run."""
    attach(model, cache_args("full", "1.0"))
    with torch.inference_mode():
        run(model, ids, decode_one_token, lambda p: None)
    c = model.layers[0].attention.kv_cache
    return c.keys()[0, :, :TOTAL].clone(), c.values()[0, :, :TOTAL].clone()


def layer0_queries(model, ids) -> torch.Tensor:
    """Layer-0 queries after RoPE, [n_head, TOTAL, D] (they depend only on the token embeddings)."""
    layer = model.layers[0]
    with torch.inference_mode():
        h = layer.attention_norm(model.tok_embeddings(ids))
        q = layer.attention.wq(h).view(1, TOTAL, model.args.n_head, model.args.head_dim).transpose(1, 2)
        return apply_rope(q, model.rope_cos[:TOTAL], model.rope_sin[:TOTAL])[0]


def naive_probs(q: torch.Tensor, keys: torch.Tensor, positions: list[int], n_kv: int) -> dict[int, torch.Tensor]:
    """Softmax of each query head over `positions`, averaged over the heads of each KV group: {pos: [n_kv]}."""
    rep = q.shape[0] // n_kv
    out = {p: torch.zeros(n_kv) for p in positions}
    for head in range(q.shape[0]):
        g = head // rep
        scores = torch.stack([q[head] @ keys[g, p] / math.sqrt(q.shape[-1]) for p in positions])
        for p, a in zip(positions, torch.softmax(scores, 0), strict=True):
            out[p][g] += a / rep
    return out


def check_invariants(caches: list[KVCache], p: int, ref_k, ref_v, storage: str) -> None:
    for layer, cache in enumerate(caches):
        c = inner(cache)
        for h, held in enumerate(held_positions(cache)):
            budget = int(c.head_budgets()[0, h])  # the layer budget, or the head's quota of a pooled cache
            assert len(held) <= budget, f"layer {layer} head {h} holds {len(held)} > {budget}"
            assert all(0 <= x <= p for x in held)
            if "global_tokens" in c.hyperparameters:
                assert set(range(GLOBAL)) <= held, f"global tokens evicted at step {p}"
            if "recent_window" in c.hyperparameters:
                assert set(range(p - RECENT + 1, p + 1)) <= held, f"recent window evicted at step {p}"
            if c.name == "full" or budget >= TOTAL:
                assert held == set(range(p + 1))
        pos = c.pos[0].expand(c.n_kv_heads, -1)
        mask = c.mask[0, :, 0]
        assert torch.equal(mask, pos >= 0), "mask and pos disagree"
        keys, values = c.keys(), c.values()
        assert torch.isfinite(keys).all() and torch.isfinite(values).all()
        if layer == 0:  # K/V in each held slot are those of the token at that position
            atol = 1e-5 if storage == "dense" else 0.2 * (ref_k.abs().max().item() + 1)
            for h in range(c.n_kv_heads):
                slots = mask[h].nonzero().flatten()
                kv = min(h, keys.shape[1] - 1)  # a pooled cache (budget_allocation.py) holds every head in one pool
                if not c.merges_keys:  # a merging cache's keys and values are checked against its oracle (test_d2o)
                    torch.testing.assert_close(keys[0, kv, slots], ref_k[h, pos[h, slots]], atol=atol, rtol=0)
                if not c.merges_values:  # (test_cam, test_d2o)
                    torch.testing.assert_close(values[0, kv, slots], ref_v[h, pos[h, slots]], atol=atol, rtol=0)


@pytest.mark.parametrize(("storage", "budget"), STORAGE_BUDGETS)
@pytest.mark.parametrize("strategy", ALL)
def test_matrix_eager(strategy, storage, budget):
    model = make_tiny_model()
    ids = token_ids()
    ref_k, ref_v = reference_kv(model, ids)
    caches = attach(model, cache_args(strategy, BUDGETS[budget], storage))
    with torch.inference_mode():
        run(model, ids, decode_one_token, lambda p: check_invariants(caches, p, ref_k, ref_v, storage))
    if budget == "absolute" and not strategy.endswith("full") and strategy != "hybrid":
        assert max(len(h) for h in held_positions(caches[0])) == 16  # the budget is really used


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "storage", "budget", "backend"), COMPILED_CASES)
def test_matrix_compiled_no_recompilation(strategy, storage, budget, backend):
    """Compiled decode equals eager decode step for step, with one graph and no recompilation. Prepared
    before the prompt as generate.py prepares it, so every step after the first runs with dynamo's guard
    evaluation skipped (CompiledDecodeStep): a cache whose decode changed what a guard reads would show here."""
    assert_compiled_equals_eager(cache_args(strategy, BUDGETS[budget], storage), storage, backend)


def assert_compiled_equals_eager(args, storage: str = "dense", backend: str = "inductor") -> None:
    """test_matrix_compiled_no_recompilation's check for any cache flags (one layer)."""
    model = make_tiny_model(n_layer=1)
    ids = token_ids()
    ref_k, ref_v = reference_kv(model, ids)
    attach(model, args)
    eager_held = []
    layer0 = model.layers[0].attention
    with torch.inference_mode():
        run(model, ids, decode_one_token, lambda p: eager_held.append(held_positions(layer0.kv_cache)))
    caches = attach(model, args)
    compiled_held = []
    torch._dynamo.reset()
    step = compile_decode_step(backend=backend)
    with torch.inference_mode():
        step.prepare(model)

    def check(p: int) -> None:
        compiled_held.append(held_positions(caches[0]))
        check_invariants(caches, p, ref_k, ref_v, storage)

    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        run(model, ids, step, check)
    assert compiled_held == eager_held


@pytest.mark.slow
@pytest.mark.parametrize("strategy", TRAIT_REPRESENTATIVES)
def test_whole_step_compiled_equals_eager(strategy):
    """`--compile_scope step` (the whole step as one graph: embedding, layer, head) keeps the eager step's
    positions at every step and its logits (float32, atol 1e-4), with one graph over the whole run. One layer:
    past the first, a strategy ranking near-equal scores (l2's key norms) may break a near tie differently
    once the fused graph rounds a layer's output differently (seen with two layers). One strategy per set of
    traits: what the step adds around a block (the embedding, the layer loop, the head) is the same code for
    every strategy of a set, whose blocks the compiled matrix compiles each."""
    model = make_tiny_model(n_layer=1)
    with torch.inference_mode():  # the tokens an inference loop feeds (prepare's are inference tensors too)
        ids = token_ids().clone()
    args = cache_args(strategy, BUDGETS["fraction"])
    runs = []
    for step in (decode_one_token, compile_decode_step(scope="step")):
        caches = attach(model, args)
        held, logits = [], []
        counters.clear()
        torch._dynamo.reset()
        if step is not decode_one_token:  # as generate.py: guards skipped after the first step (CompiledDecodeStep)
            with torch.inference_mode():
                step.prepare(model)

        def recording(m, token, pos, step=step, logits=logits):
            logits.append(step(m, token, pos))
            return logits[-1]

        with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
            run(model, ids, recording, lambda p, caches=caches, held=held: held.append(
                [held_positions(c) for c in caches]))
        runs.append((held, torch.cat(logits), counters["stats"]["unique_graphs"]))
    (eager_held, eager_logits, _), (compiled_held, compiled_logits, graphs) = runs
    assert compiled_held == eager_held
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert graphs == 1


# ---- per-strategy oracles (layer 0, unquantized) ----------------------------------------------------------


def evictions(strategy: str, budget: str = "16", *extra: str, seed: int = 0):
    """Yields (p, held_before, held_after) per head for each decode step on layer 0."""
    model = make_tiny_model(seed=seed)
    ids = token_ids(seed)
    caches = attach(model, cache_args(strategy, budget, "dense", *extra))
    history = []
    with torch.inference_mode():
        run(model, ids, decode_one_token, lambda p: history.append((p, held_positions(caches[0]))))
    return model, ids, [(p, before, after) for (_, before), (p, after) in zip(history, history[1:], strict=False)]


def test_recent_global_keeps_first_g_and_last_l_minus_g():
    _, _, steps = evictions("recent_global")
    for p, _, after in steps:
        for held in after:
            if p + 1 > 16:
                assert held == set(range(GLOBAL)) | set(range(p + 1 - (16 - GLOBAL), p + 1))


def unprotected(held: set[int], p: int) -> set[int]:
    return {x for x in held if x >= GLOBAL and x <= p - RECENT}


def test_l2_evicts_the_largest_norm_key():
    """The evicted key has the largest norm among the unprotected ones; a token repeated in the sequence has
    the same norm at every position (RoPE keeps norms) up to how its key's product rounded (the prompt's
    matrix product, a decode step's kernel), so keys within 1e-6 of the largest count as tied."""
    model, ids, steps = evictions("l2")
    ref_k, _ = reference_kv(model, ids)
    checked = 0
    for p, before, after in steps:
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            if len(b) == 16:
                evicted = b - a
                norms = {x: ref_k[h, x].norm().item() for x in unprotected(b, p)}
                largest = max(norms.values())
                assert len(evicted) == 1 and norms[next(iter(evicted))] >= largest * (1 - 1e-6), (p, h, evicted)
                checked += 1
    assert checked > 0


def test_keep_it_odd_evicts_even_positions_first():
    _, _, steps = evictions("keep_it_odd")
    for p, before, after in steps:
        for b, a in zip(before, after, strict=True):
            if len(b) == 16:
                assert b - a == {min(unprotected(b, p), key=lambda x: (x % 2, x))}


def test_random_is_reproducible_for_a_seed():
    runs = [evictions("random", "16", "--seed", str(s))[2] for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize("extra", [(), ("--attn_thresholding",), ("--history_window_size", "4")],
                         ids=["sum", "thresholding", "window4"])
def test_heavy_hitter_evicts_the_argmin_of_naive_average_attention(extra):
    """A naive H2O: accumulate each token's attention (or its count of ≥-uniform steps) since it entered,
    from the prompt's causal attention and each step's attention over the held tokens."""
    model, ids, steps = evictions("heavy_hitter", "20", *extra)
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    n_kv = model.args.n_kv_head
    window = int(extra[1]) if extra[:1] == ("--history_window_size",) else 1
    thresholding = extra == ("--attn_thresholding",)
    history: dict[int, list[torch.Tensor]] = {x: [] for x in range(TOTAL)}  # per position: per-step [n_kv]

    def observe(positions_per_head: list[set[int]], query: int) -> None:
        for h, held in enumerate(positions_per_head):
            positions = sorted(held)
            probs = naive_probs(q[:, query], ref_k, positions, n_kv)
            for x in positions:
                a = probs[x][h]
                value = float(a >= 1.0 / len(positions)) if thresholding else float(a)
                history[x].append((query, h, value))

    for i in range(PROMPT):  # the prompt's causal attention seeds the history
        observe([set(range(i + 1))] * n_kv, i)
    checked = 0
    for p, before, after in steps:
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            if len(b) == 20:
                def score(x: int, h: int = h) -> float:
                    values = [v for (_, hh, v) in history[x] if hh == h]
                    if window > 1:
                        values = values[-window:]
                    return sum(values) / max(1, len(values))
                scores = {x: score(x) for x in unprotected(b, p)}
                lowest = min(scores.values())
                ties = {x for x, v in scores.items() if v <= lowest + 1e-6}  # counts tie under thresholding
                evicted = b - a
                assert len(evicted) == 1 and evicted <= ties, f"step {p} head {h}: {evicted} not in {ties}"
                checked += 1
        observe(after, p)
    assert checked > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_debug_attention_loss_equals_naive_retained_mass(strategy):
    model = make_tiny_model()
    ids = token_ids()
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    caches = attach(model, cache_args(f"debug_{strategy}", "16"))
    expected = {}

    def check(p: int) -> None:
        if p >= PROMPT:
            probs = naive_probs(q[:, p], ref_k, list(range(p + 1)), model.args.n_kv_head)
            held = held_positions(caches[0])
            expected[p] = [1 - sum(probs[x][h] for x in held[h]).item() for h in range(len(held))]

    with torch.inference_mode():
        run(model, ids, decode_one_token, check)
    measured = caches[0].loss_history[0]
    for p, losses in expected.items():
        torch.testing.assert_close(measured[:, p], torch.tensor(losses), atol=1e-5, rtol=0)
    if strategy == "full":
        assert max(max(v) for v in expected.values()) < 1e-6
    else:
        assert caches[0].extra_statistics()["attention_loss"].mean() > 0


def test_full_cache_reproduces_the_no_cache_logits():
    model = make_tiny_model()
    ids = token_ids()
    with torch.inference_mode():
        reference = model(ids, torch.arange(TOTAL))[0, PROMPT - 1 :]
        attach(model, cache_args("full", "1.0"))
        rows = []
        model.reset_caches()
        rows.append(prefill(model, ids[:, :PROMPT])[0])
        for p in range(PROMPT, TOTAL):
            rows.append(decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]))[0])
    torch.testing.assert_close(torch.stack(rows)[:-1], reference[:-1], atol=1e-4, rtol=1e-4)


def test_hybrid_heads_pick_the_first_policy_that_recovers_enough_and_hold_different_counts():
    model = make_tiny_model(seed=2)
    ids = token_ids(2)
    ids[0, ::5] = 1  # some special tokens
    ids[0, 2::7] = 10  # and punctuation
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    caches = attach(model, cache_args("hybrid", "1.0", "dense", "--min_recovery_frac", "0.6"))
    with torch.inference_mode():
        run(model, ids, decode_one_token, lambda p: None)
    cache = caches[0]
    # Naive profile of layer 0: the prompt's attention map, query by query (FastGen, arXiv 2310.01801).
    attn = torch.zeros(model.args.n_kv_head, PROMPT, PROMPT)
    for i in range(PROMPT):
        for x, a in naive_probs(q[:, i], ref_k, list(range(i + 1)), model.args.n_kv_head).items():
            attn[:, i, x] = a
    received = attn.sum(1)
    special = TOKEN_CLASSES["special"][ids[0, :PROMPT]]
    punct = TOKEN_CLASSES["punct"][ids[0, :PROMPT]]
    # Locality is relative to each query: query i keeps the keys j with i - j < ceil(0.3 (i + 1)).
    rows, cols = torch.arange(PROMPT)[:, None], torch.arange(PROMPT)
    window = (rows - cols >= 0) & (rows - cols < torch.ceil(0.3 * (rows + 1)))
    for h in range(model.args.n_kv_head):
        k_heavy = math.ceil(0.3 * PROMPT)
        frequent = received[h] >= received[h].topk(k_heavy).values[-1]
        columns = {"special": special, "punct": punct, "frequent": frequent,
                   "full": torch.ones(PROMPT, dtype=torch.bool)}
        for index, policy in enumerate(cache.policies):
            kept = torch.zeros(PROMPT, PROMPT, dtype=torch.bool)
            for c in policy:
                kept |= window if c == "local" else columns[c].expand(PROMPT, PROMPT)
            if (attn[h] * kept).sum() >= 0.6 * attn[h].sum() or index == len(cache.policies) - 1:
                assert cache.policy[0, h].item() == index
                break
    held = [len(h) for h in held_positions(cache)]
    assert all(n <= cache.max_cache_length for n in held)
    policies = cache.policy[0].tolist()
    if len(set(policies)) > 1:
        assert len(set(held)) > 1, "heads with different policies should hold different numbers of tokens"
