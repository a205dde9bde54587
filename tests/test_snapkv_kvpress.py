"""kvpress's SnapKVPress and its protocol, against an independent recomputation of kvpress's definition.

The reference is written from kvpress's code (presses/snapkv_press.py, scorer_press.py, pipeline.py) on
transformers' own model loaded from the bundled GGUF (eager attention, so it returns the attention weights):
per query head, the last W queries' softmax attention over the keys before the window, averaged over the
window, average-pooled (kernel K, zero padding counted), averaged over each KV group; the window gets a
score above the maximum; the top int(n x (1 - ratio)) of n keys stay, per KV head. Then, as kvpress's pipeline, what
follows the compressed part is fed over the compressed cache at its true positions, and the first answer
token is the argmax after it.

Tolerance (ties aside): the two models' attention differs in the last float32 bits, so a kept set may
differ from the reference only by tokens whose reference score is within TIE_RTOL of the reference's
n_kept-th score in that head (a near-tie at the boundary); the Jaccard similarity over all (layer, head)
sets must be at least 0.999 (at most one swap per thousand kept tokens).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import strategies.heavy_hitter as heavy_hitter_module
from eval import cli, harness, rows
from eval.harness import Runtime
from eval.tasks import get_task
from eval.tasks.base import Example, continuation_ids, encode_example
from prompt_compression import snapkv_votes
from strategies.heavy_hitter import HeavyHitterCache
from tests.eval_helpers import PYDOC_EXCERPT, one_thread  # noqa: F401  (autouse: one torch thread)

WINDOW, KERNEL, RATIO = 64, 5, 0.5
TIE_RTOL = 1e-4


# ---- the reference: kvpress's SnapKVPress, written naively from its code -----------------------------------


def kvpress_snapkv_scores(attn: torch.Tensor, n_kv: int, window: int, kernel: int) -> torch.Tensor:
    """SnapKVPress.score from full causal attention weights attn [1, H, n, n] (kvpress's `attentions` branch):
    [n_kv, n], the window padded with the score maximum."""
    _, H, n, _ = attn.shape
    per_head = attn[0, :, -window:, : n - window].mean(dim=1)  # [H, n - window]: mean over the window's queries
    pooled = torch.stack([F.avg_pool1d(per_head[h][None, None], kernel, stride=1, padding=kernel // 2)[0, 0]
                          for h in range(H)])  # per query head
    grouped = pooled.view(n_kv, H // n_kv, n - window).mean(dim=1)
    # kvpress 0.5.5 pads the window with the maximum + 1 (an earlier version with the maximum): kept either way.
    return torch.cat([grouped, torch.full((n_kv, window), grouped.max().item() + 1)], dim=1)


def kvpress_kept(scores: torch.Tensor, ratio: float) -> list[set[int]]:
    n_kept = max(1, int(scores.shape[-1] * (1 - ratio)))  # ScorerPress.compress
    return [set(row.topk(n_kept).indices.tolist()) for row in scores]


def reference_run(hf, context_ids: list[int], rest_ids: list[int], n_kv: int) -> tuple[list[list[set[int]]],
                                                                                         list[torch.Tensor], int]:
    """kvpress's pipeline on transformers: prefill the compressed part, compress each layer's cache to its
    SnapKV choice, feed the rest over it at positions n.. (pipeline.generate_answer). Per layer the kept sets
    and scores, and the first answer token."""
    n = len(context_ids)
    out = hf(torch.tensor([context_ids]), use_cache=True, output_attentions=True)
    cache = out.cache
    kept, scores = [], []
    for layer, attn in enumerate(out.attentions):
        s = kvpress_snapkv_scores(attn.float(), n_kv, WINDOW, KERNEL)
        sets = kvpress_kept(s, RATIO)
        index = torch.tensor([sorted(x) for x in sets])[None, :, :, None]  # [1, n_kv, n_kept, 1]
        for name in ("keys", "values"):
            full = getattr(cache.layers[layer], name)
            setattr(cache.layers[layer], name, full.gather(2, index.expand(-1, -1, -1, full.shape[-1])))
        kept.append(sets)
        scores.append(s)
    positions = torch.arange(n, n + len(rest_ids))[None]
    logits = hf(torch.tensor([rest_ids]), position_ids=positions, cache=cache, use_cache=True).logits
    return kept, scores, int(logits[0, -1].argmax())


# ---- the comparison ----------------------------------------------------------------------------------------


def compare_kept(ours: list, reference: list[list[set[int]]], scores: list[torch.Tensor]) -> float:
    """Jaccard over all (layer, head) kept sets; asserts every difference is a near-tie (module docstring)."""
    inter = union = 0
    for layer, (held, sets, s) in enumerate(zip(ours, reference, scores, strict=True)):
        for head, ref in enumerate(sets):
            mine = {int(p) for p in held[head] if p >= 0}
            assert len(mine) == len(ref), (layer, head)
            boundary = s[head].topk(len(ref)).values[-1]
            for p in mine ^ ref:
                assert abs(s[head, p] - boundary) <= TIE_RTOL * boundary, (layer, head, p)
            inter, union = inter + len(mine & ref), union + len(mine | ref)
    return inter / union


@pytest.fixture
def hf_eager(hf_bundled_session):
    hf_bundled_session.set_attn_implementation("eager")
    yield hf_bundled_session
    hf_bundled_session.set_attn_implementation("sdpa")


def run_protocol(bundled, protocol: str, *more: str):
    """One niah item under the kvpress preset and `protocol`, through the task's own code."""
    model, tokenizer = bundled
    args = cli.parse_args(["--tasks", "niah_single", "--haystack", str(PYDOC_EXCERPT), "--limit", "1", "--seq_len",
                           "320", "--max_new_tokens", "3", "--cache_config", "snapkv_kvpress", "--max_cache_length",
                           str(1 - RATIO), "--protocol", "kvpress", *more])
    args.protocol = protocol  # the choice comes with the cli.py patch; the task reads the option itself
    with torch.inference_mode():
        return get_task("niah_single")(args).run(Runtime(model, tokenizer, args, progress=True))


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["kvpress", "kvpress_compress_questions"])
def test_kvpress_snapkv_keeps_kvpress_tokens_and_answers_over_the_compressed_cache(bundled, hf_eager, protocol):
    """Query-agnostic (the context compressed, the question fed after) and kvpress's compress_questions
    (context and question compressed together to int((context + question) x (1 - ratio)), the template's end of
    turn fed after): the kept sets per layer and KV head are kvpress's, and the first answer token is the one
    computed over the compressed cache."""
    result = run_protocol(bundled, protocol)
    item = result.items[0]
    context, rest = item["context_ids"], item["question_ids"]
    assert item["n_prefill"] == len(context) and rest  # something is always fed after compression
    if protocol == "kvpress_compress_questions":
        assert result.predictions[0]["context_budget"] == int(len(context) * (1 - RATIO))
    n_kv = bundled[0].args.n_kv_head
    with torch.inference_mode():
        reference, scores, first = reference_run(hf_eager, context, rest, n_kv)
    jaccard = compare_kept(item["kept_positions"], reference, scores)
    print(f"{protocol}: Jaccard {jaccard:.6f} over {len(reference)} layers, first token {first}")
    assert jaccard >= 0.999, jaccard
    assert item["output_ids"][0] == first


@pytest.mark.slow
def test_compress_questions_puts_the_question_in_the_compressed_part(bundled):
    """kvpress_compress_questions: the question is in the compressed part (it can be evicted) and the budget
    counts it; the plain kvpress protocol compresses the context alone and feeds the question after."""
    plain, joint = (run_protocol(bundled, p).items[0] for p in ("kvpress", "kvpress_compress_questions"))
    ids = plain["context_ids"] + plain["question_ids"]
    assert len(joint["context_ids"]) > len(plain["context_ids"])
    assert joint["context_ids"] + joint["question_ids"] == ids  # the same prompt, split after the question
    question_end = len(joint["context_ids"])
    held = [{int(p) for p in head if p >= 0} for layer in joint["kept_positions"] for head in layer]
    assert all(len(h) == int(question_end * (1 - RATIO)) and max(h) == question_end - 1 for h in held)


# ---- the votes alone, on random tensors ---------------------------------------------------------------------


@pytest.mark.parametrize(("pooling", "per_head"), [("avg", True), ("max", True), ("max", False)])
def test_prefix_votes_equal_a_naive_per_head_loop(pooling, per_head):
    """snapkv_votes with prefix_only, against a loop over batch rows, KV heads and query heads."""
    torch.manual_seed(0)
    B, H, n_kv, T, D, w, kernel = 2, 6, 3, 40, 8, 9, 5
    q, k = torch.randn(B, H, T, D), torch.randn(B, n_kv, T, D)
    votes = snapkv_votes(q, k, w, kernel, pooling, per_head, prefix_only=True)
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    for b in range(B):
        rows = []
        for g in range(n_kv):
            heads = []
            for h in range(g * H // n_kv, (g + 1) * H // n_kv):
                logits = (q[b, h, T - w:] @ k[b, g].T) / D**0.5
                logits = logits.masked_fill(torch.ones(w, T, dtype=torch.bool).triu(T - w + 1), float("-inf"))
                heads.append(torch.softmax(logits, dim=-1)[:, : T - w].sum(dim=0))
            if per_head:
                heads = [pool(x[None, None], kernel, stride=1, padding=kernel // 2)[0, 0] for x in heads]
                rows.append(torch.stack(heads).mean(dim=0))
            else:
                rows.append(pool(torch.stack(heads).mean(dim=0)[None, None], kernel, stride=1,
                                 padding=kernel // 2)[0, 0])
        expected = torch.stack(rows)
        torch.testing.assert_close(votes[b, :, : T - w], expected, atol=1e-6, rtol=1e-5)
        # The window: the row's score maximum, so it stays.
        assert (votes[b, :, T - w:] == votes[b, :, : T - w].max()).all()
        torch.testing.assert_close(votes[b, :, : T - w].max(), expected.max(), atol=1e-6, rtol=1e-5)


# ---- the kvpress protocol skips the H2O statistics ----------------------------------------------------------


def _old_configure(caches: list, budget: int | None) -> None:
    if budget is not None:
        for cache in caches:
            cache.configure(prompt_budget=budget)


@pytest.mark.parametrize("batch_size", ["1", "2"])
def test_kvpress_protocol_skips_h2o_statistics_and_decides_the_same(tiny_dir, monkeypatch, batch_size):
    """Under the kvpress protocol nothing is evicted after the prompt, so heavy_hitter's prefill pass over the
    whole prompt attention (H2O's seed) is skipped; the answers and kept positions are those of a run that
    computes it (the statistics seeded and updated as before). Under the decode protocol it still runs. The
    slots after the prompt are taken in order, unscored (never_full), where the other run scores every step."""
    calls, scored = [], []
    received = heavy_hitter_module.attention_since_entry  # H2O's seed: a pass over the prompt's attention
    token_scores = HeavyHitterCache.token_scores

    def counted(*a, **kw):
        calls.append(1)
        return received(*a, **kw)

    def counted_scores(self, input_pos):
        scored.append(1)
        return token_scores(self, input_pos)

    monkeypatch.setattr(heavy_hitter_module, "attention_since_entry", counted)
    monkeypatch.setattr(HeavyHitterCache, "token_scores", counted_scores)

    def run(protocol: str) -> list:
        args = cli.parse_args(["--tasks", "niah_single", "--checkpoint_path", str(tiny_dir), "--haystack",
                               str(PYDOC_EXCERPT), "--seq_len", "400", "--limit", "3", "--max_new_tokens", "5",
                               "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25", "--global_tokens",
                               "2", "--recent_window", "4", "--protocol", protocol, "--batch_size", batch_size])
        model, tokenizer = cli.load_model(args.checkpoint_path, args.device, torch.float32)
        with torch.inference_mode():
            return get_task("niah_single")(args).run(Runtime(model, tokenizer, args, progress=True)).items

    skipped = run("kvpress")
    assert not calls and not scored
    with monkeypatch.context() as m:
        m.setattr(harness, "configure_prompt_budget", _old_configure)  # batch 1
        m.setattr(rows, "configure_prompt_budget", _old_configure)  # rows of a batch
        m.setattr(harness, "keep_after_prompt", lambda caches: None)  # and before the items (prepare_answer_step)
        computed = run("kvpress")
    assert calls and scored
    for a, b in zip(skipped, computed, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert all((x == y).all() for x, y in zip(a["kept_positions"], b["kept_positions"], strict=True))
    calls.clear()
    run("decode")
    assert calls
    assert HeavyHitterCache.evicts_after_prompt  # the class default: decode eviction reads the statistics


def test_compress_questions_without_a_template_compresses_up_to_the_answer_prefix(tiny_dir):
    """No chat template (the tiny checkpoint): context and question are compressed together, to
    int((context + question) x (1 - ratio)), and the answer prefix is fed after, as kvpress feeds
    question suffix + answer prefix."""
    args = cli.parse_args(["--tasks", "niah_single", "--checkpoint_path", str(tiny_dir), "--haystack",
                           str(PYDOC_EXCERPT), "--seq_len", "400", "--limit", "2", "--max_new_tokens", "3",
                           "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25", "--protocol", "kvpress"])
    args.protocol = "kvpress_compress_questions"
    model, tokenizer = cli.load_model(args.checkpoint_path, args.device, torch.float32)
    task = get_task("niah_single")(args)
    assert task.options["query_aware"]
    with torch.inference_mode():
        result = task.run(Runtime(model, tokenizer, args, progress=True))
    examples = task.examples(Runtime(model, tokenizer, args, progress=True))
    for item, pred, ex in zip(result.items, result.predictions, examples, strict=True):
        n = len(item["context_ids"])
        assert item["context_ids"] == tokenizer.encode(ex.context + ex.question)
        assert item["question_ids"] == continuation_ids(tokenizer, ex.answer_prefix) != []
        assert item["n_prefill"] == n and pred["context_budget"] == int(n * 0.25)
        assert all(((layer >= 0).sum(axis=1) == int(n * 0.25)).all() for layer in item["kept_positions"])


def test_compress_questions_with_nothing_after_the_question_feeds_its_last_token_after(tiny_dir):
    tokenizer = cli.load_model(str(tiny_dir), "cpu", torch.float32)[1]
    example = Example("some context. ", "What is it?")
    ids, n = encode_example(tokenizer, example, chat=False, compress_questions=True)
    assert ids == tokenizer.encode(example.prompt) and n == len(ids) - 1
    ids, n = encode_example(tokenizer, Example("some context. ", "What is it?", " It is"), False, True)
    assert ids[:n] == tokenizer.encode("some context. What is it?")
    assert ids[n:] == continuation_ids(tokenizer, " It is")
