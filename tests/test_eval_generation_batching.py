"""Generation tasks at --batch_size > 1 (rows.greedy_answers): every item's records (answer tokens, text,
scores, kept positions, cache statistics) and the task's metrics equal a batch-1 run of the same items, for
every registered strategy and its debug_ twin, under both protocols; rows of different prompt lengths that
stop at different times. The reference is the batch-1 run (one item at a time on batch-1 caches)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eval.tasks import get_task
from gates import attach_random_gates
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    tiny_runtime,
)
from tests.strategy_matrix import ALL, STORAGES

# Statistics that are sums of attention probabilities (debug_'s attention loss and its curve, scores a
# strategy reports) come from matmuls a batch rounds differently from batch 1: measured < 3e-6 on these
# items. Everything discrete (tokens, kept positions, held tokens, evictions, budgets, bytes, compression
# ratios) must be equal exactly; timing fields are not compared.
STAT_TOLERANCE = 1e-5
CACHE_FLAGS = ["--max_cache_length", "0.5", "--global_tokens", "2", "--recent_window", "4"]


def qa_file(tmp_path, n: int = 5):
    """n QA rows whose contexts have different lengths (30 to 30 + 13 (n-1) bytes of pydoc text, not in
    order), so the prompts differ in length and a batch reorders them."""
    text = PYDOC_EXCERPT.read_text()
    rows = [{"doc": text[300 * i: 300 * i + 30 + 13 * ((i * 3) % n)], "q": f"Item {i}?", "a": [str(i)]}
            for i in range(n)]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_run(tiny_dir, path, batch_size: int, *flags: str, eos: list[int] | None = None, step=None):
    rt = tiny_runtime(tiny_dir, "--tasks", "qa", "--dataset", str(path), "--prompt_column", "q", "--context_column",
                      "doc", "--answer_column", "a", "--max_new_tokens", "4", "--batch_size", str(batch_size), *flags)
    if step is not None:  # a compiled step (the eval CLI's --compile)
        rt.step = step
    attach_random_gates(rt.model, seed=0)  # the gated strategy's gates (unused by every other cache)
    if eos is not None:
        rt.tokenizer.eos_ids = eos
    with torch.inference_mode():
        return get_task("qa")(rt.args).run(rt)


def assert_close_nested(got: object, want: object, where: str) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_close_nested(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close_nested(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and ("attention_loss" in where or "score" in where):
        assert got == pytest.approx(want, abs=STAT_TOLERANCE), where
    else:
        assert got == want, where


def assert_same_records(alone, together) -> None:
    """Per item, in the items' order: everything a batch-1 run records (timings aside)."""
    assert len(together.items) == len(alone.items)
    for a, b in zip(alone.items, together.items, strict=True):
        assert {k: v for k, v in a.items() if k != "kept_positions"} == \
               {k: v for k, v in b.items() if k != "kept_positions"}, a["index"]
        assert len(a["kept_positions"]) == len(b["kept_positions"])
        assert all(np.array_equal(x, y) for x, y in zip(a["kept_positions"], b["kept_positions"], strict=True))
    assert together.predictions == alone.predictions
    assert together.metrics == alone.metrics
    assert_close_nested(together.stats, alone.stats, "stats")
    assert together.config == alone.config
    assert together.timings.prefill_tokens == alone.timings.prefill_tokens
    assert together.timings.decode_tokens == alone.timings.decode_tokens  # finished rows are not counted


# Query-aware under the decode protocol: the whole prompt prefilled, eviction at every answer token (feeding
# the question through the decode path is in the cases of the next test, which cost more steps).
PROTOCOLS = {"decode": ["--query_aware"], "kvpress": ["--protocol", "kvpress"]}


@pytest.mark.parametrize("strategy", ALL)
def test_batched_answers_equal_batch_1_for_every_strategy_and_protocol(tiny_dir, tmp_path, strategy):
    path = qa_file(tmp_path)
    for protocol, flags in PROTOCOLS.items():
        extra = ["--cache_strategy", strategy, *CACHE_FLAGS, *flags]
        alone, together = qa_run(tiny_dir, path, 1, *extra), qa_run(tiny_dir, path, 4, *extra)
        assert len({p["prompt_tokens"] for p in alone.predictions}) == 5, protocol  # all lengths differ
        assert_same_records(alone, together)


def eos_between(outputs: list[list[int]]) -> list[int]:
    """One or two tokens that, as EOS, end the answers at three or more different steps (some perhaps not
    at all): rows then stop at different steps. Chosen from the batch-1 answers without an EOS."""
    tokens = sorted({t for out in outputs for t in out})
    for eos in [[t] for t in tokens] + [[a, b] for a in tokens for b in tokens if a < b]:
        stops = {next((i + 1 for i, t in enumerate(out) if t in eos), len(out)) for out in outputs}
        if len(stops) >= 3:
            return eos
    raise AssertionError(f"no EOS stops these answers at three different steps: {outputs}")


# (strategy, flags, batch size): 3 rows for 6 items (rows refilled as items stop) or 8 (rows left idle).
STOP_CASES = [("heavy_hitter", [], 3), ("heavy_hitter", [], 8), ("tova", ["--query_aware"], 3), ("full", [], 8),
              ("debug_keydiff", ["--cache_bits", "4"], 3), ("recent_global", ["--protocol", "kvpress"], 8),
              ("heavy_hitter", ["--protocol", "kvpress", "--query_aware"], 3), ("tova", ["--decode_first_token"], 3),
              ("rkv", ["--feed_long_prompts"], 8), ("tova", STORAGES["kivi4"], 3),
              ("heavy_hitter", ["--prefill_chunk", "8"], 3),
              ("tova", ["--protocol", "kvpress", "--prefill_chunk", "8"], 8)]


@pytest.mark.parametrize("case", STOP_CASES, ids=lambda c: f"{c[0]}{''.join(c[1])}-{c[2]}")
def test_rows_that_stop_at_different_steps_keep_batch_1_records(tiny_dir, tmp_path, case):
    strategy, flags, batch_size = case
    path = qa_file(tmp_path, n=6)
    extra = ["--cache_strategy", strategy, *CACHE_FLAGS, *flags]
    free = qa_run(tiny_dir, path, 1, *extra, eos=[])
    eos = eos_between([item["output_ids"] for item in free.items])
    alone = qa_run(tiny_dir, path, 1, *extra, eos=eos)
    assert len({len(item["output_ids"]) for item in alone.items}) >= 3
    assert_same_records(alone, qa_run(tiny_dir, path, batch_size, *extra, eos=eos))


@pytest.mark.slow
def test_compiled_rows_keep_batch_1_records_to_the_last_item(tiny_dir, tmp_path, monkeypatch):
    """Under a compiled step every step is one step of all rows, the last item's too (idle rows decode
    placeholders), never the eager row alone: records equal the eager batch-1 run's."""
    from compiled_step import compile_decode_step
    from eval import rows

    path = qa_file(tmp_path, n=6)
    extra = ["--cache_strategy", "heavy_hitter", *CACHE_FLAGS]
    free = qa_run(tiny_dir, path, 1, *extra, eos=[])
    eos = eos_between([item["output_ids"] for item in free.items])
    alone = qa_run(tiny_dir, path, 1, *extra, eos=eos)
    eager_rows = []
    monkeypatch.setattr(rows, "decode_one_token", lambda *a: eager_rows.append(1))
    torch._dynamo.reset()
    step = compile_decode_step()
    together = qa_run(tiny_dir, path, 3, *extra, eos=eos, step=step)
    assert_same_records(alone, together)
    assert not eager_rows
    # Compiled before the first item (prepare_answer_step, rows at positions of their own): no step compiled.
    assert together.timings.compiling_steps == 0
    assert together.timings.compile_seconds == step.compile_seconds > 0


@pytest.mark.parametrize("protocol", ["decode", "kvpress"])
def test_a_compiled_batch_1_run_compiles_before_its_first_item(tiny_dir, tmp_path, protocol):
    """Under --compile a generation task's step is compiled before its items, the kvpress protocol's setting
    (nothing evicted after the prompt, which heavy_hitter's step reads) included: no timed step compiles, the
    compile is its own figure, and the records are the eager run's."""
    from compiled_step import compile_decode_step

    path = qa_file(tmp_path, n=3)
    extra = ["--cache_strategy", "heavy_hitter", *CACHE_FLAGS, *PROTOCOLS[protocol]]
    eager = qa_run(tiny_dir, path, 1, *extra)
    torch._dynamo.reset()
    step = compile_decode_step()
    compiled = qa_run(tiny_dir, path, 1, *extra, step=step)
    assert compiled.timings.compiling_steps == 0 and compiled.timings.compile_seconds == step.compile_seconds > 0
    assert compiled.timings.decode_tokens > 0
    assert_same_records(eager, compiled)


def test_the_eval_command_reports_a_compile_apart_and_says_when_steps_compiled(tiny_dir, tmp_path, monkeypatch,
                                                                                capsys):
    """`python -m eval --compile`: metrics.json's compile_seconds is the compile before the first item; where a
    step compiles anyway (here: the prepare removed) the command says so on stderr."""
    from eval import cli, harness

    path = qa_file(tmp_path, n=2)
    flags = ["--checkpoint_path", str(tiny_dir), "--tasks", "qa", "--dataset", str(path), "--prompt_column", "q",
             "--context_column", "doc", "--answer_column", "a", "--max_new_tokens", "3", "--no-baseline",
             "--cache_strategy", "heavy_hitter", *CACHE_FLAGS, "--compile"]
    (prepared,) = cli.main([*flags, "--out_dir", str(tmp_path / "prepared")])
    assert prepared["compile_seconds"] > 0 and "compiled during the run" not in capsys.readouterr().err
    monkeypatch.setattr(harness, "prepare_step", lambda *a, **kw: None)
    (unprepared,) = cli.main([*flags, "--out_dir", str(tmp_path / "unprepared")])
    assert "note: 1 decode step compiled during the run" in capsys.readouterr().err
    assert unprepared["compile_seconds"] > 0 and unprepared["decode_tokens_per_second"] > 0


def test_a_step_that_compiles_counts_as_compile_time(tiny_dir):
    """A compiled step called on caches it was not prepared for compiles in that step: its time is compile
    time, not a slow decode step, and its tokens are not counted as decoded."""
    from compiled_step import compile_decode_step
    from eval.harness import Timings, attach_caches, cache_specs, prefill, timed_step

    rt = tiny_runtime(tiny_dir, "--tasks", "fidelity", "--cache_strategy", "heavy_hitter", *CACHE_FLAGS)
    torch._dynamo.reset()
    rt.step = compile_decode_step()
    timings = Timings()
    with torch.inference_mode():
        attach_caches(rt, cache_specs(rt, rt.args, 24, 8), 32)
        prefill(rt.model, torch.arange(24)[None])
        timed_step(rt, 1, 24, timings)
        assert (timings.compiling_steps, timings.decode_tokens, timings.step_seconds) == (1, 0, [])
        assert timings.compile_seconds > 0 and timings.decode_seconds == 0
        timed_step(rt, 2, 25, timings)
    assert (timings.compiling_steps, timings.decode_tokens, len(timings.step_seconds)) == (1, 1, 1)


def test_a_stopped_row_counts_only_its_own_tokens(tiny_dir, tmp_path):
    """The full cache holds every token it was fed: a row's held tokens are its prompt and its answer but the
    last token (never fed), whatever the batch went on decoding after it stopped."""
    path = qa_file(tmp_path, n=6)
    free = qa_run(tiny_dir, path, 1, "--cache_strategy", "full", "--query_aware", eos=[])
    eos = eos_between([item["output_ids"] for item in free.items])
    together = qa_run(tiny_dir, path, 4, "--cache_strategy", "full", "--query_aware", eos=eos)
    assert [item["metrics"]["compression_ratio"] for item in together.items] == [0.0] * 6
    assert len({len(item["output_ids"]) for item in together.items}) >= 3  # rows stopped at different steps
    fed = [p["prompt_tokens"] + len(item["output_ids"]) - 1 for p, item in zip(together.predictions, together.items,
                                                                                strict=True)]
    assert together.stats["evictions_per_layer"] == [0.0] * len(together.stats["evictions_per_layer"])
    for layer in together.stats["tokens_held_per_head"]:
        assert layer == pytest.approx([sum(fed) / len(fed)] * len(layer), abs=1e-9)
    assert together.timings.decode_tokens == sum(len(item["output_ids"]) - 1 for item in together.items)


@pytest.mark.parametrize(("task", "flags"), [("niah_multikey", ["--query_aware"]),
                                             ("variable_tracking", ["--protocol", "kvpress"])])
def test_synthetic_tasks_batched_equal_batch_1(tiny_dir, task, flags):
    def run(batch_size: int):
        rt = tiny_runtime(tiny_dir, "--tasks", task, "--haystack", str(PYDOC_EXCERPT), "--limit", "3", "--seq_len",
                          "800", "--max_new_tokens", "3", "--batch_size", str(batch_size), "--cache_strategy", "tova",
                          *CACHE_FLAGS, *flags)
        with torch.inference_mode():
            return get_task(task)(rt.args).run(rt)

    assert_same_records(run(1), run(2))


def choice_file(tmp_path, n: int = 5):
    """n multiple-choice rows with prompts of different lengths and options of 1 to 6 bytes."""
    text = PYDOC_EXCERPT.read_text()
    rows = [{"doc": text[200 * i: 200 * i + 20 + 11 * ((i * 3) % n)], "q": f"Pick {i}?",
             "choices": ["a", "bc" * (i % 3 + 1), "def", "g" * (6 - i % 4)], "a": i % 4} for i in range(n)]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def choice_run(tiny_dir, path, batch_size: int, *flags: str):
    rt = tiny_runtime(tiny_dir, "--tasks", "multiple_choice", "--dataset", str(path), "--prompt_column", "q",
                      "--context_column", "doc", "--answer_column", "a", "--choices_column", "choices",
                      "--batch_size", str(batch_size), *flags)
    attach_random_gates(rt.model, seed=0)
    with torch.inference_mode():
        return get_task("multiple_choice")(rt.args).run(rt)


# The row loop is the answers' (registry-wide above); these cover what options add: a saved and restored
# cache per row, options of one token (scored without a step), per-head eviction, shadows.
CHOICE_STRATEGIES = ["full", "tova", "heavy_hitter", "random", "hybrid", "debug_keydiff", "rkv"]


@pytest.mark.parametrize("strategy", CHOICE_STRATEGIES)
def test_batched_multiple_choice_equals_batch_1(tiny_dir, tmp_path, strategy):
    """Option log-likelihoods are sums of float32 log-probabilities: within STAT_TOLERANCE of batch 1's;
    the picks, kept positions and every discrete statistic are equal."""
    path = choice_file(tmp_path)
    extra = ["--cache_strategy", strategy, *CACHE_FLAGS]
    alone, together = choice_run(tiny_dir, path, 1, *extra), choice_run(tiny_dir, path, 3, *extra)
    for a, b in zip(alone.predictions, together.predictions, strict=True):
        assert {k: v for k, v in a.items() if k != "logliks"} == {k: v for k, v in b.items() if k != "logliks"}
        assert b["logliks"] == pytest.approx(a["logliks"], abs=STAT_TOLERANCE)
    for a, b in zip(alone.items, together.items, strict=True):
        assert a["metrics"] == b["metrics"] and a["option_ids"] == b["option_ids"] and a["n_prefill"] == b["n_prefill"]
        assert all(np.array_equal(x, y) for x, y in zip(a["kept_positions"], b["kept_positions"], strict=True))
    assert together.metrics == alone.metrics
    assert_close_nested(together.stats, alone.stats, "stats")
    assert together.timings.decode_tokens == alone.timings.decode_tokens


@pytest.mark.slow
def test_bundled_model_answers_batched_equal_batch_1(bundled):
    """A real model, which ends its answers with EOS at different steps: the records of --batch_size 3 are
    those of batch 1 (decode protocol, query-agnostic: the questions go through the batched decode step)."""
    from eval import cli
    from eval.harness import Runtime

    model, tokenizer = bundled
    flags = ["--tasks", "niah_single", "--haystack", str(PYDOC_EXCERPT), "--limit", "4", "--seq_len", "300",
             "--max_new_tokens", "24", "--cache_strategy", "heavy_hitter", *CACHE_FLAGS]
    runs = []
    for batch_size in (1, 3):
        args = cli.parse_args([*flags, "--batch_size", str(batch_size)])
        with torch.inference_mode():
            runs.append(get_task("niah_single")(args).run(Runtime(model, tokenizer, args, progress=True)))
    alone, together = runs
    assert len({len(item["output_ids"]) for item in alone.items}) >= 2  # rows stop at different steps
    assert any(item["output_ids"][-1] in tokenizer.eos_ids for item in alone.items)
    assert_same_records(alone, together)


def test_longest_first_runs_the_longest_prompts_first_and_returns_the_items_order():
    from eval.batching import longest_first

    prompts = [[1], [1, 2, 3], [1, 2], [4, 5, 6], [7]]
    seen = []

    def run(order: list[int]) -> list[str]:
        seen.extend(order)
        return [f"item {i}" for i in order]

    assert longest_first(prompts, run) == [f"item {i}" for i in range(5)]
    assert seen == [1, 3, 2, 0, 4]  # by length, ties in the items' order
