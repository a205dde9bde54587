"""The gated cache (strategies/gated.py), its gates (gates.py) and their training (train_gates.py).

Logic on the tiny random model with random gates; the shipped gates file against the bundled model.
"""

from __future__ import annotations

import pytest
import torch

import generate
import train_gates
from cache_setup import setup_caches
from cache_spec import build_caches, resolve_cache_spec
from errors import UserError
from gates import (
    GATES_DIR,
    INIT_BIAS,
    attach_gates,
    attach_random_gates,
    attached_gates,
    find_gates_file,
    load_gates,
    prepare_gates,
    read_metadata,
    save_gates,
)
from generate import compile_decode_step, decode_one_token
from tests.conftest import make_tiny_model
from tests.eval_helpers import write_tiny_checkpoint
from tests.strategy_matrix import NEW, PROMPT, TOTAL, attach, cache_args, held_positions, inner, run, token_ids


def reference_log_gates(model, ids) -> torch.Tensor:
    """Layer 0's log-gate of every position [n_kv, TOTAL]: layer 0's input is the token embeddings only."""
    layer = model.layers[0]
    with torch.inference_mode():
        return layer.attention.gate(layer.attention_norm(model.tok_embeddings(ids)))[0]


@pytest.mark.parametrize("strategy,storage", [("gated", "dense"), ("gated", "kivi4"), ("debug_gated", "dense")])
def test_gates_stay_attached_to_their_tokens(strategy, storage):
    """After prompt compression and every eviction, each held slot's log-gate is its own token's gate."""
    model = make_tiny_model()
    attach_random_gates(model, seed=1)
    ids = token_ids()
    expected = reference_log_gates(model, ids)
    caches = attach(model, cache_args(strategy, "16", storage))  # 16 of 24 prompt tokens: compression, then evictions
    c = inner(caches[0])
    checked = []

    def check(p: int) -> None:
        for h in range(c.n_kv_heads):
            slots = c.mask[0, h, 0].nonzero().flatten()
            torch.testing.assert_close(c.log_gate[0, h, slots], expected[h, c.pos[0, h, slots]], atol=1e-6, rtol=0)
        checked.append(p)

    with torch.inference_mode():
        for _ in range(2):  # and again after reset
            run(model, ids, decode_one_token, check)
    assert len(checked) == 2 * (NEW + 1)


def test_constant_gates_evict_in_recent_global_order():
    model = make_tiny_model()
    gates = attach_random_gates(model)
    with torch.no_grad():
        for gate in gates:
            gate.proj.weight.zero_()
            gate.proj.bias.fill_(-0.5)  # the same log-gate for every token and head
    ids = token_ids()
    history = {}
    for strategy in ("gated", "recent_global"):
        caches = attach(model, cache_args(strategy, "16"))
        steps = history[strategy] = []
        with torch.inference_mode():
            run(model, ids, decode_one_token, lambda p, caches=caches, steps=steps: steps.append(
                [held_positions(c) for c in caches]))
    assert history["gated"] == history["recent_global"]


def test_debug_gated_attention_loss_is_finite_and_shadow_sees_the_gates():
    model = make_tiny_model()
    attach_random_gates(model)
    caches = attach(model, cache_args("debug_gated", "16"))
    with torch.inference_mode():
        run(model, token_ids(), decode_one_token, lambda p: None)
    loss = caches[0].extra_statistics()["attention_loss"]
    assert torch.isfinite(loss).all() and (loss > 0).all()
    assert (caches[0].shadow.log_gate[caches[0].shadow.mask[:, :, 0]] < 0).all()


def test_compiled_gated_decode_matches_eager_without_recompiling():
    model = make_tiny_model(n_layer=1)
    attach_random_gates(model)
    ids = token_ids()
    args = cache_args("gated", "16", "4bit")
    histories = []
    for step in (decode_one_token, None):
        caches = attach(model, args)
        history = []
        if step is None:
            torch._dynamo.reset()
            step = compile_decode_step()
        with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
            run(model, ids, step, lambda p, caches=caches, history=history: history.append(
                (held_positions(caches[0]), caches[0].log_gate.clone())))
        histories.append(history)
    for (held_eager, gate_eager), (held_compiled, gate_compiled) in zip(*histories, strict=True):
        assert held_eager == held_compiled
        torch.testing.assert_close(gate_eager, gate_compiled, atol=1e-6, rtol=0)


def test_a_gated_cache_needs_gates_on_the_model():
    model = make_tiny_model()
    specs = resolve_cache_spec(cache_args("gated", "16"), model.args.n_layer, PROMPT, NEW)
    a = model.args
    caches = build_caches(specs, 1, a.n_kv_head, a.head_dim, TOTAL, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs learned gates"):
        model.setup_caches(caches)
    with pytest.raises(UserError, match="train_gates.py"):  # no shipped gates fit the tiny model
        setup_caches(model, specs, TOTAL)


def test_gated_prompt_compression_needs_a_gated_cache():
    """Refused when the spec is resolved, before any work."""
    model = make_tiny_model()
    with pytest.raises(UserError, match="gated cache"):
        attach(model, cache_args("l2", "16", "dense", "--prompt_compression_strategy", "gated"))


# ---- files and training ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


def smoke_train(checkpoint, out, *extra: str):
    return train_gates.main(["--checkpoint_path", str(checkpoint), "--out", str(out), "--steps", "2",
                             "--seq_len", "32", "--max_train_tokens", "256", *extra])


def test_runs_of_one_process_each_read_their_own_gates(tiny_checkpoint, tmp_path, monkeypatch):
    """eval loads a model once for its runs: a run with --gates_path A, then one with the default gates (here
    file B, standing in for the shipped file), computes the second with B's gates, as a fresh process does;
    and B replaced in place is read again."""
    from eval import cli

    a, b = smoke_train(tiny_checkpoint, tmp_path / "a.safetensors"), tmp_path / "b.safetensors"
    smoke_train(tiny_checkpoint, b, "--seed", "1")
    monkeypatch.setattr("gates.find_gates_file", lambda model: b)

    def kl(out: str, *more: str) -> float:
        (metrics,) = cli.main(["--tasks", "fidelity", "--checkpoint_path", str(tiny_checkpoint), "--seq_len", "64",
                               "--prefill_tokens", "16", "--no-baseline", "--cache_strategy", "gated",
                               "--max_cache_length", "0.5", "--out_dir", str(tmp_path / out), *more])
        return metrics["kl_mean"]

    cli.load_model.cache_clear()
    with_a = kl("a", "--gates_path", str(a))
    default = kl("default")
    cli.load_model.cache_clear()
    assert default == pytest.approx(kl("fresh"), abs=1e-6) and default != pytest.approx(with_a, abs=1e-6)
    b.write_bytes(a.read_bytes())  # the default file replaced by A's gates
    assert kl("replaced") == pytest.approx(with_a, abs=1e-6)


def test_the_attached_file_is_kept_until_it_changes(tiny_checkpoint, tmp_path):
    """Caches built again on one model (eval's batches, the bench's rows) keep the gate modules of a file already
    attached, so a compiled step is not compiled again; the file rewritten, its new gates are loaded."""
    path = smoke_train(tiny_checkpoint, tmp_path / "gates.safetensors")
    model = make_tiny_model(seed=0)
    prepare_gates(model, str(path))
    first = attached_gates(model)
    prepare_gates(model, str(path))
    assert all(a is b for a, b in zip(attached_gates(model), first, strict=True))
    smoke_train(tiny_checkpoint, path, "--seed", "1", "--overwrite")
    prepare_gates(model, str(path))
    assert not any(a is b for a, b in zip(attached_gates(model), first, strict=True))
    assert not torch.equal(attached_gates(model)[0].proj.weight, first[0].proj.weight)


def test_smoke_training_writes_a_loadable_deterministic_file(tiny_checkpoint, tmp_path, bundled):
    out = smoke_train(tiny_checkpoint, tmp_path / "gates.safetensors")
    assert out.stat().st_size < 1_000_000
    model = make_tiny_model(seed=0)  # the same weights as the checkpoint
    gates = load_gates(out, model)
    assert len(gates) == model.args.n_layer and not any(p.requires_grad for g in gates for p in g.parameters())
    trained = torch.stack([g.proj.bias for g in gates])
    assert not torch.allclose(trained, torch.full_like(trained, INIT_BIAS))  # training moved them

    again = smoke_train(tiny_checkpoint, tmp_path / "again.safetensors")
    for g, h in zip(gates, load_gates(again, model), strict=True):
        assert torch.equal(g.proj.weight, h.proj.weight) and torch.equal(g.proj.bias, h.proj.bias)

    with pytest.raises(UserError, match="--overwrite"):
        smoke_train(tiny_checkpoint, out)
    with pytest.raises(UserError, match="different weights"):
        load_gates(out, make_tiny_model(seed=1))
    with pytest.raises(UserError, match="trained for a model with 2 layers"):
        load_gates(out, bundled[0])


def test_save_refuses_to_overwrite_and_load_rejects_other_files(tmp_path):
    model = make_tiny_model()
    gates = attach_random_gates(model)
    path = save_gates(gates, model, tmp_path / "g.safetensors", {"model_name": "tiny"})
    with pytest.raises(UserError, match="exists"):
        save_gates(gates, model, path, {})
    with pytest.raises(UserError, match="not found"):
        load_gates(tmp_path / "missing.safetensors", model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot read"):
        load_gates(tmp_path / "junk.safetensors", model)


def test_shipped_gates_load_for_the_bundled_model(bundled):
    model, _ = bundled
    path = find_gates_file(model)
    assert path is not None and path.parent == GATES_DIR and path.stat().st_size < 1_000_000
    assert "format" in read_metadata(path)
    try:
        prepare_gates(model, None)
        gates = attached_gates(model)
        assert gates is not None and len(gates) == model.args.n_layer
        ids = torch.arange(100, 164).view(1, -1)
        with torch.inference_mode():
            log_gates = gates[5](model.tok_embeddings(ids))
        assert log_gates.shape == (1, model.args.n_kv_head, 64) and (log_gates <= 0).all()
    finally:
        attach_gates(model, None)


def test_generate_with_the_shipped_gates_and_a_mismatched_gates_file(bundled, monkeypatch, tmp_path):
    model, tokenizer = bundled
    monkeypatch.setattr(generate, "load_checkpoint", lambda *a, **k: bundled)
    prompt = "The gated cache keeps each token's forget gate next to its key and value. " * 3
    flags = ["--prompt", prompt, "--no-chat", "--max_new_tokens", "6", "--max_cache_length", "0.5"]
    try:
        stats = generate.main([*flags, "--cache_strategy", "gated"])
        assert 0.4 < stats["compression_ratio"] < 0.6 and stats["held_log_gate_mean"] < 0
        tiny = make_tiny_model()
        other = save_gates(attach_random_gates(tiny), tiny, tmp_path / "tiny.safetensors", {"model_name": "tiny"})
        with pytest.raises(UserError, match="do not fit this model"):
            generate.main([*flags, "--cache_strategy", "debug_gated", "--gates_path", str(other)])
    finally:
        attach_gates(model, None)
