"""Flags typed on a command line that its configuration would ignore (a strategy setting no cache reads,
quantization at 16 bits, a budget for the full cache alone): refused in one line rather than silently
dropped, since a run's identity leaves out what it does not read and the user would believe it applied.
generate.py and eval check the command line; eval.sweep checks its whole grid."""

from __future__ import annotations

import argparse

from errors import UserError
from flag_types import explicit_dests
from strategies import CACHE_STRATEGIES, get_strategy


def strategy_flags() -> set[str]:
    """Cache flags that only some configurations read: every strategy's hyper-parameters and prompt-rule
    settings, and Ada-KV's floor (--seed is read anyway: it seeds sampling and eval's examples too)."""
    read = {h for cls in CACHE_STRATEGIES.values() for h in cls.hyperparameters}
    read |= {st.name for cls in CACHE_STRATEGIES.values() for st in cls.settings if st.prompt_rule}
    return (read | {"adakv_floor"}) - {"seed"}


def cache_flags_read(args: argparse.Namespace) -> set[str]:
    """The strategy flags some layer of this configuration reads: its strategies' hyper-parameters, the
    settings of its prompt rules (auto: each strategy's own), Ada-KV's floor when it allocates."""
    strategies = [get_strategy(name) for name in args.cache_strategy]
    rules = {n for n in args.prompt_compression_strategy if n != "auto"}
    if "auto" in args.prompt_compression_strategy:
        rules |= {getattr(cls, "shadow_class", cls).name for cls in strategies}
    read = {h for cls in strategies for h in cls.hyperparameters}
    read |= {st.name for rule in rules for st in get_strategy(rule).settings if st.prompt_rule}
    read -= {st.name for cls in CACHE_STRATEGIES.values() for st in cls.settings
             if st.read_if and getattr(args, st.read_if[0], st.read_if[1]) != st.read_if[1]}
    return read | ({"adakv_floor"} if getattr(args, "budget_allocation", "uniform") == "adakv" else set())


def readers_of(flag: str) -> str:
    """Who reads a strategy flag, in words (for the refusal of one no cache reads)."""
    if flag == "adakv_floor":
        return "--budget_allocation adakv"
    condition = next((st.read_if for cls in CACHE_STRATEGIES.values() for st in cls.settings
                      if st.name == flag and st.read_if), None)
    if condition:
        return f"--{condition[0]} {condition[1]}"
    names = [n for n, cls in CACHE_STRATEGIES.items() if flag in cls.hyperparameters and not n.startswith("debug_")]
    rules = [n for n, cls in CACHE_STRATEGIES.items() if any(st.prompt_rule and st.name == flag for st in cls.settings)]
    others = [n for n in CACHE_STRATEGIES if n not in names and not n.startswith("debug_")]
    if len(names) > len(others):
        names = [f"every strategy but {', '.join(others)}"]
    return ", ".join(names + [f"{n}'s prompt rule" for n in rules])


def check_cache_flags_read(typed: set[str], read: set[str], what: str) -> None:
    """A strategy flag typed explicitly (`typed`: destinations) that no cache of `what` reads would be
    ignored without a word: refuse it. `read`: cache_flags_read, over every configuration of the command."""
    for flag in sorted((typed & strategy_flags()) - read):
        raise UserError(f"--{flag} would be ignored: no cache of {what} reads it (read by {readers_of(flag)})")


def check_storage_flags_read(typed: set[str], args: argparse.Namespace) -> None:
    if "cache_quantization" in typed and args.cache_bits == 16:
        raise UserError("--cache_quantization would be ignored: --cache_bits 16 stores keys and values unquantized")


def check_compile_scope_read(typed: set[str], args: argparse.Namespace) -> None:
    if "compile_scope" in typed and not args.compile:
        raise UserError("--compile_scope would be ignored: it chooses what --compile compiles (add --compile)")


def check_typed_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Flags typed explicitly that this configuration would ignore (generate.py, python -m eval)."""
    typed = explicit_dests(parser, argv)
    check_cache_flags_read(typed, cache_flags_read(args), f"--cache_strategy {' '.join(args.cache_strategy)}")
    check_storage_flags_read(typed, args)
    check_compile_scope_read(typed, args)
    if "max_cache_length" in typed and all(s.removeprefix("debug_") == "full" for s in args.cache_strategy):
        raise UserError("--max_cache_length would be ignored: the full cache keeps every token (choose a "
                        "--cache_strategy)")
