"""Chunked prefill with re-rotated positions (--prefill_chunk with --rerotate_positions): after the first chunk
RoPE sees ranks, the held tokens of each head at 0..n−1 in order of position and the chunk at n..n+T−1, for the
chunk's attention and for the prompt rule's scoring, so a prompt longer than the model's context goes through
at a fixed budget (the ranks stay below budget + chunk).

Prompts of 60 tokens through a model whose context is 32:
- a one-layer model's last logits equal the token-by-token feed (--feed_long_prompts) with re-rotation for
  recent_global, whose chunked attention is then the same set of tokens at the same ranks: a chunk of T over a
  budget of L sees the sinks and the newest L − G + T tokens, as a budget of L + T does token by token (1e-5);
- chunks of one token equal --feed_long_prompts exactly, every strategy that fits the context;
- layer 0 keeps what a naive chunk-by-chunk rule keeps when every virtual prompt is rotated at its ranks;
- every strategy that fits the context: the budget holds, ranks never pass budget + chunk, decoding follows.
"""

from __future__ import annotations

import json

import pytest
import torch

import generate
from cache_setup import attach_caches, cache_config
from errors import UserError, run_cli
from gates import attach_random_gates
from generate import chunked_prefill, decode_one_token, prefill
from rope import apply_rope
from tests.conftest import make_tiny_model
from tests.strategy_matrix import CHUNKABLE, GLOBAL, MATRIX_FLAGS, RECENT, STORAGES, TOKEN_CLASSES, held_positions
from tests.test_chunked_prefill import ATOL, RULE_FLAGS, naive_keep

CONTEXT, LONG, NEW = 32, 60, 4
# Every chunkable strategy whose cache fits the context (a debug_ twin's full reference holds the whole sequence).
FITS = [s for s in CHUNKABLE if not s.startswith("debug_") and s != "full"]


def long_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, LONG + NEW), generator=torch.Generator().manual_seed(seed))


def rotated_caches(model, strategy: str, budget: int, *extra: str, storage: str = "dense"):
    args = cache_config(["--cache_strategy", strategy, "--max_cache_length", str(budget), "--global_tokens",
                         str(GLOBAL), "--recent_window", str(RECENT), "--rerotate_positions", *STORAGES[storage],
                         *MATRIX_FLAGS.get(strategy, []), *RULE_FLAGS.get(strategy, []), *extra])
    if model.layers[0].attention.gate is None:
        attach_random_gates(model, seed=0)
    attach_caches(model, args, LONG, NEW, classes=TOKEN_CLASSES)
    return model.caches()


def test_rerotated_chunks_past_the_context_equal_the_token_by_token_feed():
    model = make_tiny_model(n_layer=1, context_length=CONTEXT)
    ids = long_ids()
    chunk, budget = 6, 10  # 60 tokens: ten full chunks
    rotated_caches(model, "recent_global", budget)
    with torch.inference_mode():
        model.reset_caches()
        chunked = chunked_prefill(model, ids[:, :LONG], chunk, decode_one_token)
    rotated_caches(model, "recent_global", budget + chunk, "--feed_long_prompts")
    with torch.inference_mode():
        model.reset_caches()
        fed = prefill(model, ids[:, :LONG], prefill_length=1)
    torch.testing.assert_close(chunked, fed, atol=ATOL, rtol=0)


@pytest.mark.parametrize("strategy", FITS)
def test_rerotated_chunks_of_one_token_are_feed_long_prompts_past_the_context(strategy):
    model = make_tiny_model(context_length=CONTEXT)
    ids = long_ids()
    caches = rotated_caches(model, strategy, 10, "--prefill_chunk", "1")
    with torch.inference_mode():
        model.reset_caches()
        chunked = prefill(model, ids[:, :LONG])
        chunked_held = [held_positions(c) for c in caches]
    caches = rotated_caches(model, strategy, 10, "--feed_long_prompts")
    with torch.inference_mode():
        model.reset_caches()
        fed = prefill(model, ids[:, :LONG], prefill_length=1)
        fed_held = [held_positions(c) for c in caches]
    torch.testing.assert_close(chunked, fed, atol=0, rtol=0)
    assert chunked_held == fed_held


def layer0_plain_qkv(model, ids):
    """Layer 0's queries, keys and values before RoPE: [H, T, D], [n_kv, T, D], [n_kv, T, D]."""
    a = model.layers[0].attention
    x = model.layers[0].attention_norm(model.tok_embeddings(ids))
    T = ids.shape[1]
    q, k, v = (w(x).view(1, T, -1, a.head_dim).transpose(1, 2)[0] for w in (a.wq, a.wk, a.wv))
    return q, k, v


def naive_rotated_chunks(model, rule: str, q, k, v, chunk: int, budget: int, heads: int):
    """Chunk by chunk: head h's held tokens + the chunk, rotated at their ranks 0..N−1, kept by the rule."""
    held = [[] for _ in range(heads)]
    cos, sin = model.rope_cos, model.rope_sin
    for start in range(0, LONG, chunk):
        new = list(range(start, min(start + chunk, LONG)))
        for h in range(heads):
            cand = held[h] + new
            if len(cand) <= budget:
                held[h] = cand
                continue
            ranks = torch.arange(len(cand))
            qr, kr = torch.zeros_like(q), torch.zeros_like(k)  # indexed by position, rotated at the ranks
            qr[:, cand] = apply_rope(q[:, cand], cos[ranks], sin[ranks])
            kr[:, cand] = apply_rope(k[:, cand], cos[ranks], sin[ranks])
            held[h] = naive_keep(rule, cand, budget, qr, kr, v, h)
    return [set(x) for x in held]


@pytest.mark.parametrize("chunk", [5, 9])
@pytest.mark.parametrize("rule", ["recent_global", "tova", "heavy_hitter", "keep_it_odd"])
def test_rerotated_layer0_keeps_what_the_naive_rule_keeps_at_ranks(rule, chunk):
    model = make_tiny_model(context_length=CONTEXT)
    ids = long_ids()
    caches = rotated_caches(model, rule, 10)
    with torch.inference_mode():
        model.reset_caches()
        chunked_prefill(model, ids[:, :LONG], chunk, decode_one_token)
        q, k, v = layer0_plain_qkv(model, ids[:, :LONG])
        heads = model.args.n_kv_head if caches[0].head_specific else 1
        want = naive_rotated_chunks(model, rule, q, k, v, chunk, 10, heads)
    assert held_positions(caches[0])[:heads] == want


@pytest.mark.parametrize("strategy", FITS)
def test_every_strategy_prefills_past_the_context_at_its_budget_and_decodes(strategy):
    """The RoPE tables have CONTEXT rows: a position past them would fail the lookup."""
    model = make_tiny_model(context_length=CONTEXT)
    ids = long_ids()
    chunk, budget = 7, 12
    caches = rotated_caches(model, strategy, budget, "--prefill_chunk", str(chunk))
    with torch.inference_mode():
        model.reset_caches()
        logits = prefill(model, ids[:, :LONG])
        for cache in caches:
            assert int(cache.held_tokens().max()) <= budget and int(cache.inserted.min()) == LONG
        out = [logits]
        for p in range(LONG, LONG + NEW):
            out.append(decode_one_token(model, out[-1].argmax(-1, keepdim=True), torch.tensor([p])))
    assert torch.isfinite(torch.stack(out)).all()


def test_a_chunk_whose_ranks_would_pass_the_context_is_refused():
    model = make_tiny_model(context_length=CONTEXT)
    with pytest.raises((ValueError, UserError), match="ranks"):  # the model, or cache_setup when it checks first
        rotated_caches(model, "recent_global", 28, "--prefill_chunk", "8")
    with pytest.raises(UserError):
        rotated_caches(model, "recent_global", 40)  # a budget past the context (cache_setup.check_budgets)


WHOLE = [s for s in CHUNKABLE if s not in FITS]  # hold the whole sequence: it must fit the context


@pytest.mark.parametrize("strategy", WHOLE)
def test_caches_holding_the_whole_sequence_take_rerotated_chunks_within_the_context(strategy):
    """debug_ twins (the shadow compresses at ranks, the full reference holds every token at its position) and
    the full cache: a 24-token prompt in chunks of 7 within a context of 32; the first chunk is the prefill."""
    model = make_tiny_model(context_length=CONTEXT)
    ids = long_ids()
    args = cache_config(["--cache_strategy", strategy, "--max_cache_length", "10", "--global_tokens", str(GLOBAL),
                         "--recent_window", str(RECENT), "--rerotate_positions", "--prefill_chunk", "7",
                         *MATRIX_FLAGS.get(strategy.removeprefix("debug_"), [])])
    if model.layers[0].attention.gate is None:
        attach_random_gates(model, seed=0)
    attach_caches(model, args, 24, NEW, classes=TOKEN_CLASSES)
    with torch.inference_mode():
        model.reset_caches()
        out = [prefill(model, ids[:, :24])]
        for p in range(24, 24 + NEW):
            out.append(decode_one_token(model, out[-1].argmax(-1, keepdim=True), torch.tensor([p])))
    assert torch.isfinite(torch.stack(out)).all()
    for cache in model.caches():
        shadow = getattr(cache, "shadow", None)
        if shadow is not None and shadow.name != "full":
            assert int(shadow.held_tokens().max()) <= 10 and int(shadow.inserted.min()) == 24 + NEW


def test_generate_prefills_a_prompt_past_the_context_in_rerotated_chunks(tiny_dir, tmp_path, capsys):
    """End to end: a prompt of 1100 bytes through the tiny checkpoint's context of 1024 tokens, 256 at a time
    into a budget of 64; without chunks (or with ranks past the context) the same prompt is one error line."""
    prompt = "".join(chr(97 + (i * 7) % 26) for i in range(1100))
    base = ["--checkpoint_path", str(tiny_dir), "--prompt", prompt, "--max_new_tokens", "3", "--no-chat",
            "--cache_strategy", "recent_global", "--max_cache_length", "64", "--rerotate_positions"]
    stats = tmp_path / "stats.json"
    generate.main([*base, "--prefill_chunk", "256", "--stats_json", str(stats)])
    run = json.loads(stats.read_text())
    assert run["prompt_tokens"] > 1024 and max(max(h) for h in run["tokens_held_per_head"]) <= 64
    for flags, message in [([], "exceeds the model's context"), (["--prefill_chunk", "980"], "ranks up to")]:
        with pytest.raises(SystemExit) as exit_:
            run_cli(generate.main, [*base, *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and message in err[0]
