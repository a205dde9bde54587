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
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml

from budget_allocation import ALLOCATIONS, DEFAULT_FLOOR, check_budget_allocation, with_allocation
from cache import KVCache, Setting, finite_float
from errors import UserError
from flag_types import count, real
from kv_storage import DENSE, SCHEMES, THINK_FIELDS, StorageSpec
from strategies import CACHE_STRATEGIES, get_strategy, prompt_rules
from strategies.critical_kv import PromptValueNorms, prompt_values_refusal
from strategies.paper_names import paper_name_hint
from strategies.token_ids import TOKEN_CLASSES_NEEDED

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
# How far funnel/pyramid budgets move away from the mean: the first and last layers get (1 ∓ slope)×.
PYRAMID_SLOPE = 0.5
# Seeds the generators and random eviction accept whole: random eviction folds seed × 1_000_003 + layer into
# an int64 buffer, and torch.manual_seed refuses values past 64 bits.
SEED_LIMIT = 1 << 32


def strategy_settings() -> list[tuple[str, Setting]]:
    """Every registered strategy's own settings, with the name of the strategy that declares each."""
    found: dict[str, tuple[str, Setting]] = {}
    for cls in CACHE_STRATEGIES.values():
        for setting in cls.settings:
            if setting.name in found and found[setting.name][1] is not setting:
                raise ValueError(f"{cls.name} and {found[setting.name][0]} both declare a setting {setting.name!r}")
            found[setting.name] = (cls.name, setting)
    return list(found.values())


def add_storage_arguments(g: argparse._ArgumentGroup) -> None:
    """How the held K/V are stored (kv_storage.py): quantized per token or as KIVI, ThinK's thin keys."""
    g.add_argument("--cache_bits", type=int, choices=[2, 4, 8, 16], default=16,
                   help="store keys/values as 2/4/8-bit integers (16 = unquantized)")
    g.add_argument("--cache_quantization", choices=SCHEMES, default="per_token",
                   help="with --cache_bits < 16: per_token scales, or kivi (keys per channel in token groups, "
                        "values per token in channel groups, the newest tokens in full precision)")
    g.add_argument("--q_group_size", type=int, default=DENSE.q_group_size,
                   help="kivi: tokens per key group and channels per value group (64 as transformers' "
                        "QuantizedCache; the KIVI paper uses 32)")
    g.add_argument("--residual_length", type=int, default=DENSE.residual_length,
                   help="kivi: newest tokens kept in full precision (a multiple of --q_group_size; 128 as "
                        "KIVI and transformers)")
    g.add_argument("--think_ratio", type=real(0, 1, high_open=True), default=DENSE.think_ratio,
                   help="ThinK (arXiv 2407.21018): prune this fraction of each KV head's key channels, chosen at "
                        "prefill by the window queries' interaction with the keys; the kept channels alone are "
                        "stored, values whole (0: keys whole; the paper uses 0.4-0.5)")
    g.add_argument("--think_window", type=count(), default=DENSE.think_window,
                   help="ThinK: the last prompt queries that score the key channels (32 as ThinK and kvpress)")
    g.add_argument("--think_recent", type=count(0), default=DENSE.think_recent,
                   help="ThinK: the newest tokens whose keys stay whole (0: every key pruned, the paper's method; "
                        "the authors' code keeps 32 prompt tokens and every decoded one whole)")


def add_allocation_arguments(g: argparse._ArgumentGroup) -> None:
    """How a layer's budget is shared between its KV heads (budget_allocation.py)."""
    g.add_argument("--budget_allocation", choices=ALLOCATIONS, default=ALLOCATIONS[0],
                   help="uniform: every KV head of a layer holds up to the budget; adakv: the heads share n_kv × "
                        "budget slots by score mass, chosen at prefill (Ada-KV, arXiv 2407.11550; "
                        "head-specific strategies)")
    g.add_argument("--adakv_floor", type=finite_float, default=DEFAULT_FLOOR,
                   help="adakv: every head keeps at least this fraction of the budget (Ada-KV's safeguard alpha "
                        "as kvpress applies it, 0.2)")


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The cache flags (cold-compress names): the shared settings here, each strategy's own from its
    declaration (`settings`), so every flag has one definition."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--cache_strategy", nargs="+", default=["full"],
                   help="strategy per layer (a list is expanded by --cache_strategy_pattern)")
    g.add_argument("--cache_strategy_pattern", choices=["tile", "repeat"], default="tile")
    g.add_argument("--max_cache_length", nargs="+", type=finite_float, default=[1.0],
                   help="budget per layer: fraction of |prompt|+max_new_tokens (≤ 1) or tokens (> 1)")
    g.add_argument("--cache_length_pattern", choices=["tile", "repeat", "funnel", "pyramid"], default="tile")
    g.add_argument("--global_tokens", type=int, default=4,
                   help="first tokens never evicted (attention sinks; 4 as in StreamingLLM and kvpress)")
    g.add_argument("--recent_window", type=finite_float, default=10,
                   help="most recent tokens never evicted: a count (> 1) or a fraction of the budget (< 1); "
                        "10: Scissorhands' r, as cold-compress; H2O gives half the budget: --recent_window 0.5")
    g.add_argument("--prompt_compression_strategy", nargs="+", default=["auto"],
                   help="per layer, when the prompt exceeds the budget (auto: the cache strategy's own; "
                        f"choices: {', '.join(prompt_rules())})")
    g.add_argument("--feed_long_prompts", action="store_true",
                   help="prefill what fits the smallest budget, feed the rest of the prompt token by token")
    g.add_argument("--prefill_chunk", type=int, default=None,
                   help="feed the prompt N tokens at a time, each layer compressing to its budget after every "
                        "chunk by its strategy's prompt rule over what it holds plus the chunk: memory holds the "
                        "budget plus one chunk, whatever the prompt's length (1: token by token, as decoding)")
    g.add_argument("--seed", type=int, default=0, help="seed of random eviction (and of sampling)")
    add_storage_arguments(g)
    add_allocation_arguments(g)
    g.add_argument("--rerotate_positions", action="store_true",
                   help="RoPE positions inside the cache, as StreamingLLM: each head's held tokens at 0..n-1 in order, "
                        "the query at its rank (keys stored before RoPE); a sequence may then exceed the model's "
                        "context when every layer's budget fits it")
    for owner, setting in strategy_settings():
        setting.add_argument(g, owner)
    g.add_argument("--cache_config", default=None,
                   help="YAML preset: a path or a name in configs/ (flags given explicitly win)")
    g.add_argument("--print_cache_spec", action="store_true", help="print the resolved per-layer table")


@dataclass
class LayerCacheSpec:
    layer: int
    strategy: str
    max_cache_length: int  # tokens
    hyperparameters: dict
    prompt_compression: str = "full"
    storage: StorageSpec = DENSE
    budget_allocation: str = "uniform"  # or adakv: the heads share the layer's slots (budget_allocation.py)
    rerotate_positions: bool = False  # keys stored before RoPE, rotated by rank each step (rerotation.py)
    # The prompt rule's own settings (Setting.prompt_rule: SnapKV's window and kernel for heavy_hitter's).
    prompt_settings: dict = field(default_factory=dict)
    prefill_chunk: int = 0  # --prefill_chunk: the prompt fed this many tokens at a time (0: at once)
    # A sliding layer's window cache (model_policies.py): its window in tokens, 0 for every other layer.
    sliding_window: int = 0

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.storage.think_ratio:  # as recorded before ThinK existed (eval.replay compares records)
            d["storage"] = {k: v for k, v in d["storage"].items() if k not in THINK_FIELDS}
        return d


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
    hint = paper_name_hint(name, sorted(CACHE_STRATEGIES))
    raise UserError(f"cache config not found: {name}" + (f" ({hint})" if hint else "")
                    + f"; a file, or one of: {available}")


# ---- one typed schema for presets, grids and the command line --------------------------------------------
# A YAML value is checked against the argparse action of its flag (the single definition of each flag),
# then turned into command-line words and parsed by the same parser: the same types, choices and errors.

NOT_PRESET_KEYS = ("cache_config", "print_cache_spec")  # not cache settings: a preset cannot set them


def cache_flag_defaults() -> dict:
    """Every cache flag a preset may set, with its default (a flag added later comes along)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_cache_arguments(probe)
    return {a.dest: a.default for a in probe._actions if a.dest not in NOT_PRESET_KEYS}


def cache_flag_names() -> list[str]:
    """The destinations of the cache flags a preset may set."""
    return list(cache_flag_defaults())


def _scalar_word(action: argparse.Action, key: str, value: object, source: str) -> str:
    """One YAML scalar as the word argparse will parse, refused unless its YAML type fits the flag's type."""
    kind = getattr(action.type, "__name__", "str") if action.type is not None else "str"
    if isinstance(value, bool) or value is None or isinstance(value, dict | list):
        wanted = "an integer" if kind == "int" else "a number" if "float" in kind else "a string"
        raise UserError(f"{source}: {key} takes {wanted}, got {'no value' if value is None else repr(value)}")
    if kind == "int":
        if not isinstance(value, int):
            raise UserError(f"{source}: {key} takes an integer, got {value!r}")
        return str(value)
    if "float" in kind:
        if not isinstance(value, int | float) or not math.isfinite(value):
            raise UserError(f"{source}: {key} takes a finite number, got {value!r}")
        return repr(float(value))
    if not isinstance(value, str | int | float):
        raise UserError(f"{source}: {key} takes a string, got {value!r}")
    return str(value)


def value_to_argv(action: argparse.Action, key: str, value: object, source: str) -> list[str]:
    """Command-line words for `key: value`: booleans must be YAML booleans, list flags take a list (a
    single value is a one-element list, never a string split into characters), numbers are finite."""
    if action.nargs == 0:  # a switch: store_true or --x/--no-x
        if not isinstance(value, bool):
            raise UserError(f"{source}: {key} takes true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [next(f for f in action.option_strings if f.startswith("--no-") == (not value))]
        return [action.option_strings[0]] if value == (action.const is True) else []
    if action.nargs in ("+", "*"):
        values = value if isinstance(value, list) else [value]
        if not values:
            raise UserError(f"{source}: {key} needs at least one value")
        return [action.option_strings[0], *(_scalar_word(action, key, v, source) for v in values)]
    if isinstance(value, list):
        raise UserError(f"{source}: {key} takes one value, got a list {value!r}")
    return [f"{action.option_strings[0]}={_scalar_word(action, key, value, source)}"]


def mapping_to_argv(mapping: object, parser: argparse.ArgumentParser, allowed: Iterable[str], source: str,
                    what: str = "flag") -> list[str]:
    """Validate a YAML mapping of flags (by destination name) and return it as command-line words."""
    if not isinstance(mapping, dict):
        raise UserError(f"{source} must be a mapping of {what}s to values, got {type(mapping).__name__}")
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    allowed = set(allowed)
    argv: list[str] = []
    for key, value in mapping.items():
        if not isinstance(key, str) or key not in allowed or key not in by_dest:
            raise UserError(f"{source}: unknown {what} {key!r}")
        argv += value_to_argv(by_dest[key], key, value, source)
    return argv


def read_yaml(path: Path, what: str) -> object:
    """A YAML document, or one UserError for a file that is unreadable, not UTF-8, malformed or empty."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not UTF-8 text") from None
    from strict_yaml import strict_load  # duplicate keys and YAML 1.1's text-not-number exponents refused

    try:
        data = strict_load(text, f"{what} {path}")
    except yaml.YAMLError as e:
        raise UserError(f"malformed YAML in {what} {path}: {str(e).splitlines()[0]}") from None
    if data is None:
        raise UserError(f"{what} {path} is empty")
    return data


def _preset_to_argv(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    return mapping_to_argv(read_yaml(path, "cache config"), parser, cache_flag_names(), str(path), "cache flag")


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
    if args.recent_window >= 1 and args.recent_window != int(args.recent_window):
        # 1.5 would silently become 1 token: a count must be whole, a fraction of the budget below 1
        raise UserError(f"--recent_window is a token count (an integer) or a fraction below 1, "
                        f"got {args.recent_window:g}")
    if not 0 <= args.seed < SEED_LIMIT:
        raise UserError(f"--seed must be in [0, 2^32), got {args.seed}")
    for value in args.max_cache_length:
        if value <= 0:
            raise UserError(f"--max_cache_length must be positive, got {value:g}")
    for name in args.prompt_compression_strategy:
        if name != "auto" and name not in prompt_rules():
            hint = paper_name_hint(name, prompt_rules(), "--prompt_compression_strategy")
            raise UserError(f"unknown prompt compression strategy {name!r}" + (f" ({hint})" if hint else "")
                            + f"; available: auto, {', '.join(prompt_rules())}")
    for _, setting in strategy_settings():
        setting.check(getattr(args, setting.name))
    storage_spec(args)
    check_budget_allocation(args)
    check_prefill_chunk(args)


def check_prefill_chunk(args: argparse.Namespace) -> None:
    """--prefill_chunk against the other flags (the model's context is checked with the model)."""
    chunk = getattr(args, "prefill_chunk", None)
    if chunk is None:
        return
    if chunk < 1:
        raise UserError(f"--prefill_chunk must be ≥ 1 token, got {chunk}")
    if args.feed_long_prompts:
        raise UserError("--prefill_chunk and --feed_long_prompts both choose how the prompt is fed; give one")
    for name in dict.fromkeys([*args.cache_strategy, *args.prompt_compression_strategy]):
        if name == "auto":
            continue
        cls = get_strategy(name)
        cls = getattr(cls, "shadow_class", cls)
        refusal = cls.chunked_prefill_refusal or cls.chunked_prefill_conflict(args)
        if refusal:
            raise UserError(f"--prefill_chunk: the {name} cache cannot compress a prompt chunk by chunk ({refusal})")


def storage_spec(args: argparse.Namespace) -> StorageSpec:
    """The K/V storage every layer uses, or a UserError for flags that do not fit together."""
    think = [getattr(args, name, getattr(DENSE, name)) for name in THINK_FIELDS]  # records made before ThinK
    spec = StorageSpec(args.cache_bits, args.cache_quantization, args.q_group_size, args.residual_length, *think)
    check_think(args, spec)
    kivi_flags = (spec.q_group_size, spec.residual_length) != (DENSE.q_group_size, DENSE.residual_length)
    if spec.scheme != "kivi" and kivi_flags:
        raise UserError("--q_group_size and --residual_length apply to --cache_quantization kivi only")
    if spec.scheme == "kivi":
        if spec.bits == 16:
            raise UserError("--cache_quantization kivi needs --cache_bits 2, 4 or 8")
        if spec.q_group_size < 1 or spec.residual_length < spec.q_group_size or \
                spec.residual_length % spec.q_group_size:
            raise UserError(f"--residual_length ({spec.residual_length}) must be a positive multiple of "
                            f"--q_group_size ({spec.q_group_size})")
    return spec


def check_think(args: argparse.Namespace, spec: StorageSpec) -> None:
    """The ThinK flags (their ranges are their argparse types') against each other and the flags ThinK's one
    channel set per KV head cannot serve."""
    if not spec.think_ratio:
        if (spec.think_window, spec.think_recent) != (DENSE.think_window, DENSE.think_recent):
            raise UserError("--think_window and --think_recent apply to ThinK's pruned keys only (--think_ratio > 0)")
        return
    conflicts = {
        "--cache_bits": spec.bits != 16,  # ThinK + KIVI is in the paper; not here
        "--budget_allocation adakv": getattr(args, "budget_allocation", "uniform") != "uniform",
        "--rerotate_positions": bool(getattr(args, "rerotate_positions", False)),
    }
    why = {"--cache_bits": "its pruned keys are stored in the cache dtype",
           "--budget_allocation adakv": "a pool mixes the heads, each with its own channels",
           "--rerotate_positions": "it prunes post-RoPE keys, as the paper; re-rotation stores them before RoPE"}
    for flag, conflict in conflicts.items():
        if conflict:
            raise UserError(f"--think_ratio with {flag}: {why[flag]}")


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


def depth_scaled_budgets(budget: int, n_layer: int, grow: bool, cap: int | None = None) -> list[int]:
    """Budgets that change linearly with depth and sum to n_layer × budget (funnel grows, pyramid shrinks), none
    past `cap` (the sequence's tokens, which no layer can hold more of): where (1 + PYRAMID_SLOPE) × budget would
    pass it, the slope flattens so that the largest layer gets cap and the smallest 2 · budget − cap, the same
    total (kvpress's PyramidKV caps its largest layer so too); a budget of cap or more is every layer's."""
    if n_layer == 1:
        return [budget]
    slope = PYRAMID_SLOPE if cap is None else max(0.0, min(PYRAMID_SLOPE, cap / budget - 1))
    weights = [1 + slope * (2 * i / (n_layer - 1) - 1) * (1 if grow else -1) for i in range(n_layer)]
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
        budgets = depth_scaled_budgets(budget, n_layer, grow=args.cache_length_pattern == "funnel", cap=total)
    else:
        budgets = [tokens_from_budget(v, total, "--max_cache_length") for v in raw]
        budgets = expand_to_layers(budgets, n_layer, args.cache_length_pattern, "--max_cache_length")
    check_cache_flags(args)
    storage = storage_spec(args)
    compressors = expand_to_layers(list(args.prompt_compression_strategy), n_layer, args.cache_strategy_pattern,
                                   "--prompt_compression_strategy")
    allocation = getattr(args, "budget_allocation", "uniform")  # configs recorded before the flag: uniform
    # getattr: flags recorded by runs made before the flag existed (eval.replay) lack it.
    rerotate = bool(getattr(args, "rerotate_positions", False))
    specs = []
    for layer, (name, budget, compressor) in enumerate(zip(strategies, budgets, compressors, strict=True)):
        cls = get_strategy(name)
        budget = total if name.removeprefix("debug_") == "full" else min(budget, total)
        compressor = check_prompt_compression(name, cls, compressor, layer)
        hp = {}
        for key in cls.hyperparameters:
            hp[key] = getattr(args, key)
        if allocation == "adakv":
            hp["adakv_floor"] = args.adakv_floor
        if "recent_window" in hp:
            window = hp["recent_window"]
            hp["recent_window"] = round(window * budget) if window < 1 else int(window)
        protected = hp.get("global_tokens", 0) + hp.get("recent_window", 0)
        if protected == 0 and getattr(getattr(cls, "shadow_class", cls), "holds_only_protected", False):
            raise UserError(f"layer {layer}: {name} streams heads (or layers) with only the sinks and the recent "
                            "window, and with --global_tokens 0 and --recent_window 0 (after rounding) they would "
                            "hold no token: give one of them at least 1")
        if budget < total and budget < protected + 1:
            raise UserError(
                f"layer {layer}: budget of {budget} tokens is smaller than the protected tokens "
                f"(global_tokens {hp.get('global_tokens', 0)} + recent_window {hp.get('recent_window', 0)} + 1): "
                f"raise --max_cache_length (a fraction is of prompt + new tokens, {total} here), or lower "
                f"--global_tokens or --recent_window"
            )
        if (budget < prompt_length and compressor == "full" and not args.feed_long_prompts):
            raise UserError(
                f"layer {layer}: the prompt ({prompt_length} tokens) exceeds the {name} budget of {budget} "
                "tokens and prompt compression 'full' keeps everything: choose a --prompt_compression_strategy "
                "or pass --feed_long_prompts"
            )
        rule_settings = {st.name: getattr(args, st.name) for st in get_strategy(compressor).settings if st.prompt_rule}
        specs.append(LayerCacheSpec(layer, name, budget, hp, compressor, storage, allocation, rerotate, rule_settings,
                                    int(getattr(args, "prefill_chunk", None) or 0)))
    return specs


def check_prompt_compression(strategy: str, cls: type[KVCache], compressor: str, layer: int) -> str:
    """The prompt rule for one layer ('auto' resolved: the strategy's own), or a UserError listing what
    would work. A debug_ twin pairs exactly as the strategy it shadows."""
    own = getattr(cls, "shadow_class", cls)
    if compressor == "auto":
        return own.name
    rule = get_strategy(compressor)
    if own.profiles_prompt or rule.profiles_prompt:
        if own is not rule:
            raise UserError(f"layer {layer}: the {compressor if rule.profiles_prompt else own.name} cache profiles "
                            f"the prompt itself and pairs with no other prompt rule (got {strategy} with {compressor})")
    if rule.needs_token_ids and own is not rule and own.name != "full":
        raise UserError(f"layer {layer}: prompt compression '{compressor}' reads the prompt's token ids, which only a "
                        f"{compressor} cache receives (got {strategy}); use --cache_strategy {compressor} or another "
                        "compressor")
    if rule.prompt_rule_needs_own_cache and own is not rule:
        raise UserError(f"layer {layer}: prompt compression '{compressor}' {rule.prompt_rule_needs_own_cache} (got "
                        f"{strategy}); use --cache_strategy {compressor} or another compressor")
    if issubclass(rule, PromptValueNorms) and own.name != "full" and not rule.observed_by(own):
        raise UserError(f"layer {layer}: {prompt_values_refusal(compressor, own.name)}")
    if rule.needs_gates and not own.needs_gates:
        raise UserError(f"layer {layer}: prompt compression '{compressor}' scores tokens by the gates a gated cache "
                        f"stores; the {strategy} cache has none (use it with --cache_strategy gated)")
    if rule.head_specific and not own.head_specific and own.name != "full":
        works = [n for n in prompt_rules() if not get_strategy(n).head_specific]
        raise UserError(f"layer {layer}: prompt compression '{compressor}' keeps different tokens per head, "
                        f"but the {strategy} cache is shared across heads; use one of: {', '.join(works)}")
    return compressor


def build_caches(
    specs: list[LayerCacheSpec],
    batch_size: int,
    n_kv_heads: int,
    head_dim: int,
    capacity_needed: int,
    dtype: torch.dtype,
    device: torch.device | str,
    token_classes: dict[str, torch.Tensor] | None = None,
) -> list[KVCache]:
    """One cache per layer. `token_classes` (strategies.token_ids.token_classes) is needed by hybrid caches."""
    caches = []
    for spec in specs:
        peers = [s.layer for s in specs if s.strategy == spec.strategy]
        group = min(spec.storage.q_group_size, head_dim)
        if spec.storage.scheme == "kivi" and spec.storage.bits < 16 and head_dim % group:
            raise UserError(f"--q_group_size {spec.storage.q_group_size}: kivi value groups of {group} channels "
                            f"must divide the model's head_dim {head_dim}")
        cls = with_allocation(get_strategy(spec.strategy), spec.budget_allocation)
        cache = cls(batch_size, n_kv_heads, head_dim, spec.max_cache_length, dtype, device, spec.storage,
                    capacity_needed=capacity_needed, **spec.hyperparameters)
        settings = dict(layer_idx=spec.layer, strategy_layers=len(peers), strategy_layer_idx=peers.index(spec.layer),
                        prompt_compressor=get_strategy(spec.prompt_compression),
                        prompt_settings=dict(spec.prompt_settings), rerotate_positions=spec.rerotate_positions,
                        prefill_chunk=spec.prefill_chunk, sliding_window=spec.sliding_window)
        if getattr(cls, "needs_token_classes", False):
            if token_classes is None:
                raise UserError(f"the {spec.strategy} cache {TOKEN_CLASSES_NEEDED}")
            settings["token_classes"] = token_classes
        cache.configure(**settings)
        caches.append(cache)
    return caches


def format_cache_spec(specs: list[LayerCacheSpec]) -> str:
    """The per-layer table of --print_cache_spec. The budget is per KV head; with adakv allocation the heads
    share n_kv × budget slots, split at prefill (the statistics' cache_budget_per_head)."""
    lines = [f"{'layer':>5}  {'strategy':<22} {'budget':>7}  {'allocation':<10} {'prompt compression':<18} "
             f"{'bits':<18}  hyper-parameters"]
    for s in specs:
        hp = ", ".join(f"{k}={v}" for k, v in (s.hyperparameters | s.prompt_settings).items())
        lines.append(f"{s.layer:>5}  {s.strategy:<22} {s.max_cache_length:>7}  {s.budget_allocation:<10} "
                     f"{s.prompt_compression:<18} {s.storage.describe():<18}  {hp}")
    if any(s.prefill_chunk for s in specs):
        lines.append(f"prefill: {max(s.prefill_chunk for s in specs)} tokens at a time (--prefill_chunk), each layer "
                     "compressed to its budget after every chunk")
    if any(s.rerotate_positions for s in specs):
        lines.append("positions: re-rotated (--rerotate_positions): RoPE at each token's rank in its head's cache")
    return "\n".join(lines)
