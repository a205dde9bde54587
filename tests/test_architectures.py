"""Every supported Hugging Face architecture against transformers on the same directory.

For each architecture a tiny random model is built from transformers' own config class and saved with
`save_pretrained`; our loader reads that directory, prefills a prompt and decodes 32 tokens greedily
through its KV caches (sliding layers through the window cache the spec gives them). The reference is
transformers' eager forward over the same whole sequence, float32 on both sides.
Tolerance: max |Δlogit| ≤ 1e-3 at every decoded position and the same argmax.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from cache_setup import attach_caches, attach_row_caches, cache_config
from cache_spec import build_caches, resolve_cache_spec
from checkpoint import load_checkpoint
from generate import prefill, prefill_rows
from model_policies import apply_model_layer_policies
from tests.arch_helpers import VOCAB, WINDOW, arch_configs, save_tiny_model

LOGIT_ATOL = 1e-3
PROMPT, STEPS = 24, 32  # both longer than the sliding window (12); STEPS decode steps after the prefill
ARCHS = list(arch_configs())


def default_cache_args(**overrides: object) -> argparse.Namespace:
    return cache_config(**overrides)


def attach(model, prompt_length: int, new_tokens: int, **flags: object) -> list:
    return attach_caches(model, cache_config(**flags), prompt_length, new_tokens)


def greedy_logits(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Logits after the prefill and after each of `steps` - 1 decode steps, [steps, vocab], and the tokens."""
    model.reset_caches()
    with torch.no_grad():
        logits = [model(torch.tensor([prompt]), torch.arange(len(prompt)), last_logits_only=True)[0, -1]]
        tokens = [int(logits[-1].argmax())]
        for i in range(steps - 1):
            pos = torch.tensor([len(prompt) + i])
            logits.append(model(torch.tensor([[tokens[-1]]]), pos)[0, -1])
            tokens.append(int(logits[-1].argmax()))
    return torch.stack(logits), tokens


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_tiny_model(request.param, directory)
    return request.param, directory, reference


def test_prefill_and_decode_match_transformers(arch_dir):
    arch, directory, reference = arch_dir
    model, tokenizer = load_checkpoint(directory, "cpu", torch.float32)
    assert model.args.vocab_size == VOCAB and tokenizer.vocab_size == VOCAB
    prompt = torch.randint(3, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    attach(model, PROMPT, STEPS + 1)
    ours, tokens = greedy_logits(model, prompt, STEPS + 1)
    with torch.no_grad():
        ref = reference(torch.tensor([prompt + tokens[:-1]])).logits[0, PROMPT - 1:].float()
    assert ours.shape[0] == STEPS + 1
    delta = (ours - ref).abs().max().item()
    print(f"{arch}: max |Δlogit| over prefill + {STEPS} decode steps = {delta:.2e}")
    assert delta <= LOGIT_ATOL, f"{arch}: max |Δlogit| {delta:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert ref.std() > 0.5  # the logits really spread: a layout bug could not hide in near-uniform outputs


def test_whole_sequence_forward_matches_transformers(arch_dir):
    """No cache at all: the prefill path alone, sliding-window masks included, over 48 positions."""
    arch, directory, reference = arch_dir
    model, _ = load_checkpoint(directory, "cpu", torch.float32)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(ids, torch.arange(48))
        ref = reference(ids).logits.float()
    assert (ours - ref).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_sliding_layers_get_the_window_cache():
    from checkpoint_hf import hf_model_args

    args = hf_model_args(arch_configs()["gemma3"].to_dict())
    specs = resolve_cache_spec(default_cache_args(cache_strategy=["heavy_hitter"], max_cache_length=[0.5]),
                               args.n_layer, 100, 20)
    specs = apply_model_layer_policies(specs, args, 100, 20, quiet=True)
    assert [s.strategy for s in specs] == ["recent_global", "recent_global", "heavy_hitter", "recent_global"]
    assert [s.max_cache_length for s in specs] == [WINDOW, WINDOW, 60, WINDOW]
    # A sequence the window covers: the user's strategy everywhere.
    short = apply_model_layer_policies(resolve_cache_spec(default_cache_args(), args.n_layer, 6, 4), args, 6, 4)
    assert {s.strategy for s in short} == {"full"}


def test_a_cache_that_outlives_the_window_is_refused(arch_dir):
    """Without the window policy (e.g. specs resolved without apply_model_layer_policies), a sliding
    layer would attend to tokens its window excludes: setup_caches refuses instead of computing it."""
    from errors import UserError

    arch, directory, _ = arch_dir
    model, _ = load_checkpoint(directory, "cpu", torch.float32)
    specs = resolve_cache_spec(default_cache_args(), model.args.n_layer, PROMPT, STEPS)
    a = model.args
    caches = build_caches(specs, 1, a.n_kv_head, a.head_dim, PROMPT + STEPS, torch.float32, "cpu")
    if not a.sliding_window:
        model.setup_caches(caches)  # nothing to refuse
        return
    with pytest.raises(UserError, match="sliding"):
        model.setup_caches(caches)
    # A sequence inside the window: any cache is exact.
    short = resolve_cache_spec(default_cache_args(), a.n_layer, 4, 4)
    model.setup_caches(build_caches(short, 1, a.n_kv_head, a.head_dim, 8, torch.float32, "cpu"))


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_compiled_decode_matches_eager_without_recompiling(arch, tmp_path):
    """The per-architecture steps (q/k norms, scaled embeddings, local RoPE tables, partial rotary, window
    caches) keep the decode step static: compiled equals eager, one graph per kind of layer (the compiled
    block is shared by the layers alike), and no recompilation once prepared."""
    from torch._dynamo.utils import counters

    from generate import compile_decode_step, decode_one_token

    save_tiny_model(arch, tmp_path)
    model, _ = load_checkpoint(tmp_path, "cpu", torch.float32)
    prompt = list(range(3, 3 + PROMPT))
    attach(model, PROMPT, 12)
    kinds = {(type(layer.attention.kv_cache), layer.attention.kv_cache.max_cache_length,
              layer.attention.sliding_window) for layer in model.layers}
    results = []
    torch._dynamo.reset()
    counters.clear()
    try:
        for step in (decode_one_token, compile_decode_step()):
            if hasattr(step, "prepare"):
                step.prepare(model)  # compiles: one graph per kind of layer
            model.reset_caches()
            with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
                model(torch.tensor([prompt]), torch.arange(PROMPT), last_logits_only=True)
                out = [step(model, torch.tensor([[5 + i]]), torch.tensor([PROMPT + i])) for i in range(12)]
            results.append(torch.cat(out))
        graphs = counters["stats"]["unique_graphs"]
    finally:
        # Compiled code is cached per function: later tests compiling for another model must not see this
        # one's graphs as recompilations.
        torch._dynamo.reset()
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=1e-4)
    assert graphs == len(kinds)


@pytest.mark.parametrize("chunk", [None, "5"])
def test_packed_rows_prefill_as_each_row_alone(arch_dir, chunk):
    """Prompts of 24, 17 and 9 tokens packed into one prefill (packed_prefill.py: a GPU's path, made to run on
    the CPU here), or with --prefill_chunk 5 their chunks packed pass by pass: RoPE at each token's own
    position (Gemma 3's local tables too), each row's sliding window, each row's cache. Each row's logits and
    kept positions equal its prefill alone (float32; the packed products round differently)."""
    _, directory, _ = arch_dir
    model, _ = load_checkpoint(directory, "cpu", torch.float32)
    lengths, new = [24, 17, 9], 8
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]
    flags = cache_config(["--cache_strategy", "heavy_hitter", "--max_cache_length", "0.5", "--global_tokens", "1",
                          "--recent_window", "2", *(["--prefill_chunk", chunk] if chunk else [])])

    def kept() -> list:  # per layer and head, the positions held (a row of a batch has its slots and more)
        return [[sorted(p for p in head if p >= 0) for head in c.pos[0].tolist()] for c in model.caches()]

    attach_row_caches(model, flags, lengths, new)
    with torch.inference_mode():
        model.reset_caches()
        together = prefill_rows(model, prompts, pack=True)
        rows_kept = []
        for b in range(len(lengths)):
            with model.cache_row(b):
                rows_kept.append(kept())
    for b, prompt in enumerate(prompts):
        attach_caches(model, flags, len(prompt), new)
        with torch.inference_mode():
            model.reset_caches()
            alone = prefill(model, prompt[None])
        torch.testing.assert_close(together[b : b + 1], alone, atol=1e-4, rtol=1e-4, msg=f"row {b}")
        assert rows_kept[b] == kept(), f"row {b}"


def test_sliding_layers_take_the_prompt_in_chunks_too(arch_dir, monkeypatch):
    """--prefill_chunk reaches the window caches as it reaches every other layer: on a model whose every layer
    slides (Mistral, Phi-3 with a window) the prompt still goes through the model chunk by chunk, not at once
    (which would hold the whole prompt's activations), and a quantized window's later chunks read its held keys
    dequantized, as the transformers adapter's chunks do (tests/test_transformers_adapter_chunked.py)."""
    arch, directory, _ = arch_dir
    model, _ = load_checkpoint(directory, "cpu", torch.float32)
    caches = attach(model, PROMPT, 8, cache_strategy=["recent_global"], max_cache_length=[16], prefill_chunk=5)
    assert [c.prefill_chunk for c in caches] == [5] * model.args.n_layer
    fed, forward = [], type(model).forward

    def counting(self, x, *args, **kwargs):
        fed.append(x.shape[1])
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    model.reset_caches()
    with torch.inference_mode():
        prefill(model, torch.tensor([list(range(3, 3 + PROMPT))]))
    assert fed == [5, 5, 5, 5, 4]
