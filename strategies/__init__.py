"""The strategy registry: the one place that collects every strategy class and turns a name
(`heavy_hitter`, `debug_heavy_hitter`) into its cache class.

One file per strategy in this package; a strategy is a `KVCache` subclass marked `@register_strategy`,
and its `debug_` twin (debug.py) is made from it on demand, so it needs nothing more. To add a strategy:
write its file (keep_it_odd.py is the smallest one) and add it to STRATEGY_FILES. `full` stays with the
contract in cache.py.
"""

from __future__ import annotations

import cache
from cache import KVCache
from errors import UserError
from strategies import (
    cam,
    capkv,
    chunkkv,
    compactor,
    critical_kv,
    curdkv,
    d2o,
    duo_attention,
    expected_attention,
    gated,
    heavy_hitter,
    hybrid,
    keep_it_odd,
    keydiff,
    keyformer,
    kvzip,
    l2,
    lacache,
    lagkv,
    morphkv,
    qfilters,
    random,
    recent_global,
    rkv,
    sepllm,
    simlayerkv,
    threshold,
    tova,
    vatp,
)
from strategies.debug import debug_strategy
from strategies.paper_names import paper_name_hint

STRATEGY_FILES = (cache, recent_global, random, keep_it_odd, l2, heavy_hitter, gated, hybrid, tova, keydiff,
                  expected_attention)
STRATEGY_FILES += (threshold, duo_attention, chunkkv, critical_kv, rkv, kvzip, lagkv, qfilters, compactor,
                   simlayerkv, curdkv, capkv, cam, keyformer, vatp, sepllm, morphkv, lacache, d2o)

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
        hint = paper_name_hint(name, sorted(CACHE_STRATEGIES))
        raise UserError(f"unknown cache strategy {name!r}" + (f" ({hint})" if hint else "")
                        + f"; available: {', '.join(names)}")
    return debug_strategy(CACHE_STRATEGIES[base]) if name != base else CACHE_STRATEGIES[base]


def prompt_rules() -> list[str]:
    """Names --prompt_compression_strategy accepts: `full`, and every strategy with a prompt rule of its own
    or that profiles the prompt itself."""
    return sorted(CACHE_STRATEGIES)
