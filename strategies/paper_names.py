"""What the papers and kvpress call the methods this tool runs, and what to type here instead.

A researcher arrives with a paper's name (`--cache_strategy snapkv`, `h2o`, `PyramidKV`, kvpress's
`KnormPress`). Our names say what a cache does (`heavy_hitter` is H2O's decode rule and SnapKV's prompt
rule at once), so a list of our names alone does not tell them which one is theirs; the refusal names the
flags that run their method. Some methods are not strategies here: a layer budget pattern (PyramidKV), a
head budget allocation (Ada-KV), a storage (KIVI, ThinK), each shown with the preset that runs it.
"""

from __future__ import annotations

import re

# normalised paper or kvpress name -> (the method as its paper writes it, the flags that run it here)
PAPER_NAMES: dict[str, tuple[str, tuple[str, ...]]] = {
    "h2o": ("H2O", ("--cache_config", "h2o")),
    "observedattention": ("kvpress's ObservedAttentionPress (H2O's prompt score)",
                          ("--cache_strategy", "heavy_hitter", "--heavy_hitter_prompt_rule", "h2o")),
    "scissorhands": ("Scissorhands", ("--cache_strategy", "heavy_hitter")),
    "snapkv": ("SnapKV", ("--cache_strategy", "heavy_hitter")),
    "streamingllm": ("StreamingLLM", ("--cache_config", "streaming_llm")),
    "attentionsinks": ("StreamingLLM's attention sinks", ("--cache_strategy", "recent_global")),
    "sinks": ("StreamingLLM's attention sinks", ("--cache_strategy", "recent_global")),
    "slidingwindow": ("a sliding window with sinks", ("--cache_strategy", "recent_global")),
    "knorm": ("kvpress's KnormPress", ("--cache_strategy", "l2")),
    "fastgen": ("FastGen", ("--cache_strategy", "hybrid")),
    "duo": ("DuoAttention", ("--cache_strategy", "duo_attention")),
    "qfilter": ("Q-Filters", ("--cache_strategy", "qfilters")),
    "cur": ("CurDKV", ("--cache_strategy", "curdkv")),
    "cap": ("CapKV", ("--cache_strategy", "capkv")),
    "kvzap": ("KVzap's fixed threshold", ("--cache_strategy", "threshold")),
    "dms": ("DMS's fixed threshold", ("--cache_strategy", "threshold")),
    "trimkv": ("TRIM-KV's retention gates", ("--cache_strategy", "gated")),
    "pyramidkv": ("PyramidKV's layer budgets", ("--cache_config", "heavy_hitter_pyramid")),
    "adakv": ("Ada-KV's head budgets", ("--cache_config", "heavy_hitter_adakv")),
    "criticaladakv": ("CriticalKV with Ada-KV", ("--cache_strategy", "critical_kv", "--budget_allocation", "adakv")),
    "kivi": ("KIVI's quantized storage", ("--cache_config", "heavy_hitter_kivi4")),
    "think": ("ThinK's thinner keys", ("--cache_config", "heavy_hitter_think")),
    "sepcache": ("SepLLM's SepCache", ("--cache_strategy", "sepllm")),
}


def normalise(name: str) -> str:
    """`SnapKVPress`, `snap-kv`, `Snap_KV` -> `snapkv`: case, separators and kvpress's `Press` suffix dropped."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return key.removesuffix("press") or key


def paper_name_hint(name: str, registered: list[str], flag: str = "--cache_strategy") -> str | None:
    """How to run what `name` (typed for `flag`, not one of `registered`) refers to, or None if unknown."""
    prefix = "debug_" if flag == "--cache_strategy" and name.startswith("debug_") else ""
    key = normalise(name.removeprefix(prefix))
    for strategy in registered:
        if normalise(strategy) == key:
            return f"did you mean {flag} {prefix}{strategy}?"
    if key not in PAPER_NAMES:
        return None
    method, flags = PAPER_NAMES[key]
    if flags[0] == "--cache_strategy" and flags[1] in registered:
        flags = (flag, prefix + flags[1], *flags[2:])  # the strategy, under the flag it was typed for
    return f"{method} runs here as {' '.join(flags)}; see docs/strategies.md, \"Paper and kvpress names\""
