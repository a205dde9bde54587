"""What the transformers adapter's tests share (tests/test_transformers_adapter.py and
tests/test_transformers_adapter_chunked.py): the cache flags, the prompts, and the two comparisons: a run through
transformers' generate against generate.py's own loop with the same flags, and a left-padded batch against each
of its prompts alone (tolerances: tests/test_transformers_adapter.py's docstring and BATCH_ATOL below)."""

from __future__ import annotations

import pytest
import torch

from cache import cache_statistics
from cache_setup import attach_caches, cache_config
from generate import generate
from strategies import CACHE_STRATEGIES
from strategies.debug import attention_loss_curve
from tests.strategy_matrix import ALL, STORAGES, held_positions

transformers = pytest.importorskip("transformers")
ta = pytest.importorskip("transformers_adapter")

NEW = 8
BUDGET = "24"  # of a 48-token prompt + 8 new tokens: the prompt is compressed and decoding evicts
COMMON = ["--global_tokens", "2", "--recent_window", "4", "--snapkv_window", "8"]
ARCHS = ["llama", "mistral", "qwen2_window", "qwen3", "gemma3", "phi3"]  # conftest's arch_models


def needs_gates(name: str) -> bool:
    return CACHE_STRATEGIES[name.removeprefix("debug_")].needs_gates


# The registry's strategies and debug_ twins (tests/strategy_matrix.ALL), minus those that need learned gates
# (refused: test_gated_caches_are_refused); a new strategy joins automatically.
# KVzip's reconstruction pass runs in generate.prefill (our model); through transformers a kvzip cache scores
# the prompt by its own queries instead, another rule: left out (docs/limitations.md).
MATRIX = [s for s in ALL if not needs_gates(s) and s.removeprefix("debug_") != "kvzip"]
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
    "think_heavy_hitter": ["--cache_strategy", "heavy_hitter", *STORAGES["think"]],
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


def assert_same_run(hf_model, model, tokenizer, flags: list[str], prompt: list[int], **generate_kwargs):
    ours = run_our_loop(model, tokenizer, flags, prompt)
    cache = ta.make_cache(hf_model, flags, len(prompt), NEW, tokenizer=tokenizer)
    tokens, _ = hf_generate(hf_model, prompt, cache, **generate_kwargs)
    assert len(ours) == NEW and tokens == ours
    for layer, (theirs, mine) in enumerate(zip(cache.kv_caches, model.caches(), strict=True)):
        assert held_positions(theirs) == held_positions(mine), f"layer {layer}"
    return cache


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


def tiny_prompt(n: int = 24) -> list[int]:
    return torch.randint(3, 160, (n,), generator=torch.Generator().manual_seed(1)).tolist()


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
    """The batch against each prompt alone through the adapter (itself equal to our loop: assert_same_run):
    greedy tokens, kept positions per layer and KV head and the row's statistics identical; scores within
    BATCH_ATOL."""
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

