"""Chunked prefill (--prefill_chunk): the prompt goes through the model N tokens at a time and every layer
compresses to its budget after each chunk by its strategy's prompt rule over what it holds plus the chunk.

- one chunk (the prompt fits it) equals the one-shot prefill, every registered strategy and debug_ twin,
  every storage: the same kept positions, greedy tokens and logits (float32, atol 1e-5);
- N = 1 is --feed_long_prompts' path with a prefill of one token (every prompt token a decode step);
- several chunks against naive references written here from the rules' definitions (recent_global,
  keep_it_odd, l2, tova, critical_kv, curdkv, capkv, morphkv, lacache, SnapKV for heavy_hitter): the positions
  layer 0 keeps after every chunk, and for a one-layer model the logits after the prompt (the last chunk
  attending over the held tokens and itself);
- the kvpress protocol (the context chunked, the question appended), compiled decoding afterwards, and bad
  input (one error: line, exit 2). Batched rows prefilled in chunks, every chunkable strategy:
  test_batching.py; re-rotated positions: test_chunked_rerotation.py; head-adaptive budgets:
  test_chunked_adakv.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import generate
from cache_setup import cache_config
from errors import UserError, run_cli
from eval.harness import configure_prompt_budget
from generate import chunked_prefill, compile_decode_step, decode_one_token, prefill
from rope import apply_rope
from strategies import CACHE_STRATEGIES
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    CHUNK_POOL_REFUSED,
    CHUNK_REFUSED,
    CHUNKABLE,
    CURDKV_WINDOW,
    GLOBAL,
    PROMPT,
    RECENT,
    VARIABLE,
    attach,
    cache_args,
    held_positions,
    inner,
    token_ids,
)
from tests.test_capkv import naive_capacity
from tests.test_curdkv import naive_window_shares, squared_norms
from tests.test_lacache import naive_ladder, naive_sweep

ATOL = 1e-5
# Every chunkable strategy and twin on dense storage; the strategies (a twin's shadow is the same cache) on
# 4-bit per-token and KIVI storage, whose held K/V are read back dequantized into the next chunk's prompt, and
# on ThinK's pruned keys, whose held keys the cache keeps whole until the prompt is in.
STORAGE_CASES = [(s, "dense") for s in CHUNKABLE] + [(s, st) for st in ("4bit", "kivi4", "think") for s in CHUNKABLE
                                                      if not s.startswith("debug_")]
BUDGET = "10"  # of a 24-token prompt: chunks of 6 compress from the second one on


def run_prompt(model, ids, chunk: int | None, steps: int = 6, decode=decode_one_token):
    """Prefill PROMPT tokens (chunked by `chunk`, else one shot), then `steps` greedy decode steps; the logits
    after the prompt and of every step, the tokens and layer 0's held positions after the prompt."""
    with torch.inference_mode():
        model.reset_caches()
        prompt = ids[:, :PROMPT]
        logits = chunked_prefill(model, prompt, chunk, decode_one_token) if chunk else prefill(model, prompt)
        held = [held_positions(c) for c in model.caches()]
        out, tokens = [logits.clone()], []
        for p in range(PROMPT, PROMPT + steps):
            token = out[-1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            out.append(decode(model, token, torch.tensor([p])).clone())
    return torch.stack(out), tokens, held


# ---- (a) one chunk equals the one-shot prefill -----------------------------------------------------------


@pytest.mark.parametrize(("strategy", "storage"), STORAGE_CASES)
def test_one_chunk_equals_the_one_shot_prefill(strategy, storage):
    model = make_tiny_model()
    attach(model, cache_args(strategy, BUDGET, storage, "--prefill_chunk", str(PROMPT)))
    chunked = run_prompt(model, token_ids(), PROMPT)
    attach(model, cache_args(strategy, BUDGET, storage))
    whole = run_prompt(model, token_ids(), None)
    torch.testing.assert_close(chunked[0], whole[0], atol=ATOL, rtol=0)
    assert chunked[1:] == whole[1:]


# ---- (b) N = 1 is --feed_long_prompts' semantics ----------------------------------------------------------


@pytest.mark.parametrize("strategy", CHUNKABLE)
def test_chunks_of_one_token_are_feed_long_prompts_with_a_one_token_prefill(strategy):
    model = make_tiny_model()
    ids = token_ids()
    attach(model, cache_args(strategy, BUDGET, "dense", "--prefill_chunk", "1"))
    with torch.inference_mode():
        model.reset_caches()
        chunked = prefill(model, ids[:, :PROMPT])
        chunked_held = [held_positions(c) for c in model.caches()]
    attach(model, cache_args(strategy, BUDGET, "dense", "--feed_long_prompts"))
    with torch.inference_mode():
        model.reset_caches()
        fed = prefill(model, ids[:, :PROMPT], prefill_length=1)
        fed_held = [held_positions(c) for c in model.caches()]
    torch.testing.assert_close(chunked, fed, atol=0, rtol=0)
    assert chunked_held == fed_held


# ---- (c) several chunks against naive references ---------------------------------------------------------


def layer0_qkv(model, ids):
    """Layer 0's queries, keys and values of every token, rotated at their positions (they depend on the
    tokens only, not on what any cache kept): [H, T, D], [n_kv, T, D], [n_kv, T, D]."""
    a = model.layers[0].attention
    x = model.layers[0].attention_norm(model.tok_embeddings(ids))
    T = ids.shape[1]
    q = a.wq(x).view(1, T, a.n_head, a.head_dim).transpose(1, 2)
    k = a.wk(x).view(1, T, a.n_kv_head, a.head_dim).transpose(1, 2)
    v = a.wv(x).view(1, T, a.n_kv_head, a.head_dim).transpose(1, 2)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    return apply_rope(q, cos, sin)[0], apply_rope(k, cos, sin)[0], v[0]


def attention_from(q, k, query: int, keys: list[int], h: int) -> torch.Tensor:
    """Softmax attention of position `query` over `keys` (all ≤ query) for KV head h, averaged over its query
    heads, written out per head."""
    rep = q.shape[0] // k.shape[0]
    rows = []
    for j in range(h * rep, (h + 1) * rep):
        logits = torch.stack([q[j, query] @ k[h, p] for p in keys]) / math.sqrt(q.shape[-1])
        rows.append(torch.softmax(logits, 0))
    return torch.stack(rows).mean(0)


def naive_scores(rule: str, cand: list[int], budget: int, q, k, v, h: int) -> tuple[torch.Tensor, int]:
    """A prompt rule's scores of the positions `cand` (sorted) in KV head h, by its definition, and the number
    of most recent ones it protects."""
    n = len(cand)
    protected_recent = RECENT
    if rule == "recent_global":
        score = torch.tensor(cand, dtype=torch.float32)
    elif rule == "keep_it_odd":
        score = torch.tensor([(p % 2) * 1000.0 + p for p in cand])
    elif rule == "l2":
        score = torch.stack([-k[h, p].norm() for p in cand])
    elif rule in ("tova", "critical_kv"):
        score = attention_from(q, k, cand[-1], cand, h)
        if rule == "critical_kv":
            score = score * torch.stack([v[h, p].norm() for p in cand])
    elif rule == "curdkv":  # each token's share of its window's squared key norms times its values' share
        shares = naive_window_shares(squared_norms(k[h, cand]), squared_norms(v[h, cand]), CURDKV_WINDOW,
                                     "kv_product")
        score = torch.tensor(shares) / sum(shares)
    elif rule == "capkv":  # w·vᵀA⁻¹v past the sinks, statistics over them (τ = 5); the sinks above the rest
        rep = q.shape[0] // k.shape[0]
        capacity = naive_capacity(q[h * rep : (h + 1) * rep], k[h], v[h], cand[GLOBAL:])
        lev = [capacity(p) for p in cand[GLOBAL:]]
        score = torch.tensor([max(lev) + 1] * GLOBAL + lev)
    elif rule == "morphkv":  # the last W = RECENT − 1 queries' attention over the distant tokens, renormalised, summed
        distant = [i for i in range(n) if GLOBAL <= i <= n - RECENT]
        score = torch.zeros(n, dtype=torch.float64)
        for i in range(max(0, n - (RECENT - 1)), n):
            row = attention_from(q, k, cand[i], cand[: i + 1], h).double()
            mass = sum(float(row[c]) for c in distant if c <= i)
            for c in distant:
                if c <= i:
                    score[c] += float(row[c]) / mass
    elif rule == "lacache":  # layer 0's ladder (2 layers: blocks of 2, the first kept): the later-swept rank higher
        evicted = naive_sweep(naive_ladder(2, 1, 0, 0), PROMPT, budget)[1]
        score = torch.tensor([float(evicted.get(p, 1000 + p)) for p in cand])
    elif rule == "heavy_hitter":  # SnapKV: the last W queries' attention summed, max-pooled over K keys
        window, kernel = 4, 1  # no pooling: max-pooled votes tie exactly, and top-k breaks ties its own way
        votes = torch.zeros(n)
        for i in range(n - window, n):
            votes[: i + 1] += attention_from(q, k, cand[i], cand[: i + 1], h)
        score = torch.stack([votes[max(0, i - kernel // 2) : i + kernel // 2 + 1].max() for i in range(n)])
        protected_recent = max(RECENT, min(window, budget - GLOBAL))
    return score, protected_recent


def naive_keep(rule: str, cand: list[int], budget: int, q, k, v, h: int) -> list[int]:
    """The positions a prompt rule keeps out of `cand` (sorted), by its definition."""
    n = len(cand)
    score, protected_recent = naive_scores(rule, cand, budget, q, k, v, h)
    protected = set(range(GLOBAL)) | set(range(n - protected_recent, n))
    order = sorted(range(n), key=lambda i: (i not in protected, -float(score[i])))
    return sorted(cand[i] for i in order[:budget])


NAIVE_RULES = ["recent_global", "keep_it_odd", "l2", "tova", "critical_kv", "curdkv", "capkv", "heavy_hitter",
               "morphkv", "lacache"]
RULE_FLAGS = {"heavy_hitter": ["--snapkv_window", "4", "--snapkv_kernel", "1"]}


def naive_chunked(rule: str, q, k, v, chunk: int, budget: int, heads: int, prompt: int = PROMPT):
    """Chunk by chunk: each head keeps its rule's choice out of what it holds + the chunk."""
    held = [[] for _ in range(heads)]
    history = []
    for start in range(0, prompt, chunk):
        new = list(range(start, min(start + chunk, prompt)))
        for h in range(heads):
            cand = held[h] + new
            held[h] = cand if len(cand) <= budget else naive_keep(rule, cand, budget, q, k, v, h)
        history.append([set(x) for x in held])
    return history


@pytest.mark.parametrize("chunk", [5, 6, 9])
@pytest.mark.parametrize("rule", NAIVE_RULES)
def test_layer0_keeps_what_the_naive_chunk_by_chunk_rule_keeps(rule, chunk):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args(rule, BUDGET, "dense", "--prefill_chunk", str(chunk), *RULE_FLAGS.get(rule, [])))
    with torch.inference_mode():
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        heads = model.args.n_kv_head if caches[0].head_specific else 1
        expected = naive_chunked(rule, q, k, v, chunk, int(BUDGET), heads)
        for n in range(chunk, PROMPT + chunk, chunk):  # the same prompt cut after each chunk
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            got = held_positions(caches[0])[:heads]  # a shared cache: every head holds the same
            assert got == expected[n // chunk - 1], n


@pytest.mark.parametrize("rule", ["tova", "heavy_hitter", "recent_global"])
def test_one_layer_logits_equal_a_naive_chunked_forward(rule):
    """n_layer = 1: the prompt's last logits are its last chunk's last query attending over what the cache
    held before that chunk and the chunk itself, then the rest of the block (written out here)."""
    chunk = 6
    model = make_tiny_model(n_layer=1)
    ids = token_ids()
    attach(model, cache_args(rule, BUDGET, "dense", "--prefill_chunk", str(chunk), *RULE_FLAGS.get(rule, [])))
    with torch.inference_mode():
        model.reset_caches()
        got = chunked_prefill(model, ids[:, :PROMPT], chunk, decode_one_token)
        q, k, v = layer0_qkv(model, ids[:, :PROMPT])
        heads = model.args.n_kv_head if inner(model.caches()[0]).head_specific else 1
        before_last = naive_chunked(rule, q, k, v, chunk, int(BUDGET), heads, prompt=PROMPT - chunk)[-1]
        a, rep, last = model.layers[0].attention, q.shape[0] // k.shape[0], PROMPT - 1
        outs = []
        for j in range(q.shape[0]):
            h = j // rep
            keys = sorted(before_last[h if heads > 1 else 0] | set(range(PROMPT - chunk, PROMPT)))
            logits = torch.stack([q[j, last] @ k[h, p] for p in keys]) / math.sqrt(q.shape[-1])
            outs.append(torch.softmax(logits, 0) @ v[h, keys])
        x = model.tok_embeddings(ids[:, last])[0]
        block = model.layers[0]
        h1 = x + a.wo(torch.cat(outs))
        h2 = h1 + block.feed_forward(block.ffn_norm(h1))
        want = model.output(model.norm(h2))
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)


# ---- every strategy, storage, several chunks: the budget holds, decoding follows -------------------------


@pytest.mark.parametrize(("strategy", "storage"), STORAGE_CASES)
def test_every_chunk_leaves_at_most_the_budget_and_decoding_follows(strategy, storage):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args(strategy, BUDGET, storage, "--prefill_chunk", "5"))
    with torch.inference_mode():
        model.reset_caches()
        for n in range(5, PROMPT, 5):
            model.reset_caches()
            chunked_prefill(model, ids[:, :n], 5, decode_one_token)
            for cache in caches:
                c = inner(cache)
                assert int(c.held_tokens().max()) <= c.max_cache_length
                assert int(c.inserted.min()) == n
                held = [sorted(h) for h in held_positions(cache)]
                assert all(h == sorted(set(h)) and h[:GLOBAL] == list(range(GLOBAL)) for h in held)
        logits, tokens, _ = run_prompt(model, ids, 5, steps=4)
    assert torch.isfinite(logits).all() and len(tokens) == 4


@pytest.mark.parametrize("strategy", ["heavy_hitter", "critical_kv", "debug_tova"])
def test_kvpress_protocol_chunked_context_then_the_question_appended(strategy):
    """The context (20 tokens) chunked into a prompt budget of 8, the question (4) appended uncompressed;
    with one chunk for the whole context it is the one-shot protocol."""
    model = make_tiny_model()
    ids = token_ids()

    def run(chunk: str) -> tuple[torch.Tensor, list]:
        caches = attach(model, cache_args(strategy, "12", "dense", "--prefill_chunk", chunk))
        for cache in caches:
            inner(cache).prompt_budget = 8
        with torch.inference_mode():
            model.reset_caches()
            chunked_prefill(model, ids[:, :20], int(chunk), decode_one_token)
            assert all(int(inner(c).held_tokens().max()) <= 8 for c in caches)
            out = model(ids[:, 20:PROMPT], torch.arange(20, PROMPT), append=True)[:, -1]
        return out, [held_positions(c) for c in caches]

    one_chunk, one_held = run("20")
    attach(model, cache_args(strategy, "12", "dense"))
    for cache in model.caches():
        inner(cache).prompt_budget = 8
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :20])
        whole = model(ids[:, 20:PROMPT], torch.arange(20, PROMPT), append=True)[:, -1]
    torch.testing.assert_close(one_chunk, whole, atol=ATOL, rtol=0)
    chunked, held = run("6")
    assert torch.isfinite(chunked).all()
    assert all(set(range(20, PROMPT)) <= h for layer in held for h in layer)  # the question, whole


@pytest.mark.parametrize("strategy", [s for s in CHUNKABLE if s.removeprefix("debug_") != "full"])
def test_kvpress_protocol_compresses_a_one_token_last_chunk_with_the_context(strategy):
    """Under the kvpress protocol (a prompt budget of 8, nothing evicted after the prompt) a 19-token context in
    chunks of 6 ends in a chunk of one token. There a decode step would evict nothing and keep 9, so that token is
    compressed with the context by the prompt rule: every strategy and twin's cache (a twin's shadow) holds at
    most 8 tokens per head, and exactly 8 where its occupancy is fixed (FastGen's policies, which profile the
    prompt, may hold fewer)."""
    model = make_tiny_model()
    caches = attach(model, cache_args(strategy, "12", "dense", "--prefill_chunk", "6"))
    configure_prompt_budget(caches, 8)
    with torch.inference_mode():
        model.reset_caches()
        logits = chunked_prefill(model, token_ids()[:, :19], 6, decode_one_token)
    assert torch.isfinite(logits).all()
    for cache in map(inner, caches):
        held = cache.held_tokens()
        assert int(held.max()) <= 8
        name = strategy.removeprefix("debug_")
        if name not in VARIABLE and not CACHE_STRATEGIES[name].profiles_prompt:
            assert int(held.min()) == 8


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["heavy_hitter", "gated"])
def test_compiled_decoding_after_a_chunked_prefill_equals_eager(strategy):
    model = make_tiny_model()
    ids = token_ids()
    attach(model, cache_args(strategy, BUDGET, "dense", "--prefill_chunk", "7"))
    eager = run_prompt(model, ids, 7, steps=8)
    step = compile_decode_step()
    step.prepare(model)
    compiled = run_prompt(model, ids, 7, steps=8, decode=step)
    torch.testing.assert_close(compiled[0], eager[0], atol=1e-4, rtol=1e-4)
    assert compiled[1] == eager[1]


# ---- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill_chunk", "0"], "--prefill_chunk must be ≥ 1"),
    (["--prefill_chunk", "-3"], "--prefill_chunk must be ≥ 1"),
    (["--prefill_chunk", "8", "--feed_long_prompts"], "give one"),
    *[(["--prefill_chunk", "8", "--cache_strategy", s], "cannot compress a prompt chunk by chunk")
      for s in CHUNK_REFUSED],
    *[(["--prefill_chunk", "8", "--cache_strategy", s, "--budget_allocation", "adakv"],
       "with --budget_allocation adakv") for s in CHUNK_POOL_REFUSED],
])
def test_bad_chunk_flags_are_refused(flags, message):
    with pytest.raises(UserError, match=message):
        cache_config(flags)


def test_a_declared_refusal_or_conflict_is_answered_for_the_strategy_its_twin_and_as_a_prompt_rule(monkeypatch):
    # Every registered strategy takes chunks (CHUNK_REFUSED and CHUNK_POOL_REFUSED are empty): what a new one would
    # declare is tried on tova. A refusal holds whatever the other flags; a conflict with the flags it names only.
    from strategies.tova import TovaCache

    uses = [["--cache_strategy", "tova"], ["--cache_strategy", "debug_tova"],
            ["--cache_strategy", "heavy_hitter", "--prompt_compression_strategy", "tova"]]
    monkeypatch.setattr(TovaCache, "chunked_prefill_refusal", "a refusal for the test")
    for use in uses:
        with pytest.raises(UserError, match=r"the \w+ cache cannot compress .* \(a refusal for the test\)"):
            cache_config(["--prefill_chunk", "8", *use])
    monkeypatch.setattr(TovaCache, "chunked_prefill_refusal", None)
    monkeypatch.setattr(TovaCache, "chunked_prefill_conflict",
                        classmethod(lambda cls, args: "pooled" if args.budget_allocation == "adakv" else None))
    for use in uses:
        assert cache_config(["--prefill_chunk", "8", *use]).prefill_chunk == 8
        with pytest.raises(UserError, match=r"chunk by chunk \(pooled\)"):
            cache_config(["--prefill_chunk", "8", *use, "--budget_allocation", "adakv"])


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill_chunk", "0"], "--prefill_chunk must be ≥ 1"),
    (["--prefill_chunk", "2048"], "larger than the model's context of 1024"),
    # FastGen profiles the prompt itself, chunked or not: it is no other cache's prompt rule
    (["--prefill_chunk", "4", "--cache_strategy", "heavy_hitter", "--prompt_compression_strategy", "hybrid"],
     "profiles the prompt itself"),
    # KVzip's pass over a chunk reads it twice (the chunk, then its repeat input): 2 × 600 > the context
    (["--prefill_chunk", "600", "--cache_strategy", "kvzip", "--max_cache_length", "64", "--prompt", "ab" * 350],
     "KVzip's pass over a 600-token chunk"),
])
def test_generate_answers_bad_chunks_with_one_error_line_and_exit_2(flags, message, tiny_dir, capsys, tmp_path):
    stats = tmp_path / "stats.json"
    with pytest.raises(SystemExit) as exit_:
        run_cli(generate.main, ["--checkpoint_path", str(tiny_dir), "--prompt", "hello there", "--max_new_tokens",
                                "2", "--stats_json", str(stats), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0]
    assert not stats.exists()



def generate_chunk_runs(base: list[str], tmp_path) -> dict[str, dict]:
    """generate.py's statistics for `base` one shot, in one chunk of 64 and in chunks of 5; the one chunk
    decodes the one-shot tokens."""
    runs = {}
    chunks = {"one_shot": [], "one_chunk": ["--prefill_chunk", "64"], "chunks": ["--prefill_chunk", "5"]}
    for name, extra in chunks.items():
        path = tmp_path / f"{name}.json"
        generate.main([*base, *extra, "--stats_json", str(path)])
        runs[name] = json.loads(path.read_text())
    assert runs["one_chunk"]["tokens"] == runs["one_shot"]["tokens"]
    return runs


def test_generate_records_the_chunk_and_one_chunk_is_the_one_shot_run(tiny_dir, tmp_path, capsys):
    """The flag end to end: generate.py with the tiny checkpoint, a 27-byte prompt under a budget of 8."""
    base = ["--checkpoint_path", str(tiny_dir), "--prompt", "a prompt of twenty-seven by", "--max_new_tokens", "4",
            "--cache_strategy", "heavy_hitter", "--max_cache_length", "8", "--recent_window", "2", "--no-chat"]
    runs = generate_chunk_runs(base, tmp_path)
    assert [s["prefill_chunk"] for s in runs["chunks"]["cache_spec"]] == [5, 5]
    assert runs["chunks"]["config"]["prefill_chunk"] == 5
    assert max(max(h) for h in runs["chunks"]["tokens_held_per_head"]) <= 8
