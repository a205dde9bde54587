"""Prefill + one-token decode through the cache reproduces a single full forward pass, eager and
compiled, and the compiled step never recompiles."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from cache_setup import setup_caches
from cache_spec import LayerCacheSpec
from generate import compile_decode_step, decode_one_token, generate, prefill, sample
from tests.conftest import make_tiny_model


def full_cache_specs(n_layer: int, length: int) -> list[LayerCacheSpec]:
    return [LayerCacheSpec(i, "full", length, {}) for i in range(n_layer)]


def incremental_logits(model, ids: list[int], prompt_length: int, step_fn) -> torch.Tensor:
    setup_caches(model, full_cache_specs(model.args.n_layer, len(ids)), len(ids))
    model.reset_caches()
    rows = [prefill(model, torch.tensor([ids[:prompt_length]]))]
    for p in range(prompt_length, len(ids)):
        rows.append(step_fn(model, torch.tensor([[ids[p]]]), torch.tensor([p])))
    return torch.stack(rows, dim=1)  # logits for positions prompt_length-1 .. len-1


def test_decode_matches_full_forward_bundled_eager(bundled):
    model, tokenizer = bundled
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:80]
    with torch.inference_mode():
        reference = model(torch.tensor([ids]), torch.arange(len(ids)))[:, 59:]
        ours = incremental_logits(model, ids, 60, decode_one_token)
    assert (ours - reference).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("compiled", [False, "block", "step"], ids=["eager", "compiled", "compiled-whole-step"])
def test_decode_matches_full_forward_tiny(compiled):
    model = make_tiny_model()
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    counters.clear()
    torch._dynamo.reset()  # graphs compiled by earlier tests (other cache classes) would count as recompiles
    step = compile_decode_step(scope=compiled) if compiled else decode_one_token
    with torch.inference_mode():
        reference = model(torch.tensor([ids]), torch.arange(len(ids)))[:, 31:]
        with torch._dynamo.config.patch(error_on_recompile=True):
            ours = incremental_logits(model, ids, 32, step)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    if compiled:  # 16 decode steps, one graph, no recompilation (error_on_recompile would have raised)
        assert counters["stats"]["unique_graphs"] == 1


def test_sampling_is_reproducible_for_a_seed_and_greedy_by_default():
    model = make_tiny_model()
    setup_caches(model, full_cache_specs(2, 40), 40)
    runs = [generate(model, [1, 2, 3, 4], 12, eos_ids=[], temperature=1.0, top_k=20, seed=s).tokens
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]
    greedy = generate(model, [1, 2, 3, 4], 12, eos_ids=[]).tokens
    with torch.inference_mode():
        ids = [1, 2, 3, 4]
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]), torch.arange(len(ids)))[0, -1].argmax()))
    assert greedy == ids[4:]


def test_top_k_keeps_only_the_k_best():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits, 1.0, 2, g)) for _ in range(200)}
    assert drawn == {1, 2}


def test_generation_stops_at_eos():
    model = make_tiny_model()
    setup_caches(model, full_cache_specs(2, 40), 40)
    free = generate(model, [1, 2, 3], 10, eos_ids=[]).tokens
    stopped = generate(model, [1, 2, 3], 10, eos_ids=[free[3]])
    assert stopped.stopped_at_eos and stopped.tokens == free[: free.index(free[3]) + 1]


@pytest.mark.parametrize("compiled", [False, "step"], ids=["eager", "compiled"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "qkv-bias"])
def test_stacked_projections_give_the_separate_projections_logits(compiled, bias):
    """Transformer.fuse_projections (every non-CPU model: one product for q, k, v and one for gate, up) changes
    no result: prefill and decode logits equal the separate products' within float32 summation order, and the
    weights are held once (each layer's parameters are views of the stacked matrix)."""
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    separate, fused = make_tiny_model(attention_bias=bias), make_tiny_model(attention_bias=bias)
    if bias:  # the random init leaves biases at zero
        for model in (separate, fused):
            torch.manual_seed(3)
            for layer in model.layers:
                for linear in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                    linear.bias.normal_(std=0.2)
    reference = separate.layers[0].attention.wk.weight.clone()
    fused.fuse_projections()
    attention, mlp = fused.layers[0].attention, fused.layers[0].feed_forward
    assert attention.wk.weight.untyped_storage().data_ptr() == attention.qkv_weight.untyped_storage().data_ptr()
    assert mlp.w3.weight.untyped_storage().data_ptr() == mlp.gate_up_weight.untyped_storage().data_ptr()
    assert torch.equal(attention.wk.weight, reference) and attention.qkv_weight.shape == (64 + 32 + 32, 64)
    torch._dynamo.reset()
    step = compile_decode_step(scope=compiled) if compiled else decode_one_token
    with torch.inference_mode():
        want = incremental_logits(separate, ids, 24, decode_one_token)
        got = incremental_logits(fused, ids, 24, step)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.equal(want, incremental_logits(make_tiny_model(seed=1), ids, 24, decode_one_token))
