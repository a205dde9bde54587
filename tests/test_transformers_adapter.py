"""transformers_adapter: `model.generate` of a transformers model under this project's caches, against
generate.py's own loop with the same flags.

References, none produced by the adapter: (1) generate.generate on this project's Transformer loaded from the
same weights (the bundled GGUF; tiny random checkpoints written by transformers for the other
architectures), with caches built as generate.main builds them; (2) transformers' own DynamicCache for `full`.
Tolerances: float32 on both sides; greedy tokens and kept positions (per layer and KV head) must be identical;
logits within LOGIT_ATOL (test_model_parity measures |Δlogit| ≈ 1e-4 between the two models); attention loss
within 1e-4 (both sides round it to 5 decimals from probabilities that differ in the last float32 bits).
A chunked prefill's cases: tests/test_transformers_adapter_chunked.py; what both files share:
tests/adapter_helpers.py.
"""

from __future__ import annotations

import pytest
import torch

from errors import UserError
from strategies import CACHE_STRATEGIES, get_strategy
from tests.adapter_helpers import (
    ARCHS,
    BATCH_LENGTHS,
    COMMON,
    FAST_VARIANTS,
    MATRIX,
    NEW,
    ROW_STATISTICS,
    VARIANTS,
    assert_batch_equals_rows_alone,
    assert_same_run,
    assert_same_statistics,
    cache_flags,
    distinct_prompt,
    hf_generate,
    hf_generate_batch,
    needs_gates,
    run_our_loop,
    ta,
    tiny_prompt,
    transformers,
)
from tests.strategy_matrix import ALL, STORAGES

LOGIT_ATOL = 1e-3
FAST = {"heavy_hitter", "hybrid", "debug_l2", "duo_attention", "threshold"}  # also on the bundled model


@pytest.fixture(scope="module")
def prompt(bundled_session) -> list[int]:
    import pydoc_data.topics

    ids = bundled_session[1].encode(pydoc_data.topics.topics["with"][:600])[:48]
    assert len(ids) == 48
    return ids


# ---- every strategy against generate.py's loop: the registry on a tiny random Llama, a few on the bundled model --

# The whole registry runs on the tiny random Llama (a second a case; the adapter's equality is about the cache
# plumbing, not the weights), and FAST also on the bundled model, where a case costs ~10 s.
@pytest.mark.parametrize("strategy", MATRIX)
def test_generate_matches_our_loop(strategy, arch_models):
    hf, model, tokenizer = arch_models["llama"]
    cache = assert_same_run(hf, model, tokenizer, cache_flags(strategy), tiny_prompt(48))
    assert_same_statistics(strategy, cache, model)


@pytest.mark.parametrize("strategy", sorted(FAST))
def test_bundled_model_matches_our_loop(strategy, hf_bundled, bundled, prompt):
    model, tokenizer = bundled
    cache = assert_same_run(hf_bundled, model, tokenizer, cache_flags(strategy), prompt)
    assert_same_statistics(strategy, cache, model)


@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v in FAST_VARIANTS else pytest.mark.slow)
                                     for v in VARIANTS])
def test_storages_patterns_and_adakv_match_our_loop(variant, hf_bundled, bundled, prompt):
    model, tokenizer = bundled
    assert_same_run(hf_bundled, model, tokenizer, cache_flags(VARIANTS[variant]), prompt)


@pytest.mark.parametrize("storage", ["4bit", "kivi4"])
def test_a_quantized_cache_driving_transformers_attends_from_its_codes(storage, hf_bundled, prompt, monkeypatch):
    # The adapter's decode step reads the slots itself (attention.attend_slots): on quantized storage from the codes,
    # checked at every layer and step against the float64 attention over the K/V rebuilt from them. (The run is
    # not compared with our loop: a ~1e-6 difference in transformers' keys can flip a 4-bit code.)
    from tests.test_quantized_attention import checked_attend

    calls: list = []
    checked_attend(monkeypatch, calls)
    cache = ta.make_cache(hf_bundled, cache_flags(["--cache_strategy", "heavy_hitter", *STORAGES[storage]]),
                          len(prompt), NEW)
    hf_generate(hf_bundled, prompt, cache)
    assert len(calls) == (NEW - 1) * len(cache.kv_caches) and max(calls) < 1e-5


def test_full_equals_transformers_dynamic_cache(hf_bundled, prompt):
    hf_bundled.set_attn_implementation("sdpa")  # transformers' own attention and DynamicCache: the reference
    reference, ref_scores = hf_generate(hf_bundled, prompt)
    cache = ta.make_cache(hf_bundled, cache_flags("full"), len(prompt), NEW)
    tokens, scores = hf_generate(hf_bundled, prompt, cache)
    assert tokens == reference
    torch.testing.assert_close(scores, ref_scores, atol=LOGIT_ATOL, rtol=0)
    # Switched to the eviction attention, any other cache still gets transformers' SDPA (the fallback).
    assert hf_bundled.config._attn_implementation == ta.ATTENTION_NAME
    assert hf_generate(hf_bundled, prompt)[0] == reference


def test_a_cache_is_reusable_after_reset(hf_bundled, bundled, prompt):
    model, tokenizer = bundled
    flags = cache_flags("tova")
    ours = run_our_loop(model, tokenizer, flags, prompt)
    cache = ta.make_cache(hf_bundled, flags, len(prompt), NEW)
    assert hf_generate(hf_bundled, prompt, cache)[0] == ours
    assert int(cache.get_seq_length()) == len(prompt) + NEW - 1  # tokens seen, not held (24)
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    assert hf_generate(hf_bundled, prompt, cache)[0] == ours


# ---- every supported architecture, on tiny random checkpoints written by transformers -----------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("strategy", ["heavy_hitter", "debug_tova"])
def test_every_architecture_matches_our_loop(arch, strategy, arch_models):
    hf, model, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", strategy, "--max_cache_length", "16"]
    cache = assert_same_run(hf, model, tokenizer, flags, tiny_prompt())
    if model.args.sliding_window:  # the window (12) binds: sliding layers hold a window cache, as generate.py's
        sliding = [i for i in range(model.args.n_layer) if model.args.layer_window(i)]
        assert sliding and all(cache.kv_caches[i].name == "recent_global" for i in sliding)


# ---- batches: left-padded prompts of different lengths, each row as it runs alone ----------------------------


@pytest.mark.parametrize("strategy", MATRIX)
def test_a_padded_batch_matches_each_row_alone(strategy, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(BATCH_LENGTHS)]
    assert_batch_equals_rows_alone(hf, cache_flags(strategy), prompts, tokenizer)


def compile_config_kwargs() -> dict:
    """generate's auto-compile of the decode step on the CPU (fullgraph, static shapes; the eager backend:
    the trace is what matters here)."""
    config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
    config._compile_all_devices = True
    return {"compile_config": config}


@pytest.mark.parametrize(("strategy", "recipe"), [("heavy_hitter", "eager"), ("debug_tova", "eager"),
                                                  ("heavy_hitter", "compile_config"), ("debug_tova", "criteria")])
def test_a_row_that_stops_keeps_its_statistics_at_its_eos(strategy, recipe, arch_models):
    """With make_cache's eos_token_id (generate's), a row that makes its EOS has its statistics taken before the
    EOS is fed, and before transformers feeds it padding for the rest of the batch: equal to its prompt's alone,
    which stops there. Eager the forward hook takes them; under compile_config, where the hook is traced,
    cache.stopping_criteria() does, between steps (and gives the same snapshots eager)."""
    hf, _, tokenizer = arch_models["llama"]
    flags = cache_flags(strategy)
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(BATCH_LENGTHS)]
    free, _ = hf_generate_batch(hf, prompts, ta.make_cache(hf, flags, BATCH_LENGTHS, NEW))
    # A token a row makes first at its third step or later: as EOS, that row stops there while the batch goes
    # on (other rows may stop too, where they make it).
    stopper, at = next((b, i) for i in range(2, NEW - 1) for b, row in enumerate(free) if row[i] not in row[:i])
    eos = free[stopper][at]
    batch = ta.make_cache(hf, flags, BATCH_LENGTHS, NEW, eos_token_id=eos)
    kwargs = {"compile_config": compile_config_kwargs()["compile_config"]} if recipe == "compile_config" else {}
    if recipe != "eager":
        kwargs["stopping_criteria"] = batch.stopping_criteria()
    tokens, _ = hf_generate_batch(hf, prompts, batch, eos_token_id=eos, **kwargs)
    assert tokens[stopper][: at + 1] == free[stopper][: at + 1] and batch.row_snapshots[stopper] is not None
    for b, prompt in enumerate(prompts):
        alone = ta.make_cache(hf, flags, len(prompt), NEW, eos_token_id=eos)
        row_tokens, _ = hf_generate(hf, prompt, alone, eos_token_id=eos)
        assert tokens[b][: len(row_tokens)] == row_tokens, b
        row, ref = batch.statistics(row=b), alone.statistics()
        for key in ROW_STATISTICS:
            assert row[key] == ref[key], (b, key)
    batch.reset()
    assert batch.row_snapshots == [None] * 3


def test_stopping_criteria_need_the_eos(arch_models):
    hf = arch_models["llama"][0]
    with pytest.raises(UserError, match=r"make_cache\(..., eos_token_id=...\)"):
        ta.make_cache(hf, cache_flags("tova"), BATCH_LENGTHS, NEW).stopping_criteria()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_padded_batch_with_storages_patterns_and_adakv_matches_each_row_alone(variant, arch_models):
    hf, _, tokenizer = arch_models["llama"]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(BATCH_LENGTHS)]
    assert_batch_equals_rows_alone(hf, cache_flags(VARIANTS[variant]), prompts, tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_padded_batch_matches_each_row_alone_on_every_architecture(arch, arch_models):
    hf, model, tokenizer = arch_models[arch]
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.5"]
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate([30, 17])]  # the window (12) binds in both
    assert_batch_equals_rows_alone(hf, flags, prompts, tokenizer)


# ---- compiled, as transformers compiles a static cache's decode step --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("recipe", ["generate_compile_config", "compiled_forward"])
def test_compiled_matches_eager_without_recompiling(recipe, rows, arch_models, monkeypatch):
    """transformers' two recipes for a static cache: generate's auto-compile of the decode step (a compileable
    cache + compile_config; _compile_all_devices lets it run on the CPU), and model.forward = torch.compile(...)
    (prefill compiled too), for one prompt and for a left-padded batch of two. fullgraph and static shapes: one
    graph per kind of forward for every step, and none more for a second cache of the same flags. The backend
    counts graphs and runs them as traced."""
    hf, _, _ = arch_models["llama"]
    graphs = []

    def counting_backend(gm, example_inputs):  # a function: CompileConfig deep-copies its backend
        graphs.append(gm)
        return gm.forward

    kwargs = {}
    if recipe == "generate_compile_config":
        config = transformers.CompileConfig(fullgraph=True, dynamic=False, backend=counting_backend, mode=None)
        config._compile_all_devices = True
        kwargs = dict(compile_config=config)
    flags = [*COMMON, "--cache_strategy", "heavy_hitter", "--max_cache_length", "16"]
    prompts = [tiny_prompt(), distinct_prompt(17, 1)][:rows]
    lengths = [len(p) for p in prompts]
    eager, eager_scores = hf_generate_batch(hf, prompts, ta.make_cache(hf, flags, lengths, NEW))
    if recipe == "compiled_forward":
        monkeypatch.setattr(hf, "forward", torch.compile(hf.forward, fullgraph=True, backend=counting_backend))
    for _ in range(2):
        tokens, scores = hf_generate_batch(hf, prompts, ta.make_cache(hf, flags, lengths, NEW), **kwargs)
        assert tokens == eager
        torch.testing.assert_close(scores, eager_scores, atol=1e-5, rtol=0)
    assert len(graphs) == (1 if recipe == "generate_compile_config" else 2)  # decode (and prefill)


# ---- refused, each with one clear error -------------------------------------------------------------------


def test_gated_caches_are_refused(arch_models):
    hf = arch_models["llama"][0]
    for name in [s for s in ALL if needs_gates(s)]:
        with pytest.raises(UserError, match=f"^{name}: learned gates"):
            ta.make_cache(hf, [*COMMON, "--cache_strategy", name, "--max_cache_length", "16"], 24, NEW)


@pytest.mark.parametrize("name", [s for s in ALL if get_strategy(s.removeprefix("debug_")).needs_token_classes])
def test_caches_that_read_token_classes_need_the_tokenizer_and_say_which(name, arch_models):
    """Without a tokenizer (or token_classes) the refusal names the strategy that reads them: it once named
    hybrid for sepllm, whose classes are the separators."""
    hf = arch_models["llama"][0]
    flags = [*COMMON, "--cache_strategy", "recent_global", name, "--cache_strategy_pattern", "repeat"]
    with pytest.raises(UserError, match=f"^the {name} cache needs the tokenizer's token classes .*pass make_cache"):
        ta.make_cache(hf, [*flags, "--max_cache_length", "16"], 24, NEW)


@pytest.mark.parametrize("flags, message", [
    (["--rerotate_positions"], "rerotate_positions is not supported"),
    (["--feed_long_prompts"], "feed_long_prompts is not supported.*--prefill_chunk 1"),
    (["--cache_strategy", "hybrid"], "pass make_cache\\(..., tokenizer=tokenizer\\)"),
    (["--cache_strategy", "nope"], "unknown cache strategy"),
])
def test_unsupported_flags_are_refused(flags, message, arch_models):
    hf = arch_models["llama"][0]
    with pytest.raises(UserError, match=message):
        ta.make_cache(hf, [*COMMON, "--max_cache_length", "16", *flags], 24, NEW)


def test_unsupported_and_multimodal_architectures_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'.*supported: llama"):
        ta.make_cache(gpt2, ["--cache_strategy", "full"], 8, 4)
    multimodal = torch.nn.Module()
    multimodal.config = transformers.Gemma3Config()  # a config only: the check comes before any weight is read
    with pytest.raises(UserError, match="multimodal.*Gemma3ForCausalLM"):
        ta.model_args_of(multimodal)


def test_a_model_that_cannot_switch_attention_is_refused(tmp_path, monkeypatch):
    from tests.arch_helpers import save_tiny_model

    hf = save_tiny_model("llama", tmp_path)
    monkeypatch.setattr(type(hf), "_can_set_attn_implementation", lambda self: False)
    with pytest.raises(UserError, match="cannot switch its attention implementation"):
        ta.make_cache(hf, ["--cache_strategy", "full"], 8, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), "beam search|one sequence"),
    (dict(do_sample=True, num_return_sequences=2), "num_return_sequences"),
])
def test_beam_search_and_several_sequences_are_refused(kwargs, message, arch_models):
    hf = arch_models["llama"][0]
    x = torch.tensor([tiny_prompt()])
    cache = ta.make_cache(hf, [*COMMON, "--cache_strategy", "tova", "--max_cache_length", "16"], 24, NEW)
    with pytest.raises(UserError, match=message):
        hf.generate(x, attention_mask=torch.ones_like(x), cache=cache, max_new_tokens=NEW, eos_token_id=None,
                    pad_token_id=0, **{"do_sample": False, **kwargs})


@pytest.mark.parametrize("mask_of, message", [
    (lambda m: m.index_fill_(1, torch.tensor([23]), 0), "pad on the left"),  # right padding
    (lambda m: m.index_fill_(1, torch.tensor([5]), 0), "pad on the left"),  # a hole inside the prompt
    (lambda m: m.zero_(), "padding only"),
])
def test_padding_that_is_not_on_the_left_is_refused(mask_of, message, arch_models):
    hf = arch_models["llama"][0]
    flags = [*COMMON, "--cache_strategy", "tova", "--max_cache_length", "16"]
    x = torch.tensor([tiny_prompt(), tiny_prompt()])
    mask = torch.ones_like(x)
    mask[1] = mask_of(mask[1:]).squeeze(0)
    with pytest.raises(UserError, match=message):
        hf.generate(x, attention_mask=mask, cache=ta.make_cache(hf, flags, [24, 24], NEW), max_new_tokens=NEW,
                    do_sample=False, eos_token_id=None, pad_token_id=0)


def test_a_batch_other_than_the_cache_rows_is_refused(arch_models):
    hf = arch_models["llama"][0]
    flags = [*COMMON, "--cache_strategy", "tova", "--max_cache_length", "16"]
    x = torch.tensor([tiny_prompt(), tiny_prompt()])
    with pytest.raises(UserError, match="built for 1 sequence\\(s\\).*got 2"):
        hf.generate(x, attention_mask=torch.ones_like(x), cache=ta.make_cache(hf, flags, 24, NEW),
                    max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    for lengths in ([], [24, 0], [24.0]):
        with pytest.raises(UserError, match="prompt lengths must be whole numbers"):
            ta.make_cache(hf, flags, lengths, NEW)
    with pytest.raises(UserError, match="row 2: the cache has rows 0 to 1"):
        ta.make_cache(hf, flags, [24, 20], NEW).statistics(row=2)


def test_a_sequence_past_the_cache_or_context_is_refused(arch_models):
    hf = arch_models["llama"][0]
    with pytest.raises(UserError, match="exceeds the model's context"):
        ta.make_cache(hf, ["--cache_strategy", "full"], 250, 10)  # the tiny model's context is 256


def test_more_tokens_than_the_cache_was_built_for_is_refused(arch_models):
    hf = arch_models["llama"][0]
    x = torch.tensor([tiny_prompt()])
    cache = ta.make_cache(hf, [*COMMON, "--cache_strategy", "full"], 24, 4)
    with pytest.raises(UserError, match="sized for 24 prompt tokens \\+ 4 new ones"):
        hf.generate(x, attention_mask=torch.ones_like(x), cache=cache, max_new_tokens=8, do_sample=False,
                    eos_token_id=None, pad_token_id=0)


# ---- the README's examples, read from the README ------------------------------------------------------------


@pytest.mark.slow
def test_the_readme_examples_run_and_the_batch_row_equals_the_prompt_alone(capsys, monkeypatch, hf_bundled,
                                                                            hf_bundled_tokenizer):
    """The two code blocks of the README's "Use from transformers", executed as written (the bundled model
    through transformers' GGUF loader): the single prompt answers with text, and the batch's row 1, the same
    prompt left-padded beside a longer one, gives the same tokens. The blocks' from_pretrained calls are the
    session fixtures' own calls (HF_BUNDLED_ARGS, float32), so they are answered with those objects (a copy of
    the tokenizer, which the example sets to pad on the left) instead of reading the GGUF again (~30 s)."""
    import copy
    import re
    from pathlib import Path

    import transformers

    from tests.conftest import HF_BUNDLED_ARGS

    def loaded(real, same):
        def from_pretrained(*args, **kwargs):
            if (*args, kwargs.get("gguf_file")) == (HF_BUNDLED_ARGS[0], HF_BUNDLED_ARGS[1]) and \
                    kwargs.get("dtype", torch.float32) == torch.float32:
                return same()
            return real(*args, **kwargs)
        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        loaded(transformers.AutoModelForCausalLM.from_pretrained, lambda: hf_bundled))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        loaded(transformers.AutoTokenizer.from_pretrained, lambda: copy.deepcopy(hf_bundled_tokenizer)))
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### Use from transformers", 1)[1].split("\n## ", 1)[0]
    single, batch = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    namespace: dict = {}
    exec(compile(single, "README.md (transformers, one prompt)", "exec"), namespace)
    alone, prompt_length = namespace["out"][0, namespace["ids"].shape[1]:], namespace["ids"].shape[1]
    exec(compile(batch, "README.md (transformers, a batch)", "exec"), namespace)
    rows = namespace["out"][:, namespace["batch"]["input_ids"].shape[1]:]
    mask = namespace["batch"]["attention_mask"]
    assert prompt_length == int(mask[1].sum()) < mask.shape[1]  # row 1 is the prompt alone, padded
    assert alone.numel() > 1 and torch.equal(rows[1, : alone.numel()], alone)
    printed = capsys.readouterr().out
    assert "KV cache" in printed and "compression_ratio" in printed


def test_load_gguf_model_makes_the_reference_fixtures_call(monkeypatch, tmp_path):
    """load_gguf_model (the benchmarks' loader) reads the bundled GGUF with the reference fixtures' call (the
    file's folder and name, float32) and returns the model in eval mode; a path that is not a GGUF file is one
    UserError."""
    import transformers

    from errors import UserError
    from tests.conftest import HF_BUNDLED_ARGS

    calls = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: calls.append(("model", a, k)) or torch.nn.Dropout().train())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(("tokenizer", a, k)) or "tokenizer")
    model, tokenizer = ta.load_gguf_model()
    folder, name = HF_BUNDLED_ARGS
    assert calls == [("model", (folder,), {"gguf_file": name, "dtype": torch.float32}),
                     ("tokenizer", (folder,), {"gguf_file": name})]
    assert not model.training and tokenizer == "tokenizer"
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(UserError, match="not a GGUF file"):
        ta.load_gguf_model(str(tmp_path / "weights.bin"))


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 24])
def test_the_adapter_batching_benchmark_reports_rows_equal_alone(tmp_path, chunk, hf_bundled, hf_bundled_tokenizer,
                                                                 monkeypatch):
    """benchmarks.adapter_batching end to end, tiny: its report's fields, and every batched row's tokens equal
    to its prompt's alone (the benchmark compares them itself), with the prompts at once and in transformers'
    chunks of 24 (which cut the padded rows of 64 and 80 tokens off their own chunk boundaries). The model and
    tokenizer are the session's, loaded by the call the benchmark's load_model makes
    (test_load_gguf_model_makes_the_reference_fixtures_call)."""
    from benchmarks import adapter_batching

    monkeypatch.setattr(adapter_batching, "load_model", lambda: (hf_bundled, hf_bundled_tokenizer))
    out = tmp_path / "adapter_batching.json"
    rounds = 1 if chunk else 2  # what rounds add is checked once
    chunked = ["--prefill_chunk", str(chunk)] if chunk else []
    report = adapter_batching.main(["--prompts", "3", "--min_tokens", "64", "--max_new_tokens", "4", "--rounds",
                                    str(rounds), "--out", str(out), *chunked])
    assert report["prompt_tokens"] == [64, 80, 96] and report["same_tokens"] is True
    assert report["prefill_chunk"] == chunk
    assert len(report["rounds"]) == rounds and report["batched_tok_s"] > 0 and report["one_by_one_tok_s"] > 0
    assert report["transformers_cache_batched_tok_s"] > 0
    assert out.is_file()


TOKEN_CLASS_STRATEGIES = [s for s in CACHE_STRATEGIES if get_strategy(s).needs_token_classes]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", TOKEN_CLASS_STRATEGIES)
def test_the_adapter_batching_benchmark_runs_strategies_that_read_token_classes(tmp_path, strategy, hf_bundled,
                                                                                 hf_bundled_tokenizer, monkeypatch):
    """Every cache the benchmark makes (its warm-up's too) gets the tokenizer, which these strategies read."""
    from benchmarks import adapter_batching

    monkeypatch.setattr(adapter_batching, "load_model", lambda: (hf_bundled, hf_bundled_tokenizer))
    report = adapter_batching.main(["--cache_strategy", strategy, "--prompts", "2", "--min_tokens", "64",
                                    "--max_new_tokens", "2", "--rounds", "1", "--out", str(tmp_path / "a.json")])
    assert report["cache_strategy"] == strategy and report["same_tokens"] is True

