"""Fair comparisons: the rules an experiment's arms are held to beyond "the same items" (docs/DESIGN.md §8).

- A fixed-budget arm matched to an arm whose compression is an outcome (FastGen's) gets the budget at which
  its mean compression over the scored steps equals the measured one (MATCHING_RULE).
- The flags an experiment gives every compared arm (`common`) reach every one of them, or the experiment
  declares which arms do not read which flag (`unread`); `common_flags_unread` is what a strategy's declared
  hyper-parameters say, which the tests compare with the declaration.
"""

from __future__ import annotations

import argparse

from errors import UserError
from eval import cli
from strategies import CACHE_STRATEGIES, get_strategy

MATCHING_RULE = (
    "An arm whose compression is an outcome (FastGen's) is compared with fixed-budget arms at equal mean "
    "compression over the scored steps: a fixed arm gets the budget of L tokens whose compression 1 − min(L, t)/t, "
    "averaged over the steps the task scores (t: the tokens the cache has seen, prompt included, when it predicts "
    "a scored position), is closest to the measured arm's. Matching the final compression instead would let a "
    "budget above the prompt hold every token for the first scored steps.")
# The task whose scored steps are known before it runs (every window scores positions prefill_tokens..seq_len−1).
MATCHED_TASK = "fidelity"


def scored_seen(args: argparse.Namespace) -> list[int]:
    """Tokens the cache has seen when it predicts each scored position: position p is predicted from
    tokens 0..p−1 (eval.harness.teacher_force), for p = prefill_tokens .. seq_len − 1."""
    if MATCHED_TASK not in args.tasks:
        raise UserError(f"a matched budget needs the {MATCHED_TASK} task, whose scored steps are known in advance")
    return list(range(args.prefill_tokens, args.seq_len))


def fixed_budget_compression(tokens: int, seen: list[int]) -> float:
    """Mean over the steps of a fixed budget's compression: it holds min(L, t) of the t tokens seen
    (a prompt longer than L is compressed to L), at 16 bits (docs/DESIGN.md §6)."""
    return sum(1.0 - min(tokens, t) / t for t in seen) / len(seen)


def matched_tokens(target: float, seen: list[int]) -> int:
    """The budget L (2 .. the last step's tokens) whose mean compression over `seen` is closest to `target`;
    a tie goes to the larger budget (the fixed arm then holds at least as much as the rule asks)."""
    candidates = range(2, max(seen) + 1)  # 1 would read as a fraction (the whole sequence)
    return min(candidates, key=lambda n: (abs(fixed_budget_compression(n, seen) - target), -n))


# ---- flags of every compared arm ------------------------------------------------------------------------


def hyperparameter_names() -> set[str]:
    """Every flag some strategy declares it reads (cache_spec defines them once)."""
    return {h for cls in CACHE_STRATEGIES.values() for h in cls.hyperparameters} | {"adakv_floor"}


def hyperparameters_read(args: argparse.Namespace) -> set[str]:
    """The hyper-parameters an arm's caches read: its strategies' declared ones (cache_spec.resolve_cache_spec
    hands a cache only those), and Ada-KV's floor when it allocates."""
    read = {h for name in args.cache_strategy for h in get_strategy(name).hyperparameters}
    return read | ({"adakv_floor"} if getattr(args, "budget_allocation", "uniform") == "adakv" else set())


def flag_dests(flags: tuple[str, ...]) -> dict[str, str]:
    """argparse dest of each option in `flags`, through eval's own parser: {dest: option string}."""
    parser = cli.build_parser()
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    out = {}
    for word in flags:
        if word.startswith("--"):
            if word not in by_option:
                raise UserError(f"{word} is not a python -m eval flag")
            out[by_option[word]] = word
    return out


def common_flags_unread(common: tuple[str, ...], args: argparse.Namespace) -> set[str]:
    """The dests of `common`'s strategy hyper-parameters that this arm's strategies do not read."""
    hyper = set(flag_dests(common)) & hyperparameter_names()
    return hyper - hyperparameters_read(args)


def check_common_flags(common: tuple[str, ...], unread: dict[str, tuple[str, ...]], label: str,
                       args: argparse.Namespace) -> None:
    """An arm's strategies read every strategy flag of `common` but those `unread` declares for it."""
    missing = common_flags_unread(common, args)
    declared = {dest for dest, arms in unread.items() if label in arms}
    if missing != declared:
        raise UserError(f"its strategies do not read {sorted(missing)} of the flags of every compared arm; "
                        f"the experiment declares {sorted(declared)} (Experiment.unread)")


def check_matched_arm(args: argparse.Namespace, label: str) -> None:
    scored_seen(args)
    if args.cache_bits != 16:
        raise UserError(f"{label}: a matched arm holds tokens at 16 bits (its compression is tokens held)")
    if args.cache_length_pattern in ("funnel", "pyramid"):
        raise UserError(f"{label}: a matched arm has one budget for every layer")


def describe_match(tokens: int, seen: list[int], target: float, source: str) -> str:
    """How a matched budget meets the rule, for the report."""
    whole = sum(1 for t in seen if t <= tokens)
    return (f"tokens: mean compression {fixed_budget_compression(tokens, seen):.3f} over the {len(seen)} scored "
            f"steps, {source} {target:.3f}; it holds every token for {whole} of them")
