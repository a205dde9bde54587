"""Fidelity under teacher forcing: exact zeros for the full cache, the right positions scored, and the
first difference exactly where the compressed cache first evicts."""

from __future__ import annotations

import pytest
import torch

from eval.harness import Runtime, Timings, teacher_force
from eval.tasks import get_task
from eval.tasks.fidelity import text_windows
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    tiny_runtime,
)


def run_fidelity(rt: Runtime):
    with torch.inference_mode():
        return get_task("fidelity")(rt.args).run(rt)


@pytest.mark.parametrize("decode_first_token", [False, True])
def test_full_cache_gives_exactly_zero_kl_and_full_agreement(tiny_dir, decode_first_token):
    flags = ["--text_file", str(PYDOC_EXCERPT), "--seq_len", "96", "--prefill_tokens", "40", "--limit", "2"]
    rt = tiny_runtime(tiny_dir, *flags, *(["--decode_first_token"] if decode_first_token else []))
    out = run_fidelity(rt)
    m = out.metrics
    assert m["kl_mean"] == 0.0 and m["kl_max"] == 0.0 and m["top1_agreement"] == 1.0
    assert m["perplexity"] == m["perplexity_full"] and m["perplexity_delta"] == 0.0
    assert m["scored_tokens"] == 2 * (96 - 40) == len(out.predictions)
    assert out.stats["compression_ratio"] == 0.0 and out.config["windows"] == 2


@pytest.mark.parametrize("decode_first_token", [False, True])
def test_the_baseline_from_one_forward_equals_decoding_it_token_by_token(tiny_dir, monkeypatch, decode_first_token):
    """The baseline run (the full cache) is scored from one causal forward pass per window, not decoded: its
    metrics, kept positions and cache statistics equal those of decoding it through the full cache token by
    token (the general path, its own logits the reference while lossless), NLL within 1e-4."""
    import eval.harness as harness

    flags = ["--text_file", str(PYDOC_EXCERPT), "--seq_len", "80", "--prefill_tokens", "24", "--limit", "3",
             "--batch_size", "2", *(["--decode_first_token"] if decode_first_token else [])]
    fast = run_fidelity(tiny_runtime(tiny_dir, *flags))
    monkeypatch.setattr(harness, "exact_attention_traces", lambda *a, **k: pytest.fail("decoded path expected"))
    monkeypatch.setattr(harness, "reference_is_run", lambda args: False)
    decoded = run_fidelity(tiny_runtime(tiny_dir, *flags))
    assert 0 < fast.timings.decode_tokens < decoded.timings.decode_tokens
    assert [(p["window"], p["position"], p["token"], p["kl"], p["top1_agree"]) for p in fast.predictions] == [
        (p["window"], p["position"], p["token"], p["kl"], p["top1_agree"]) for p in decoded.predictions]
    assert all(p["kl"] == 0.0 and p["nll"] == p["nll_full"] for p in fast.predictions)
    assert [p["nll"] for p in fast.predictions] == pytest.approx([p["nll"] for p in decoded.predictions], abs=1e-4)
    assert fast.stats == decoded.stats and fast.stats["compression_ratio"] == 0.0
    for a, b in zip(fast.items, decoded.items, strict=True):
        assert a["metrics"]["compression_ratio_scored_mean"] == b["metrics"]["compression_ratio_scored_mean"] == 0.0
        assert a["n_prefill"] == b["n_prefill"]
    def kept(items: list[dict]) -> list:
        return [[layer.tolist() for layer in item["kept_positions"]] for item in items]

    assert kept(fast.items) == kept(decoded.items)


def test_a_compiled_baseline_is_compiled_before_its_timed_steps(tiny_dir):
    """Under --compile the baseline's step is compiled (prepared) before the few steps that time it, so its
    decode speed is not its compile; its records are the eager baseline's."""
    from compiled_step import compile_decode_step

    flags = ["--text_file", str(PYDOC_EXCERPT), "--seq_len", "80", "--prefill_tokens", "24", "--limit", "2",
             "--batch_size", "2"]
    eager = run_fidelity(tiny_runtime(tiny_dir, *flags))
    rt = tiny_runtime(tiny_dir, *flags)
    rt.step = compile_decode_step()
    compiled = run_fidelity(rt)
    assert rt.step.prepared and compiled.timings.compile_seconds == rt.step.compile_seconds > 0
    assert len(compiled.timings.step_seconds) == 32  # one batch of two windows
    assert compiled.predictions == eager.predictions and compiled.stats == eager.stats


def test_a_baseline_with_sliding_window_layers_is_decoded_as_its_own_reference(tmp_path, monkeypatch):
    """A model's sliding-window layers give the baseline window caches, whose compression changes step by step:
    it is decoded (not taken from one forward pass), its own logits the reference, so KL is exactly 0 and its
    per-step compression is what each step's caches hold."""
    import eval.harness as harness
    from tests.arch_helpers import WINDOW, save_tiny_model

    save_tiny_model("mistral", tmp_path / "mistral")
    monkeypatch.setattr(harness, "exact_attention_traces", lambda *a, **k: pytest.fail("decoded path expected"))
    n, prompt = 40, 8
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"w{3 + (7 * i) % 150}" for i in range(200)))
    rt = tiny_runtime(tmp_path / "mistral", "--text_file", str(text), "--seq_len", str(n), "--prefill_tokens",
                      str(prompt), "--limit", "2", "--batch_size", "2")
    out = run_fidelity(rt)
    assert out.metrics["kl_max"] == 0.0 and out.metrics["top1_agreement"] == 1.0
    # Token p is predicted after feeding p tokens, of which each layer's window holds WINDOW.
    want = [round(1 - min(p, WINDOW) / p, 4) for p in range(prompt, n)]
    assert [it["metrics"]["compression_ratio_scored_mean"] for it in out.items] == pytest.approx(
        [sum(want) / len(want)] * 2, abs=1e-4)


def test_scored_positions_match_one_full_forward_pass(tiny_dir):
    rt = tiny_runtime(tiny_dir)
    ids = [int(b) for b in PYDOC_EXCERPT.read_bytes()[:120]]
    with torch.inference_mode():
        [(trace, _)] = teacher_force(rt, [ids], 30, decode_first_token=False, timings=Timings())
        logp = torch.log_softmax(rt.model(torch.tensor([ids]), torch.arange(len(ids)))[0].float(), dim=-1)
    assert trace.positions == list(range(30, 120))
    want = [-float(logp[p - 1, ids[p]]) for p in trace.positions]  # the logits at p-1 predict token p
    assert trace.nll_full == pytest.approx(want, abs=1e-4)


def test_compressed_cache_differs_exactly_after_its_first_eviction(tiny_dir):
    budget = 64  # tokens; the window is 200: evictions start when token 64 is inserted
    rt = tiny_runtime(tiny_dir, "--text_file", str(PYDOC_EXCERPT), "--seq_len", "200", "--prefill_tokens", "32",
                      "--cache_strategy", "recent_global", "--max_cache_length", str(budget))
    out = run_fidelity(rt)
    kl = {p["position"]: p["kl"] for p in out.predictions}
    # Token p is predicted after feeding p-1 with p tokens cached: identical up to p = budget.
    assert all(kl[p] == 0.0 for p in range(32, budget + 1))
    assert sum(kl[p] for p in range(budget + 1, 200)) > 0
    assert out.metrics["kl_mean"] > 0 and out.metrics["top1_agreement"] < 1
    assert out.stats["compression_ratio"] == pytest.approx(1 - budget / 199, abs=1e-4)  # the last is never fed
    assert out.config["cache_spec"][0]["max_cache_length"] == budget


def test_bundled_model_full_cache_is_exact_on_real_text(bundled):
    """The bundled SmolLM2 on 96 tokens of pinned pydoc text: zero KL; perplexity of a real model."""
    model, tokenizer = bundled
    from eval import cli

    args = cli.parse_args(["--text_file", str(PYDOC_EXCERPT), "--seq_len", "96", "--prefill_tokens", "64"])
    with torch.inference_mode():
        out = get_task("fidelity")(args).run(Runtime(model, tokenizer, args, progress=True))
    assert out.metrics["kl_max"] == 0.0 and out.metrics["top1_agreement"] == 1.0
    assert 1.5 < out.metrics["perplexity_full"] < 30  # a language model, not noise (vocab 49152)


def test_every_window_starts_with_bos_when_the_tokenizer_adds_one():
    """Gemma's tokenizer starts every text with BOS: each window, not only the first, gets it, followed by the
    next seq_len - 1 text tokens, so the windows still tile the text; without a BOS they are plain slices."""
    text = list(range(10, 40))  # 30 text tokens
    plain = text_windows(text, 2, 8, 5, None)
    assert plain == [text[2:10], text[10:18], text[18:26]]  # a short last window is dropped
    windows = text_windows([1, *text], 2, 8, 5, 1)
    assert all(len(w) == 8 and w[0] == 1 for w in windows) and len(windows) == 4
    assert [t for w in windows for t in w[1:]] == text[2:30]
