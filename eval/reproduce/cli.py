"""`python -m eval.reproduce`: run the papers' headline claims as experiments and say whether they hold here.

    python -m eval.reproduce --list
    OMP_NUM_THREADS=1 python -m eval.reproduce streamingllm              # results/reproduce/streamingllm/
    OMP_NUM_THREADS=1 python -m eval.reproduce all --profile quick       # every experiment + summary.md
    python -m eval.reproduce kivi --dry_run                              # the eval command of every arm
    python -m eval.reproduce --summarize --out_dir DIR                   # DIR/summary.md from DIR/*/result.json

Each experiment (eval/reproduce/experiments.py) runs its arms as `python -m eval` runs under --runs_dir
(content-addressed: finished runs are reused), prints the claim, each arm's score with its 95% bootstrap
interval and n, the paired difference on the same items with its interval, and the verdict, and writes
report.md, plot.png, arms.csv, items.csv and result.json into --out_dir (default results/reproduce/NAME;
with several experiments, one folder each under --out_dir, default results/reproduce, plus summary.md).
An existing report is replaced only with --overwrite.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from errors import CliParser, UserError, run_cli
from eval import results
from eval.reproduce import report
from eval.reproduce.experiments import EXPERIMENTS, PROFILES
from eval.reproduce.runner import Outcome, arm_argv, check_experiment, eval_command, run_experiment
from flag_types import count, explicit_dests, refuse_unused

DEFAULT_ROOT = Path("results/reproduce")
DEFAULT_RUNS = DEFAULT_ROOT / "runs"


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m eval.reproduce", description=__doc__, allow_abbrev=False)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"experiments, or all: {', '.join(EXPERIMENTS)}")
    parser.add_argument("--list", action="store_true", help="list the experiments and their claims")
    parser.add_argument("--profile", choices=PROFILES, default="quick",
                        help="quick: minutes each on a 2-core CPU; full: more and longer items")
    parser.add_argument("--out_dir", default=None,
                        help=f"where the report goes (default {DEFAULT_ROOT}/NAME; with several experiments the "
                             f"parent of their folders, default {DEFAULT_ROOT})")
    parser.add_argument("--runs_dir", default=str(DEFAULT_RUNS),
                        help="where the eval runs go (shared, so experiments reuse each other's finished runs)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing reports (runs are reused)")
    parser.add_argument("--dry_run", action="store_true", help="print each arm's eval command, run nothing")
    parser.add_argument("--summarize", action="store_true",
                        help="only rebuild summary.md / .csv under --out_dir from the experiments' result.json")
    parser.add_argument("--limit", type=count(), default=None, help="items per arm instead of the profile's")
    parser.add_argument("--batch_size", type=count(), default=None,
                        help="windows or items each arm decodes together (eval's --batch_size: records as at 1, "
                             "KL within 1e-6; not part of a run's identity, so finished runs are reused)")
    parser.add_argument("--checkpoint_path", default=None, help="another model (default: the bundled one)")
    return parser


def selected(names: list[str]) -> list[str]:
    if not names:
        raise UserError(f"name an experiment ({', '.join(EXPERIMENTS)}), all, or --list")
    chosen: list[str] = []
    for name in names:
        if name != "all" and name not in EXPERIMENTS:
            raise UserError(f"unknown experiment {name!r}; available: {', '.join(EXPERIMENTS)}, all")
        chosen += list(EXPERIMENTS) if name == "all" else [name]
    return list(dict.fromkeys(chosen))


def overrides(args: argparse.Namespace) -> list[str]:
    """Eval flags that replace the profile's for every arm."""
    out = ["--limit", str(args.limit)] if args.limit is not None else []
    out += ["--batch_size", str(args.batch_size)] if args.batch_size is not None else []
    return out + (["--checkpoint_path", args.checkpoint_path] if args.checkpoint_path else [])


def rerun_command(name: str, args: argparse.Namespace, out_dir: Path, default_out: Path) -> str:
    """The command that reruns one experiment into the same folder (finished runs are reused)."""
    words = ["python", "-m", "eval.reproduce", name, "--profile", args.profile]
    if out_dir != default_out:
        words += ["--out_dir", out_dir.as_posix()]
    if Path(args.runs_dir) != DEFAULT_RUNS:
        words += ["--runs_dir", args.runs_dir]
    words += overrides(args)  # eval.reproduce takes them under eval's names
    return "OMP_NUM_THREADS=1 " + shlex.join(words) + "   # add --overwrite to replace this report"


def list_experiments() -> None:
    for exp in EXPERIMENTS.values():
        arrow = "higher" if exp.higher_is_better else "lower"
        print(f"{exp.name:<13} {exp.paper}\n{'':<14}{exp.claim}\n{'':<14}{exp.task}: {exp.metric} ({arrow} is better); "
              f"arms: {', '.join(a.label for a in exp.arms)}")


# Flags each mode ignores: typed with it, they are refused rather than dropped without a word.
IGNORED_BY = {
    "list": (("profile", "out_dir", "runs_dir", "overwrite", "dry_run", "summarize", "limit", "batch_size",
              "checkpoint_path"),
             "--list only lists the experiments"),
    "summarize": (("profile", "runs_dir", "dry_run", "limit", "batch_size", "checkpoint_path"),
                  "--summarize only rebuilds the summary from the experiments' result.json under --out_dir"),
    "dry_run": (("out_dir", "overwrite"), "--dry_run prints the eval commands and writes nothing"),
}


def check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    typed = explicit_dests(parser, argv)
    mode = next((m for m in IGNORED_BY if getattr(args, m)), None)
    if mode is not None:
        refuse_unused(parser, typed, *IGNORED_BY[mode])


def main(argv: list[str] | None = None) -> list[Outcome]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list and args.names:
        raise UserError("--list takes no experiment names")
    check_modes(parser, args, argv)
    if args.list:
        list_experiments()
        return []
    if args.summarize:
        root = Path(args.out_dir) if args.out_dir else DEFAULT_ROOT
        found = report.read_results(root, selected(args.names) if args.names else list(EXPERIMENTS))
        for path in report.write_summary(found, root, args.overwrite):
            print(f"summary: {path}", file=sys.stderr)
        return []
    names = selected(args.names)
    extra = overrides(args)
    runs_dir = Path(args.runs_dir)
    several = len(names) > 1
    root = Path(args.out_dir) if args.out_dir else DEFAULT_ROOT
    folders = {n: root / n if several or not args.out_dir else root for n in names}
    for name in names:  # every arm's flags through eval's parser before anything runs
        check_experiment(EXPERIMENTS[name], args.profile, runs_dir, extra)
    if args.dry_run:
        for name in names:
            exp = EXPERIMENTS[name]
            print(f"# {name} ({args.profile}): {exp.paper}")
            for arm in exp.arms:
                note = f"   # budget: the tokens at which its mean compression over the scored steps is " \
                    f"{arm.match_compression_of}'s measured one" if arm.match_compression_of else ""
                print(eval_command(arm_argv(exp, arm, args.profile, runs_dir, extra)) + note)
        return []
    # Fail now, not after an hour of runs, when a report could not be written.
    for name in names:
        report.check_targets(folders[name], report.REPORT_FILES, args.overwrite)
    if several:
        report.check_targets(root, report.SUMMARY_FILES, args.overwrite)
    results.check_out_dir(runs_dir)
    outcomes = []
    for name in names:
        command = rerun_command(name, args, folders[name], DEFAULT_ROOT / name)
        outcome = run_experiment(EXPERIMENTS[name], args.profile, runs_dir, extra, command)
        written = report.write_report(outcome, folders[name], runs_dir, args.overwrite)
        print(report.console_text(outcome))
        print(f"report: {written[0]}", file=sys.stderr)
        outcomes.append(outcome)
    if several:
        found = [report.result_data(o, runs_dir) for o in outcomes]
        for path in report.write_summary(found, root, args.overwrite):
            print(f"summary: {path}", file=sys.stderr)
    return outcomes


if __name__ == "__main__":
    run_cli(main)
