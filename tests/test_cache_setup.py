"""The Python API from flags to attached caches (cache_setup.py), and strategies that own their settings
(cache.Setting): flags, presets, checks, --print_cache_spec and the run identity come from the declaration."""

from __future__ import annotations

import pytest
import torch

import cache_spec
import generate
from cache import KVCache, Setting, register_strategy
from cache_setup import attach_caches, cache_config, cache_specs
from checkpoint import load_checkpoint
from errors import UserError
from strategies import CACHE_STRATEGIES
from tests.arch_helpers import WINDOW, save_tiny_model


def test_the_usage_example_runs():
    """The API's usage example, verbatim: load the bundled model, heavy_hitter at 25%, generate, statistics."""
    import torch

    from cache import cache_statistics
    from cache_setup import attach_caches, cache_config
    from checkpoint import load_checkpoint
    from generate import generate

    model, tokenizer = load_checkpoint(None, "cpu", torch.float32)  # the bundled SmolLM2-135M-Instruct
    ids = tokenizer.encode("A KV cache keeps the keys and values of past tokens. " * 12)
    config = cache_config(cache_strategy=["heavy_hitter"], max_cache_length=[0.25])
    attach_caches(model, config, len(ids), 16, tokenizer)
    result = generate(model, ids, 16, tokenizer.eos_ids)
    stats = cache_statistics(model.caches())
    print(tokenizer.decode(result.tokens), stats["compression_ratio"])

    budget = round(0.25 * (len(ids) + 16))
    assert stats["cache_budget_per_layer"] == [budget] * model.args.n_layer
    assert 0.5 < stats["compression_ratio"] < 1 and result.tokens


def test_flags_a_mapping_and_a_preset_give_the_same_configuration():
    words = cache_config(["--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25", "--snapkv_window", "8"])
    mapping = cache_config({"cache_strategy": "heavy_hitter", "max_cache_length": 0.25, "snapkv_window": 8})
    keywords = cache_config(cache_strategy=["heavy_hitter"], max_cache_length=[0.25], snapkv_window=8)
    assert vars(words) == vars(mapping) == vars(keywords)
    preset = cache_config("heavy_hitter", max_cache_length=[0.1])  # a typed value wins over the preset's
    assert preset.cache_strategy == ["heavy_hitter"] and preset.max_cache_length == [0.1]


@pytest.mark.parametrize(("flags", "message"), [
    ({"snapkv_kernel": 4}, "--snapkv_kernel must be a positive odd number"),
    ({"history_window_size": 0}, "--history_window_size must be ≥ 1"),
    ({"snapkv_window": True}, "integer"),
    ({"no_such_flag": 1}, "unknown cache flag"),
])
def test_bad_settings_are_one_user_error(flags, message):
    with pytest.raises(UserError, match=message):
        cache_config(flags)


def test_a_sliding_window_benchmark_gets_the_caches_generate_gets(tmp_path, monkeypatch, capsys):
    """The benchmarks build caches through the same call as generate.py: on a sliding-window model the
    window layers get their window cache in both."""
    from benchmarks import strategy_report

    directory = tmp_path / "mistral"
    save_tiny_model("mistral", directory)
    model, tokenizer = load_checkpoint(directory, "cpu", torch.float32)
    prompt = " ".join(f"w{i}" for i in range(40))
    monkeypatch.setattr(generate, "load_checkpoint", lambda *a, **k: (model, tokenizer))
    generate.main(["--prompt", prompt, "--no-chat", "--max_new_tokens", "4", "--cache_strategy", "heavy_hitter",
                   "--max_cache_length", "0.5"])
    capsys.readouterr()

    def described(caches: list[KVCache]) -> list[tuple]:
        return [(c.name, c.max_cache_length, c.global_tokens, c.recent_window, c.hparams, c.prompt_settings)
                for c in caches]

    from_generate = described(model.caches())
    ids = tokenizer.encode(prompt)
    strategy_report.attach(model, tokenizer, ids, "heavy_hitter", 0.5, 4)
    assert described(model.caches()) == from_generate
    assert {(name, budget) for name, budget, *_ in from_generate} == {("recent_global", WINDOW)}


def test_a_strategy_with_one_setting_needs_nothing_outside_its_class(monkeypatch):
    """Declaring a setting is enough for the flag, its check, the preset key, the resolved spec, the
    --print_cache_spec table and the run identity."""
    from eval import results

    @register_strategy
    class NewestFirst(KVCache):
        name = "newest_first"
        hyperparameters = ("global_tokens",)
        settings = (Setting("newest_weight", 2.0, type=float, low=0.0, low_open=True, high=10.0,
                            help="weight of the position"),)

        def token_scores(self, input_pos: torch.Tensor) -> torch.Tensor:
            return self.pos.float() * float(self.setting(self.settings[0]))

    monkeypatch.setitem(CACHE_STRATEGIES, NewestFirst.name, NewestFirst)
    assert NewestFirst.hyperparameters == ("global_tokens", "newest_weight")
    config = cache_config({"cache_strategy": "newest_first", "max_cache_length": 0.5, "newest_weight": 3.5})
    (spec,) = cache_spec.resolve_cache_spec(config, 1, 90, 10)
    assert spec.hyperparameters == {"global_tokens": 4, "newest_weight": 3.5}
    assert "newest_weight=3.5" in cache_spec.format_cache_spec([spec])
    assert results.cache_identity(config)["newest_weight"] == 3.5
    assert "newest_weight" not in results.cache_identity(cache_config(["--cache_strategy", "l2"]))
    with pytest.raises(UserError, match=r"--newest_weight must be in \(0, 10\], got 0"):
        cache_config(newest_weight=0.0)


def test_cache_specs_apply_the_window_policy_and_the_budget_check(tmp_path):
    directory = tmp_path / "gemma3"
    save_tiny_model("gemma3", directory)
    model, _ = load_checkpoint(directory, "cpu", torch.float32)
    specs = cache_specs(cache_config(cache_strategy=["l2"], max_cache_length=[0.5]), model.args, 30, 10)
    assert [s.strategy for s in specs] == ["recent_global", "recent_global", "l2", "recent_global"]
    with pytest.raises(UserError, match="rerotate_positions"):
        attach_caches(model, cache_config(rerotate_positions=True), 30, model.args.context_length)


def test_the_strategy_report_checks_every_budget_before_its_first_run(tiny_dir, tmp_path, capsys, monkeypatch):
    """A budget too small for a strategy's protected tokens stops the report before any strategy runs, not
    after the runs listed before it."""
    from benchmarks import strategy_report
    from tests.bad_input_matrix import ENTRY_POINTS, refused

    def tripwire(*args, **kwargs):
        raise AssertionError("a run started before every budget was checked")

    monkeypatch.setattr(strategy_report, "run", tripwire)
    entry = ENTRY_POINTS["python -m benchmarks.strategy_report"]
    argv = [*entry.prefix(tmp_path), "--budgets", "0.5", "2", "--checkpoint_path", str(tiny_dir), "--no_compile",
            "--prompt_tokens", "40", "--max_new_tokens", "4"]
    line = refused(entry, argv, tmp_path, capsys, monkeypatch, early=False)
    assert "budget of 2 tokens is smaller than the protected tokens" in line, line
