"""One rule per strategy, checked over the registry: prompt compression and decode eviction keep the same
tokens on the same scores, and a strategy scores the prompt by the rule it evicts by; a debug_ twin reads
exactly the flags and pairs with exactly the prompt rules of the strategy it shadows."""

from __future__ import annotations

import pytest
import torch

from cache_spec import check_prompt_compression
from errors import UserError
from prompt_compression import compress_prompt, prompt_positions
from strategies import CACHE_STRATEGIES, get_strategy, prompt_rules
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, attach, cache_args, run, token_ids

# Strategies whose prompt rule is on purpose not their decode rule by default, and why; and the flags that
# make it their decode rule.
OTHER_PROMPT_RULE = {"heavy_hitter": "SnapKV's observation window at prefill, H2O's accumulated attention after",
                     "vatp": "heavy_hitter's two rules, each times the values' l1 norms"}
SAME_RULE_FLAGS = {"heavy_hitter": ("--heavy_hitter_prompt_rule", "h2o"), "vatp": ("--heavy_hitter_prompt_rule", "h2o")}
WITH_PROMPT_RULE = [n for n, c in sorted(CACHE_STRATEGIES.items()) if not c.profiles_prompt and n != "full"]


def prompt_cache(name: str, *flags: str) -> tuple:
    """Layer 0's cache of `name` after a full-size prefill of the prompt (nothing evicted), and its K/Q."""
    model = make_tiny_model(n_layer=1)
    caches = attach(model, cache_args(name, "1.0", "dense", *flags))
    seen = {}
    layer = model.layers[0].attention
    prefill_fn = caches[0].prefill

    def spy(input_pos, k, v, q) -> None:
        seen.update(k=k.clone(), v=v.clone(), q=q.clone())
        if caches[0].needs_gates:
            seen["log_gates"] = caches[0].prompt_log_gates.clone()
        prefill_fn(input_pos, k, v, q)

    caches[0].prefill = spy
    with torch.inference_mode():
        run(model, token_ids()[:, : PROMPT + 1], lambda *a: None, lambda p: None)
    assert layer.kv_cache is caches[0]
    caches[0].observe_prompt_values(seen["v"])  # as a prefill hands them over (a rule may drop them after it)
    return caches[0], seen


@pytest.mark.parametrize("name", WITH_PROMPT_RULE)
def test_prompt_selection_equals_repeated_decode_eviction_on_the_same_scores(name):
    """The shared top-k keeps exactly what evicting the lowest unprotected token, one at a time, keeps."""
    cache, seen = prompt_cache(name)
    if cache.needs_gates:
        cache.prompt_log_gates = seen["log_gates"]
    cls = type(cache)
    budget = 12
    cache.max_cache_length = budget  # before scoring: a rule may weigh by the compression (compactor's λ)
    scores = cls.prompt_scores(cache, seen["k"], seen["q"]).float()  # [1, heads, T]
    if cache.needs_gates:
        cache.prompt_log_gates = seen["log_gates"]
    kept = compress_prompt(cache, torch.arange(PROMPT), seen["k"], seen["q"])[0]
    window = cls.prompt_protected_window(cache)
    for h in range(scores.shape[1]):
        held = set(range(PROMPT))
        while len(held) > budget:
            candidates = [p for p in held if GLOBAL <= p < PROMPT - window]
            held.remove(min(candidates, key=lambda p: (scores[0, h, p].item(), -p)))
        assert set(kept[min(h, kept.shape[0] - 1)].tolist()) == held


@pytest.mark.parametrize("name", [n for n in WITH_PROMPT_RULE if n not in OTHER_PROMPT_RULE or n in SAME_RULE_FLAGS])
def test_prompt_rule_is_the_decode_rule(name):
    """After a prefill that keeps everything, the decode scores of the held prompt tokens order them as the
    prompt rule does (for the next position, the one a decode step would insert)."""
    cache, seen = prompt_cache(name, *SAME_RULE_FLAGS.get(name, ()))
    if cache.needs_gates:
        cache.prompt_log_gates = seen["log_gates"]
    prompt = type(cache).prompt_scores(cache, seen["k"], seen["q"]).float()[0]  # [heads, T]
    pos = cache.pos[0, :, :PROMPT]
    decode = cache.token_scores(torch.tensor([PROMPT]))[0, :, :PROMPT].float()
    for h in range(decode.shape[0]):
        ours = prompt[min(h, prompt.shape[0] - 1)][pos[h]]
        assert torch.equal(ours.argsort(stable=True), decode[h].argsort(stable=True)), name


@pytest.mark.parametrize("name", sorted(CACHE_STRATEGIES))
def test_debug_twin_reads_the_same_flags_and_pairs_with_the_same_prompt_rules(name):
    cls, twin = get_strategy(name), get_strategy(f"debug_{name}")
    assert twin.hyperparameters == cls.hyperparameters
    for rule in prompt_rules():
        outcomes = []
        for strategy, c in ((name, cls), (f"debug_{name}", twin)):
            try:
                outcomes.append(check_prompt_compression(strategy, c, rule, 0))
            except UserError:
                outcomes.append("refused")
        assert outcomes[0] == outcomes[1], f"{name} with {rule}: {outcomes}"


def test_debug_heavy_hitter_accepts_snapkv_compression(tmp_path):
    cache = attach(make_tiny_model(n_layer=1), cache_args("debug_heavy_hitter", "12", "dense",
                                                          "--prompt_compression_strategy", "heavy_hitter"))[0]
    assert cache.shadow.prompt_compressor is get_strategy("heavy_hitter")
    assert prompt_positions(torch.zeros(1, 2, 5, 4)).tolist() == [[[0, 1, 2, 3, 4]]]
