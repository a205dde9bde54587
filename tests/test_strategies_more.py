"""Naive oracles of kvzip, lagkv and qfilters, each re-computed from its paper's definition with plain loops
(over queries, heads, channels, partitions) and compared with what the caches held after prefill and
after every decode step on the tiny model (a 24-token prompt + 16 new tokens, budget 16, 2 sinks and a
4-token recent window), and the scoring passes (KVzip's reconstruction, the Q-Filters calibration) with
an independent naive forward / numpy's SVD."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
import torch

from errors import UserError
from generate import decode_one_token, prefill
from rope import apply_rope
from strategies.kvzip import RepeatPrompts, reconstruction_scores, set_repeat_prompt, supply_reconstruction_scores
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids
from tests.test_strategies import assert_compiled_equals_eager, evictions, layer0_queries, reference_kv, unprotected
from tests.test_strategies_recent import BUDGET, assert_evicts_lowest, assert_prompt_kept_best

# ---- naive attention -------------------------------------------------------------------------------------------


def head_probs(q: torch.Tensor, keys: torch.Tensor, positions: list[int]) -> list[float]:
    """One query head's softmax over `positions` (q [D], keys [S, D]), as plain floats."""
    logits = [float(q @ keys[p]) / math.sqrt(q.shape[-1]) for p in positions]
    top = max(logits)
    exp = [math.exp(x - top) for x in logits]
    return [e / sum(exp) for e in exp]


def naive_forward_qk(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's queries [n_head, S, D] and keys [n_kv, S, D] (after RoPE) of a plain causal forward
    over ids [1, S], attention written out query by query."""
    a = model.args
    S, rep = ids.shape[1], a.n_head // a.n_kv_head
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    out = []
    with torch.inference_mode():
        x = model.tok_embeddings(ids)[0]
        for layer in model.layers:
            att = layer.attention
            h = layer.attention_norm(x)
            q = apply_rope(att.wq(h).view(S, a.n_head, a.head_dim).transpose(0, 1), cos, sin)
            k = apply_rope(att.wk(h).view(S, a.n_kv_head, a.head_dim).transpose(0, 1), cos, sin)
            v = att.wv(h).view(S, a.n_kv_head, a.head_dim).transpose(0, 1)
            out.append((q, k))
            y = torch.zeros(S, a.n_head, a.head_dim)
            for head in range(a.n_head):
                for i in range(S):
                    probs = head_probs(q[head, i], k[head // rep], list(range(i + 1)))
                    y[i, head] = sum(p * v[head // rep, j] for j, p in enumerate(probs))
            x = x + att.wo(y.reshape(S, -1))
            x = x + layer.feed_forward(layer.ffn_norm(x))
    return out


# ---- kvzip -----------------------------------------------------------------------------------------------------


def naive_kvzip_scores(model, context: list[int], prompts: tuple[list[int], list[int], list[int]] = ([], [], []),
                       chunk: int = 0) -> list[list[list[float]]]:
    """[layer][kv head][j], from kvpress's KVzipPress (score_kvzip, prepare): for each chunk [s, e) the model
    reads context + (the first prompt, or the later prompt + the previous chunk's last 8 tokens) + suffix +
    chunk; each query of that repeat input gives a softmax over the first min(4, s) tokens, the chunk and the
    repeat input up to itself; a chunk token's score is the max over those queries and the group's query heads
    (only its own chunk's pass scores it)."""
    first, later, suffix = prompts
    T, rep, step = len(context), model.args.n_head // model.args.n_kv_head, chunk or len(context)
    best = [[[0.0] * T for _ in range(model.args.n_kv_head)] for _ in model.layers]
    for start in range(0, T, step):
        end = min(start + step, T)
        head = first if start == 0 else (later + context[max(start - step, start - 8) : start] if later else [])
        sequence = context + head + suffix + context[start:end]
        for layer, (q, k) in enumerate(naive_forward_qk(model, torch.tensor([sequence]))):
            for h in range(model.args.n_head):
                g = h // rep
                for i in range(T, len(sequence)):
                    keys = list(range(min(4, start))) + list(range(start, end)) + list(range(T, i + 1))
                    for j, p in zip(keys, head_probs(q[h, i], k[g], keys), strict=True):
                        if start <= j < end:
                            best[layer][g][j] = max(best[layer][g][j], p)
    return best


@pytest.mark.parametrize("prompts", [([7, 8, 9], [5, 6], [2]), ([], [], [])])
@pytest.mark.parametrize(("chunk", "length"), [(0, 12), (5, 12), (3, 12), (4, 8)])
def test_kvzip_scores_are_the_max_attention_of_the_reconstruction_queries(chunk, length, prompts):
    """Chunks of 5 (12 tokens: a partial last chunk, the 4 sinks in the third pass), of 3 (a tail shorter
    than 8: the whole previous chunk) and of 4 in 8 tokens (the last chunk starts at the sinks' end, so nothing
    before it is left out of its softmax); the prompts' rows count as the repeated context's; without prompts
    (no tokenizer) every chunk follows the context directly."""
    model = make_tiny_model()
    context = token_ids()[0, :length].tolist()
    scores = reconstruction_scores(model, torch.tensor([context]), RepeatPrompts(*map(tuple, prompts)), chunk)
    naive = naive_kvzip_scores(model, context, prompts, chunk)
    for layer, (got, expected) in enumerate(zip(scores, naive, strict=True)):
        assert got.shape == (1, model.args.n_kv_head, length)
        assert torch.allclose(got[0], torch.tensor(expected), atol=1e-5), f"layer {layer}"
    assert model.caches() == [], "the scoring pass leaves the model's caches as they were"


def kvzip_decode_oracle(model, ids, initial: dict[int, list[float]]):
    """score(p, h, held, x): max(x's prompt score, the largest attention any query head of group h gave x at
    the decode steps since x was held (each step's softmax over what the head then held))."""
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    rep = model.args.n_head // model.args.n_kv_head
    running: dict[tuple[int, int], float] = {}
    seen_steps: set[tuple[int, int]] = set()

    def observe(p: int, h: int, held_after: set[int]) -> None:
        if (p, h) in seen_steps:
            return
        seen_steps.add((p, h))
        positions = sorted(held_after)
        for head in range(h * rep, (h + 1) * rep):
            for x, a in zip(positions, head_probs(q[head, p], ref_k[h], positions), strict=True):
                running[(h, x)] = max(running.get((h, x), 0.0), a)

    def score(p: int, h: int, held: set[int], x: int) -> float:
        base = initial[h][x] if x < PROMPT else 0.0
        return max(base, running.get((h, x), 0.0))

    return score, observe


def run_with_hook(strategy: str, *extra: str, hook: bool = True):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args(strategy, str(BUDGET), "dense", *extra))
    history = []
    with torch.inference_mode():
        model.reset_caches()
        if hook:
            supply_reconstruction_scores(model, ids[:, :PROMPT])
        # The forward itself, not generate.prefill (whose hook would run the pass without being asked).
        model(ids[:, :PROMPT], torch.arange(PROMPT), last_logits_only=True)
        history.append((PROMPT - 1, held_positions(caches[0])))
        for p in range(PROMPT, TOTAL):
            decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]))
            history.append((p, held_positions(caches[0])))
    steps = [(p, before, after) for (_, before), (p, after) in zip(history, history[1:], strict=False)]
    return model, ids, steps


def check_kvzip_decode(model, ids, steps, initial) -> int:
    score, observe = kvzip_decode_oracle(model, ids, initial)
    checked = 0
    for p, before, after in steps:
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            if len(b) == BUDGET:
                scores = {x: score(p, h, b, x) for x in unprotected(b, p)}
                ties = {x for x, v in scores.items() if v <= min(scores.values()) + 1e-6}
                assert len(b - a) == 1 and b - a <= ties, f"step {p} head {h}: {b - a} not in {ties}"
                checked += 1
            observe(p, h, a)
    return checked


def test_kvzip_keeps_the_best_reconstruction_scores_and_evicts_the_least_attended():
    # The unchunked pass (the shared matrices run it in chunks of 4: tests/strategy_matrix.MATRIX_FLAGS).
    model, ids, steps = run_with_hook("kvzip", "--kvzip_chunk", "0")
    naive = naive_kvzip_scores(model, ids[0, :PROMPT].tolist())[0]  # no tokenizer: context twice
    assert_prompt_kept_best(steps, lambda p, h, held, x: naive[h][x])
    assert check_kvzip_decode(model, ids, steps, naive) > 0


def test_kvzip_without_a_reconstruction_pass_scores_the_prompt_by_its_own_queries():
    model, ids, steps = run_with_hook("kvzip", hook=False)
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    rep = model.args.n_head // model.args.n_kv_head
    own = [[max(head_probs(q[head, i], ref_k[h], list(range(i + 1)))[x]
                for head in range(h * rep, (h + 1) * rep) for i in range(x, PROMPT))
            for x in range(PROMPT)] for h in range(model.args.n_kv_head)]
    assert_prompt_kept_best(steps, lambda p, h, held, x: own[h][x])
    assert check_kvzip_decode(model, ids, steps, own) > 0
    assert steps[0][1] != run_with_hook("kvzip", "--kvzip_chunk", "0")[2][0][1], \
        "the reconstruction should change what is kept"


def test_kvzip_scores_compress_another_strategys_prompt():
    model, ids, steps = run_with_hook("tova", "--prompt_compression_strategy", "kvzip")
    naive = naive_kvzip_scores(model, ids[0, :PROMPT].tolist())[0]
    assert_prompt_kept_best(steps, lambda p, h, held, x: naive[h][x])
    with torch.inference_mode():  # a prompt that fits: no pass, and the earlier prompt's scores are dropped
        supply_reconstruction_scores(model, ids[:, :BUDGET])
    assert all("reconstruction_scores" not in vars(c) for c in model.caches())


def test_kvzip_repeat_prompt_comes_from_the_tokenizer():
    class Words:
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    model = make_tiny_model()
    caches = attach(model, cache_args("kvzip", str(BUDGET)))
    set_repeat_prompt(caches, Words())
    # The suffix is whitespace alone: no word.
    assert all(c.kvzip_prompts == RepeatPrompts((6, 3, 8, 7, 8), (6, 3, 4, 2, 3, 8, 7, 8, 8, 4), ()) for c in caches)


def kvzip_prefill(monkeypatch, args, fused: bool):
    """(last logits, each layer's (held positions, keys, values), forward passes) of a kvzip prefill of the
    matrix prompt: generate.prefill (`fused`), or the scores supplied and then a forward over the context."""
    model = make_tiny_model()
    caches = attach(model, args)
    ids = token_ids()[:, :PROMPT]
    calls = []
    original = type(model).forward

    def counted(self, *a, **k):
        calls.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(type(model), "forward", counted)
    with torch.inference_mode():
        model.reset_caches()
        if fused:
            logits = prefill(model, ids)
        else:
            supply_reconstruction_scores(model, ids)
            logits = model(ids, torch.arange(PROMPT), last_logits_only=True)[:, -1]
    monkeypatch.setattr(type(model), "forward", original)
    return logits, [(held_positions(c), c.keys().clone(), c.values().clone()) for c in caches], len(calls)


@pytest.mark.parametrize("chunk", ["0", "4"])
@pytest.mark.parametrize("flags", [
    ("kvzip",), ("debug_kvzip",), ("tova", "--prompt_compression_strategy", "kvzip"),
    ("debug_gated", "--prompt_compression_strategy", "kvzip"),  # gates observed for the context's tokens only
    ("kvzip", "--budget_allocation", "adakv"), ("kvzip", "--rerotate_positions"), ("kvzip", "--cache_bits", "4"),
])
def test_kvzip_prefill_inside_its_last_reconstruction_pass_equals_a_prefill_after_it(monkeypatch, flags, chunk):
    """generate.prefill lets KVzip's last reconstruction pass prefill the caches with the context that opens its
    sequence; a separate forward over the context after the passes (the scores supplied) holds the same
    positions, K/V within 1e-5 (the context's rows go through products of another length) and predicts the
    same logits within 1e-4, at the cost of one pass less."""
    args = cache_args(flags[0], str(BUDGET), "dense", *flags[1:], "--kvzip_chunk", chunk)
    logits, fused, passes = kvzip_prefill(monkeypatch, args, fused=True)
    reference, after, reference_passes = kvzip_prefill(monkeypatch, args, fused=False)
    assert passes == (PROMPT // int(chunk) if int(chunk) else 1) and reference_passes == passes + 1
    assert torch.allclose(logits, reference, atol=1e-4)
    for layer, ((h_fused, k_fused, v_fused), (h_ref, k_ref, v_ref)) in enumerate(zip(fused, after, strict=True)):
        assert h_fused == h_ref, f"layer {layer}"
        assert torch.allclose(k_fused, k_ref, atol=1e-5) and torch.allclose(v_fused, v_ref, atol=1e-5), f"layer {layer}"


def test_kvzip_reconstruction_longer_than_the_context_is_a_user_error():
    model = make_tiny_model(context_length=40)
    with pytest.raises(UserError, match="kvzip_chunk"):
        reconstruction_scores(model, token_ids()[:, :24])
    assert len(reconstruction_scores(model, token_ids()[:, :24], chunk=8)) == model.args.n_layer


# ---- lagkv -----------------------------------------------------------------------------------------------------


def naive_partition_scores(states: list[torch.Tensor], target: list[int], ref: list[int], lag: int) -> dict[int, float]:
    """LagKV: per token x of `target`, per state (keys, values): min-max normalise each channel by the `ref`
    tokens, the sample std over channels, softmax over the target tokens; the mean over states, ranked
    within the target (rank / lag)."""
    total = {x: 0.0 for x in target}
    for s in states:
        spread = {}
        for x in target:
            normed = []
            for c in range(s.shape[-1]):
                lo, hi = min(float(s[r, c]) for r in ref), max(float(s[r, c]) for r in ref)
                normed.append((float(s[x, c]) - lo) / max(hi - lo, 1e-6))
            spread[x] = statistics.stdev(normed)
        top = max(spread.values())
        norm = sum(math.exp(v - top) for v in spread.values())
        for x in target:
            total[x] += math.exp(spread[x] - top) / norm / len(states)
    order = sorted(target, key=lambda x: total[x])
    return {x: order.index(x) / lag for x in target}


def lagkv_oracle(model, ids, lag: int):
    """(prompt score, decode checker) of naive LagKV over layer 0's keys and values of a full-cache run."""
    ref_k, ref_v = reference_kv(model, ids)

    def partition(x: int) -> int:
        return (x - GLOBAL) // lag

    def prompt_score(h: int, x: int) -> float:
        complete = (PROMPT - GLOBAL) // lag
        j = partition(x)
        if x < GLOBAL or j >= complete - 1:
            return 1 + x / (PROMPT + 1)
        members = [y for y in range(PROMPT) if y >= GLOBAL and partition(y) == j]
        nxt = [y for y in range(PROMPT) if y >= GLOBAL and partition(y) == j + 1]
        return naive_partition_scores([ref_k[h], ref_v[h]], members, nxt, lag)[x]

    return prompt_score, ref_k, ref_v, partition


def assert_prompt_kept_best_up_to_ties(steps, score) -> None:
    """Prefill kept the protected tokens and BUDGET of the prompt, none of the others scoring above a kept
    one (ranks tie across partitions, and top-k may break a tie either way)."""
    protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
    for h, kept in enumerate(steps[0][1]):
        assert protected <= kept and len(kept) == BUDGET
        dropped = set(range(PROMPT)) - kept
        assert min(score(h, x) for x in kept - protected) >= max(score(h, x) for x in dropped) - 1e-9, f"head {h}"


@pytest.mark.parametrize("lag", [3, 4])
def test_lagkv_ranks_each_partition_against_the_next_and_evicts_the_lowest_rank(lag):
    model, ids, steps = evictions("lagkv", str(BUDGET), "--lag_size", str(lag))
    prompt_score, ref_k, ref_v, partition = lagkv_oracle(model, ids, lag)
    assert_prompt_kept_best_up_to_ties(steps, prompt_score)
    frozen = [{x: prompt_score(h, x) for x in steps[0][1][h] if prompt_score(h, x) < 1} for h in range(2)]
    checked = 0
    for p, before, after in steps:
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            if len(b) == BUDGET:
                scores = {x: frozen[h].get(x, 1 + x / (p + 1)) for x in unprotected(b, p)}
                ties = {x for x, v in scores.items() if v <= min(scores.values()) + 1e-9}
                assert len(b - a) == 1 and b - a <= ties, f"step {p} head {h}: {b - a} not in {ties}"
                checked += 1
            if (p + 1 - GLOBAL) % lag == 0:  # p closes partition c: partition c − 1 is scored against it
                c = partition(p)
                target = sorted(x for x in a if x >= GLOBAL and partition(x) == c - 1)
                ref = sorted(x for x in a if x >= GLOBAL and partition(x) == c)
                frozen[h].update(naive_partition_scores([ref_k[h], ref_v[h]], target, ref, lag))
    assert checked > 0


@pytest.mark.slow
@pytest.mark.parametrize("lag", [4, 8])
def test_lagkv_compiled_equals_eager_in_both_scoring_paths(lag):
    """16 slots: partitions of 4 are rescored over their 2 × 4 slots (score_closed_partition), partitions of 8
    over every slot (2 × 8 is not below 16); on the CPU both run under torch.cond when compiled, the scoring
    only at the steps that close a partition. The compiled step keeps the eager step's positions at every step,
    with one graph."""
    assert_compiled_equals_eager(cache_args("lagkv", str(BUDGET), "dense", "--lag_size", str(lag)))


def test_lag_size_out_of_range_is_a_user_error():
    with pytest.raises(UserError, match="lag_size"):
        cache_args("lagkv", "16", "dense", "--lag_size", "1")


# ---- qfilters --------------------------------------------------------------------------------------------------


def numpy_direction(queries: np.ndarray) -> np.ndarray:
    """The first right singular vector of the stacked queries [n, D], oriented by their mean projection."""
    u = np.linalg.svd(queries.astype(np.float64), full_matrices=False)[2][0]
    return u if (queries @ u).mean() >= 0 else -u


def group_mean_directions(per_head_queries: list[np.ndarray], n_kv: int) -> list[np.ndarray]:
    """The authors' make_filters: each query head's direction, averaged over its KV group (heads in order)."""
    rep = len(per_head_queries) // n_kv
    return [np.mean([numpy_direction(per_head_queries[head]) for head in range(h * rep, (h + 1) * rep)], axis=0)
            for h in range(n_kv)]


def prompt_directions(model, ids) -> list[np.ndarray]:
    q = layer0_queries(model, ids)[:, :PROMPT].numpy()
    return group_mean_directions(list(q), model.args.n_kv_head)


def projection_score(ref_k, directions):
    def score(p: int, h: int, held: set[int], x: int) -> float:
        return float(sum(float(a) * float(b) for a, b in zip(ref_k[h, x], directions[h], strict=True)))

    return score


def test_qfilters_keeps_the_keys_with_the_largest_projection_on_the_prompts_query_direction():
    model, ids, steps = evictions("qfilters", str(BUDGET))
    ref_k, _ = reference_kv(model, ids)
    score = projection_score(ref_k, prompt_directions(model, ids))
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


@pytest.mark.parametrize("gap", [None, 0.5, 0.999, "rank 1", "rank 3"])
def test_top_eigenvectors_by_repeated_squaring_match_numpy(gap):
    """The GPU's top eigenvector (repeated squaring, no eigensolver) against numpy's eigh, float64: batched
    Gram matrices of queries with a dominant mean (as real queries have), without one, with λ₂/λ₁ set to 0.5 or
    0.999, and rank-deficient ones; the same direction up to sign within 1e-9 (1e-6 at the 0.999 gap)."""
    from strategies.qfilters import top_eigenvectors

    rng = np.random.default_rng(0)
    D = 64
    if gap is None:  # queries: a mean direction plus noise, and isotropic ones
        q = rng.standard_normal((2, 3, 500, D)) + np.array([3.0, 0.0])[:, None, None, None] * rng.standard_normal(D)
        gram = q.transpose(0, 1, 3, 2) @ q
    elif isinstance(gap, float):  # eigenvalues 1, gap, then ≤ 0.4·gap, in a random basis
        basis = np.linalg.qr(rng.standard_normal((4, D, D)))[0]
        values = np.concatenate([[1.0, gap], rng.uniform(0, 0.4 * gap, D - 2)])
        gram = (basis * values) @ basis.transpose(0, 2, 1)
    else:
        rank = int(gap.split()[1])
        x = rng.standard_normal((4, rank, D))
        gram = x.transpose(0, 2, 1) @ x
    got = top_eigenvectors(torch.tensor(gram)).numpy()
    want = np.linalg.eigh(gram)[1][..., -1]
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-12)
    tolerance = 1e-6 if gap == 0.999 else 1e-9
    np.testing.assert_allclose(np.abs((got * want).sum(-1)), 1.0, atol=tolerance)


def test_top_eigenvector_of_a_zero_matrix_is_a_unit_vector():
    from strategies.qfilters import top_eigenvectors

    u = top_eigenvectors(torch.zeros(2, 8, 8, dtype=torch.float64))
    assert torch.equal(u, torch.eye(8, dtype=torch.float64)[0].expand(2, 8))


def test_qfilters_reads_the_directions_of_a_calibration_file(tmp_path):
    gen = torch.Generator().manual_seed(1)
    filters = torch.nn.functional.normalize(torch.randn(2, 2, 16, generator=gen), dim=-1)
    path = tmp_path / "qf.json"
    path.write_text(json.dumps({"n_kv_head": 2, "head_dim": 16, "filters": filters.tolist()}))
    model, ids, steps = evictions("qfilters", str(BUDGET), "--qfilters_path", str(path))
    ref_k, _ = reference_kv(model, ids)
    score = projection_score(ref_k, filters[0].tolist())
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0
    caches = attach(model, cache_args("qfilters", str(BUDGET), "dense", "--qfilters_path", str(path)))
    with torch.inference_mode():
        model.reset_caches()
    assert all(torch.equal(c.direction[0], filters[i]) for i, c in enumerate(caches)), "reset keeps the file's"
    path.write_text(json.dumps({"filters": [[[0.1, 0.2]]]}))
    with pytest.raises(UserError, match="KV heads"):
        attach(model, cache_args("qfilters", "16", "dense", "--qfilters_path", str(path)))
    path.write_text("{}")
    with pytest.raises(UserError, match="qfilters_path"):
        attach(model, cache_args("qfilters", "16", "dense", "--qfilters_path", str(path)))


def test_calibrated_filters_average_each_query_heads_svd_over_every_window():
    from calibrate_qfilters import query_filters

    model = make_tiny_model()
    windows = [token_ids(seed)[:, :PROMPT] for seed in (0, 1)]
    filters = query_filters(model, windows)
    queries = [layer0_queries(model, torch.cat([w, w[:, : TOTAL - PROMPT]], 1))[:, :PROMPT].numpy()
               for w in windows]
    per_head = [np.concatenate([q[head] for q in queries]) for head in range(model.args.n_head)]
    for h, expected in enumerate(group_mean_directions(per_head, model.args.n_kv_head)):
        assert np.allclose(filters[0][h], expected, atol=1e-5)
    assert len(filters) == model.args.n_layer and len(filters[1][0]) == model.args.head_dim


def test_the_shipped_filters_fit_the_bundled_models_layers():
    from strategies.qfilters import SHIPPED, QFiltersCache, load_filters

    data = load_filters(SHIPPED)
    filters = torch.tensor(data["filters"])
    assert filters.shape == (data["n_layer"], 3, 64) == (30, 3, 64)
    norms = filters.norm(dim=-1)  # a group's mean of unit vectors, not renormalised
    assert bool((norms <= 1 + 1e-6).all()) and bool((norms > 0.2).all())
    cache = QFiltersCache(1, 3, 64, 8, torch.float32, capacity_needed=16)
    cache.configure(layer_idx=7)
    assert cache.from_file and torch.allclose(cache.direction[0], filters[7])


@pytest.mark.parametrize("rows_per_step", [3, 7, 64])
@pytest.mark.parametrize("first_row", [0, 5])
def test_kvzip_max_attention_received_in_row_blocks_equals_naive_loops(rows_per_step, first_row):
    """KVzip's score of a key without a reconstruction pass (the prompt's own queries, first_row 0), computed
    in blocks of rows: keys past a block's last row get their scores from later blocks only. Against the
    maximum over query heads and causal queries of naive softmaxes; blocks shorter than the prompt
    included (a prompt longer than 256 tokens used to fail here)."""
    from strategies.kvzip import max_attention_received

    g = torch.Generator().manual_seed(0)
    B, H, n_kv, S, D = 2, 4, 2, 20, 8
    q, k = torch.randn(B, H, S, D, generator=g), torch.randn(B, n_kv, S, D, generator=g)
    got = max_attention_received(q, k, first_row, S, max_elements=rows_per_step * B * H * S)
    for b in range(B):
        for kv in range(n_kv):
            for j in range(S):
                naive = max(head_probs(q[b, h, t], k[b, kv], list(range(t + 1)))[j]
                            for h in range(kv * H // n_kv, (kv + 1) * H // n_kv) for t in range(max(j, first_row), S))
                assert got[b, kv, j].item() == pytest.approx(naive, abs=1e-6)


def dense_received_attention(q: torch.Tensor, k: torch.Tensor, first_query: int = 0) -> torch.Tensor:
    """H2O's received attention from its definition: one dense causal softmax in float64, summed over the
    queries from `first_query` on, the mean over each KV group's query heads."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    scores = (q.double() @ k.double().repeat_interleave(H // n_kv, dim=1).transpose(-1, -2)) / D**0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)[:, :, first_query:]
    return probs.sum(dim=2).view(B, n_kv, H // n_kv, T).mean(dim=2)


@pytest.mark.parametrize("path", ["blocks", "fused", "fused_by_kv_head"])
@pytest.mark.parametrize("first_query", [0, 130])
def test_received_attention_equals_a_dense_float64_pass(first_query, path):
    """H2O's attention received by each prompt key (summed over queries, the group's mean over its query heads)
    in the CPU's blocks of rows (several blocks here: 32 heads of 400 tokens, 2 rows), or by the two fused
    attention passes (all 8 KV groups in one call, or one group a call), against one dense causal softmax in
    float64."""
    from prompt_compression import block_elements, prompt_attention_received, received_attention_fused

    g = torch.Generator().manual_seed(0)
    B, H, n_kv, T, D = 2, 32, 8, 400, 16
    assert block_elements(torch.device("cpu")) // (B * H * T) < T - first_query  # more than one block
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, n_kv, T, D, generator=g)
    if path == "fused_by_kv_head":
        got = received_attention_fused(q, k, first_query, max_elements=1)
    else:
        got = prompt_attention_received(q, k, first_query=first_query, path=path)
    torch.testing.assert_close(got.double(), dense_received_attention(q, k, first_query), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dtype", "amplitude", "rtol"), [(torch.bfloat16, 2.0, 5e-4), (torch.float32, 10.0, 1e-5)])
def test_fused_received_attention_in_bfloat16_and_over_any_range_of_scores(dtype, amplitude, rtol):
    """bfloat16 inputs: the fused passes accumulate q·k in float32 and carry −lse in three bfloat16 terms, so
    they stay within 5e-4 of the float64 pass over the same rounded inputs (measured 6e-5; the blocks, whose
    scores are rounded to bfloat16, are 4e-2 off). Scores of amplitude 10 (log-sum-exps spread over ~750, past
    float32's exponent range) still give finite, exact sums."""
    from prompt_compression import prompt_attention_received

    g = torch.Generator().manual_seed(1)
    B, H, n_kv, T, D = 1, 4, 2, 300, 16
    q = (torch.randn(B, H, T, D, generator=g) * amplitude).to(dtype)
    k = (torch.randn(B, n_kv, T, D, generator=g) * amplitude).to(dtype)
    got = prompt_attention_received(q, k, first_query=40, path="fused").double()
    torch.testing.assert_close(got, dense_received_attention(q, k, 40), rtol=rtol, atol=1e-5)


def test_the_received_attention_path_by_device_and_environment(monkeypatch):
    from errors import UserError
    from prompt_compression import RECEIVED_ATTENTION_ENV, received_attention_path

    monkeypatch.delenv(RECEIVED_ATTENTION_ENV, raising=False)
    cpu, gpu = torch.empty(1, 1, 1, 128), torch.empty(1, 1, 1, 128, device="meta")
    assert received_attention_path(cpu) == "blocks" and received_attention_path(gpu) == "fused"
    assert received_attention_path(torch.empty(1, 1, 1, 256, device="meta")) == "blocks"  # no room for 8 more
    monkeypatch.setenv(RECEIVED_ATTENTION_ENV, "fused")
    assert received_attention_path(cpu) == "fused"
    monkeypatch.setenv(RECEIVED_ATTENTION_ENV, "dense")
    with pytest.raises(UserError, match="KV_RECEIVED_ATTENTION='dense': give one of blocks, fused"):
        received_attention_path(cpu)


def held_and_logits(model, ids: torch.Tensor, args) -> tuple[list, torch.Tensor]:
    """Every layer's held positions after the prompt and each step, and each step's logits."""
    caches = attach(model, args)
    held, logits = [], []
    with torch.inference_mode():
        run(model, ids, lambda m, t, p: logits.append(decode_one_token(m, t, p).clone()),
            lambda _: held.append([held_positions(c) for c in caches]))
    return held, torch.stack(logits)


@pytest.mark.parametrize("extra", [[], ["--prefill_chunk", "5"], ["--history_window_size", "4"],
                                   ["--budget_allocation", "adakv"]], ids=["one_shot", "chunks", "window", "adakv"])
@pytest.mark.parametrize("strategy", ["heavy_hitter", "debug_heavy_hitter"])
def test_heavy_hitter_decodes_the_same_with_either_received_attention_path(strategy, extra, monkeypatch):
    """H2O's decode-time scores start from the prompt's received attention: with the fused passes (the GPUs'
    default) the caches keep, at every step of a 24-token prompt + 16 teacher-forced tokens at budget 16, the
    positions they keep with the blocks (the CPU's), and the logits agree within 1e-5 (float32)."""
    from prompt_compression import RECEIVED_ATTENTION_ENV

    model, ids = make_tiny_model(), token_ids()
    runs = {}
    for path in ("blocks", "fused"):
        monkeypatch.setenv(RECEIVED_ATTENTION_ENV, path)
        runs[path] = held_and_logits(model, ids, cache_args(strategy, str(BUDGET), "dense", *extra))
    assert runs["fused"][0] == runs["blocks"][0]
    assert any(len(h) == BUDGET for layer in runs["blocks"][0][-1] for h in layer)  # eviction happened
    torch.testing.assert_close(runs["fused"][1], runs["blocks"][1], atol=1e-5, rtol=0)
