"""transformers_adapter: `model.generate` of a transformers model under this project's caches, against
generate.py's own loop with the same flags.

References, none produced by the adapter: (1) generate.generate on this project's Transformer loaded from the
same weights (the bundled GGUF; tiny random checkpoints written by transformers for the other
architectures), with caches built as generate.main builds them; (2) transformers' own DynamicCache for `full`.
Tolerances: float32 on both sides; greedy tokens and kept positions (per layer and KV head) must be identical;
logits within LOGIT_ATOL (test_model_parity measures |Δlogit| ≈ 1e-4 between the two models); attention loss
within 1e-4 (both sides round it to 5 decimals from probabilities that differ in the last float32 bits).
"""

from __future__ import annotations

import pytest
import torch

from cache import cache_statistics
from cache_setup import attach_caches, cache_config
from checkpoint import load_checkpoint
from errors import UserError
from eval.batching import TIED_SCORES
from generate import generate
from strategies import CACHE_STRATEGIES
from strategies.debug import attention_loss_curve
from tests.strategy_matrix import ALL, CHUNKABLE, STORAGES, held_positions

transformers = pytest.importorskip("transformers")
ta = pytest.importorskip("transformers_adapter")

NEW = 8
BUDGET = "24"  # of a 48-token prompt + 8 new tokens: the prompt is compressed and decoding evicts
COMMON = ["--global_tokens", "2", "--recent_window", "4", "--snapkv_window", "8"]
LOGIT_ATOL = 1e-3
# The registry's strategies and debug_ twins (tests/strategy_matrix.ALL), minus those that need learned gates
# (refused: test_gated_caches_are_refused); a new strategy joins automatically. FAST: also on the bundled model.
FAST = {"heavy_hitter", "hybrid", "debug_l2", "duo_attention", "threshold"}


def _needs_gates(name: str) -> bool:
    return CACHE_STRATEGIES[name.removeprefix("debug_")].needs_gates


# KVzip's reconstruction pass runs in generate.prefill (our model); through transformers a kvzip cache scores
# the prompt by its own queries instead, another rule: left out (docs/limitations.md).
MATRIX = [s for s in ALL if not _needs_gates(s) and s.removeprefix("debug_") != "kvzip"]
# Storages, budget patterns, prompt rules and Ada-KV allocation on top of a strategy (flags beyond COMMON).
# Quantized storages run under debug_ twins: the two models' keys differ by ~1e-6 before quantization, which
# flips one 4-bit code in a few layers (measured: layers 5, 8, 16 of 30 at prefill), a whole quantization step;
# when the quantized cache drives the output (4bit tova / keydiff / l2, measured) that moves a near-tie eviction
# or a later token. Under debug_ the output is the full cache's while the shadow's quantized storage takes every
# insert, so kept positions stay comparable.
VARIANTS = {
    "adakv_heavy_hitter": ["--cache_strategy", "heavy_hitter", "--budget_allocation", "adakv"],
    "4bit_debug_tova": ["--cache_strategy", "debug_tova", *STORAGES["4bit"]],
    "kivi4_debug_l2": ["--cache_strategy", "debug_l2", *STORAGES["kivi4"]],
    "2bit_debug_heavy_hitter": ["--cache_strategy", "debug_heavy_hitter", *STORAGES["2bit"]],
    "adakv_debug_tova": ["--cache_strategy", "debug_tova", "--budget_allocation", "adakv"],
    "adakv_8bit_debug_keydiff": ["--cache_strategy", "debug_keydiff", "--budget_allocation", "adakv",
                                 *STORAGES["8bit"]],
    "budgets_repeat": ["--cache_strategy", "heavy_hitter", "--max_cache_length", "16", "32",
                       "--cache_length_pattern", "repeat"],
    "pyramid": ["--cache_strategy", "tova", "--cache_length_pattern", "pyramid"],
    "strategy_pattern": ["--cache_strategy", "l2", "heavy_hitter", "--cache_strategy_pattern", "repeat"],
    "prompt_rule": ["--cache_strategy", "recent_global", "--prompt_compression_strategy", "keep_it_odd"],
    "preset": ["--cache_config", "alternating_local_global"],
}
FAST_VARIANTS = {"adakv_heavy_hitter"}


def cache_flags(strategy_or_flags: str | list[str]) -> list[str]:
    flags = ["--cache_strategy", strategy_or_flags] if isinstance(strategy_or_flags, str) else strategy_or_flags
    budget = [] if "--max_cache_length" in flags or "--cache_config" in flags else ["--max_cache_length", BUDGET]
    return [*COMMON, *budget, *flags]


def run_our_loop(model, tokenizer, flags: list[str], prompt: list[int], new: int = NEW):
    """generate.main's path: flags (a preset included) -> specs -> model policies -> caches -> the loop."""
    attach_caches(model, cache_config(flags), len(prompt), new, tokenizer)
    return generate(model, prompt, new, eos_ids=[]).tokens


def hf_generate(hf_model, prompt: list[int], cache=None, new: int = NEW, **kwargs):
    tokens, scores = hf_generate_batch(hf_model, [prompt], cache, new, **kwargs)
    return tokens[0], scores[0]


@pytest.fixture(scope="module")
def prompt(bundled_session) -> list[int]:
    import pydoc_data.topics

    ids = bundled_session[1].encode(pydoc_data.topics.topics["with"][:600])[:48]
    assert len(ids) == 48
    return ids


def assert_same_run(hf_model, model, tokenizer, flags: list[str], prompt: list[int], **generate_kwargs):
    ours = run_our_loop(model, tokenizer, flags, prompt)
    cache = ta.make_cache(hf_model, flags, len(prompt), NEW, tokenizer=tokenizer)
    tokens, _ = hf_generate(hf_model, prompt, cache, **generate_kwargs)
    assert len(ours) == NEW and tokens == ours
    for layer, (theirs, mine) in enumerate(zip(cache.kv_caches, model.caches(), strict=True)):
        assert held_positions(theirs) == held_positions(mine), f"layer {layer}"
    return cache


# ---- every strategy against generate.py's loop: the registry on a tiny random Llama, a few on the bundled model --


def assert_same_statistics(strategy: str, cache, model) -> None:
    stats, ours = cache.statistics(), cache_statistics(model.caches())
    if strategy.removeprefix("debug_") != "full":
        assert stats["compression_ratio"] > 0 and sum(stats["evictions_per_layer"]) > 0  # it really evicts
    for key in ("compression_ratio", "compression_ratio_per_head", "tokens_held_per_head", "evictions_per_layer",
                "cache_budget_per_head", "cache_bytes", "cache_kv_bytes"):
        assert stats[key] == ours[key], key
    if strategy.startswith("debug_"):
        assert stats["attention_loss_mean"] == pytest.approx(ours["attention_loss_mean"], abs=1e-4)
        assert stats["attention_loss_per_head"] == [pytest.approx(x, abs=1e-4) for x in ours["attention_loss_per_head"]]
        curve = attention_loss_curve(model.caches())
        assert stats["attention_loss_cumulative_by_step"] == {k: pytest.approx(v, abs=1e-4) for k, v in curve.items()}


# The whole registry runs on the tiny random Llama (a second a case; the adapter's equality is about the cache
# plumbing, not the weights), and FAST also on the bundled model, where a case costs ~10 s.
@pytest.mark.parametrize("strategy", MATRIX)
def test_generate_matches_our_loop(strategy, arch_models):
    hf, model, tokenizer = arch_models["llama"]
    cache = assert_same_run(hf, model, tokenizer, cache_flags(strategy), tiny_prompt(48))
    assert_same_statistics(strategy, cache, model)


@pytest.mark.parametrize("strategy", sorted(FAST))
def test_bundled_model_matches_our_loop(strategy, hf_bundled, bundled, prompt):
    model, tokenizer = bundled
    cache = assert_same_run(hf_bundled, model, tokenizer, cache_flags(strategy), prompt)
    assert_same_statistics(strategy, cache, model)


@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v in FAST_VARIANTS else pytest.mark.slow)
                                     for v in VARIANTS])
def test_storages_patterns_and_adakv_match_our_loop(variant, hf_bundled, bundled, prompt):
    model, tokenizer = bundled
    assert_same_run(hf_bundled, model, tokenizer, cache_flags(VARIANTS[variant]), prompt)


@pytest.mark.parametrize("storage", ["4bit", "kivi4"])
def test_a_quantized_cache_driving_transformers_attends_from_its_codes(storage, hf_bundled, prompt, monkeypatch):
    # The adapter's decode step reads the slots itself (attention.attend_slots): on quantized storage from the codes,
    # checked at every layer and step against the float64 attention over the K/V rebuilt from them. (The run is
    # not compared with our loop: a ~1e-6 difference in transformers' keys can flip a 4-bit code.)
    from tests.test_quantized_attention import checked_attend

    calls: list = []
    checked_attend(monkeypatch, calls)
    cache = ta.make_cache(hf_bundled, cache_flags(["--cache_strategy", "heavy_hitter", *STORAGES[storage]]),
                          len(prompt), NEW)
    hf_generate(hf_bundled, prompt, cache)
    assert len(calls) == (NEW - 1) * len(cache.kv_caches) and max(calls) < 1e-5


def test_full_equals_transformers_dynamic_cache(hf_bundled, prompt):
    hf_bundled.set_attn_implementation("sdpa")  # transformers' own attention and DynamicCache: the reference
    reference, ref_scores = hf_generate(hf_bundled, prompt)
    cache = ta.make_cache(hf_bundled, cache_flags("full"), len(prompt), NEW)
    tokens, scores = hf_generate(hf_bundled, prompt, cache)
    assert tokens == reference
    torch.testing.assert_close(scores, ref_scores, atol=LOGIT_ATOL, rtol=0)
    # Switched to the eviction attention, any other cache still gets transformers' SDPA (the fallback).
    assert hf_bundled.config._attn_implementation == ta.ATTENTION_NAME
    assert hf_generate(hf_bundled, prompt)[0] == reference


def test_a_cache_is_reusable_after_reset(hf_bundled, bundled, prompt):
    model, tokenizer = bundled
    flags = cache_flags("tova")
    ours = run_our_loop(model, tokenizer, flags, prompt)
    cache = ta.make_cache(hf_bundled, flags, len(prompt), NEW)
    assert hf_generate(hf_bundled, prompt, cache)[0] == ours
    assert int(cache.get_seq_length()) == len(prompt) + NEW - 1  # tokens seen, not held (24)
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    assert hf_generate(hf_bundled, prompt, cache)[0] == ours


# ---- every supported architecture, on tiny random checkpoints written by transformers -----------------------


ARCHS = ["llama", "mistral", "qwen2_window", "qwen3", "gemma3", "phi3"]


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory):
    from tests.arch_helpers import save_tiny_model

    models = {}
    for arch in ARCHS:
        directory = tmp_path_factory.mktemp(arch)
        hf = save_tiny_model(arch, directory)
        models[arch] = (hf, *load_checkpoint(str(directory), "cpu", torch.float32))
    return models


def tiny_prompt(n: int = 24) -> list[int]:
    return torch.randint(3, 160, (n,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("strategy", ["heavy_hitter", "debug_tova"])
def test_every_architecture_matches_our_loop(arch, strategy, arch_models):
    hf, model, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", strategy, "--max_cache_length", "16"]
    cache = assert_same_run(hf, model, tokenizer, flags, tiny_prompt())
    if model.args.sliding_window:  # the window (12) binds: sliding layers hold a window cache, as generate.py's
        sliding = [i for i in range(model.args.n_layer) if model.args.layer_window(i)]
        assert sliding and all(cache.kv_caches[i].name == "recent_global" for i in sliding)


# ---- batches: left-padded prompts of different lengths, each row as it runs alone ----------------------------

BATCH_LENGTHS = [48, 37, 29]  # rows of their own budgets (a fraction resolves per row) and their own positions
ROW_STATISTICS = ("compression_ratio", "compression_ratio_per_head", "tokens_held_per_head", "evictions_per_layer",
                  "cache_budget_per_head")


def distinct_prompt(n: int, seed: int) -> list[int]:
    """Tokens without repeats: l2's key-norm scores tie exactly on a repeated token, and a batch's products round
    differently from one row's, so such ties could break differently (docs/limitations.md)."""
    return (torch.randperm(157, generator=torch.Generator().manual_seed(seed))[:n] + 3).tolist()


def hf_generate_batch(hf_model, prompts: list[list[int]], cache, new: int = NEW, **kwargs):
    """transformers' batch: prompts left-padded with token 0, its attention mask marking the padding."""
    x, mask = ta.left_padded(prompts)
    T = x.shape[1]
    out = hf_model.generate(x, attention_mask=mask, cache=cache, max_new_tokens=new, do_sample=False,
                            pad_token_id=0, return_dict_in_generate=True, output_scores=True,
                            **{"eos_token_id": None, **kwargs})
    return out.sequences[:, T:].tolist(), torch.stack(out.scores, dim=1)


def assert_batch_equals_rows_alone(hf, flags: list[str], prompts: list[list[int]], tokenizer=None,
                                   **generate_kwargs):
    """The batch against each prompt alone through the adapter (itself equal to our loop, above): greedy tokens,
    kept positions per layer and KV head and the row's statistics identical; scores within BATCH_ATOL."""
    batch = ta.make_cache(hf, flags, [len(p) for p in prompts], NEW, tokenizer=tokenizer)
    tokens, scores = hf_generate_batch(hf, prompts, batch, **generate_kwargs)
    assert int(batch.get_seq_length()) == max(map(len, prompts)) + NEW - 1  # positions fed, padding included
    for b, prompt in enumerate(prompts):
        alone = ta.make_cache(hf, flags, len(prompt), NEW, tokenizer=tokenizer)
        row_tokens, row_scores = hf_generate(hf, prompt, alone, **generate_kwargs)
        assert tokens[b] == row_tokens, f"row {b}"
        torch.testing.assert_close(scores[b], row_scores, atol=BATCH_ATOL, rtol=0)
        for layer, (batched, single) in enumerate(zip(batch.kv_caches, alone.kv_caches, strict=True)):
            with batched.row(b):
                assert held_positions(batched) == held_positions(single), f"row {b}, layer {layer}"
        row, ref = batch.statistics(row=b), alone.statistics()
        for key in ROW_STATISTICS:
            assert row[key] == ref[key], (b, key)
        if "attention_loss_mean" in ref:
            assert row["attention_loss_mean"] == pytest.approx(ref["attention_loss_mean"], abs=1e-4)
    return batch


# float32 on both sides: the batch's products run over 3 × 48 rows where a row alone runs over its own, which
# rounds differently in the last bits (measured: at most 5.9e-6 over the matrix, on scores up to ~4).
BATCH_ATOL = 1e-4


@pytest.mark.parametrize("strategy", MATRIX)
def test_a_padded_batch_matches_each_row_alone(strategy, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(BATCH_LENGTHS)]
    assert_batch_equals_rows_alone(hf, cache_flags(strategy), prompts, tokenizer)


def compile_config_kwargs() -> dict:
    """generate's auto-compile of the decode step on the CPU (fullgraph, static shapes; the eager backend:
    the trace is what matters here)."""
    config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
    config._compile_all_devices = True
    return {"compile_config": config}


@pytest.mark.parametrize(("strategy", "recipe"), [("heavy_hitter", "eager"), ("debug_tova", "eager"),
                                                  ("heavy_hitter", "compile_config"), ("debug_tova", "criteria")])
def test_a_row_that_stops_keeps_its_statistics_at_its_eos(strategy, recipe, arch_models):
    """With make_cache's eos_token_id (generate's), a row that makes its EOS has its statistics taken before the
    EOS is fed, and before transformers feeds it padding for the rest of the batch: equal to its prompt's alone,
    which stops there. Eager the forward hook takes them; under compile_config, where the hook is traced,
    cache.stopping_criteria() does, between steps (and gives the same snapshots eager)."""
    hf, _, tokenizer = arch_models["llama"]
    flags = cache_flags(strategy)
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(BATCH_LENGTHS)]
    free, _ = hf_generate_batch(hf, prompts, ta.make_cache(hf, flags, BATCH_LENGTHS, NEW))
    # A token a row makes first at its third step or later: as EOS, that row stops there while the batch goes
    # on (other rows may stop too, where they make it).
    stopper, at = next((b, i) for i in range(2, NEW - 1) for b, row in enumerate(free) if row[i] not in row[:i])
    eos = free[stopper][at]
    batch = ta.make_cache(hf, flags, BATCH_LENGTHS, NEW, eos_token_id=eos)
    kwargs = {"compile_config": compile_config_kwargs()["compile_config"]} if recipe == "compile_config" else {}
    if recipe != "eager":
        kwargs["stopping_criteria"] = batch.stopping_criteria()
    tokens, _ = hf_generate_batch(hf, prompts, batch, eos_token_id=eos, **kwargs)
    assert tokens[stopper][: at + 1] == free[stopper][: at + 1] and batch.row_snapshots[stopper] is not None
    for b, prompt in enumerate(prompts):
        alone = ta.make_cache(hf, flags, len(prompt), NEW, eos_token_id=eos)
        row_tokens, _ = hf_generate(hf, prompt, alone, eos_token_id=eos)
        assert tokens[b][: len(row_tokens)] == row_tokens, b
        row, ref = batch.statistics(row=b), alone.statistics()
        for key in ROW_STATISTICS:
            assert row[key] == ref[key], (b, key)
    batch.reset()
    assert batch.row_snapshots == [None] * 3


def test_stopping_criteria_need_the_eos(arch_models):
    hf = arch_models["llama"][0]
    with pytest.raises(UserError, match=r"make_cache\(..., eos_token_id=...\)"):
        ta.make_cache(hf, cache_flags("tova"), BATCH_LENGTHS, NEW).stopping_criteria()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_padded_batch_with_storages_patterns_and_adakv_matches_each_row_alone(variant, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(BATCH_LENGTHS)]
    assert_batch_equals_rows_alone(hf, cache_flags(VARIANTS[variant]), prompts, tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_padded_batch_matches_each_row_alone_on_every_architecture(arch, arch_models):
    hf, model, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.5"]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate([30, 17])]  # the window (12) binds in both
    assert_batch_equals_rows_alone(hf, flags, prompts, tokenizer)


# ---- chunked prefill: transformers' prefill_chunk_size against our --prefill_chunk ------------------------------

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


@pytest.mark.parametrize("arch", ARCHS)
def test_a_chunked_prefill_matches_our_loop_on_every_architecture(arch, arch_models):
    hf, model, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "16", "--prefill_chunk", "8"]
    assert_same_run(hf, model, tokenizer, flags, tiny_prompt(30), prefill_chunk_size=8)


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
        assert cache.chunk_queries is None and not any(q is not None for q in cache.row_chunk_queries.values())


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


@pytest.mark.parametrize("variant", ["adakv_heavy_hitter", "4bit_debug_tova", "kivi4_debug_l2", "pyramid",
                                     "strategy_pattern"])
def test_a_chunked_padded_batch_with_storages_patterns_and_adakv_matches_each_row_alone(variant, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    assert_chunked_batch_equals_rows_alone(hf, cache_flags(VARIANTS[variant]) + ["--prefill_chunk", str(CHUNK)],
                                           CHUNKED_BATCH, tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_chunked_padded_batch_matches_each_row_alone_on_every_architecture(arch, arch_models):
    hf, _, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "16", "--prefill_chunk", "8"]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate([30, 17])]  # the window (12) binds in both
    assert_batch_equals_rows_alone(hf, flags, prompts, tokenizer, prefill_chunk_size=8)


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
    assert any(q is not None for c in cache.kv_caches for q in c.row_chunk_queries.values())
    cache.reset()
    assert hf_generate_batch(hf, prompts, cache, prefill_chunk_size=CHUNK)[0] == fresh


# ---- compiled, as transformers compiles a static cache's decode step --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("recipe", ["generate_compile_config", "compiled_forward"])
def test_compiled_matches_eager_without_recompiling(recipe, rows, arch_models, monkeypatch):
    """transformers' two recipes for a static cache: generate's auto-compile of the decode step (a compileable
    cache + compile_config; _compile_all_devices lets it run on the CPU), and model.forward = torch.compile(...)
    (prefill compiled too), for one prompt and for a left-padded batch of two. fullgraph and static shapes: one
    graph per kind of forward for every step, and none more for a second cache of the same flags. The backend
    counts graphs and runs them as traced."""
    hf, _, _ = arch_models["llama"]
    graphs = []

    def counting_backend(gm, example_inputs):  # a function: CompileConfig deep-copies its backend
        graphs.append(gm)
        return gm.forward

    kwargs = {}
    if recipe == "generate_compile_config":
        config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend=counting_backend, mode=None)
        config._compile_all_devices = True
        kwargs = dict(compile_config=config)
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "16"]
    prompts = [tiny_prompt(), distinct_prompt(17, 1)][:rows]
    lengths = [len(p) for p in prompts]
    eager, eager_scores = hf_generate_batch(hf, prompts, ta.make_cache(hf, flags, lengths, NEW))
    if recipe == "compiled_forward":
        monkeypatch.setattr(hf, "forward", torch.compile(hf.forward, fullgraph=True, backend=counting_backend))
    for _ in range(2):
        tokens, scores = hf_generate_batch(hf, prompts, ta.make_cache(hf, flags, lengths, NEW), **kwargs)
        assert tokens == eager
        torch.testing.assert_close(scores, eager_scores, atol=1e-5, rtol=0)
    assert len(graphs) == (1 if recipe == "generate_compile_config" else 2)  # decode (and prefill)


# ---- refused, each with one clear error -------------------------------------------------------------------


def test_gated_caches_are_refused(arch_models):
    hf = arch_models["llama"][0]
    for name in [s for s in ALL if _needs_gates(s)]:
        with pytest.raises(UserError, match="learned gates"):
            ta.make_cache(hf, [*COMMON, "--cache_strategy", name, "--max_cache_length", "16"], 24, NEW)


@pytest.mark.parametrize("flags, message", [
    (["--rerotate_positions"], "rerotate_positions is not supported"),
    (["--feed_long_prompts"], "feed_long_prompts is not supported.*--prefill_chunk 1"),
    (["--cache_strategy", "hybrid"], "pass make_cache\\(..., tokenizer=tokenizer\\)"),
    (["--cache_strategy", "nope"], "unknown cache strategy"),
])
def test_unsupported_flags_are_refused(flags, message, arch_models):
    hf = arch_models["llama"][0]
    with pytest.raises(UserError, match=message):
        ta.make_cache(hf, [*COMMON, "--max_cache_length", "16", *flags], 24, NEW)


def test_unsupported_and_multimodal_architectures_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'.*supported: llama"):
        ta.make_cache(gpt2, ["--cache_strategy", "full"], 8, 4)
    multimodal = torch.nn.Module()
    multimodal.config = transformers.Gemma3Config()  # a config only: the check comes before any weight is read
    with pytest.raises(UserError, match="multimodal.*Gemma3ForCausalLM"):
        ta.model_args_of(multimodal)


def test_a_model_that_cannot_switch_attention_is_refused(tmp_path, monkeypatch):
    from tests.arch_helpers import save_tiny_model

    hf = save_tiny_model("llama", tmp_path)
    monkeypatch.setattr(type(hf), "_can_set_attn_implementation", lambda self: False)
    with pytest.raises(UserError, match="cannot switch its attention implementation"):
        ta.make_cache(hf, ["--cache_strategy", "full"], 8, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), "beam search|one sequence"),
    (dict(do_sample=True, num_return_sequences=2), "num_return_sequences"),
])
def test_beam_search_and_several_sequences_are_refused(kwargs, message, arch_models):
    hf = arch_models["llama"][0]
    x = torch.tensor([tiny_prompt()])
    cache = ta.make_cache(hf, [*COMMON, "--cache_strategy", "tova", "--max_cache_length", "16"], 24, NEW)
    with pytest.raises(UserError, match=message):
        hf.generate(x, attention_mask=torch.ones_like(x), cache=cache, max_new_tokens=NEW, eos_token_id=None,
                    pad_token_id=0, **{"do_sample": False, **kwargs})


@pytest.mark.parametrize("mask_of, message", [
    (lambda m: m.index_fill_(1, torch.tensor([23]), 0), "pad on the left"),  # right padding
    (lambda m: m.index_fill_(1, torch.tensor([5]), 0), "pad on the left"),  # a hole inside the prompt
    (lambda m: m.zero_(), "padding only"),
])
def test_padding_that_is_not_on_the_left_is_refused(mask_of, message, arch_models):
    hf = arch_models["llama"][0]
    flags = [*COMMON, "--cache_strategy", "tova", "--max_cache_length", "16"]
    x = torch.tensor([tiny_prompt(), tiny_prompt()])
    mask = torch.ones_like(x)
    mask[1] = mask_of(mask[1:]).squeeze(0)
    with pytest.raises(UserError, match=message):
        hf.generate(x, attention_mask=mask, cache=ta.make_cache(hf, flags, [24, 24], NEW), max_new_tokens=NEW,
                    do_sample=False, eos_token_id=None, pad_token_id=0)


def test_a_batch_other_than_the_cache_rows_is_refused(arch_models):
    hf = arch_models["llama"][0]
    flags = [*COMMON, "--cache_strategy", "tova", "--max_cache_length", "16"]
    x = torch.tensor([tiny_prompt(), tiny_prompt()])
    with pytest.raises(UserError, match="built for 1 sequence\\(s\\).*got 2"):
        hf.generate(x, attention_mask=torch.ones_like(x), cache=ta.make_cache(hf, flags, 24, NEW),
                    max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    for lengths in ([], [24, 0], [24.0]):
        with pytest.raises(UserError, match="prompt lengths must be whole numbers"):
            ta.make_cache(hf, flags, lengths, NEW)
    with pytest.raises(UserError, match="row 2: the cache has rows 0 to 1"):
        ta.make_cache(hf, flags, [24, 20], NEW).statistics(row=2)


def test_a_sequence_past_the_cache_or_context_is_refused(arch_models):
    hf = arch_models["llama"][0]
    with pytest.raises(UserError, match="exceeds the model's context"):
        ta.make_cache(hf, ["--cache_strategy", "full"], 250, 10)  # the tiny model's context is 256


def test_more_tokens_than_the_cache_was_built_for_is_refused(arch_models):
    hf = arch_models["llama"][0]
    x = torch.tensor([tiny_prompt()])
    cache = ta.make_cache(hf, [*COMMON, "--cache_strategy", "full"], 24, 4)
    with pytest.raises(UserError, match="sized for 24 prompt tokens \\+ 4 new ones"):
        hf.generate(x, attention_mask=torch.ones_like(x), cache=cache, max_new_tokens=8, do_sample=False,
                    eos_token_id=None, pad_token_id=0)


# ---- the README's examples, read from the README ------------------------------------------------------------


@pytest.mark.slow
def test_the_readme_examples_run_and_the_batch_row_equals_the_prompt_alone(capsys, monkeypatch, hf_bundled,
                                                                            hf_bundled_tokenizer):
    """The two code blocks of the README's "Use from transformers", executed as written (the bundled model
    through transformers' GGUF loader): the single prompt answers with text, and the batch's row 1, the same
    prompt left-padded beside a longer one, gives the same tokens. The blocks' from_pretrained calls are the
    session fixtures' own calls (HF_BUNDLED_ARGS, float32), so they are answered with those objects (a copy of
    the tokenizer, which the example sets to pad on the left) instead of reading the GGUF again (~30 s)."""
    import copy
    import re
    from pathlib import Path

    import transformers

    from tests.conftest import HF_BUNDLED_ARGS

    def loaded(real, same):
        def from_pretrained(*args, **kwargs):
            if (*args, kwargs.get("gguf_file")) == (HF_BUNDLED_ARGS[0], HF_BUNDLED_ARGS[1]) and \
                    kwargs.get("dtype", torch.float32) == torch.float32:
                return same()
            return real(*args, **kwargs)
        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        loaded(transformers.AutoModelForCausalLM.from_pretrained, lambda: hf_bundled))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        loaded(transformers.AutoTokenizer.from_pretrained, lambda: copy.deepcopy(hf_bundled_tokenizer)))
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### Use from transformers", 1)[1].split("\n## ", 1)[0]
    single, batch = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(single, "README.md (transformers, one prompt)", "exec"), namespace)
    alone, prompt_length = namespace["out"][0, namespace["ids"].shape[1]:], namespace["ids"].shape[1]
    exec(compile(batch, "README.md (transformers, a batch)", "exec"), namespace)
    rows = namespace["out"][:, namespace["batch"]["input_ids"].shape[1]:]
    mask = namespace["batch"]["attention_mask"]
    assert prompt_length == int(mask[1].sum()) < mask.shape[1]  # row 1 is the prompt alone, padded
    assert alone.numel() > 1 and torch.equal(rows[1, : alone.numel()], alone)
    printed = capsys.readouterr().out
    assert "KV cache" in printed and "compression_ratio" in printed


def test_load_gguf_model_makes_the_reference_fixtures_call(monkeypatch, tmp_path):
    """load_gguf_model (the benchmarks' loader) reads the bundled GGUF with the reference fixtures' call (the
    file's folder and name, float32) and returns the model in eval mode; a path that is not a GGUF file is one
    UserError."""
    import transformers

    from errors import UserError
    from tests.conftest import HF_BUNDLED_ARGS

    calls = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: calls.append(("model", a, k)) or torch.nn.Dropout().train())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(("tokenizer", a, k)) or "tokenizer")
    model, tokenizer = ta.load_gguf_model()
    folder, name = HF_BUNDLED_ARGS
    assert calls == [("model", (folder,), {"gguf_file": name, "dtype": torch.float32}),
                     ("tokenizer", (folder,), {"gguf_file": name})]
    assert not model.training and tokenizer == "tokenizer"
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="not a GGUF file"):
        ta.load_gguf_model(str(tmp_path / "weights.bin"))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 24])
def test_the_adapter_batching_benchmark_reports_rows_equal_alone(tmp_path, chunk, hf_bundled, hf_bundled_tokenizer,
                                                                 monkeypatch):
    """benchmarks.adapter_batching end to end, tiny: its report's fields, and every batched row's tokens equal
    to its prompt's alone (the benchmark compares them itself), with the prompts at once and in transformers'
    chunks of 24 (which cut the padded rows of 64 and 80 tokens off their own chunk boundaries). The model and
    tokenizer are the session's, loaded by the call the benchmark's load_model makes
    (test_load_gguf_model_makes_the_reference_fixtures_call)."""
    from benchmarks import adapter_batching

    monkeypatch.setattr(adapter_batching, "load_model", lambda: (hf_bundled, hf_bundled_tokenizer))
    out = tmp_path / "adapter_batching.json"
    rounds = 1 if chunk else 2  # what rounds add is checked once
    chunked = ["--prefill_chunk", str(chunk)] if chunk else []
    report = adapter_batching.main(["--prompts", "3", "--min_tokens", "64", "--max_new_tokens", "4", "--rounds",
                                    str(rounds), "--out", str(out), *chunked])
    assert report["prompt_tokens"] == [64, 80, 96] and report["same_tokens"] is True
    assert report["prefill_chunk"] == chunk
    assert len(report["rounds"]) == rounds and report["batched_tok_s"] > 0 and report["one_by_one_tok_s"] > 0
    assert report["transformers_cache_batched_tok_s"] > 0
    assert out.is_file()
