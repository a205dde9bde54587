"""transformers_adapter under a chunked prefill: generate(prefill_chunk_size=N) with caches made with
--prefill_chunk N, against generate.py's own chunked prefill, and a left-padded batch in chunks against each of
its prompts alone. Tolerances: tests/test_transformers_adapter.py's."""

from __future__ import annotations

import pytest
import torch

from cache_setup import attach_caches, cache_config
from errors import UserError
from eval.batching import TIED_SCORES
from generate import prefill
from tests.adapter_helpers import (
    ARCHS,
    BUDGET,
    COMMON,
    MATRIX,
    NEW,
    VARIANTS,
    assert_batch_equals_rows_alone,
    assert_same_run,
    assert_same_statistics,
    cache_flags,
    distinct_prompt,
    hf_generate,
    hf_generate_batch,
    run_our_loop,
    ta,
    tiny_prompt,
    transformers,
)
from tests.strategy_matrix import CHUNKABLE, held_positions
from tests.test_transformers_adapter import LOGIT_ATOL

CHUNK = 16


@pytest.mark.parametrize("strategy", [s for s in MATRIX if s in CHUNKABLE])
def test_a_chunked_prefill_matches_our_loop(strategy, arch_models):
    """generate(prefill_chunk_size=16) under a cache made with --prefill_chunk 16 against generate.py's chunked
    prefill (generate.chunked_prefill): a 49-token prompt in chunks of 16, 16, 16 and a last token (a decode
    step on both sides); greedy tokens and kept positions identical, statistics as test_generate_matches_our_loop's."""
    hf, model, tokenizer = arch_models["llama"]
    flags = cache_flags(strategy) + ["--prefill_chunk", str(CHUNK)]
    cache = assert_same_run(hf, model, tokenizer, flags, tiny_prompt(49), prefill_chunk_size=CHUNK)
    assert_same_statistics(strategy, cache, model)
    assert all(c.chunk_queries is None for c in cache.kv_caches)  # the held queries dropped once decoding began


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_chunked_prefill_with_storages_patterns_and_adakv_matches_our_loop(variant, arch_models):
    hf, model, tokenizer = arch_models["llama"]
    flags = cache_flags(VARIANTS[variant]) + ["--prefill_chunk", str(CHUNK)]
    assert_same_run(hf, model, tokenizer, flags, tiny_prompt(49), prefill_chunk_size=CHUNK)


@pytest.mark.parametrize("strategy", ["heavy_hitter", "tova", "debug_l2"])
def test_one_token_chunks_are_the_token_by_token_feed(strategy, arch_models):
    """--prefill_chunk 1 with prefill_chunk_size=1: every prompt token a decode step, as generate.py's
    --prefill_chunk 1 (itself equal to --feed_long_prompts, tests/test_chunked_prefill.py)."""
    hf, model, tokenizer = arch_models["llama"]
    assert_same_run(hf, model, tokenizer, cache_flags(strategy) + ["--prefill_chunk", "1"], tiny_prompt(30),
                    prefill_chunk_size=1)


# Chunks within the tiny models' sliding window (12 tokens) and past it: a later chunk's mask is read for its rows'
# tokens, and once covered keys from 0, so a chunk longer than the window (on Mistral, whose every layer slides)
# saw none of its own tokens and was refused as padding only.
ARCH_CHUNKS = [8, 16]


@pytest.mark.parametrize("chunk", ARCH_CHUNKS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_chunked_prefill_matches_our_loop_on_every_architecture(arch, chunk, arch_models):
    hf, model, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "16", "--prefill_chunk", str(chunk)]
    assert_same_run(hf, model, tokenizer, flags, tiny_prompt(40), prefill_chunk_size=chunk)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_chunked_prefill_through_quantized_windows_matches_our_loop(arch, arch_models):
    """A sliding layer's window cache takes the chunks too, on both sides: with 4-bit storage a later chunk reads
    the window's held keys dequantized, so a side that prefilled such a layer at once would part from the other
    (it did on Mistral, whose every layer slides). A debug_ twin keeps the other layers' output exact."""
    hf, model, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", "debug_full", "--max_cache_length", "16", "--cache_bits", "4",
             "--prefill_chunk", "8"]
    assert_same_run(hf, model, tokenizer, flags, distinct_prompt(16, 1420), prefill_chunk_size=8)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "got 48 prompt tokens at once: pass prefill_chunk_size=16"),
    ({"prefill_chunk_size": 8}, "got a chunk after a shorter one"),
    ({"prefill_chunk_size": 32}, "got 32 prompt tokens at once"),
])
def test_a_chunked_cache_refuses_a_prompt_not_in_its_chunks(kwargs, message, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    cache = ta.make_cache(hf, cache_flags("tova") + ["--prefill_chunk", str(CHUNK)], 48, NEW)
    with pytest.raises(UserError, match=message):
        hf_generate(hf, tiny_prompt(48), cache, **kwargs)
    cache.reset()  # reusable after a refusal
    assert hf_generate(hf, tiny_prompt(48), cache, prefill_chunk_size=CHUNK)[0] == run_our_loop(
        arch_models["llama"][1], tokenizer, cache_flags("tova") + ["--prefill_chunk", str(CHUNK)], tiny_prompt(48))


@pytest.mark.parametrize("recipe", ["generate_compile_config", "compiled_forward"])
def test_a_compiled_chunked_prefill_is_refused(recipe, arch_models, monkeypatch):
    """A chunk's re-prefill reads counts on the host: under either compile recipe the prompt's chunks would be
    traced, so the hook refuses them with its own message (dynamo carries it when it traces the hook)."""
    hf = arch_models["llama"][0]
    kwargs = {"prefill_chunk_size": CHUNK}
    if recipe == "generate_compile_config":
        config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
        config._compile_all_devices = True
        kwargs["compile_config"] = config
    else:
        monkeypatch.setattr(hf, "forward", torch.compile(hf.forward, fullgraph=True, backend="eager"))
    cache = ta.make_cache(hf, cache_flags("tova") + ["--prefill_chunk", str(CHUNK)], 48, NEW)
    with pytest.raises(Exception, match="a chunked prefill \\(--prefill_chunk\\) runs eager"):
        hf_generate(hf, tiny_prompt(48), cache, **kwargs)


# transformers cuts a padded batch every 16 positions, which is not where its shorter rows' own chunks end: with
# 48 positions, the 33-token row's chunks are 16, 16 and a last token (a decode step inside transformers' third
# chunk), the 29-token row's 16 and 13, each spanning two of transformers' chunks.
CHUNKED_BATCH = [48, 33, 29]
CHUNKED_BUDGET = "10"  # below a chunk: every chunk compresses, so where a row's chunks end decides what it keeps


def assert_chunked_batch_equals_rows_alone(hf, flags: list[str], lengths: list[int], tokenizer=None) -> None:
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(lengths)]
    batch = assert_batch_equals_rows_alone(hf, flags, prompts, tokenizer, prefill_chunk_size=CHUNK)
    for cache in batch.kv_caches:  # every row's held queries dropped once decoding began
        assert cache.chunk_queries is None and not any(q is not None for q, *_ in cache.row_chunk_state.values())


@pytest.mark.parametrize("strategy", [s for s in MATRIX if s in CHUNKABLE])
def test_a_chunked_prefill_of_a_padded_batch_matches_each_row_alone(strategy, arch_models):
    """generate(prefill_chunk_size=16) of a left-padded batch: each row's chunks are its own (16 of its tokens,
    wherever transformers' chunks of the padded batch end), so each row equals its prompt alone through the
    adapter (itself equal to our loop's chunked prefill, test_a_chunked_prefill_matches_our_loop)."""
    hf, _, tokenizer = arch_models["llama"]
    # l2's scores tie exactly where greedy decoding repeats a prompt token (RoPE keeps key norms), and the batch's
    # rounding breaks such a tie its own way (docs/limitations.md): at 10 slots that happens here, at 24 not.
    budget = BUDGET if strategy.removeprefix("debug_") in TIED_SCORES else CHUNKED_BUDGET
    flags = cache_flags(["--cache_strategy", strategy, "--max_cache_length", budget, "--prefill_chunk", str(CHUNK)])
    assert_chunked_batch_equals_rows_alone(hf, flags, CHUNKED_BATCH, tokenizer)


@pytest.mark.parametrize("lengths", [
    [49, 40, 17],  # 49 positions: transformers' last chunk is one token, where the 40-token row's last chunk ends
                   # (8 tokens, its first 7 in the chunk before) and the 17-token row's is a decode step
    [20, 3],       # a row shorter than a chunk
    [5, 40],       # the longer prompt second
    [16, 16],      # no padding: transformers' chunks are the rows' own
])
@pytest.mark.parametrize("strategy", ["heavy_hitter", "debug_tova"])
def test_a_chunked_padded_batch_of_other_lengths_matches_each_row_alone(strategy, lengths, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    assert_chunked_batch_equals_rows_alone(hf, cache_flags(strategy) + ["--prefill_chunk", str(CHUNK)], lengths,
                                           tokenizer)


@pytest.mark.parametrize("variant", ["adakv_heavy_hitter", "4bit_debug_tova", "kivi4_debug_l2", "think_heavy_hitter",
                                     "pyramid", "strategy_pattern"])
def test_a_chunked_padded_batch_with_storages_patterns_and_adakv_matches_each_row_alone(variant, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    assert_chunked_batch_equals_rows_alone(hf, cache_flags(VARIANTS[variant]) + ["--prefill_chunk", str(CHUNK)],
                                           CHUNKED_BATCH, tokenizer)


@pytest.mark.parametrize("chunk", ARCH_CHUNKS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_chunked_padded_batch_matches_each_row_alone_on_every_architecture(arch, chunk, arch_models):
    hf, _, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "16", "--prefill_chunk", str(chunk)]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate([40, 17])]  # the window (12) binds in both
    assert_batch_equals_rows_alone(hf, flags, prompts, tokenizer, prefill_chunk_size=chunk)


def test_a_chunked_padded_batch_needs_make_caches_prompt_lengths(arch_models):
    """Each row's chunks are cut from make_cache's lengths: prompts of other lengths are refused at the first
    chunk, before any row is stored; so is a padded batch fed token by token (its padding would enter as tokens)."""
    hf = arch_models["llama"][0]
    cache = ta.make_cache(hf, cache_flags("tova") + ["--prefill_chunk", str(CHUNK)], [40, 30], NEW)
    with pytest.raises(UserError, match="prompt lengths given to make_cache \\(\\[40, 30\\]\\)"):
        hf_generate_batch(hf, [distinct_prompt(40, 0), distinct_prompt(25, 1)], cache, prefill_chunk_size=CHUNK)
    assert all(int(c.inserted.sum()) == 0 for c in cache.kv_caches)
    cache = ta.make_cache(hf, cache_flags("tova") + ["--prefill_chunk", "1"], [40, 30], NEW)
    with pytest.raises(UserError, match="padded batch fed token by token"):
        hf_generate_batch(hf, [distinct_prompt(40, 0), distinct_prompt(30, 1)], cache, prefill_chunk_size=1)


def test_a_chunked_padded_batch_cut_short_then_reset_runs_as_fresh(arch_models):
    """A padded batch's chunked prefill stopped after its first chunk (here by an error from a forward hook) leaves
    rows' held queries and half chunks behind; cache.reset() drops them, and the batch then decodes as on a new
    cache."""
    hf = arch_models["llama"][0]
    flags = cache_flags(["--cache_strategy", "tova", "--max_cache_length", CHUNKED_BUDGET, "--prefill_chunk",
                         str(CHUNK)])
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(CHUNKED_BATCH)]
    fresh, _ = hf_generate_batch(hf, prompts, ta.make_cache(hf, flags, CHUNKED_BATCH, NEW), prefill_chunk_size=CHUNK)
    cache = ta.make_cache(hf, flags, CHUNKED_BATCH, NEW)
    forwards = []

    def stop_at_second(module, args, kwargs):
        forwards.append(1)
        if len(forwards) == 2:
            raise RuntimeError("stopped")

    handle = hf.register_forward_pre_hook(stop_at_second, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            hf_generate_batch(hf, prompts, cache, prefill_chunk_size=CHUNK)
    finally:
        handle.remove()
    assert any(q is not None for c in cache.kv_caches for q, *_ in c.row_chunk_state.values())
    cache.reset()
    assert hf_generate_batch(hf, prompts, cache, prefill_chunk_size=CHUNK)[0] == fresh


@pytest.mark.parametrize("arch", ARCHS)
def test_a_chunk_after_the_prompt_matches_our_append_on_every_architecture(arch, arch_models):
    """The kvpress protocol's question: a chunk after the prompt in one forward call goes into the cache's empty
    slots on both sides (KVCache.append); logits of every question position within LOGIT_ATOL, the same held
    positions. A sliding layer's window cache is full after the prompt: the adapter refuses the chunk in one line
    before any layer stores it (eval feeds such a question token by token instead)."""
    hf, model, tokenizer = arch_models[arch]
    ids = tiny_prompt(40)
    prompt, question = ids[:24], ids[24:]
    flags = cache_flags(["--cache_strategy", "heavy_hitter", "--max_cache_length", "48"])  # room for the question
    specs = attach_caches(model, cache_config(flags), len(prompt), len(question) + 1, tokenizer)
    cache = ta.make_cache(hf, flags, len(prompt), len(question) + 1, tokenizer=tokenizer)
    with torch.inference_mode():
        hf(torch.tensor([prompt]), cache=cache, use_cache=True)
        if any(spec.sliding_window for spec in specs):
            with pytest.raises(UserError, match="a layer has room for 0"):
                hf(torch.tensor([question]), cache=cache, use_cache=True)
            assert all(int(c.inserted.max()) == len(prompt) for c in cache.kv_caches)
            return
        theirs = hf(torch.tensor([question]), cache=cache, use_cache=True).logits[0]
        model.reset_caches()
        prefill(model, torch.tensor([prompt]))
        ours = model(torch.tensor([question]), torch.arange(len(prompt), len(ids)), append=True)[0]
    torch.testing.assert_close(theirs.float(), ours, atol=LOGIT_ATOL, rtol=0)
    for layer, (their_cache, our_cache) in enumerate(zip(cache.kv_caches, model.caches(), strict=True)):
        assert held_positions(their_cache) == held_positions(our_cache), f"layer {layer}"


@pytest.mark.parametrize("recovery", ["0.5", "0.178"])
def test_a_last_one_token_chunk_comes_after_hybrids_cut_as_in_our_loop(recovery, arch_models):
    """A 49-token prompt in chunks of 16 ends in a one-token chunk, which both sides feed as the first decode step:
    hybrid cuts the prompt to its heads' policies when the prefill ends, before that step. generate.py's loop once
    ended the prefill after it while the adapter ended it before, so at recovery fractions below the default (0.95)
    the two kept other tokens."""
    hf, model, tokenizer = arch_models["llama"]
    flags = cache_flags("hybrid") + ["--min_recovery_frac", recovery, "--prefill_chunk", str(CHUNK)]
    assert_same_run(hf, model, tokenizer, flags, tiny_prompt(49), prefill_chunk_size=CHUNK)
