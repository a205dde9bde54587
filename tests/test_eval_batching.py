"""Rows decoded together (eval/batching.py): a row in a batch keeps what it keeps alone for every strategy;
the one-pass full-cache reference equals the step-by-step full cache; a batched fidelity run records what
batch-1 runs of the same windows record. The references are batch-1 and step-by-step runs."""

from __future__ import annotations

import pytest
import torch

import cpu_bf16_kernels
from cache import cache_statistics
from cache_setup import attach_caches, cache_config, cache_specs
from cache_spec import build_caches
from eval.batching import ReferenceLogits, copy_row, reference_hidden, rows_per_batch, step_compression
from eval.metrics import rows_fidelity, step_fidelity
from eval.tasks import get_task
from gates import attach_random_gates
from generate import decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    tiny_runtime,
)
from tests.strategy_matrix import (
    ADAKV,
    ALL,
    ALLOCATIONS,
    NEW,
    PROMPT,
    TOKEN_CLASSES,
    TOTAL,
    VOCAB,
    cache_args,
    inner,
)

ROWS = 3


def distinct_rows(rows: int = ROWS) -> torch.Tensor:
    """Rows of TOTAL distinct token ids. A repeated token would tie l2's scores exactly at layer 0 (see
    batching.TIED_SCORES), and the tie would be broken by rounding: not what this test is about."""
    g = torch.Generator().manual_seed(1)
    return torch.stack([torch.randperm(VOCAB, generator=g)[:TOTAL] for _ in range(rows)])


def decode_rows(model, args, ids: torch.Tensor):
    """Prefill PROMPT tokens of every row, decode the rest one shared position at a time: logits per step
    [B, steps, vocab] and the caches."""
    specs = cache_specs(args, model.args, PROMPT, NEW)
    a = model.args
    caches = build_caches(specs, ids.shape[0], a.n_kv_head, a.head_dim, TOTAL, torch.float32, "cpu",
                          token_classes=TOKEN_CLASSES)
    model.setup_caches(caches)
    model.reset_caches()
    out = [prefill(model, ids[:, :PROMPT])]
    for p in range(PROMPT, TOTAL):
        out.append(decode_one_token(model, ids[:, p: p + 1], torch.tensor([p])))
    return torch.stack(out, 1), caches


def held(cache, row: int) -> list[list[int]]:
    c = inner(cache)
    pos = c.pos[row].expand(c.n_kv_heads, -1)
    return [sorted(pos[h][c.mask[row, h, 0]].tolist()) for h in range(c.n_kv_heads)]


CASES = [(s, b, st, "uniform") for s in ALL for b, st in (("0.5", "dense"), ("16", "dense"), ("0.5", "4bit"),
                                                          ("16", "kivi4"))]
CASES += [(s, "0.5", "dense", "adakv") for s in ADAKV]


@pytest.mark.parametrize(("strategy", "budget", "storage", "allocation"), CASES,
                         ids=["-".join(c) for c in CASES])
def test_a_row_in_a_batch_keeps_what_it_keeps_alone(strategy, budget, storage, allocation):
    model = make_tiny_model()
    attach_random_gates(model, seed=0)
    args = cache_args(strategy, budget, storage, *ALLOCATIONS[allocation])
    ids = distinct_rows()
    with torch.inference_mode():
        batch_logits, batch_caches = decode_rows(model, args, ids)
        together = [[held(c, r) for c in batch_caches] for r in range(ROWS)]
        for r in range(ROWS):
            alone_logits, alone_caches = decode_rows(model, args, ids[r: r + 1])
            assert [held(c, 0) for c in alone_caches] == together[r], f"row {r}"
            torch.testing.assert_close(batch_logits[r], alone_logits[0], atol=1e-4, rtol=0)


def test_rows_fidelity_is_step_fidelity_per_row():
    g = torch.Generator().manual_seed(0)
    ref, logits = torch.randn(4, 50, generator=g), torch.randn(4, 50, generator=g)
    logits[2] = ref[2]  # identical logits: exactly 0 and agreement
    targets = torch.tensor([0, 7, 3, 49])
    got = rows_fidelity(ref, logits, targets)
    for r in range(4):
        want = step_fidelity(ref[r], logits[r], int(targets[r]))
        assert [values[r] for values in got] == pytest.approx(list(want), abs=1e-6)
    assert got[0][2] == 0.0 and got[1][2] is True


def test_step_compression_and_row_statistics_are_the_batch_1_statistics():
    model = make_tiny_model()
    args = cache_args("heavy_hitter", "16", "4bit")
    ids = distinct_rows()
    with torch.inference_mode():
        _, caches = decode_rows(model, args, ids)
        ratios, lossless = step_compression(caches)
        a = model.args
        single = build_caches(cache_specs(args, a, PROMPT, NEW), 1, a.n_kv_head, a.head_dim, TOTAL, torch.float32,
                              "cpu")
        for r in range(ROWS):
            _, alone = decode_rows(model, args, ids[r: r + 1])
            assert cache_statistics(copy_row(caches, single, r)) == cache_statistics(alone)
            assert ratios[r] == cache_statistics(alone)["compression_ratio"]
    assert lossless == [False] * ROWS  # 4-bit storage loses precision from the first token


def step_by_step_full_cache(model, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    """The reference as it was computed before the one-pass forward: the full cache, prefill then one token
    at a time; logits after each position n_prefill-1 .. T-2, [T - n_prefill, vocab]."""
    n = ids.shape[1]
    attach_caches(model, cache_config(["--cache_strategy", "full"]), n_prefill, n - n_prefill)
    model.reset_caches()
    out = [prefill(model, ids[:, :n_prefill])]
    for p in range(n_prefill, n - 1):
        out.append(decode_one_token(model, ids[:, p: p + 1], torch.tensor([p])))
    model.remove_caches()
    return torch.stack(out, 1)[0]


def one_pass(model, ids: torch.Tensor, n_prefill: int) -> torch.Tensor:
    reference = ReferenceLogits(model, reference_hidden(model, ids), chunk=7)  # chunks that do not divide
    return torch.stack([reference.at(p)[0] for p in range(n_prefill - 1, ids.shape[1] - 1)])


def assert_reference_matches(model, ids: torch.Tensor, n_prefill: int, logit_tol: float, kl_tol: float) -> None:
    with torch.inference_mode():
        want, got = step_by_step_full_cache(model, ids, n_prefill), one_pass(model, ids, n_prefill)
    assert (got - want).abs().max() <= logit_tol
    want_logp, got_logp = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    assert (want_logp.exp() * (want_logp - got_logp)).sum(-1).max() <= kl_tol
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_one_pass_reference_equals_the_step_by_step_full_cache_on_the_tiny_model():
    model = make_tiny_model()
    ids = torch.tensor([[int(b) for b in PYDOC_EXCERPT.read_bytes()[:150]]])
    assert_reference_matches(model, ids, 20, logit_tol=1e-4, kl_tol=1e-6)


def test_one_pass_reference_equals_the_step_by_step_full_cache_on_the_bundled_model(bundled):
    """Measured on these 400 tokens (float32, one thread): max |logit difference| 7.6e-5, max KL 4.2e-7."""
    model, tokenizer = bundled
    ids = torch.tensor([tokenizer.encode(PYDOC_EXCERPT.read_text())[:400]])
    assert_reference_matches(model, ids, 64, logit_tol=5e-4, kl_tol=5e-6)


WINDOW_FLAGS = ["--text_file", str(PYDOC_EXCERPT), "--seq_len", "64", "--prefill_tokens", "16", "--limit", "4",
                "--max_cache_length", "24", "--global_tokens", "2", "--recent_window", "4"]
# Per-window metrics of a batch of 4 against batch-1 runs of the same windows: the rows' matmuls round
# differently (measured: < 6e-7 for every strategy); the decisions, kept positions and compression are equal.
RECORD_TOLERANCE = 1e-5


def fidelity_run(tiny_dir, strategy: str, batch_size: int, *extra: str):
    rt = tiny_runtime(tiny_dir, *WINDOW_FLAGS, "--cache_strategy", strategy, "--batch_size", str(batch_size), *extra)
    attach_random_gates(rt.model, seed=0)  # the gated strategy's gates (unused by every other cache)
    with torch.inference_mode():
        return get_task("fidelity")(rt.args).run(rt)


def assert_nested_close(got: object, want: object, where: str) -> None:
    """Numbers within RECORD_TOLERANCE, through the lists (per layer, per head) and dicts (curves) of stats."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_nested_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_nested_close(g, w, f"{where}[{i}]")
    else:
        assert got == pytest.approx(want, abs=RECORD_TOLERANCE), where


BATCH_CASES = [(s, ()) for s in ALL] + [("heavy_hitter", ("--cache_bits", "4")), ("tova", ("--budget_allocation",
                                                                                          "adakv"))]


@pytest.mark.parametrize(("strategy", "extra"), BATCH_CASES, ids=[f"{s}{''.join(e)}" for s, e in BATCH_CASES])
def test_batched_fidelity_records_equal_batch_1_records(tiny_dir, strategy, extra):
    alone, together = fidelity_run(tiny_dir, strategy, 1, *extra), fidelity_run(tiny_dir, strategy, 4, *extra)
    assert together.config["batch_size"] == 4  # l2 too: the CPU's products are batch-invariant (TIED_SCORES)
    assert len(together.items) == len(alone.items) == 4
    for a, b in zip(alone.items, together.items, strict=True):
        assert a["metrics"].keys() == b["metrics"].keys() and a["context_ids"] == b["context_ids"]
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, abs=RECORD_TOLERANCE), key
        assert len(a["kept_positions"]) == len(b["kept_positions"])
        assert all((x == y).all() for x, y in zip(a["kept_positions"], b["kept_positions"], strict=True))
    for a, b in zip(alone.predictions, together.predictions, strict=True):
        assert (a["window"], a["position"], a["top1_agree"]) == (b["window"], b["position"], b["top1_agree"])
        assert b["kl"] == pytest.approx(a["kl"], abs=RECORD_TOLERANCE)
    assert alone.stats.keys() == together.stats.keys()
    for key, value in alone.stats.items():
        assert_nested_close(together.stats[key], value, key)
    assert together.timings.decode_tokens == alone.timings.decode_tokens


def test_l2_anywhere_decodes_one_row_at_a_time_where_products_round_by_the_batch(monkeypatch):
    """l2's exact ties break by the products' last bit: rows batch where the products are batch-invariant (the
    CPU's kernels, up to MAX_ROWS rows), and one at a time where they are not (a GPU, made here by hand)."""
    args = cache_config(["--cache_strategy", "tova", "--max_cache_length", "16",
                         "--prompt_compression_strategy", "l2"])
    plain = cache_config(["--cache_strategy", "tova", "--max_cache_length", "16"])
    model = make_tiny_model()
    specs, plain_specs = cache_specs(args, model.args, PROMPT, NEW), cache_specs(plain, model.args, PROMPT, NEW)
    assert rows_per_batch(model, specs, 8) == rows_per_batch(model, plain_specs, 8) == 8
    assert rows_per_batch(model, specs, 16) == 8 and rows_per_batch(model, plain_specs, 16) == 16  # one kernel call
    monkeypatch.setattr(cpu_bf16_kernels, "batch_invariant", lambda weight, rows: False)
    assert rows_per_batch(model, specs, 8) == 1
    assert rows_per_batch(model, plain_specs, 8) == 8


def test_low_precision_rows_batch_only_as_far_as_they_stay_batch_invariant(monkeypatch, capsys):
    """In bfloat16 a product's last bit flips which tokens a strategy keeps: every strategy decodes at most as
    many rows together as stay batch-invariant (8 with the CPU kernels; 16 asked are decoded 8 at a time), so
    the records stay a batch-1 run's; where no batch is (a GPU, made here by hand) the rows asked, with one note
    per setting. float32 batches whatever was asked."""
    import generate

    generate._note_rows.cache_clear()  # noted once per process: another test may have said it
    plain = cache_config(["--cache_strategy", "tova", "--max_cache_length", "16"])
    for dtype, asked_16 in ((torch.bfloat16, 8), (torch.float16, 8), (torch.float32, 16)):
        model = make_tiny_model().to(dtype)
        specs = cache_specs(plain, model.args, PROMPT, NEW)
        monkeypatch.setattr(cpu_bf16_kernels, "batch_invariant", lambda weight, rows: rows <= 8)
        assert rows_per_batch(model, specs, 8) == 8 and rows_per_batch(model, specs, 16) == asked_16
        monkeypatch.setattr(cpu_bf16_kernels, "batch_invariant", lambda weight, rows: False)
        assert rows_per_batch(model, specs, 4) == 4 and rows_per_batch(model, specs, 4) == 4
    notes = capsys.readouterr().err.splitlines()
    assert notes == [f"note: 4 rows in {d} on cpu round their products by the batch, so a row may keep other tokens "
                     "than in a batch-1 run (the run is reused at any --batch_size; --batch_size 1 for batch-1 records)"
                     for d in ("bfloat16", "float16")]
