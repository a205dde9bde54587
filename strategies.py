"""The strategy registry: the one place that collects every strategy class and turns a name
(`heavy_hitter`, `debug_heavy_hitter`) into its cache class.

A strategy is a `KVCache` subclass marked `@register_strategy` in one of the files listed in
STRATEGY_FILES; its `debug_` twin (debug_cache.py) is made from it on demand, so it needs nothing more.
To add a strategy: write the class in a file (see keep_it_odd in cache.py for the smallest one), and add
that file's import to STRATEGY_FILES if it is a new file.
"""

from __future__ import annotations

import cache
import cache_expected_attention
import cache_gated
import cache_hybrid
import cache_keydiff
import cache_tova
from cache import KVCache
from debug_cache import debug_strategy
from errors import UserError

STRATEGY_FILES = (cache, cache_gated, cache_hybrid, cache_tova, cache_keydiff, cache_expected_attention)

CACHE_STRATEGIES: dict[str, type[KVCache]] = {
    cls.name: cls
    for module in STRATEGY_FILES
    for cls in vars(module).values()
    if isinstance(cls, type) and issubclass(cls, KVCache) and vars(cls).get("registered", False)
}


def get_strategy(name: str) -> type[KVCache]:
    """The cache class of a strategy name, or a UserError listing the names."""
    base = name.removeprefix("debug_")
    if base.startswith("debug_"):
        raise UserError(f"{name}: a debug cache cannot shadow another debug cache")
    if base not in CACHE_STRATEGIES:
        names = sorted(CACHE_STRATEGIES) + ["debug_<strategy>"]
        raise UserError(f"unknown cache strategy {name!r}; available: {', '.join(names)}")
    return debug_strategy(CACHE_STRATEGIES[base]) if name != base else CACHE_STRATEGIES[base]


def prompt_rules() -> list[str]:
    """Names --prompt_compression_strategy accepts: `full`, and every strategy with a prompt rule of its own
    or that profiles the prompt itself."""
    return sorted(CACHE_STRATEGIES)
