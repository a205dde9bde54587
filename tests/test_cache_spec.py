"""Budgets, per-layer patterns, YAML presets, and the bad-input matrix of the cache flags."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import generate
from cache_setup import cache_config
from cache_spec import CONFIG_DIR, add_cache_arguments, depth_scaled_budgets, resolve_cache_spec
from errors import CliParser, UserError, run_cli


def parser() -> CliParser:
    p = CliParser()
    add_cache_arguments(p)
    return p


def spec(*flags: str, n_layer: int = 30, prompt: int = 900, new: int = 100):
    return resolve_cache_spec(cache_config(list(flags)), n_layer, prompt, new)


def test_fraction_and_absolute_budgets():
    def budgets(value: str) -> set[int]:
        return {s.max_cache_length for s in spec("--cache_strategy", "recent_global", "--max_cache_length", value)}

    assert budgets("0.25") == {250}
    assert budgets("128") == {128}
    assert {s.max_cache_length for s in spec("--cache_strategy", "full", "--max_cache_length", "0.1")} == {1000}


def test_tile_and_repeat_patterns():
    tiled = spec("--cache_strategy", "full", "recent_global", "--max_cache_length", "1.0", "0.5",
                 "--cache_length_pattern", "tile", n_layer=4)
    assert [s.strategy for s in tiled] == ["full", "full", "recent_global", "recent_global"]
    assert [s.max_cache_length for s in tiled] == [1000, 1000, 500, 500]
    repeated = spec("--cache_strategy", "full", "recent_global", "--cache_strategy_pattern", "repeat",
                    "--max_cache_length", "1.0", "0.5", "--cache_length_pattern", "repeat", n_layer=4)
    assert [s.strategy for s in repeated] == ["full", "recent_global", "full", "recent_global"]
    assert [s.max_cache_length for s in repeated] == [1000, 500, 1000, 500]


@pytest.mark.parametrize("n_layer", [1, 2, 7, 30])
@pytest.mark.parametrize("budget", [17, 250, 999])
def test_funnel_and_pyramid_keep_the_total_of_tile(n_layer, budget):
    funnel = depth_scaled_budgets(budget, n_layer, grow=True)
    pyramid = depth_scaled_budgets(budget, n_layer, grow=False)
    assert sum(funnel) == sum(pyramid) == budget * n_layer
    if n_layer > 2:
        assert funnel == sorted(funnel) and funnel[0] < funnel[-1]
        assert pyramid == sorted(pyramid, reverse=True) and pyramid[0] > pyramid[-1]


@pytest.mark.parametrize("budget", ["0.7", "0.8", "0.95", "1.0"])
@pytest.mark.parametrize("pattern", ["funnel", "pyramid"])
def test_depth_scaled_budgets_near_the_whole_sequence_keep_the_total_and_fit_it(budget, pattern):
    """Past 2/3 of the sequence, 1.5 × the mean would not fit: the largest layer holds the whole sequence, the
    smallest the rest of the total, and the total is tile's (not cut by clipping each layer to the sequence)."""
    flat = spec("--cache_strategy", "tova", "--max_cache_length", budget, n_layer=30)
    scaled = spec("--cache_strategy", "tova", "--max_cache_length", budget, "--cache_length_pattern", pattern,
                  n_layer=30)
    lengths = [s.max_cache_length for s in scaled]
    assert sum(lengths) == sum(s.max_cache_length for s in flat)
    assert max(lengths) <= 1000 and (budget == "1.0" or max(lengths) == 1000)
    assert lengths == sorted(lengths, reverse=pattern == "pyramid")


def test_funnel_spec_total_matches_tile():
    flat = spec("--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25")
    funnel = spec("--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25", "--cache_length_pattern", "funnel")
    assert sum(s.max_cache_length for s in funnel) == sum(s.max_cache_length for s in flat)


def test_recent_window_as_fraction_of_the_budget():
    specs = spec("--cache_strategy", "heavy_hitter", "--max_cache_length", "200", "--recent_window", "0.1")
    assert {s.hyperparameters["recent_window"] for s in specs} == {20}


def test_auto_prompt_compression_follows_the_strategy():
    assert {s.prompt_compression for s in spec("--cache_strategy", "heavy_hitter", "--max_cache_length", "0.5")} == {
        "heavy_hitter"}
    assert {s.prompt_compression for s in spec("--cache_strategy", "debug_l2", "--max_cache_length", "0.5")} == {"l2"}


def preset_as_flags(path: Path) -> list[str]:
    """The preset written out as command-line flags, independently of cache_spec's own conversion."""
    flags = []
    for key, value in yaml.safe_load(path.read_text()).items():
        if value is True:
            flags.append(f"--{key}")
        elif value is not False:
            flags += [f"--{key}", *map(str, value if isinstance(value, list) else [value])]
    return flags


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
def test_preset_gives_the_same_spec_as_the_flags(preset):
    from_preset = spec("--cache_config", preset.removesuffix(".yaml"))
    from_flags = spec(*preset_as_flags(CONFIG_DIR / preset))
    assert [s.to_dict() for s in from_preset] == [s.to_dict() for s in from_flags]


def test_explicit_flags_win_over_the_preset():
    specs = spec("--cache_config", "heavy_hitter", "--max_cache_length", "0.5", "--global_tokens", "8")
    assert {s.max_cache_length for s in specs} == {500}
    assert {s.hyperparameters["global_tokens"] for s in specs} == {8}
    assert {s.hyperparameters["recent_window"] for s in specs} == {10}  # from the preset


# ---- bad input: one line on stderr, exit status 2, nothing written ----------------------------------------


@pytest.fixture
def bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("cache_strategy: [heavy_hitter\nmax_cache_length: 0.5\n")
    return path


@pytest.fixture
def unknown_key_yaml(tmp_path):
    path = tmp_path / "unknown.yaml"
    path.write_text("cache_strategy: heavy_hitter\nmax_cache_lenght: 0.5\n")
    return path


BAD = {
    "unknown strategy": (["--cache_strategy", "h2o"], "unknown cache strategy"),
    "unknown debug strategy": (["--cache_strategy", "debug_h2o"], "unknown cache strategy"),
    "debug of debug": (["--cache_strategy", "debug_debug_l2"], "debug cache"),
    "unknown prompt compressor": (["--prompt_compression_strategy", "snap"], "unknown prompt compression"),
    "strategies do not divide layers": (["--cache_strategy", "full", "l2", "random", "l2", "--max_cache_length", "0.5"],
                                        "does not divide"),
    "budgets do not divide layers": (["--cache_strategy", "l2", "--max_cache_length", "0.5", "0.4", "0.3", "0.2"],
                                     "does not divide"),
    "budget below protected": (["--cache_strategy", "heavy_hitter", "--max_cache_length", "12",
                                "--global_tokens", "4", "--recent_window", "10"], "protected"),
    "zero budget": (["--max_cache_length", "0"], "positive"),
    "negative budget": (["--max_cache_length", "-0.5"], "positive"),
    "fractional absolute budget": (["--cache_strategy", "l2", "--max_cache_length", "12.5"], "integer"),
    "negative global tokens": (["--cache_strategy", "l2", "--global_tokens", "-1"], "global_tokens"),
    "negative recent window": (["--cache_strategy", "l2", "--recent_window", "-3"], "recent_window"),
    "zero history window": (["--cache_strategy", "heavy_hitter", "--history_window_size", "0"], "history_window"),
    "bad cache bits": (["--cache_bits", "3"], "invalid choice"),
    "kivi without bits": (["--cache_quantization", "kivi"], "--cache_bits 2, 4 or 8"),
    "kivi flags without kivi": (["--cache_bits", "4", "--residual_length", "64"], "kivi only"),
    "residual not a multiple of the group": (["--cache_bits", "4", "--cache_quantization", "kivi",
                                              "--q_group_size", "48", "--residual_length", "64"], "multiple"),
    "kivi group not dividing head_dim": (["--cache_bits", "4", "--cache_quantization", "kivi",
                                          "--q_group_size", "48", "--residual_length", "96"], "head_dim"),
    "think ratio of 1": (["--think_ratio", "1"], "--think_ratio"),
    "negative think ratio": (["--think_ratio", "-0.1"], "--think_ratio"),
    "zero think window": (["--think_ratio", "0.5", "--think_window", "0"], "--think_window"),
    "negative think recent": (["--think_ratio", "0.5", "--think_recent", "-1"], "--think_recent"),
    "think flags without think": (["--think_window", "8"], "--think_ratio > 0"),
    "think with quantization": (["--think_ratio", "0.5", "--cache_bits", "4"], "cache dtype"),
    "think with adakv": (["--cache_strategy", "heavy_hitter", "--think_ratio", "0.5", "--budget_allocation",
                          "adakv"], "pool"),
    "think with re-rotation": (["--think_ratio", "0.5", "--rerotate_positions"], "post-RoPE"),
    "head-specific compressor on shared cache": (["--cache_strategy", "recent_global", "--max_cache_length", "0.1",
                                                  "--prompt_compression_strategy", "heavy_hitter"],
                                                 "shared across heads"),
    "hybrid with another compressor": (["--cache_strategy", "hybrid", "--prompt_compression_strategy", "l2"],
                                       "hybrid"),
    "full compressor on a short budget": (["--cache_strategy", "l2", "--max_cache_length", "0.4",
                                           "--prompt_compression_strategy", "full"], "feed_long_prompts"),
    "gated compressor without gates": (["--cache_strategy", "l2", "--max_cache_length", "0.4",
                                        "--prompt_compression_strategy", "gated"], "gated"),
    "bad hybrid policy": (["--cache_strategy", "hybrid", "--hybrid_policies", "special+nouns"], "hybrid policy"),
    "recovery above 1": (["--cache_strategy", "hybrid", "--min_recovery_frac", "1.5"], "min_recovery_frac"),
    "funnel with a list": (["--cache_strategy", "l2", "--max_cache_length", "0.5", "0.2",
                            "--cache_length_pattern", "funnel"], "single"),
    "missing preset": (["--cache_config", "no_such_preset"], "not found"),
    "even snapkv kernel": (["--cache_strategy", "heavy_hitter", "--snapkv_kernel", "4"], "snapkv"),
}


@pytest.fixture
def patched_loader(monkeypatch, bundled_session):
    """generate.main with the session's model instead of reloading it for every case."""
    monkeypatch.setattr(generate, "load_checkpoint", lambda *a, **k: bundled_session)


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        run_cli(generate.main, argv)
    return exit_info.value.code, capsys.readouterr().err


PROMPT = "A prompt of some twenty tokens, long enough for the budgets used in these bad-input cases. " * 4


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_cache_input(case, patched_loader, capsys, tmp_path):
    flags, fragment = BAD[case]
    stats = tmp_path / "stats.json"
    code, err = run_main(["--prompt", PROMPT, "--no-chat", "--max_new_tokens", "4", "--stats_json", str(stats),
                          *flags], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert not stats.exists()


@pytest.mark.parametrize(
    "fixture,fragment", [("bad_yaml", "malformed YAML"), ("unknown_key_yaml", "unknown cache flag")]
)
def test_bad_preset_files(fixture, fragment, request, patched_loader, capsys):
    path = request.getfixturevalue(fixture)
    code, err = run_main(["--prompt", PROMPT, "--cache_config", str(path)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_user_error_is_raised_not_printed_by_library_code():
    with pytest.raises(UserError, match="does not divide"):
        spec("--cache_strategy", "full", "l2", "random", n_layer=4)
