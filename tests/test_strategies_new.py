"""Naive oracles of duo_attention, threshold and chunkkv: each rule re-computed here from its paper's
definition with plain loops over layer 0's keys and queries of a full-cache run (tests/test_strategies.py),
and compared with what the cache held after prefill and after every decode step (the tiny model, a
24-token prompt + 16 new tokens, 2 sinks and a 4-token recent window)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from cache import cache_statistics
from errors import UserError
from generate import decode_one_token, prefill
from strategies import CACHE_STRATEGIES, get_strategy
from strategies.duo_attention import retrieval_heads
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids
from tests.test_strategies import evictions, layer0_queries, naive_probs, reference_kv, unprotected
from tests.test_strategies_recent import assert_evicts_lowest, assert_prompt_kept_best, tova_oracle


def naive_attention(model, ids):
    """attention(query, held, h, x): query's softmax over the positions `held`, averaged over KV group h."""
    ref_k, _ = reference_kv(model, ids)
    q = layer0_queries(model, ids)
    memo: dict = {}

    def attention(query: int, held: set[int], h: int, x: int) -> float:
        key = (query, tuple(sorted(held)))
        if key not in memo:
            memo[key] = naive_probs(q[:, query], ref_k, sorted(held), model.args.n_kv_head)
        return memo[key][x][h].item()

    return attention


# ---- threshold ---------------------------------------------------------------------------------------------


def test_threshold_releases_every_token_under_its_share_of_the_previous_querys_attention():
    """Step p: the previous query (p − 1) attended over what the head held (the whole prompt for the last
    prompt query); a full head evicts TOVA's argmin; then every unprotected older token whose attention ×
    the number of tokens attended is below τ is released."""
    tau, budget = 0.3, 16
    model, ids, steps = evictions("threshold", str(budget), "--eviction_threshold", str(tau))
    attention = naive_attention(model, ids)
    assert_prompt_kept_best(steps, tova_oracle(model, ids))
    released = 0
    for p, before, after in steps:
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            attended = set(range(PROMPT)) if p == PROMPT else b
            relative = {x: attention(p - 1, attended, h, x) * len(attended) for x in b}
            held = set(b)
            if len(held) == budget:
                held.remove(min(unprotected(held, p), key=lambda x: relative[x]))
            drop = {x for x in unprotected(held, p) if relative[x] < tau}
            expected = (held - drop) | {p}
            assert a == expected, f"step {p} head {h}: held {sorted(a)}, expected {sorted(expected)}"
            released += len(drop)
    assert released > 0, "the threshold should release tokens on this text"


def test_threshold_compression_is_measured_from_the_held_tokens():
    model = make_tiny_model()
    caches = attach(model, cache_args("threshold", "1.0", "dense", "--eviction_threshold", "0.3"))
    with torch.inference_mode():
        run(model, token_ids(), decode_one_token, lambda p: None)
    held = [c.mask[0, :, 0].sum(-1).double() for c in caches]
    naive = sum(float((1 - h / TOTAL).mean()) for h in held) / len(held)
    stats = cache_statistics(caches)
    assert stats["compression_ratio"] == pytest.approx(naive, abs=1e-4)
    assert stats["compression_ratio"] > 0.1  # a budget of the whole sequence, compressed anyway


def test_threshold_out_of_range_is_a_user_error():
    with pytest.raises(UserError, match="eviction_threshold"):
        cache_args("threshold", "16", "dense", "--eviction_threshold", "1.5")


# ---- duo_attention ------------------------------------------------------------------------------------------


def naive_streaming_loss(model, ids) -> list[float]:
    """Per KV head of layer 0: mean over prompt queries i of 1 − the attention on keys j < GLOBAL or
    i − RECENT < j ≤ i (softmax over keys 0..i)."""
    attention = naive_attention(model, ids)
    losses = []
    for h in range(model.args.n_kv_head):
        total = 0.0
        for i in range(PROMPT):
            seen = set(range(i + 1))
            kept = sum(attention(i, seen, h, j) for j in seen if j < GLOBAL or j > i - RECENT)
            total += 1.0 - kept
        losses.append(total / PROMPT)
    return losses


def expected_duo_heads(held_before: set[int], p: int, retrieval: bool, budget: int) -> set[int]:
    """A retrieval head: StreamingLLM within the budget; a streaming head: sinks + the RECENT newest."""
    held = held_before | {p}
    if retrieval and len(held) > budget:
        held.remove(min(unprotected(held_before, p)))
    if not retrieval:
        held = {x for x in held if x < GLOBAL or x > p - RECENT}
    return held


@pytest.mark.parametrize("budget", ["1.0", "16"])
def test_duo_attention_profiles_heads_on_the_prompt_and_keeps_each_roles_tokens(budget):
    model, ids, steps = evictions("duo_attention", budget, "--duo_retrieval_fraction", "0.5")
    losses = naive_streaming_loss(model, ids)  # before attaching: the reference run attaches a full cache
    cache = attach(model, cache_args("duo_attention", budget, "dense", "--duo_retrieval_fraction", "0.5"))[0]
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :PROMPT])
    best = max(range(len(losses)), key=lambda h: losses[h])
    assert cache.retrieval[0].tolist() == [float(h == best) for h in range(len(losses))]
    slots = TOTAL if budget == "1.0" else int(budget)
    for p, before, after in steps:
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            assert a == expected_duo_heads(b, p, h == best, slots), f"step {p} head {h}"
    streaming = steps[-1][2][1 - best]
    assert len(streaming) == GLOBAL + RECENT


def test_duo_attention_reads_head_roles_from_a_calibration_file(tmp_path):
    """Roles ranked over every layer at once: with these scores layer 1 has both retrieval heads."""
    path = tmp_path / "duo.json"
    path.write_text(json.dumps({"n_kv_head": 2, "head_dim": 16, "scores": [[0.1, 0.2], [0.5, 0.4]]}))
    model = make_tiny_model()
    caches = attach(model, cache_args("duo_attention", "1.0", "dense", "--duo_heads_path", str(path),
                                      "--duo_retrieval_fraction", "0.5"))
    with torch.inference_mode():
        run(model, token_ids(), decode_one_token, lambda p: None)  # reset, prefill, decode: roles stay
    assert [c.retrieval[0].tolist() for c in caches] == [[0.0, 0.0], [1.0, 1.0]]
    held = [[len(h) for h in held_positions(c)] for c in caches]
    assert held == [[GLOBAL + RECENT] * 2, [TOTAL] * 2]
    for bad, message in [({"scores": [[0.1, 0.2, 0.3]]}, "KV heads"), ({"scores": 5}, "one row of KV heads"),
                         ({"n_layer": 2, "scores": [[0.1, 0.2]]}, "1 rows of scores for 2 layers")]:
        path.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=message):
            attach(model, cache_args("duo_attention", "1.0", "dense", "--duo_heads_path", str(path)))


def test_duo_calibration_measures_every_layer_of_a_model_with_sliding_windows(tmp_path):
    """On a tiny Gemma 3 (layers 0, 1 and 3 slide over 64 tokens) windows of text longer than 64 would leave the
    sliding layers their own window, unmeasured: refused in one line (the file had one row, of layer 2, which
    a duo cache read as layer 0's). Within the window every layer gets its row, finite and ≥ 0."""
    import calibrate_duo
    from tests.eval_helpers import SLIDING_WINDOW, write_tiny_sliding_checkpoint

    checkpoint = write_tiny_sliding_checkpoint(tmp_path / "gemma3")
    base = ["--checkpoint_path", str(checkpoint), "--windows", "2", "--global_tokens", "2", "--recent_window", "8"]
    with pytest.raises(UserError, match=f"sliding window of {SLIDING_WINDOW} tokens"):
        calibrate_duo.main([*base, "--seq_len", str(SLIDING_WINDOW + 1), "--out", str(tmp_path / "long.json")])
    assert not (tmp_path / "long.json").exists()
    out = calibrate_duo.main([*base, "--seq_len", str(SLIDING_WINDOW), "--out", str(tmp_path / "duo.json")])
    scores = json.loads(out.read_text())["scores"]
    assert len(scores) == 4 and all(len(row) == 2 and all(0 <= x < math.inf for x in row) for row in scores)


def test_retrieval_heads_are_the_top_fraction_over_all_layers():
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(5, 3, generator=gen).tolist()
    for fraction in (0.0, 0.2, 0.5, 1.0):
        flat = sorted(((s, layer, h) for layer, row in enumerate(scores) for h, s in enumerate(row)), reverse=True)
        top = {(layer, h) for _, layer, h in flat[: round(fraction * 15)]}
        expected = [[(layer, h) in top for h in range(3)] for layer in range(5)]
        assert retrieval_heads(scores, fraction) == expected


def test_duo_attention_settings_out_of_range_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="duo_retrieval_fraction"):
        cache_args("duo_attention", "16", "dense", "--duo_retrieval_fraction", "1.5")
    with pytest.raises(UserError, match="duo_heads_path"):
        attach(make_tiny_model(), cache_args("duo_attention", "16", "dense", "--duo_heads_path",
                                             str(tmp_path / "missing.json")))


STREAMING = [n for n in CACHE_STRATEGIES if getattr(get_strategy(n), "holds_only_protected", False)]


@pytest.mark.parametrize("strategy", STREAMING + ["debug_" + n for n in STREAMING])
def test_streaming_heads_that_would_hold_no_token_are_refused(strategy):
    """A streaming head holds the sinks and the window only (the window counts the decoded token): with
    neither it has no key to attend to. Refused; one sink, or a window of one, decodes finite logits."""
    model, ids = make_tiny_model(), token_ids()
    with pytest.raises(UserError, match="--global_tokens 0 and --recent_window 0 .* would hold no token"):
        attach(model, cache_args(strategy, "16", "dense", "--global_tokens", "0", "--recent_window", "0"))
    for sinks, window in ((1, 0), (0, 1)):
        protected = ["--global_tokens", str(sinks), "--recent_window", str(window)]
        attach(model, cache_args(strategy, "16", "dense", *protected))
        with torch.inference_mode():
            model.reset_caches()
            prefill(model, ids[:, :PROMPT])
            logits = decode_one_token(model, ids[:, PROMPT : PROMPT + 1], torch.tensor([PROMPT]))
        logits = logits[0] if isinstance(logits, tuple) else logits
        assert torch.isfinite(logits).all(), (sinks, window)


# ---- chunkkv -----------------------------------------------------------------------------------------------


def chunkkv_oracle(model, ids, chunk: int):
    """Naive ChunkKV over TOVA: a token's score is the sum, over the held tokens of its chunk (same
    position // chunk), of the previous query's attention, over the number of the chunk's positions before
    p (kvpress's mean over a chunk; a partial chunk's over the positions it has), lowered by
    10⁻⁴·(pos mod chunk)/chunk of itself."""
    attention = naive_attention(model, ids)

    def score(p: int, h: int, held: set[int], x: int) -> float:
        attended = set(range(PROMPT)) if p == PROMPT else held
        total = sum(attention(p - 1, attended, h, y) for y in held if y // chunk == x // chunk)
        positions = len([y for y in range(p) if y // chunk == x // chunk])
        return total / positions * (1 - 1e-4 * (x % chunk) / chunk)

    return score


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_chunkkv_keeps_and_evicts_whole_chunks_by_their_attention(chunk):
    model, ids, steps = evictions("chunkkv", "16", "--chunk_size", str(chunk))
    score = chunkkv_oracle(model, ids, chunk)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


def test_a_chunk_still_filling_ranks_by_its_mean_not_its_sum():
    """Chunks of 4, positions 0..5 seen: the whole chunk 0 (0.2 a token: sum 0.8) ranks below the partial chunk
    1 (0.3 a token over its two positions: sum 0.6), and after chunk 0 loses a token (sum 0.6 over its 4
    positions) it ranks lower still."""
    from strategies.chunkkv import chunk_scores

    scores = torch.tensor([[[0.2, 0.2, 0.2, 0.2, 0.3, 0.3]]])
    got = chunk_scores(scores, torch.arange(6).view(1, 1, 6), 4, 2, 6)
    assert got[0, 0, :4].max() < got[0, 0, 4:].min()
    assert torch.allclose(got[0, 0, [0, 4]], torch.tensor([0.2, 0.3]))
    evicted = chunk_scores(scores, torch.tensor([[[0, 1, 2, -1, 4, 5]]]), 4, 2, torch.tensor([6]).view(1, 1, 1))
    assert torch.allclose(evicted[0, 0, 0], torch.tensor(0.15)) and evicted[0, 0, 3] == 0


def test_chunkkv_of_chunk_one_is_tova():
    assert evictions("chunkkv", "16", "--chunk_size", "1")[2] == evictions("tova", "16")[2]


def test_chunk_size_out_of_range_is_a_user_error():
    with pytest.raises(UserError, match="chunk_size"):
        cache_args("chunkkv", "16", "dense", "--chunk_size", "0")


# ---- critical_kv -------------------------------------------------------------------------------------------


def critical_kv_oracle(model, ids):
    """Naive CriticalKV's bound a_x · ‖v_x‖: the previous query's attention over what the head held (the
    whole prompt for the last prompt query) times the L2 norm of the token's value."""
    attention = naive_attention(model, ids)
    _, ref_v = reference_kv(model, ids)

    def score(p: int, h: int, held: set[int], x: int) -> float:
        attended = set(range(PROMPT)) if p == PROMPT else held
        norm = math.sqrt(sum(float(c) ** 2 for c in ref_v[h, x]))
        return attention(p - 1, attended, h, x) * norm

    return score


def test_critical_kv_evicts_the_smallest_attention_times_value_norm():
    model, ids, steps = evictions("critical_kv", "16")
    score = critical_kv_oracle(model, ids)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0
    assert steps != evictions("tova", "16")[2], "the value norms should change some choice"


def test_critical_kv_prompt_rule_needs_its_own_cache():
    with pytest.raises(UserError, match="critical_kv"):
        evictions("l2", "16", "--prompt_compression_strategy", "critical_kv")


@pytest.mark.parametrize(("cache", "rule", "refused"), [
    ("l2", "critical_kv", True),           # no values observed at all
    ("vatp", "critical_kv", True),         # l1 norms where the rule weighs by l2
    ("critical_kv", "vatp", True),         # the other way round
    ("critical_kv", "capkv", True),        # norms but not the values capkv reads
    ("capkv", "critical_kv", False),       # l2 norms kept: the rule is served
    ("debug_vatp", "vatp", False),         # a twin pairs as the strategy it shadows
])
def test_a_value_weighted_prompt_rule_is_refused_before_loading_where_the_cache_cannot_serve_it(cache, rule, refused):
    """Refused by the cache flags (before a model loads), not at the first prefill; what is accepted runs."""
    from cache_setup import cache_config
    from cache_spec import resolve_cache_spec

    args = cache_config(["--cache_strategy", cache, "--max_cache_length", "16", "--prompt_compression_strategy", rule])
    if refused:
        with pytest.raises(UserError, match=f"prompt compression '{rule}' weighs tokens by the prompt's values"):
            resolve_cache_spec(args, 2, 24, 16)
    else:
        resolve_cache_spec(args, 2, 24, 16)
        evictions(cache, "16", "--prompt_compression_strategy", rule)


def test_the_shipped_head_file_gives_the_bundled_models_layers_their_roles():
    """A cache shaped as the bundled model's layers (3 KV heads of 64) reads duo/'s file: half of all heads,
    ranked over the 30 layers together, are retrieval heads."""
    from strategies.duo_attention import SHIPPED, DuoAttentionCache, load_head_scores

    scores = load_head_scores(SHIPPED)["scores"]
    expected = retrieval_heads(scores, 0.5)
    roles = []
    for layer in range(len(scores)):
        cache = DuoAttentionCache(1, 3, 64, 8, torch.float32, capacity_needed=16)
        cache.configure(layer_idx=layer)
        roles.append([bool(x) for x in cache.retrieval[0].tolist()])
    assert roles == expected and sum(map(sum, roles)) == round(0.5 * 3 * len(scores))


# ---- rkv ---------------------------------------------------------------------------------------------------


def rkv_oracle(model, ids, lam: float):
    """Naive R-KV: λ · the previous query's attention − (1 − λ) · the key's share of the redundancy, the softmax
    over the held keys (the whole prompt at prefill) of each one's mean cosine similarity to the others."""
    attention = naive_attention(model, ids)
    ref_k, _ = reference_kv(model, ids)

    def cosine(h: int, x: int, y: int) -> float:
        a, b = ref_k[h, x].tolist(), ref_k[h, y].tolist()
        dot = sum(u * v for u, v in zip(a, b, strict=True))
        return dot / (math.sqrt(sum(u * u for u in a)) * math.sqrt(sum(v * v for v in b)))

    def mean_cosine(h: int, held: set[int], x: int) -> float:
        others = [y for y in held if y != x]
        return sum(cosine(h, x, y) for y in others) / len(others)

    def score(p: int, h: int, held: set[int], x: int) -> float:
        attended = set(range(PROMPT)) if p == PROMPT else held
        share = math.exp(mean_cosine(h, held, x)) / sum(math.exp(mean_cosine(h, held, y)) for y in held)
        return lam * attention(p - 1, attended, h, x) - (1 - lam) * share

    return score


@pytest.mark.parametrize("lam", [0.0, 0.07, 0.5, 0.9])
def test_rkv_evicts_the_lowest_importance_minus_redundancy(lam):
    model, ids, steps = evictions("rkv", "16", "--rkv_lambda", str(lam))
    score = rkv_oracle(model, ids, lam)
    assert_prompt_kept_best(steps, score)
    assert assert_evicts_lowest(steps, score) > 0


def test_rkv_redundancy_is_the_mean_cosine_to_the_other_held_keys():
    """Against the definition, key by key: held masks with gaps, a head holding one key (nothing else: 0) and
    a zero key (cosine 0 with everything)."""
    from strategies.rkv import redundancy

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 7, 5, generator=g)
    keys[1, 2, 4] = 0.0
    held = torch.rand(2, 3, 7, generator=g) > 0.3
    held[0, 1] = False
    held[0, 1, 2] = True
    held[1, 2] = True

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        norms = a.double().norm() * b.double().norm()
        return 0.0 if norms == 0 else float(a.double() @ b.double() / norms)

    for mask in (held, None):
        got = redundancy(keys, mask)
        for b, h, x in itertools.product(range(2), range(3), range(7)):
            others = [y for y in range(7) if y != x and (mask is None or mask[b, h, y])]
            want = sum(cosine(keys[b, h, x], keys[b, h, y]) for y in others) / max(len(others), 1)
            assert got[b, h, x].item() == pytest.approx(want, abs=1e-6), (b, h, x)


def test_rkv_redundancy_share_is_the_softmax_over_the_held_keys():
    """The share sums to 1 over each head's held keys, is 0 elsewhere, and orders them as their mean cosines; a head
    holding nothing gets zeros, not NaNs."""
    from strategies.rkv import redundancy, redundancy_share

    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 3, 6, 4, generator=g)
    held = torch.rand(2, 3, 6, generator=g) > 0.4
    held[0, 0] = False
    held[1, 1] = True
    share, mean = redundancy_share(keys, held), redundancy(keys, held).double()
    for b, h in itertools.product(range(2), range(3)):
        slots = [x for x in range(6) if held[b, h, x]]
        total = sum(math.exp(mean[b, h, y]) for y in slots)
        for x in range(6):
            want = math.exp(mean[b, h, x]) / total if x in slots else 0.0
            assert share[b, h, x].item() == pytest.approx(want, abs=1e-6), (b, h, x)
    assert torch.equal(share[0, 0], torch.zeros(6))
    assert torch.allclose(redundancy_share(keys, None).sum(-1), torch.ones(2, 3))


def test_rkv_lambda_one_is_tova():
    assert evictions("rkv", "16", "--rkv_lambda", "1")[2] == evictions("tova", "16")[2]
    with pytest.raises(UserError, match="rkv_lambda"):
        cache_args("rkv", "16", "dense", "--rkv_lambda", "-0.1")
