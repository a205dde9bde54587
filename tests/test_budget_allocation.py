"""Head-adaptive budgets (`--budget_allocation adakv`, budget_allocation.py; Ada-KV, arXiv 2407.11550).

- the matrix axis: every head-specific strategy and its debug_ twin pooled, dense and 4-bit per-token storage,
  eager and compiled, checked after every step (the shared invariants, plus quotas that sum to the layer's
  n_kv·L, stay fixed after prefill and are filled);
- a naive oracle of the selection (a loop over (head, token) pairs with the floor and protection), on random
  scores and on every strategy's own prompt scores, against the positions each head keeps after prefill;
- the same memory as uniform allocation: K/V bytes equal, held tokens n_kv·L, the bookkeeping's bound;
- decode attention against a naive per-head attention over exactly the tokens each head holds, eager and
  compiled, and the probabilities strategies receive;
- uniform allocation is the code before the flag existed (a trace recorded from it), and bad input is refused.
"""

from __future__ import annotations

import math

import pytest
import torch

import generate
from attention import grouped_attention
from budget_allocation import PooledCache
from cache import cache_statistics
from cache_setup import cache_config
from cache_spec import build_caches, format_cache_spec, resolve_cache_spec
from errors import UserError, run_cli
from eval.harness import kept_positions
from generate import compile_decode_step, decode_one_token, prefill
from prompt_compression import adaptive_prompt_tokens
from rope import apply_rope
from strategies import CACHE_STRATEGIES
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    ADAKV,
    ADAKV_COMPILED_CASES,
    ADAKV_STORAGES,
    ADAKV_STRATEGIES,
    ALLOCATIONS,
    GLOBAL,
    PROMPT,
    TOTAL,
    attach,
    cache_args,
    held_positions,
    inner,
    run,
    token_ids,
)
from tests.test_strategies import check_invariants, reference_kv

BUDGET = 16  # of a 24-token prompt: every layer allocates at prefill


def adakv_args(strategy: str, budget: str = str(BUDGET), storage: str = "dense", *extra: str):
    return cache_args(strategy, budget, storage, *ALLOCATIONS["adakv"], *extra)


def distinct_ids(seed: int = 0) -> torch.Tensor:
    """Token ids without repeats: two equal tokens give equal key norms (RoPE keeps norms), an exact tie."""
    return torch.randperm(256, generator=torch.Generator().manual_seed(seed))[:TOTAL].view(1, TOTAL)


# ---- the matrix axis ----------------------------------------------------------------------------------------


def check_pool(caches, n_kv: int, budget: int, quotas: list) -> None:
    """Every pooled layer: quotas sum to n_kv·budget, every slot is used (the prompt exceeded the budget),
    every head keeps its floor, and quotas never change after prefill."""
    now = []
    for cache in caches:
        c = inner(cache)
        assert isinstance(c, PooledCache)
        quota = c.head_budgets()[0]
        held = [len(h) for h in held_positions(cache)]
        assert int(quota.sum()) == n_kv * budget and sum(held) == n_kv * budget
        assert held == quota.tolist()
        assert min(held) >= int(0.2 * budget)
        now.append(quota.tolist())
    quotas.append(now)
    assert quotas[0] == now


@pytest.mark.parametrize("storage", ADAKV_STORAGES)
@pytest.mark.parametrize("strategy", ADAKV)
def test_adakv_matrix_eager(strategy, storage):
    model = make_tiny_model()
    ids = token_ids()
    ref_k, ref_v = reference_kv(model, ids)
    caches = attach(model, adakv_args(strategy, storage=storage))
    quotas: list = []

    def check(p: int) -> None:
        check_invariants(caches, p, ref_k, ref_v, storage)
        check_pool(caches, model.args.n_kv_head, BUDGET, quotas)

    with torch.inference_mode():
        run(model, ids, decode_one_token, check)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "storage", "backend"), ADAKV_COMPILED_CASES)
def test_adakv_matrix_compiled_no_recompilation(strategy, storage, backend):
    """Compiled decode keeps what eager decode keeps, step for step, with one graph and no recompilation."""
    model = make_tiny_model(n_layer=1)
    ids = token_ids()
    ref_k, ref_v = reference_kv(model, ids)
    args = adakv_args(strategy, storage=storage)
    attach(model, args)
    eager = []
    with torch.inference_mode():
        run(model, ids, decode_one_token, lambda p: eager.append(held_positions(model.layers[0].attention.kv_cache)))
    caches = attach(model, args)
    compiled: list = []
    quotas: list = []
    torch._dynamo.reset()
    step = compile_decode_step(backend=backend)

    def check(p: int) -> None:
        compiled.append(held_positions(caches[0]))
        check_invariants(caches, p, ref_k, ref_v, storage)
        check_pool(caches, model.args.n_kv_head, BUDGET, quotas)

    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        run(model, ids, step, check)
    assert compiled == eager


# ---- the selection against a naive loop ----------------------------------------------------------------------


def naive_selection(scores: torch.Tensor, global_tokens: int, window: int, budget: int, floor: int) -> list[set[int]]:
    """Ada-KV by hand: protected tokens in every head; each head tops up to its floor with its best; then the
    best remaining (head, token) pairs over the layer until it holds heads × budget."""
    H, T = scores.shape
    kept = [{t for t in range(T) if t < global_tokens or t >= T - window} for _ in range(H)]
    for h in range(H):
        for t in sorted(range(T), key=lambda t: -scores[h, t].item()):
            if len(kept[h]) >= floor:
                break
            kept[h].add(t)
    pairs = sorted(((scores[h, t].item(), h, t) for h in range(H) for t in range(T) if t not in kept[h]), reverse=True)
    for _, h, t in pairs:
        if sum(len(k) for k in kept) == H * budget:
            break
        kept[h].add(t)
    return kept


@pytest.mark.parametrize(("H", "T", "budget", "g", "w", "alpha"), [
    (3, 40, 10, 2, 4, 0.2), (3, 40, 10, 2, 4, 0.0), (3, 40, 10, 2, 4, 1.0), (2, 30, 12, 0, 0, 0.2),
    (4, 64, 16, 4, 10, 0.5), (1, 20, 5, 1, 1, 0.2), (3, 100, 90, 4, 10, 0.2),
])
def test_selection_equals_a_naive_loop_on_random_scores(H, T, budget, g, w, alpha):
    generator = torch.Generator().manual_seed(H * 1000 + T + budget)
    for _ in range(5):
        # Heads of different spreads, as attention is: some concentrated, some flat.
        scores = torch.randn(2, H, T, generator=generator) * torch.rand(1, H, 1, generator=generator) * 4
        keep = adaptive_prompt_tokens(scores, g, w, budget, int(alpha * budget))
        for b in range(2):
            expected = naive_selection(scores[b], g, w, budget, int(alpha * budget))
            assert [set(keep[b, h].nonzero().flatten().tolist()) for h in range(H)] == expected
        if alpha == 1.0:  # the floor is the whole budget: uniform per-head top-k
            assert (keep.sum(-1) == budget).all()


@pytest.mark.parametrize("strategy", ADAKV_STRATEGIES)
def test_kept_positions_after_prefill_equal_the_naive_selection_on_the_strategys_scores(strategy):
    """The positions each head holds after prefill are the naive selection over the rule's own prompt scores
    (heavy_hitter with SnapKV pooling off: max-pooling makes plateaus of equal votes, i.e. ties)."""
    counts = set()
    for seed in range(4):  # keyformer's quotas come out equal for the first three
        model = make_tiny_model(seed, n_layer=1)
        cache = attach(model, adakv_args(strategy, "12", "dense", "--snapkv_kernel", "1"))[0]
        seen = {}
        original = cache.prefill

        def spy(input_pos, k, v, q, cache=cache, seen=seen, original=original) -> None:
            seen.update(k=k.clone(), v=v.clone(), q=q.clone())
            if cache.needs_gates:  # the gated rule reads the prompt's gates, which prefill clears
                seen["log_gates"] = cache.prompt_log_gates.clone()
            original(input_pos, k, v, q)

        cache.prefill = spy
        with torch.inference_mode():
            model.reset_caches()
            prefill(model, distinct_ids(seed)[:, :PROMPT])
            rule = cache.prompt_compressor
            cache.prompt_log_gates = seen.get("log_gates")
            cache.observe_prompt_values(seen["v"])  # as the prefill handed them (capkv drops them after it)
            scores = rule.prompt_scores(cache, seen["k"], seen["q"]).float()[0]
        expected = naive_selection(scores, GLOBAL, rule.prompt_protected_window(cache), 12, int(0.2 * 12))
        assert held_positions(cache) == expected, f"seed {seed}"
        counts.add(tuple(len(h) for h in expected))
    assert any(len(set(c)) > 1 for c in counts), "the heads should receive different quotas in some case"


# ---- the same memory as uniform --------------------------------------------------------------------------------


def smollm_caches(strategy: str, storage: str, allocation: str):
    """Layer caches with SmolLM2-135M's shapes (3 KV heads of 64 dims), budget 256 of 1024 tokens."""
    flags = ["--cache_strategy", strategy, "--max_cache_length", "256", "--budget_allocation", allocation]
    flags += {"dense": [], "4bit": ["--cache_bits", "4"], "2bit": ["--cache_bits", "2"],
              "8bit": ["--cache_bits", "8"]}[storage]
    specs = resolve_cache_spec(cache_config(flags), 1, 900, 124)
    return build_caches(specs, 1, 3, 64, 1024, torch.bfloat16, "cpu")[0]


@pytest.mark.parametrize("storage", ["dense", "2bit", "4bit", "8bit"])
@pytest.mark.parametrize("strategy", ADAKV_STRATEGIES)
def test_adakv_stores_exactly_the_uniform_kv_bytes_and_bounds_its_bookkeeping(strategy, storage):
    uniform, pooled = smollm_caches(strategy, storage, "uniform"), smollm_caches(strategy, storage, "adakv")
    assert pooled.kv_bytes() == uniform.kv_bytes() > 0
    assert pooled.keys().shape == (1, 1, 3 * 256, 64) and uniform.keys().shape == (1, 3, 256, 64)
    # Bookkeeping (positions, masks, the strategy's per-slot state) is per head over the whole pool: n_kv × the
    # uniform cache's, plus the quota and offset of each head.
    book_uniform, book_pooled = uniform.nbytes() - uniform.kv_bytes(), pooled.nbytes() - pooled.kv_bytes()
    assert book_uniform < book_pooled <= 3 * book_uniform + 2 * 3 * 8


@pytest.mark.parametrize("strategy", ["heavy_hitter", "l2"])
def test_adakv_holds_n_kv_times_the_budget_and_reports_it(strategy):
    stats = {}
    for allocation in ALLOCATIONS:
        model = make_tiny_model()
        caches = attach(model, cache_args(strategy, str(BUDGET), "dense", *ALLOCATIONS[allocation]))
        with torch.inference_mode():
            run(model, token_ids(), decode_one_token, lambda p: None)
        stats[allocation] = cache_statistics(caches)
        kept = kept_positions(caches)  # what eval records per item: a row per head
        assert [[int((row >= 0).sum()) for row in layer] for layer in kept] == \
               [[len(h) for h in held_positions(c)] for c in caches]
    uniform, adakv = stats["uniform"], stats["adakv"]
    assert adakv["cache_kv_bytes"] == uniform["cache_kv_bytes"]
    assert adakv["cache_budget_per_layer"] == uniform["cache_budget_per_layer"] == [BUDGET, BUDGET]
    assert uniform["cache_budget_per_head"] == [[BUDGET, BUDGET]] * 2
    for budgets, held in zip(adakv["cache_budget_per_head"], adakv["tokens_held_per_head"], strict=True):
        assert sum(budgets) == sum(held) == 2 * BUDGET and budgets == held
    assert any(b[0] != b[1] for b in adakv["cache_budget_per_head"])
    assert adakv["cache_bytes"] > uniform["cache_bytes"]  # the bookkeeping, bounded above


def test_print_cache_spec_shows_the_allocation():
    args = cache_config("heavy_hitter_adakv")
    table = format_cache_spec(resolve_cache_spec(args, 2, 900, 100))
    assert "allocation" in table.splitlines()[0]
    assert all(" adakv " in line and "adakv_floor=0.2" in line for line in table.splitlines()[1:])


# ---- decode attention against a naive per-head attention --------------------------------------------------------


def naive_decode(model, ids, p: int, held: list[set[int]], ref_k, ref_v) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-layer model's step at position p computed by hand: each query head's softmax over exactly the
    positions its KV head holds (K/V from a full-cache run), then the rest of the block and the head.
    Returns (attention output [n_head·D], logits [vocab])."""
    a, layer = model.args, model.layers[0]
    x = model.tok_embeddings(ids[:, p : p + 1])
    q = layer.attention.wq(layer.attention_norm(x)).view(1, 1, a.n_head, a.head_dim).transpose(1, 2)
    q = apply_rope(q, model.rope_cos[p : p + 1], model.rope_sin[p : p + 1])[0, :, 0]
    rep = a.n_head // a.n_kv_head
    heads = []
    for i in range(a.n_head):
        g, positions = i // rep, sorted(held[i // rep])
        weights = torch.softmax(torch.stack([q[i] @ ref_k[g, t] for t in positions]) / math.sqrt(a.head_dim), 0)
        heads.append(sum(w * ref_v[g, t] for w, t in zip(weights, positions, strict=True)))
    y = torch.cat(heads)
    h = x[0, 0] + y @ layer.attention.wo.weight.T  # not the module: the test hooks it
    h = h + layer.feed_forward(layer.ffn_norm(h))
    return y, model.output(model.norm(h)).float()


# Eager: every strategy; compiled: one that reads attention and one that does not (the matrix compiles all).
DECODE_CASES = [pytest.param(s, False, id=f"{s}-eager") for s in ADAKV_STRATEGIES] + [
    pytest.param(s, True, id=f"{s}-compiled", marks=pytest.mark.slow) for s in ("heavy_hitter", "keydiff")]


@pytest.mark.parametrize(("strategy", "compiled"), DECODE_CASES)
def test_decode_attention_is_each_heads_attention_over_its_own_tokens(strategy, compiled):
    model = make_tiny_model(n_layer=1)
    ids = token_ids()
    ref_k, ref_v = reference_kv(model, ids)
    caches = attach(model, adakv_args(strategy))
    cache = caches[0]
    outputs, probs = [], []
    if not compiled:
        hook = model.layers[0].attention.wo.register_forward_pre_hook(lambda m, a: outputs.append(a[0][0, -1].clone()))
        original = cache.update_state
        cache.update_state = lambda p: (probs.append(p.clone()), original(p))
    torch._dynamo.reset()
    step = compile_decode_step() if compiled else decode_one_token
    checked = 0
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :PROMPT])
        outputs.clear()
        for p in range(PROMPT, TOTAL):
            logits = step(model, ids[:, p : p + 1], torch.tensor([p]))
            held = held_positions(cache)
            y, expected = naive_decode(model, ids, p, held, ref_k, ref_v)
            torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
            if not compiled:
                torch.testing.assert_close(outputs[-1], y, atol=2e-5, rtol=0)
            if probs:  # [B, n_kv, rep, P]: each head's softmax over its own slots, zero elsewhere
                P = cache.pool_slots
                assert probs[-1].shape == (1, 2, 2, P)
                mask = cache.mask[0, :, 0]
                assert (probs[-1][0].masked_select(~mask[:, None, :].expand(2, 2, P)) == 0).all()
                torch.testing.assert_close(probs[-1][0].sum(-1), torch.ones(2, 2))
            checked += 1
    if not compiled:
        hook.remove()
    assert checked == TOTAL - PROMPT


def test_the_fused_kernels_mask_for_a_pool_is_each_query_heads_own_slots():
    """The GPU branch of model.py gives SDPA the pooled mask as [B, n_head, 1, P] (mask.transpose(1, 2) of the
    grouped rows): on the CPU, the same call equals the grouped attention and a naive per-head softmax."""
    model = make_tiny_model(n_layer=1)
    cache = attach(model, adakv_args("l2"))[0]
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, token_ids()[:, :PROMPT])
    n_head, n_kv, P, D = 4, 2, cache.pool_slots, model.args.head_dim
    rows = cache.mask.expand(-1, -1, n_head // n_kv, -1).reshape(1, 1, n_head, P)  # as model.py builds it
    q = torch.randn(1, n_head, 1, D, generator=torch.Generator().manual_seed(0))
    k, v = cache.keys(), cache.values()
    fused = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=rows.transpose(1, 2), enable_gqa=True)
    grouped, _ = grouped_attention(q, k, v, rows)
    torch.testing.assert_close(fused, grouped, atol=1e-5, rtol=0)
    for i in range(n_head):
        slots = cache.mask[0, i // 2, 0].nonzero().flatten()
        weights = torch.softmax(q[0, i, 0] @ k[0, 0, slots].T / math.sqrt(D), 0)
        torch.testing.assert_close(fused[0, i, 0], weights @ v[0, 0, slots], atol=1e-5, rtol=0)


@pytest.mark.parametrize("storage", ADAKV_STORAGES)
@pytest.mark.parametrize("strategy", ADAKV)
def test_a_chunk_into_the_shared_out_free_slots_equals_feeding_it_token_by_token(strategy, storage):
    """The kvpress protocol on a pooled cache: the context is allocated to 12 per head on average, each head
    owns 8 free slots more, and a question of 8 tokens appended in one step gives the logits of feeding it
    one token at a time."""
    ids = token_ids()
    logits, quotas = [], []
    for chunk in (False, True):
        model = make_tiny_model()
        caches = attach(model, adakv_args(strategy, "20", storage))
        for c in caches:
            c.configure(prompt_budget=12)
        with torch.inference_mode():
            model.reset_caches()
            prefill(model, ids[:, :16])
            assert all(c.room() == 8 for c in caches)
            quotas.append([inner(c).head_budgets()[0].tolist() for c in caches])
            if chunk:
                out = model(ids[:, 16:PROMPT], torch.arange(16, PROMPT), append=True)[:, -1]
            else:
                for p in range(16, PROMPT):
                    out = decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]))
            assert all(c.room() == 0 for c in caches)
        logits.append(out)
    torch.testing.assert_close(logits[1], logits[0], atol=2e-5, rtol=0)
    assert quotas[0] == quotas[1] and all(sum(q) == 40 for q in quotas[0])


@pytest.mark.parametrize("strategy", ["debug_l2", "debug_recent_global"])
def test_a_debug_twins_reference_keeps_the_whole_context_under_a_prompt_budget(strategy):
    """The prompt budget (kvpress protocol) is the shadow's: the full reference cache keeps every token (it
    used to compress too, failing on a head-specific rule)."""
    model = make_tiny_model()
    caches = attach(model, cache_args(strategy, "20"))
    for c in caches:
        c.configure(prompt_budget=12)
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, token_ids()[:, :16])
    for c in caches:
        assert c.mask[0, :, 0].sum(-1).tolist() == [16, 16] and [len(h) for h in held_positions(c)] == [12, 12]


# ---- uniform allocation is today's caches ----------------------------------------------------------------------


@pytest.mark.parametrize("explicit", [False, True], ids=["default", "explicit_uniform"])
def test_uniform_allocation_builds_the_registered_caches(explicit):
    """Uniform allocation (the default) builds each strategy's registered class with its L slots per head, no
    pool: its behaviour is what the shared strategy matrix checks against its oracles."""
    model = make_tiny_model()
    extra = ["--budget_allocation", "uniform"] if explicit else []
    caches = attach(model, cache_args("heavy_hitter", "16", "dense", *extra))
    for c in caches:
        assert type(c) is CACHE_STRATEGIES["heavy_hitter"] and not c.pooled
        assert c.keys().shape[1:3] == (c.n_kv_heads, 16)


# ---- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--cache_strategy", "recent_global"], "keeps the same tokens in every head"),
    (["--cache_strategy", "debug_random"], "keeps the same tokens in every head; use one of: debug_capkv, "),
    (["--cache_strategy", "random"], "keeps the same tokens in every head; use one of: capkv, "),
    (["--cache_strategy", "full"], "keeps the same tokens in every head"),
    (["--cache_strategy", "heavy_hitter", "recent_global"], "recent_global cache keeps the same tokens"),
    (["--cache_strategy", "hybrid"], "sizes its heads by its own policies"),
    (["--cache_strategy", "debug_hybrid"], r"sizes its heads by its own policies \(FastGen\); use one of: debug_capkv"),
    (["--prompt_compression_strategy", "recent_global"], "scores tokens alike in every head"),
    (["--cache_bits", "4", "--cache_quantization", "kivi"], "KIVI"),
    (["--feed_long_prompts"], "nothing would be allocated"),
    (["--rerotate_positions"], "do not combine"),
    (["--adakv_floor", "1.5"], r"in \[0, 1\], got 1.5"),
    (["--adakv_floor", "-0.1"], r"in \[0, 1\], got -0.1"),
])
def test_adakv_refuses_what_cannot_work(flags, message):
    base = ["--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25", "--budget_allocation", "adakv"]
    with pytest.raises(UserError, match=message):
        resolve_cache_spec(cache_config(base + flags), 30, 900, 100)


@pytest.mark.parametrize(("flags", "message"), [
    (["--adakv_floor", "0.3"], "applies to --budget_allocation adakv only"),
    (["--budget_allocation", "paged"], "invalid choice: 'paged'"),
    (["--budget_allocation", "adakv", "--adakv_floor", "nan"], "not a finite number"),
])
def test_allocation_flags_are_checked(flags, message):
    with pytest.raises(UserError, match=message):
        resolve_cache_spec(cache_config(["--cache_strategy", "l2", *flags]), 30, 900, 100)


def test_generate_refuses_adakv_with_one_line_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(generate, "load_checkpoint", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        run_cli(generate.main, ["--prompt", "hello", "--cache_strategy", "recent_global", "--budget_allocation",
                                "adakv"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and err.startswith("error: --budget_allocation adakv")


def test_eval_tells_adakv_runs_apart():
    """An adakv run is its own line in results tables and plots, and its own run identity; the floor counts
    only where it is read."""
    from eval import results

    uniform = cache_config(["--cache_strategy", "heavy_hitter"])
    adakv = cache_config(["--cache_strategy", "heavy_hitter", "--budget_allocation", "adakv"])
    assert (results.strategy_label(uniform), results.strategy_label(adakv)) == ("heavy_hitter", "heavy_hitter adakv")
    assert "adakv_floor" not in results.cache_identity(uniform) and results.cache_identity(adakv)["adakv_floor"] == 0.2
    assert results.cache_identity(uniform) != results.cache_identity(adakv)
