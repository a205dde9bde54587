"""The bench plan: which rows a run measures, as data (`Job.kind`), and its estimated cost."""


from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

from cache_setup import cache_config
from cache_spec import resolve_cache_spec
from errors import UserError

# Costs behind --dry_run's estimate, fitted to runs on this project's 2-core machine, bf16, 2 threads, idle
# (one thread: compile about the same, prefill 1.85x and steps 1.35x these): a cold compile of the decode step;
# prefill of c tokens, c * (A + B * c) s, plus c² * C s of prompt attention for heavy_hitter / hybrid; one
# compiled step over L slots, A + B * L s (eager 1.4x; HF generate about 39 ms + 25 µs per context token).
EST_COMPILE_S = 45.0
EST_PREFILL_A, EST_PREFILL_B, EST_SCORED_PREFILL_C = 8.3e-4, 2.7e-7, 2.4e-6
EST_STEP_A, EST_STEP_B, EST_EAGER_FACTOR = 0.033, 3.2e-6, 1.4
EST_HF_STEP_A, EST_HF_STEP_B = 0.039, 2.5e-5


def cache_args(strategy: str, budget: float, cache_bits: int = 16) -> argparse.Namespace:
    return cache_config(cache_strategy=[strategy], max_cache_length=[float(budget)], cache_bits=cache_bits)


def cache_slots(strategy: str, budget: float, n_layer: int, prompt: int, new: int) -> int:
    """Slots each layer's cache allocates (the largest layer budget) for this strategy and budget."""
    return max(s.max_cache_length for s in resolve_cache_spec(cache_args(strategy, budget), n_layer, prompt, new))


def recompile_check_shape(slots: int, capacity: int, steps: int) -> tuple[int, int]:
    """(prompt length, decode steps) of the recompilation check run on an already compiled cache: the prompt
    leaves room for about half the steps, so the cache fills during the run and then evicts; positions stay
    below the capacity the cache was built for (prompt + steps ≤ capacity)."""
    prompt = max(1, min(slots - steps // 2, capacity - steps))
    return prompt, max(1, min(steps, capacity - prompt))


@dataclass
class Job:
    kind: str  # "hf", "hf_static", "full" (a context's full-cache row), "ref" (same-size full reference), "strategy"
    context: int  # prompt tokens
    strategy: str = "full"
    budget: float = 1.0
    compiled: bool = False
    slots: int = 0  # per-layer cache slots
    recompile_steps: int = 0
    new_tokens: int = 0
    pair_blocks: int = 0  # > 0: paired overhead measurement against a same-size full cache
    profile_steps: int = 0  # > 0: that many more steps under torch.profiler (eval/bench/profile.py)

    def engine(self) -> str:
        if self.kind == "hf":
            return "hf generate"
        if self.kind == "hf_static":
            return "hf generate, static cache compiled"
        mode = "ours compiled" if self.compiled else "ours eager"
        return f"{mode} (same-size ref)" if self.kind == "ref" else mode


def fit_context(context: int, context_length: int, new_tokens: int, profile_steps: int) -> int:
    """The prompt's length, cut so that prompt + new tokens fit the model's context; refused where nothing is
    left, or less than --profile_steps needs (check_values checks the contexts as typed; this, after the cut)."""
    if context < 1:
        raise UserError(f"contexts must be ≥ 1, got {context}")
    fitted = min(context, context_length - new_tokens)
    if fitted < 1:
        raise UserError(f"--new_tokens {new_tokens} leaves no room for a prompt in the model's context of "
                        f"{context_length} tokens")
    if profile_steps and fitted <= profile_steps + 2:
        raise UserError(f"--profile_steps {profile_steps} needs prompts longer than {profile_steps + 2} tokens; "
                        f"context {context} is cut to {fitted} so that --new_tokens {new_tokens} fit the model's "
                        f"context of {context_length}")
    return fitted


def build_plan(args: argparse.Namespace, strategies: list[str], n_layer: int, context_length: int) -> list[Job]:
    """Every row the run measures, in order; the same-size references right before the strategies they serve."""
    new = args.new_tokens
    compiled = not args.no_compile

    fit = partial(fit_context, context_length=context_length, new_tokens=new, profile_steps=args.profile_steps)
    plan: list[Job] = []
    refs: set[tuple[bool, int]] = set()  # (compiled, slots) already measured by a full or ref row
    checked: set[str] = set()  # strategies whose compiled graph got a recompilation check

    def check(strategy: str) -> int:
        if not compiled or args.recompile_steps <= 0 or strategy in checked:
            return 0
        checked.add(strategy)
        return args.recompile_steps

    def full_row(context: int, is_compiled: bool) -> None:
        if any(j.kind == "full" and (j.context, j.compiled) == (context, is_compiled) for j in plan):
            return
        plan.append(Job("full", context, compiled=is_compiled, slots=context + new, new_tokens=new,
                        recompile_steps=check("full") if is_compiled else 0, profile_steps=args.profile_steps))
        refs.add((is_compiled, context + new))

    def strategy_rows(context: int, budgets: list[float], names: list[str], overhead: bool = True) -> None:
        full_row(context, compiled)  # the speed-up is measured against the full cache at this context
        for b in sorted(set(budgets)):
            for s in names if b == args.speedup_budget else [n for n in names if n in budget_strategies]:
                if any(j.kind == "strategy" and (j.context, j.strategy, j.budget) == (context, s, b) for j in plan):
                    continue
                slots = cache_slots(s, b, n_layer, context, new)
                measure_overhead = overhead and not args.no_same_size_ref
                if measure_overhead and (compiled, slots) not in refs:
                    ref_new = min(new, slots - 1)
                    if ref_new >= 2:
                        plan.append(Job("ref", slots - ref_new, compiled=compiled, slots=slots, new_tokens=ref_new))
                        refs.add((compiled, slots))
                pair = args.overhead_blocks if measure_overhead else 0
                profiled = args.profile_steps if (s in args.speedup_strategies and b == args.speedup_budget) else 0
                plan.append(Job("strategy", context, s, b, compiled, slots, check(s), new, pair, profiled))

    for context in map(fit, args.contexts):
        if not args.no_hf:
            plan.append(Job("hf", context, new_tokens=new))
            if args.hf_static:
                plan.append(Job("hf_static", context, new_tokens=new))
        full_row(context, False)
        if compiled:
            full_row(context, True)
    for context in map(fit, args.bound_contexts):
        full_row(context, compiled)
    budget_strategies = strategies if args.budget_strategies == ["all"] else args.budget_strategies
    # The long-context speed-ups before the per-strategy rows: a run cut short (a lent GPU's timeout) keeps
    # the rows that answer the bound question and loses the tail of the strategy list.
    for context in map(fit, args.speedup_contexts):  # the speed-up only: overheads are measured below
        strategy_rows(context, [args.speedup_budget], args.speedup_strategies, overhead=False)
    for context in map(fit, args.strategy_contexts):
        strategy_rows(context, [args.speedup_budget, *args.budgets], strategies)
    return plan


def plan_summary(plan: list[Job]) -> str:
    """Size of the plan and its estimated duration from the EST_* costs (2 idle cores)."""

    def prefill_s(tokens: int, strategy: str = "full") -> float:
        scored = EST_SCORED_PREFILL_C * tokens**2 if strategy in ("heavy_hitter", "hybrid") else 0.0
        return tokens * (EST_PREFILL_A + EST_PREFILL_B * tokens) + scored

    def step_s(j: Job, slots: int) -> float:
        return (EST_STEP_A + EST_STEP_B * slots) * (1 if j.compiled else EST_EAGER_FACTOR)

    seconds, prefill, steps = 30.0, 0, 0  # model load, bandwidth
    for j in plan:
        if j.kind == "hf":
            prefill += j.context
            steps += j.new_tokens
            seconds += 5 + prefill_s(j.context) + j.new_tokens * (EST_HF_STEP_A + EST_HF_STEP_B * j.context)
            continue
        seconds += EST_COMPILE_S * j.compiled + prefill_s(j.context, j.strategy) + j.new_tokens * step_s(j, j.slots)
        prefill += j.context
        steps += j.new_tokens
        if j.recompile_steps:
            seconds += prefill_s(j.slots // 2) + j.recompile_steps * step_s(j, j.slots)
            steps += j.recompile_steps
        if j.profile_steps:  # a second prefill, then the profiled steps (the profiler's own cost not counted)
            seconds += prefill_s(j.context, j.strategy) + j.profile_steps * step_s(j, j.slots)
            prefill += j.context
            steps += j.profile_steps
        if j.pair_blocks:  # the strategy's prefill of `slots` tokens, then as many steps on each cache
            seconds += prefill_s(min(j.slots, j.context), j.strategy) + 2 * j.new_tokens * step_s(j, j.slots)
            prefill += min(j.slots, j.context)
            steps += 2 * j.new_tokens
    return (f"{len(plan)} rows, {sum(j.compiled for j in plan)} compiles, {prefill} prefill tokens, {steps} decode "
            f"steps: about {seconds / 60:.0f} min on 2 idle cores (--dry_run's model of this machine)")


