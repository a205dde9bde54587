"""From flags to one cache per layer: the shared cache flags (defined once, used by generate.py and eval),
YAML presets from configs/, budgets and per-layer patterns, and building the `KVCache` modules.

Budgets: each `--max_cache_length` value is a fraction of |prompt| + max_new_tokens when ≤ 1, or an
absolute number of tokens when > 1. A list shorter than the number of layers is expanded by
`--cache_length_pattern` (tile: contiguous blocks, repeat: alternating); funnel / pyramid turn a single
budget into per-layer budgets that grow / shrink linearly with depth and keep the same total
(PyramidKV, arXiv 2406.02069). Strategies are expanded the same way by `--cache_strategy_pattern`.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from cache import KVCache, get_strategy
from errors import UserError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# How far funnel/pyramid budgets move away from the mean: the first and last layers get (1 ∓ slope)×.
PYRAMID_SLOPE = 0.5


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The cache flags (cold-compress names). The single definition of every cache hyper-parameter."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--cache_strategy", nargs="+", default=["full"],
                   help="strategy per layer (a list is expanded by --cache_strategy_pattern)")
    g.add_argument("--cache_strategy_pattern", choices=["tile", "repeat"], default="tile")
    g.add_argument("--max_cache_length", nargs="+", type=float, default=[1.0],
                   help="budget per layer: fraction of |prompt|+max_new_tokens (≤ 1) or tokens (> 1)")
    g.add_argument("--cache_length_pattern", choices=["tile", "repeat", "funnel", "pyramid"], default="tile")
    g.add_argument("--global_tokens", type=int, default=4,
                   help="first tokens never evicted (attention sinks)")
    g.add_argument("--recent_window", type=float, default=10,
                   help="most recent tokens never evicted: a count (> 1) or a fraction of the budget (< 1)")
    g.add_argument("--cache_config", default=None,
                   help="YAML preset: a path or a name in configs/ (flags given explicitly win)")
    g.add_argument("--print_cache_spec", action="store_true", help="print the resolved per-layer table")


@dataclass
class LayerCacheSpec:
    layer: int
    strategy: str
    max_cache_length: int  # tokens
    hyperparameters: dict

    def to_dict(self) -> dict:
        return asdict(self)


# ---- presets -------------------------------------------------------------------------------------------


def _explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations the user actually typed (a preset must not override them)."""
    probe = copy.deepcopy(parser)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    return set(vars(probe.parse_known_args(argv)[0]))


def _preset_path(name: str) -> Path:
    path = Path(name)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.is_file():
            return candidate
    available = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise UserError(f"cache config not found: {name} (a file, or one of: {available})")


def _preset_to_argv(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    try:
        preset = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"malformed YAML in {path}: {str(e).splitlines()[0]}") from None
    if preset is None:
        return []
    if not isinstance(preset, dict):
        raise UserError(f"{path} must be a mapping of cache flags to values")
    by_dest = {a.dest: a for a in parser._actions}
    argv: list[str] = []
    for key, value in preset.items():
        action = by_dest.get(key)
        if action is None or key == "cache_config":
            raise UserError(f"{path}: unknown cache flag {key!r}")
        flag = action.option_strings[-1]
        if isinstance(value, bool) and action.nargs == 0:
            if value:
                argv.append(flag)
            continue
        values = value if isinstance(value, list) else [value]
        argv += [flag, *map(str, values)]
    return argv


def parse_args_with_preset(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse flags; values from --cache_config fill in every flag the user did not type.

    The preset is turned back into flags and parsed by the same parser, so its values get the same
    types, choices and errors as the command line.
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.cache_config is None:
        return args
    path = _preset_path(args.cache_config)
    preset_args = vars(parser.parse_args(_preset_to_argv(path, parser) + argv))
    explicit = _explicit_flags(parser, argv)
    for key, value in preset_args.items():
        if key not in explicit:
            setattr(args, key, value)
    args.cache_config = str(path)
    return args


def check_cache_flags(args: argparse.Namespace) -> None:
    """Checks that need neither the model nor the prompt, run before anything is loaded."""
    for name in args.cache_strategy:
        get_strategy(name)
    if args.global_tokens < 0:
        raise UserError(f"--global_tokens must be ≥ 0, got {args.global_tokens}")
    if args.recent_window < 0:
        raise UserError(f"--recent_window must be ≥ 0, got {args.recent_window:g}")
    for value in args.max_cache_length:
        if value <= 0:
            raise UserError(f"--max_cache_length must be positive, got {value:g}")


# ---- per-layer spec ------------------------------------------------------------------------------------


def expand_to_layers(values: list, n_layer: int, pattern: str, what: str) -> list:
    if n_layer % len(values):
        raise UserError(f"{what} has {len(values)} values, which does not divide the {n_layer} layers")
    if pattern == "tile":  # contiguous blocks: [a, b] -> a a a ... b b b
        return [values[i * len(values) // n_layer] for i in range(n_layer)]
    return [values[i % len(values)] for i in range(n_layer)]  # repeat: a b a b ...


def tokens_from_budget(value: float, total: int, what: str) -> int:
    if value <= 0:
        raise UserError(f"{what} must be positive, got {value:g}")
    if value <= 1:
        return max(1, round(value * total))
    if value != int(value):
        raise UserError(f"{what} above 1 is a token count and must be an integer, got {value:g}")
    return int(value)


def depth_scaled_budgets(budget: int, n_layer: int, grow: bool) -> list[int]:
    """Budgets that change linearly with depth and sum to n_layer × budget (funnel grows, pyramid shrinks)."""
    if n_layer == 1:
        return [budget]
    weights = [1 + PYRAMID_SLOPE * (2 * i / (n_layer - 1) - 1) * (1 if grow else -1) for i in range(n_layer)]
    budgets = [int(budget * w) for w in weights]
    # Hand the tokens lost to rounding down to the layers with the largest remainders.
    order = sorted(range(n_layer), key=lambda i: budget * weights[i] - budgets[i], reverse=True)
    for i in order[: n_layer * budget - sum(budgets)]:
        budgets[i] += 1
    return budgets


def resolve_cache_spec(
    args: argparse.Namespace, n_layer: int, prompt_length: int, max_new_tokens: int
) -> list[LayerCacheSpec]:
    """One LayerCacheSpec per layer; raises UserError for anything inconsistent, before any work."""
    total = prompt_length + max_new_tokens
    strategies = expand_to_layers(list(args.cache_strategy), n_layer, args.cache_strategy_pattern, "--cache_strategy")
    raw = list(args.max_cache_length)
    if args.cache_length_pattern in ("funnel", "pyramid"):
        if len(raw) != 1:
            raise UserError(f"--cache_length_pattern {args.cache_length_pattern} takes a single --max_cache_length")
        budget = tokens_from_budget(raw[0], total, "--max_cache_length")
        budgets = depth_scaled_budgets(budget, n_layer, grow=args.cache_length_pattern == "funnel")
    else:
        budgets = [tokens_from_budget(v, total, "--max_cache_length") for v in raw]
        budgets = expand_to_layers(budgets, n_layer, args.cache_length_pattern, "--max_cache_length")
    check_cache_flags(args)
    specs = []
    for layer, (name, budget) in enumerate(zip(strategies, budgets, strict=False)):
        cls = get_strategy(name)
        budget = total if name == "full" else min(budget, total)
        hp = {}
        for key in cls.hyperparameters:
            hp[key] = getattr(args, key)
        if "recent_window" in hp:
            window = hp["recent_window"]
            hp["recent_window"] = round(window * budget) if window < 1 else int(window)
        protected = hp.get("global_tokens", 0) + hp.get("recent_window", 0)
        if budget < total and budget < protected + 1:
            raise UserError(
                f"layer {layer}: budget of {budget} tokens is smaller than the protected tokens "
                f"(global_tokens {hp.get('global_tokens', 0)} + recent_window {hp.get('recent_window', 0)} + 1)"
            )
        specs.append(LayerCacheSpec(layer, name, budget, hp))
    return specs


def build_caches(
    specs: list[LayerCacheSpec],
    batch_size: int,
    n_kv_heads: int,
    head_dim: int,
    capacity_needed: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    caches = []
    for spec in specs:
        cache = get_strategy(spec.strategy)(
            batch_size, n_kv_heads, head_dim, spec.max_cache_length, dtype, device, **spec.hyperparameters
        )
        cache.capacity_needed = capacity_needed
        caches.append(cache)
    return caches


def format_cache_spec(specs: list[LayerCacheSpec]) -> str:
    lines = [f"{'layer':>5}  {'strategy':<16} {'budget':>7}  hyper-parameters"]
    for s in specs:
        hp = ", ".join(f"{k}={v}" for k, v in s.hyperparameters.items())
        lines.append(f"{s.layer:>5}  {s.strategy:<16} {s.max_cache_length:>7}  {hp}")
    return "\n".join(lines)
