"""The kvpress protocol (`--protocol kvpress`): each item's context compressed once to its own budget, the
question appended as one chunk, nothing evicted while answering; and the chunk append itself, which must
give the logits of feeding the same tokens one at a time, for every strategy and storage."""

from __future__ import annotations

import json

import pytest
import torch

from errors import UserError
from eval import cli, replay, results
from strategies.heavy_hitter import HeavyHitterCache
from tests.conftest import make_tiny_model
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    SLIDING_WINDOW,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    write_tiny_sliding_checkpoint,
)
from tests.strategy_matrix import ALL, STORAGES, VARIABLE, attach, cache_args, prompt_then_rest, token_ids


@pytest.mark.parametrize("storage", sorted(STORAGES))
# Variable-occupancy caches drop tokens a chunk's queries would still see when fed one by one: left out.
@pytest.mark.parametrize("strategy", [s for s in ALL if s not in VARIABLE])
def test_a_chunk_appended_after_the_prompt_equals_feeding_it_token_by_token(strategy, storage):
    ids = token_ids()
    logits = []
    for chunk in (False, True):
        model = make_tiny_model()
        attach(model, cache_args(strategy, "40", storage))  # room for every token: nothing is evicted
        logits.append(prompt_then_rest(model, ids, chunk))
    torch.testing.assert_close(logits[1], logits[0], atol=2e-5, rtol=0)


def kvpress_flags(tiny_dir, out_dir, *more: str) -> list[str]:
    return ["--tasks", "niah_single", "--checkpoint_path", str(tiny_dir), "--haystack", str(PYDOC_EXCERPT),
            "--seq_len", "400", "--limit", "3", "--max_new_tokens", "6", "--out_dir", str(out_dir),
            "--protocol", "kvpress", *more]


def test_kvpress_protocol_compresses_each_context_to_its_budget_and_never_evicts_after(tiny_dir, tmp_path):
    cli.main(kvpress_flags(tiny_dir, tmp_path, "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25",
                           "--global_tokens", "2", "--recent_window", "4"))
    dirs = {d.name.split("-")[0]: d for d in (p.parent for p in tmp_path.glob("*/*/*/metrics.json"))}
    items = results.read_items(dirs["heavy_hitter"])
    predictions = [json.loads(x) for x in (dirs["heavy_hitter"] / "predictions.jsonl").read_text().splitlines()]
    metrics = json.loads((dirs["heavy_hitter"] / "metrics.json").read_text())
    for it, pred in zip(items, predictions, strict=True):
        n_context = len(it["context_ids"])
        budget = int(n_context * 0.25)  # per item, of its own context, rounded down as kvpress's int()
        assert pred["context_budget"] == budget and it["n_prefill"] == n_context
        for layer in it["kept_positions"]:  # what the context was compressed to, per head
            assert ((layer >= 0).sum(axis=1) == budget).all() and layer.max() < n_context
    # Nothing evicted after the context: the last item's cache holds its compressed context, the whole
    # question and every answer token but the last (which is never fed back).
    last, pred = items[-1], predictions[-1]
    held = budget + len(last["question_ids"]) + len(last["output_ids"]) - 1
    seen = len(last["context_ids"]) + len(last["question_ids"]) + len(last["output_ids"]) - 1
    assert pred["compression_ratio"] == pytest.approx(1 - held / seen, abs=1e-4)
    assert 0 < metrics["compression_ratio"] < 0.75
    # The full cache under the same protocol keeps every context token.
    full_items = results.read_items(dirs["full"])
    assert all(((layer >= 0).sum() == len(it["context_ids"])) for it in full_items for layer in it["kept_positions"])
    # Replayed from the stored token ids: the same answer and kept positions.
    model, tokenizer = cli.load_model(str(tiny_dir), "cpu", torch.float32)
    again = replay.replay_item(dirs["heavy_hitter"], 1, model, tokenizer)
    assert again["output_ids"] == items[1]["output_ids"]
    assert replay.same_kept(again["kept_positions"], items[1]["kept_positions"])


def test_kvpress_protocol_leaves_sliding_windows_to_slide(tmp_path):
    """On a model with sliding layers (a tiny Gemma 3) whose window is shorter than the contexts, those layers'
    caches are the window (model_policies.py), which the protocol leaves alone: they keep the context's last
    SLIDING_WINDOW tokens, not its budget, and go on sliding while the question and answer come (they were told
    nothing is evicted after the prompt, and wrote past their slots). The other layer compresses to the budget
    and keeps the rest. The compression ratio is each layer's 1 − held / seen, averaged; replay agrees."""
    checkpoint = write_tiny_sliding_checkpoint(tmp_path / "gemma3")
    cli.main(kvpress_flags(checkpoint, tmp_path / "out", "--cache_strategy", "heavy_hitter", "--max_cache_length",
                           "0.25", "--global_tokens", "2", "--recent_window", "4", "--no-baseline"))
    run = next(p.parent for p in (tmp_path / "out").glob("*/*/*/metrics.json"))
    items = results.read_items(run)
    predictions = [json.loads(x) for x in (run / "predictions.jsonl").read_text().splitlines()]
    for it, pred in zip(items, predictions, strict=True):
        n_context, n_question, n_output = (len(it[k]) for k in ("context_ids", "question_ids", "output_ids"))
        assert n_context > SLIDING_WINDOW
        budget = int(n_context * 0.25)
        for i, layer in enumerate(it["kept_positions"]):
            held = [sorted(head[head >= 0].tolist()) for head in layer]
            if i == 2:
                assert all(len(h) == budget for h in held)
            else:
                assert all(h == list(range(n_context - SLIDING_WINDOW, n_context)) for h in held)
        seen = n_context + n_question + n_output - 1
        window_ratio, global_ratio = 1 - SLIDING_WINDOW / seen, 1 - (budget + n_question + n_output - 1) / seen
        assert pred["compression_ratio"] == pytest.approx((3 * window_ratio + global_ratio) / 4, abs=1e-4)
    model, tokenizer = cli.load_model(str(checkpoint), "cpu", torch.float32)
    again = replay.replay_item(run, 1, model, tokenizer)
    assert again["output_ids"] == items[1]["output_ids"]
    assert replay.same_kept(again["kept_positions"], items[1]["kept_positions"])


@pytest.mark.parametrize("batch", ["1", "3", "3-packed"])
def test_kvpress_protocol_compresses_a_chunked_context_to_its_budget(tiny_dir, tmp_path, monkeypatch, batch):
    """With --prefill_chunk 5 the first item's context (196 tokens) ends in a chunk of one token, which outside
    the protocol is a decode step; under it decode steps never evict, so that token is compressed with the
    context by the prompt rule: every item keeps exactly its budget per head (it kept one more), alone, in
    rows, and with the rows' chunks packed (a GPU's path)."""
    if batch == "3-packed":
        import cpu_bf16_kernels

        monkeypatch.setattr(cpu_bf16_kernels, "batch_invariant", lambda weight, rows: False)
    cli.main(kvpress_flags(tiny_dir, tmp_path, "--cache_strategy", "tova", "--max_cache_length", "0.25",
                           "--global_tokens", "2", "--recent_window", "4", "--no-baseline", "--prefill_chunk", "5",
                           "--batch_size", batch.split("-")[0]))
    items = results.read_items(next(p.parent for p in tmp_path.glob("*/*/*/metrics.json")))
    assert len(items[0]["context_ids"]) % 5 == 1
    for it in items:
        for layer in it["kept_positions"]:
            assert ((layer >= 0).sum(axis=1) == int(len(it["context_ids"]) * 0.25)).all()


def test_kvpress_protocol_query_aware_compresses_context_and_question_to_the_same_slots(tiny_dir, tmp_path):
    """SnapKV's setting: the whole prompt is prefilled and compressed to the context's budget + the question's
    length (the slots the query-agnostic arm uses), with the question in the observation window."""
    cli.main(kvpress_flags(tiny_dir, tmp_path, "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25",
                           "--global_tokens", "2", "--recent_window", "4", "--query_aware", "--no-baseline"))
    run = next(p.parent for p in tmp_path.glob("*/*/*/metrics.json"))
    items = results.read_items(run)
    for it in items:
        n_context, n_question = len(it["context_ids"]), len(it["question_ids"])
        assert it["n_prefill"] == n_context + n_question
        for layer in it["kept_positions"]:
            held = layer >= 0
            assert (held.sum(axis=1) == int(n_context * 0.25) + n_question).all()
            n = n_context + n_question
            # SnapKV's observation window
            window = set(range(n - min(HeavyHitterCache.SNAPKV_WINDOW.default, n_question), n))
            for head in range(layer.shape[0]):
                assert window <= set(layer[head][held[head]])
    model, tokenizer = cli.load_model(str(tiny_dir), "cpu", torch.float32)
    again = replay.replay_item(run, 0, model, tokenizer)
    assert again["output_ids"] == items[0]["output_ids"]
    assert replay.same_kept(again["kept_positions"], items[0]["kept_positions"])


@pytest.mark.parametrize(("more", "message"), [
    (["--tasks", "fidelity"], "applies to tasks that answer"),
    (["--decode_first_token"], "does not combine"),
    (["--prefill_chunk", "1"], "token by token as decode steps"),
    (["--max_cache_length", "0.5", "0.25"], "one --max_cache_length"),
])
def test_kvpress_protocol_refuses_what_it_cannot_mean(tiny_dir, tmp_path, more, message):
    with pytest.raises(UserError, match=message):
        cli.main(kvpress_flags(tiny_dir, tmp_path, "--cache_strategy", "recent_global", "--max_cache_length", "0.5",
                               *more))
