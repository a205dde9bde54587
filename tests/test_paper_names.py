"""A paper's or kvpress's name typed for a strategy, a prompt rule or a preset is refused with the flags that run
its method here (strategies/paper_names.py), and those flags do run it: each entry's expected strategy and
setting are written below by hand from the papers, not read from the table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cache_setup import cache_config
from errors import UserError
from strategies import CACHE_STRATEGIES, get_strategy
from strategies.paper_names import PAPER_NAMES, normalise

# name -> (the strategy that runs its method, a setting that makes it that method, or None)
EXPECTED = {
    "h2o": ("heavy_hitter", ("heavy_hitter_prompt_rule", "h2o")),
    "observedattention": ("heavy_hitter", ("heavy_hitter_prompt_rule", "h2o")),
    "scissorhands": ("heavy_hitter", None), "snapkv": ("heavy_hitter", None),
    "streamingllm": ("recent_global", ("rerotate_positions", True)),
    "attentionsinks": ("recent_global", None), "sinks": ("recent_global", None),
    "slidingwindow": ("recent_global", None), "knorm": ("l2", None), "fastgen": ("hybrid", None),
    "duo": ("duo_attention", None), "qfilter": ("qfilters", None), "cur": ("curdkv", None), "cap": ("capkv", None),
    "kvzap": ("threshold", None), "dms": ("threshold", None), "trimkv": ("gated", None),
    "pyramidkv": ("heavy_hitter", ("cache_length_pattern", "pyramid")),
    "adakv": ("heavy_hitter", ("budget_allocation", "adakv")),
    "criticaladakv": ("critical_kv", ("budget_allocation", "adakv")),
    "kivi": ("heavy_hitter", ("cache_quantization", "kivi")),
    "think": ("heavy_hitter", ("think_ratio", 0.5)),
    "sepcache": ("sepllm", None),
}
SUGGESTION = re.compile(r"runs here as (.+?); see docs/strategies\.md")


def refusal(call, *arguments) -> str:
    with pytest.raises(UserError) as info:
        call(*arguments)
    return str(info.value)


def suggested_flags(message: str) -> list[str]:
    match = SUGGESTION.search(message)
    assert match, message
    return match.group(1).split()


def test_every_name_has_a_hand_written_expectation() -> None:
    assert set(PAPER_NAMES) == set(EXPECTED)


@pytest.mark.parametrize("name", PAPER_NAMES)
def test_the_suggested_flags_run_the_papers_method(name: str) -> None:
    # the name as kvpress spells a press (or a paper its method), refused where a strategy is expected
    message = refusal(get_strategy, f"{name.upper()}Press")
    args = cache_config(suggested_flags(message))
    strategy, setting = EXPECTED[name]
    assert args.cache_strategy == [strategy]
    if setting is not None:
        assert getattr(args, setting[0]) == setting[1]
    assert name == normalise(name) and name not in {normalise(s) for s in CACHE_STRATEGIES}  # reachable


@pytest.mark.parametrize("typed", ["SnapKV", "snap-kv", "Snap_KV", "SnapKVPress", "snapkv_press"])
def test_spellings_of_one_name_get_the_same_answer(typed: str) -> None:
    assert suggested_flags(refusal(get_strategy, typed)) == ["--cache_strategy", "heavy_hitter"]


@pytest.mark.parametrize("strategy", sorted(CACHE_STRATEGIES))
def test_our_name_spelt_as_a_press_is_answered_with_ours(strategy: str) -> None:
    press = "".join(part.capitalize() for part in strategy.split("_")) + "Press"  # DuoAttentionPress
    assert f"(did you mean --cache_strategy {strategy}?)" in refusal(get_strategy, press)
    assert f"(did you mean --cache_strategy debug_{strategy}?)" in refusal(get_strategy, f"debug_{press}")


def test_the_answer_follows_the_flag_it_was_typed_for() -> None:
    assert suggested_flags(refusal(get_strategy, "debug_h2o")) == ["--cache_config", "h2o"]
    assert suggested_flags(refusal(get_strategy, "debug_snapkv")) == ["--cache_strategy", "debug_heavy_hitter"]
    get_strategy("debug_heavy_hitter")
    message = refusal(cache_config, ["--prompt_compression_strategy", "SnapKV"])
    assert suggested_flags(message) == ["--prompt_compression_strategy", "heavy_hitter"]
    cache_config(suggested_flags(message))
    message = refusal(cache_config, "PyramidKV")  # a preset's name
    assert message.startswith("cache config not found: PyramidKV (PyramidKV's layer budgets runs here as")
    assert cache_config(suggested_flags(message)).cache_length_pattern == "pyramid"


@pytest.mark.parametrize("typed", ["nonsense", "press", "debug_nonsense"])
def test_an_unknown_name_gets_the_list_alone(typed: str) -> None:
    message = refusal(get_strategy, typed)
    assert "(" not in message and message.startswith(f"unknown cache strategy {typed!r}; available: ")


def test_the_docs_table_lists_every_name_with_its_flags() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "strategies.md").read_text()
    section = text.split("## Paper and kvpress names", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z0-9]+)` \| [^|]+ \| `([^`]+)` \|$", section, re.MULTILINE)
    assert dict(rows) == {name: " ".join(flags) for name, (_, flags) in PAPER_NAMES.items()}
