"""Rows prefilled together, packed into one sequence (packed_prefill.py), as a GPU prefills them. Every registered
strategy's packed rows equal each row alone through tests/test_batching.py's packed cases; here: that they go
through one forward pass, how rows are grouped, rows in later groups and beside one-token prompts, and eval's
rows."""

from __future__ import annotations

import pytest
import torch

import cpu_bf16_kernels
import packed_prefill
from cache_setup import attach_caches, attach_row_caches
from errors import UserError
from generate import prefill, prefill_rows
from model import Transformer
from packed_prefill import packed_groups
from tests.strategy_matrix import BUDGETS, TOKEN_CLASSES, VOCAB, cache_args
from tests.test_batching import LENGTHS, NEW, assert_rows_match, held, sequences, tiny_model
from tests.test_eval_generation_batching import assert_same_records, qa_file, qa_run

ATOL = 1e-4  # float32 logits: a packed batch's products round differently from one row's


@pytest.fixture(autouse=True)
def packed_as_on_a_gpu(monkeypatch):
    """The model packs rows by default only where its products are not batch-invariant (a GPU; on the CPU
    each row is prefilled alone, generate.shares_prefill): these tests make it pack on the CPU too."""
    monkeypatch.setattr(cpu_bf16_kernels, "batch_invariant", lambda weight, rows: False)


def test_groups_follow_the_token_limit_and_keep_one_token_prompts_alone(monkeypatch):
    monkeypatch.setattr(packed_prefill, "PREFILL_BATCH_TOKENS", 100)
    assert packed_groups([40, 30, 20, 11]) == [range(0, 3), range(3, 4)]  # 90 tokens fit, 101 not
    assert packed_groups([40, 30, 20, 10]) == [range(0, 4)]  # 100: the limit itself fits
    assert packed_groups([50, 50, 1, 30]) == [range(0, 2), range(2, 3), range(3, 4)]
    assert packed_groups([101, 5, 4]) == [range(0, 1), range(1, 3)]  # past the limit alone
    assert packed_groups([9, 1, 7, 6, 1]) == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]
    assert packed_groups([1, 1]) == [range(0, 1), range(1, 2)]
    assert packed_groups([]) == []


def forward_calls(monkeypatch) -> list[tuple[int, ...] | None]:
    """The row lengths of every forward pass from now on (None: not packed rows)."""
    calls: list[tuple[int, ...] | None] = []
    original = Transformer.forward

    def counted(self, idx, input_pos, *args, **kwargs):
        rows = kwargs.get("rows")
        calls.append(None if rows is None else rows.lengths)
        return original(self, idx, input_pos, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", counted)
    return calls


@pytest.mark.parametrize(("strategy", "flags", "passes"), [
    ("heavy_hitter", (), [LENGTHS]),
    # Chunked: the rows' j-th chunks in one pass for each j; a one-token last chunk is a decode step in its row.
    ("heavy_hitter", ("--prefill_chunk", "10"), [(10, 10, 10), (10, 9, 3), (4,)]),
    ("heavy_hitter", ("--prefill_chunk", "12"), [(12, 12, 12), None, (12, 7)]),
    ("heavy_hitter", ("--prefill_chunk", "30"), [LENGTHS]),
    ("heavy_hitter", ("--prefill_chunk", "1"), [None] * sum(LENGTHS)),  # the token-by-token feed, row by row
    # Each prompt alone: its reconstruction passes (--kvzip_chunk 4: ceil(T / 4) of them), the last of which
    # prefills its row; no forward after them.
    ("kvzip", (), [None] * sum(-(-n // 4) for n in LENGTHS)),
])
def test_rows_share_forward_passes(monkeypatch, strategy, flags, passes):
    """The whole batch in one pass, or with --prefill_chunk one pass for the rows' chunks at each offset."""
    model = tiny_model()
    attach_row_caches(model, cache_args(strategy, BUDGETS["fraction"], "dense", *flags), list(LENGTHS), NEW,
                      classes=TOKEN_CLASSES)
    calls = forward_calls(monkeypatch)
    with torch.inference_mode():
        model.reset_caches()
        prefill_rows(model, [s[:n] for s, n in zip(sequences(), LENGTHS, strict=True)])
    assert calls == passes


@pytest.mark.parametrize("strategy", ["heavy_hitter", "hybrid", "debug_gated", "l2"])
def test_rows_in_later_groups_decode_as_alone(monkeypatch, strategy):
    """A limit of 32 tokens splits (24, 19, 13) into (24) and (19, 13): the second group's rows are cache rows
    1 and 2 of a forward pass over two rows."""
    monkeypatch.setattr(packed_prefill, "PREFILL_BATCH_TOKENS", 32)
    calls = forward_calls(monkeypatch)
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"]))
    assert calls[:2] == [None, LENGTHS[1:]]


@pytest.mark.parametrize("strategy", ["heavy_hitter", "tova", "debug_hybrid"])
def test_a_one_token_prompt_beside_packed_rows(strategy):
    """Prompts of 24, 13 and 1 tokens: the one-token row is prefilled alone (a decode step into an empty
    cache), the others together; each holds and predicts what it does alone."""
    model = tiny_model()
    args = cache_args(strategy, BUDGETS["absolute"])  # 16 slots: a fraction of the short row is below the protected
    lengths = [24, 13, 1]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randperm(VOCAB, generator=g)[:n] for n in lengths]
    attach_row_caches(model, args, lengths, NEW, classes=TOKEN_CLASSES)
    with torch.inference_mode():
        model.reset_caches()
        together = prefill_rows(model, prompts)
        kept = []
        for b in range(len(lengths)):
            with model.cache_row(b):
                kept.append([held(c) for c in model.caches()])
    for b, prompt in enumerate(prompts):
        attach_caches(model, args, len(prompt), NEW, classes=TOKEN_CLASSES)
        with torch.inference_mode():
            model.reset_caches()
            alone = prefill(model, prompt[None])
        torch.testing.assert_close(together[b: b + 1], alone, atol=ATOL, rtol=ATOL, msg=f"row {b}")
        assert kept[b] == [held(c) for c in model.caches()], f"row {b}"


@pytest.mark.parametrize("protocol", [["--query_aware"], ["--protocol", "kvpress"]], ids=["decode", "kvpress"])
def test_eval_items_that_start_together_prefill_together(tiny_dir, tmp_path, monkeypatch, protocol):
    """qa at --batch_size 2, 4 items answering --max_new_tokens each (no EOS): both rows start together and
    stop at the same step, so each pair of items is prefilled in one packed pass (under kvpress each row at
    its own prompt budget, its question appended after); records equal batch 1's."""
    path = qa_file(tmp_path, 4)
    flags = ("--cache_strategy", "heavy_hitter", "--max_cache_length", "0.5", *protocol)
    alone = qa_run(tiny_dir, path, 1, *flags, eos=[])
    calls = forward_calls(monkeypatch)
    together = qa_run(tiny_dir, path, 2, *flags, eos=[])
    by_length = sorted(alone.predictions, key=lambda p: -p["prompt_tokens"])  # the order rows take items
    prefilled = [p["prefill_tokens"] for p in by_length]
    assert [c for c in calls if c is not None] == [tuple(prefilled[:2]), tuple(prefilled[2:])]
    assert_same_records(alone, together)


def test_the_batched_prefill_benchmark_reports_rows_equal_alone(tiny_dir, tmp_path):
    """benchmarks.batched_prefill end to end on the tiny model: its report's fields, and every round's packed
    rows within float rounding of the rows prefilled one by one, with the same kept positions; with
    --decode_steps, the batch's rows decoded (packed prefill, as on a GPU) against each prompt's batch-1 run:
    the same greedy tokens and held positions, logits within float rounding. More steps than the caches plan
    for is one UserError."""
    from benchmarks import batched_prefill

    out = tmp_path / "batched_prefill.json"
    argv = ["--checkpoint_path", str(tiny_dir), "--prompts", "3", "--min_tokens", "40", "--step_tokens", "6",
            "--max_new_tokens", "4", "--max_cache_length", "0.5", "--rounds", "2"]
    report = batched_prefill.main([*argv, "--decode_steps", "4", "--out", str(out)])
    assert report["prompt_tokens"] == [52, 46, 40] and len(report["rounds"]) == 2
    assert all(r["same_kept_positions"] and r["max_logit_difference"] < ATOL for r in report["rounds"])
    assert report["batched_tok_s"] > 0 and report["row_by_row_tok_s"] > 0
    decode = report["decode"]
    assert decode["steps"] == 4 and decode["steps_with_another_token"] == 0
    assert decode["same_kept_positions"] and decode["rows_with_other_kept_positions"] == 0
    assert 0 <= decode["max_logit_difference"] < ATOL
    assert out.exists()
    with pytest.raises(UserError, match="--decode_steps 5: at most --max_new_tokens"):
        batched_prefill.main([*argv, "--decode_steps", "5"])


@pytest.mark.parametrize("strategy", ["full", "debug_heavy_hitter"])
def test_the_batched_prefill_benchmark_runs_caches_sized_to_their_rows(tiny_dir, tmp_path, strategy):
    """Four prompts of 58-40 tokens with 4 new: the longest outgrows the shortest row's 44 slots. The full
    cache, and a debug cache's full reference, are sized to each row's own prompt, so no row may be given
    another row's prompt (the benchmark's warm-up once gave every row the longest)."""
    from benchmarks import batched_prefill

    report = batched_prefill.main(["--checkpoint_path", str(tiny_dir), "--prompts", "4", "--min_tokens", "40",
                                   "--step_tokens", "6", "--max_new_tokens", "4", "--cache_strategy", strategy,
                                   "--max_cache_length", "0.5" if strategy.startswith("debug") else "1",
                                   "--rounds", "1", "--out", str(tmp_path / "report.json")])
    assert report["prompt_tokens"] == [58, 52, 46, 40]
    assert all(r["same_kept_positions"] and r["max_logit_difference"] < ATOL for r in report["rounds"])
