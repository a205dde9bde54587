"""Running an experiment: its arms through the eval harness, the numbers on the same items, the verdict.

Each arm is one `python -m eval` run (eval/cli.py's plan / current_state / execute, in this process, so the
model loads once), written under --runs_dir: runs are content-addressed (eval/results.py), so a finished
run with today's inputs is reused, by this experiment or another one that shares the arm.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from errors import UserError
from eval import cli, results
from eval.compare import item_key, required_items
from eval.reproduce import matching
from eval.reproduce.experiments import Arm, Comparison, Experiment
from eval.uncertainty import Interval, bootstrap_mean, paired_difference

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
VERDICT_RULE = ("PASS if the 95% paired-bootstrap interval of the difference (treatment − control, over the same "
                "items) lies entirely on the claimed side of 0; FAIL if it lies entirely on the other side; "
                "INCONCLUSIVE otherwise (it contains 0, touches it, or there is a single item). With several "
                "comparisons the claim needs them all: PASS if every one passes, FAIL if any fails, else "
                "INCONCLUSIVE.")
# The budget a matched arm validates with before the arm it is matched to has run (any valid fraction).
_PLACEHOLDER_BUDGET = 0.5


def verdict(difference: Interval, higher_is_better: bool) -> str:
    """The verdict for one comparison from the interval of treatment − control (see VERDICT_RULE)."""
    low, high = difference.low, difference.high
    if difference.n < 2 or math.isnan(low) or math.isnan(high):
        return INCONCLUSIVE
    # Flip a lower-is-better metric so that the claimed side is always > 0.
    if not higher_is_better:
        low, high = -high, -low
    if low > 0:
        return PASS
    if high < 0:
        return FAIL
    return INCONCLUSIVE


def combine(verdicts: list[str]) -> str:
    """One claim tested by several comparisons holds only if it holds in each."""
    if not verdicts:
        raise ValueError("no comparisons")
    if any(v == FAIL for v in verdicts):
        return FAIL
    return PASS if all(v == PASS for v in verdicts) else INCONCLUSIVE


@dataclass
class ArmResult:
    arm: Arm
    argv: list[str]
    run_dir: Path
    metrics: dict  # the run's metrics.json
    values: dict[str, float]  # item key -> the experiment's metric, in items.jsonl order
    estimate: Interval  # the metric's mean over items with its bootstrap interval
    reused: bool  # finished before this invocation (content-addressed), not computed now
    budget: int | None = None  # a matched arm's budget in tokens, from the other arm's measured compression
    match: str = ""  # how that budget meets the matching rule (matching.describe_match)
    # Where arms are matched: the compression the rule compared (mean over the scored steps, or its stand-in).
    scored_compression: float | None = None


@dataclass
class ComparisonResult:
    comparison: Comparison
    difference: Interval  # treatment − control over the same items
    verdict: str


@dataclass
class Outcome:
    experiment: Experiment
    profile: str
    arms: list[ArmResult]
    comparisons: list[ComparisonResult]
    verdict: str
    wall_seconds: float  # this invocation, reused runs included as nothing
    command: str  # the command that reruns it
    overrides: tuple[str, ...] = ()  # eval flags given to every arm in place of the profile's (--limit N, ...)

    @property
    def compute_seconds(self) -> float:
        """What the arms' runs took when computed (reused ones too): the experiment's cost from scratch."""
        return sum(float(a.metrics.get("seconds") or 0.0) for a in self.arms)

    def result(self, label: str) -> ArmResult:
        return next(a for a in self.arms if a.arm.label == label)


# ---- arms as eval command lines ---------------------------------------------------------------------------


def arm_argv(experiment: Experiment, arm: Arm, profile: str, runs_dir: Path, overrides: list[str],
             budget: int | None = None) -> list[str]:
    """The `python -m eval` flags of one arm; argparse keeps the last value, so overrides come last."""
    flags = arm.flags if arm.reference else (*experiment.common, *arm.flags)
    if arm.match_compression_of is not None:
        flags = (*flags, "--max_cache_length", f"{_PLACEHOLDER_BUDGET if budget is None else budget:g}")
    replaced = {word for word in overrides if word.startswith("--")}
    return ["--tasks", experiment.task, "--out_dir", str(runs_dir), "--no-baseline",
            *without(experiment.profiles[profile], replaced), *flags, *overrides]


def without(flags: tuple[str, ...], names: set[str]) -> list[str]:
    """`flags` without the single-valued flags in `names` and their values (an override replaces them)."""
    out, skip = [], False
    for word in flags:
        if skip:
            skip = False
        elif word in names:
            skip = True
        else:
            out.append(word)
    return out


def ordered_arms(experiment: Experiment) -> list[Arm]:
    """Arms in run order: an arm matched to another's compression after that one."""
    first = [a for a in experiment.arms if a.match_compression_of is None]
    return first + [a for a in experiment.arms if a.match_compression_of is not None]


def checkpoint_override(overrides: list[str]) -> str | None:
    """The --checkpoint_path that `overrides` give every arm, or None (the bundled model)."""
    return overrides[overrides.index("--checkpoint_path") + 1] if "--checkpoint_path" in overrides else None


def check_experiment(experiment: Experiment, profile: str, runs_dir: Path, overrides: list[str]) -> None:
    """Every arm's flags through eval's own parser (and task checks), before anything runs or loads."""
    if profile not in experiment.profiles:
        raise UserError(f"{experiment.name} has no profile {profile!r}; profiles: {', '.join(experiment.profiles)}")
    if experiment.source is not None:
        experiment.source(checkpoint_override(overrides))
    labels = [a.label for a in experiment.arms]
    for c in experiment.comparisons:
        for label in (c.treatment, c.control):
            if label not in labels or experiment.arm(label).reference:
                raise UserError(f"{experiment.name}: comparison arm {label!r} is not a compared arm")
    compared = [a.label for a in experiment.arms if not a.reference]
    for dest, arms in experiment.unread.items():
        if dest not in matching.flag_dests(experiment.common) or not set(arms) <= set(compared):
            raise UserError(f"{experiment.name}: unread {dest!r} names no flag of every compared arm or an unknown arm")
    for arm in experiment.arms:
        if arm.match_compression_of not in (None, *labels):
            raise UserError(f"{experiment.name}: {arm.label} is matched to unknown arm {arm.match_compression_of!r}")
        try:
            args = cli.parse_args(arm_argv(experiment, arm, profile, runs_dir, overrides))
            if arm.match_compression_of is not None:
                matching.check_matched_arm(args, arm.label)
            if not arm.reference:
                matching.check_common_flags(experiment.common, experiment.unread, arm.label, args)
        except UserError as e:
            raise UserError(f"{experiment.name}, arm {arm.label}: {e}") from None


def eval_command(argv: list[str]) -> str:
    return "python -m eval " + " ".join(argv)


# ---- running ----------------------------------------------------------------------------------------------


def run_arm(argv: list[str]) -> tuple[Path, dict, bool]:
    """(run directory, metrics.json, reused): the eval run of `argv`, computed unless finished and current."""
    args = cli.parse_args(argv)
    ((task, config, path),) = cli.plan(args)
    metrics, state = cli.current_state(task, config, path)
    if metrics is not None:
        print(f"{state}: {path}", file=sys.stderr)
        return path, metrics, True
    print(f"{state}: {eval_command(argv)}", file=sys.stderr)
    return path, cli.execute(task, config, path), False


def item_values(run_dir: Path, metric: str) -> dict[str, float]:
    """The metric of every item of a run, keyed by the item's content (its token ids), in run order."""
    values: dict[str, float] = {}
    for item in sorted(required_items(run_dir), key=lambda it: it["index"]):
        value = item.get("metrics", {}).get(metric)
        if value is None:
            raise UserError(f"{run_dir}: item {item['index']} has no {metric}")
        values[item_key(item)] = float(value)
    return values


# Per item, the mean compression over the scored steps, when the task records it; else the final ratio.
STEPS_MEAN = "compression_ratio_scored_mean"


def matched_budget(source: ArmResult, argv: list[str]) -> tuple[int, str, float, float]:
    """(tokens, how it meets the rule, the source's compression, the budget's): the budget at which the
    fixed-budget arm of `argv` has, over the scored steps, the mean compression `source` measured
    (matching.MATCHING_RULE). Until eval records compression per step (STEPS_MEAN), the source's final ratio
    (mean over items) stands in for its mean over the steps."""
    ratio = source.metrics.get(STEPS_MEAN, source.metrics.get("compression_ratio"))
    if not isinstance(ratio, int | float):
        raise UserError(f"{source.run_dir} has no measured compression_ratio to match")
    seen = matching.scored_seen(cli.parse_args(argv))
    tokens = matching.matched_tokens(float(ratio), seen)
    what = "mean over the scored steps" if STEPS_MEAN in source.metrics else "final, standing in for its mean"
    text = matching.describe_match(tokens, seen, float(ratio), f"{source.arm.label}'s ({what})")
    return tokens, text, float(ratio), matching.fixed_budget_compression(tokens, seen)


def compare(experiment: Experiment, treatment: ArmResult, control: ArmResult, comparison: Comparison) -> \
        ComparisonResult:
    """The paired difference over the items both arms scored; they must be the same items."""
    if set(treatment.values) != set(control.values):
        raise UserError(f"{experiment.name}: arms {treatment.arm.label!r} and {control.arm.label!r} scored different "
                        f"items ({len(treatment.values)} vs {len(control.values)}); their task options must match")
    keys = list(treatment.values)
    difference = paired_difference([treatment.values[k] for k in keys], [control.values[k] for k in keys])
    return ComparisonResult(comparison, difference, verdict(difference, experiment.higher_is_better))


def run_experiment(experiment: Experiment, profile: str, runs_dir: Path, overrides: list[str],
                   command: str) -> Outcome:
    start = time.perf_counter()
    check_experiment(experiment, profile, runs_dir, overrides)
    print(f"\n== {experiment.name}: {experiment.paper}\nclaim: {experiment.claim}", file=sys.stderr)
    if experiment.prepare is not None:
        sources = (experiment.source(checkpoint_override(overrides)),) if experiment.source else ()
        experiment.prepare(*sources)
    done: dict[str, ArmResult] = {}
    arms = ordered_arms(experiment)
    with tqdm(total=len(arms), desc=experiment.name, unit="arm") as bar:
        for arm in arms:
            budget, match, mean = None, "", None
            if arm.match_compression_of:
                source = done[arm.match_compression_of]
                placeholder = arm_argv(experiment, arm, profile, runs_dir, overrides)
                budget, match, compared, mean = matched_budget(source, placeholder)
                if STEPS_MEAN in source.metrics:  # else only its final compression is known
                    source.scored_compression = compared
            argv = arm_argv(experiment, arm, profile, runs_dir, overrides, budget)
            path, metrics, reused = run_arm(argv)
            values = item_values(path, experiment.metric)
            done[arm.label] = ArmResult(arm, argv, path, metrics, values, bootstrap_mean(list(values.values())),
                                        reused, budget, match, mean)
            bar.update()
    results.write_results_table(runs_dir)  # the runs can also be read with python -m eval.plot --out_dir
    comparisons = [compare(experiment, done[c.treatment], done[c.control], c) for c in experiment.comparisons]
    return Outcome(experiment, profile, [done[a.label] for a in experiment.arms], comparisons,
                   combine([c.verdict for c in comparisons]), time.perf_counter() - start, command, tuple(overrides))
