"""What an experiment leaves behind: report.md (claim, setup, table, verdict, the command that reruns it),
plot.png (each arm's score and each paired difference with their 95% intervals), arms.csv, items.csv (the
per-item scores the intervals come from) and result.json; and, for several experiments, summary.md / .csv.

Every file is written atomically (atomic_files.py) and an existing one is replaced only with --overwrite;
the targets are checked before any experiment runs.
"""

from __future__ import annotations

import io
import json
import math
from datetime import date
from pathlib import Path

import pandas as pd

from atomic_files import atomic_write, check_writable
from errors import UserError
from eval.compare import format_interval
from eval.reproduce.matching import MATCHING_RULE
from eval.reproduce.runner import PASS, VERDICT_RULE, ArmResult, Outcome
from eval.uncertainty import Interval

REPORT_FILES = ("report.md", "plot.png", "arms.csv", "items.csv", "result.json")
SUMMARY_FILES = ("summary.md", "summary.csv")
# Below this many items the percentile bootstrap under-covers; the report says so.
FEW_ITEMS = 10


def check_targets(directory: Path, names: tuple[str, ...], overwrite: bool) -> None:
    for name in names:
        check_writable(directory / name, overwrite)


def run_interval(metrics: dict, name: str) -> Interval | None:
    """A run-level metric with the bootstrap interval eval stored beside it (None when it has none)."""
    value = metrics.get(name)
    if not isinstance(value, int | float):
        return None
    low, high = metrics.get(f"{name}_ci_low"), metrics.get(f"{name}_ci_high")
    n = int(metrics.get("n_items") or 1)
    if low is None or high is None:
        return Interval(float(value), math.nan, math.nan, 1)
    return Interval(float(value), float(low), float(high), n)


def direction(outcome: Outcome) -> str:
    return "higher is better" if outcome.experiment.higher_is_better else "lower is better"


def claimed_side(outcome: Outcome) -> str:
    return "> 0" if outcome.experiment.higher_is_better else "< 0"


def flags_text(flags: tuple[str, ...] | list[str]) -> str:
    return " ".join(flags)


def arm_flags(arm: ArmResult) -> str:
    flags = flags_text(arm.arm.flags)
    if arm.budget is not None:
        flags += f" --max_cache_length {arm.budget} ({arm.match})"
    return flags + (" (reference)" if arm.arm.reference else "")


# ---- one experiment -----------------------------------------------------------------------------------------


def arm_rows(outcome: Outcome, runs_dir: Path) -> list[dict]:
    exp = outcome.experiment
    rows = []
    for a in outcome.arms:
        row = {"experiment": exp.name, "arm": a.arm.label, "reference": a.arm.reference, "flags": arm_flags(a),
               "metric": exp.metric, "mean": a.estimate.estimate, "ci_low": a.estimate.to_dict()["low"],
               "ci_high": a.estimate.to_dict()["high"], "n": a.estimate.n}
        for name in ("compression_ratio", *exp.extra_metrics):
            iv = run_interval(a.metrics, name)
            row[name] = iv.estimate if iv else None
            bounds = iv.to_dict() if iv else {"low": None, "high": None}
            row[f"{name}_ci_low"], row[f"{name}_ci_high"] = bounds["low"], bounds["high"]
        row["scored_compression"] = a.scored_compression  # what a matched comparison equalised (else None)
        row.update({"seconds": a.metrics.get("seconds"), "reused": a.reused,
                    "run_dir": _relative(a.run_dir, runs_dir), "identity": a.metrics.get("identity")})
        rows.append(row)
    return rows


def item_rows(outcome: Outcome) -> list[dict]:
    return [{"arm": a.arm.label, "item": i, "item_key": key, outcome.experiment.metric: value}
            for a in outcome.arms for i, (key, value) in enumerate(a.values.items())]


def _relative(path: Path, base: Path) -> str:
    try:
        return path.relative_to(base).as_posix()
    except ValueError:
        return path.as_posix()


def common_text(outcome: Outcome) -> str:
    """The flags of every compared arm, and which arms do not read which of them."""
    exp = outcome.experiment
    text = f"flags of every compared arm: `{flags_text(exp.common) or '(none)'}`"
    by_arms: dict[tuple[str, ...], list[str]] = {}
    for dest, arms in exp.unread.items():
        by_arms.setdefault(arms, []).append(f"`--{dest}`")
    for arms, flags in by_arms.items():
        text += f"; not read by {', '.join(arms)}: {', '.join(flags)}"
    return text


def profile_text(outcome: Outcome) -> str:
    """The profile's task options, and the flags given in their place (a report's items are the latter's)."""
    text = f"profile `{outcome.profile}`: `{flags_text(outcome.experiment.profiles[outcome.profile])}`"
    if outcome.overrides:
        text += f"; given instead for every arm: `{flags_text(outcome.overrides)}`"
    return text


def markdown(outcome: Outcome, runs_dir: Path, plot_name: str = "plot.png") -> str:
    exp = outcome.experiment
    model = outcome.arms[0].metrics.get("model", "?")
    extras = list(exp.extra_metrics)
    header = ["arm", "flags", f"{exp.metric} [95% CI]", "n", "compression [95% CI]", *[f"{m} [95% CI]" for m in extras],
              "run s", "run"]
    lines = [f"# {exp.name}: {exp.paper}", "", f"**Claim.** {exp.claim}", "",
             f"**Verdict: {outcome.verdict}** ({exp.metric}, {direction(outcome)}; profile `{outcome.profile}`, "
             f"{date.today().isoformat()})", "", "## Setup", "",
             f"- model `{model}`, task `{exp.task}`, metric `{exp.metric}` per item ({direction(outcome)}); an item "
             "is " + ("a fidelity window (KL averaged over its teacher-forced positions)" if exp.task == "fidelity"
                      else "one generated example"),
             f"- {profile_text(outcome)}",
             f"- {common_text(outcome)}; the arms of a comparison differ "
             f"only in {', '.join(f'`--{v}`' for v in sorted(exp.varies))}",
             f"- wall time of this invocation: {outcome.wall_seconds:.0f} s "
             f"({sum(a.reused for a in outcome.arms)} of {len(outcome.arms)} runs reused, finished earlier); the runs "
             f"took {outcome.compute_seconds:.0f} s when computed",
             *[f"- {note}" for note in exp.notes], "", "## Arms", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for a in outcome.arms:
        cells = [a.arm.label, f"`{arm_flags(a)}`", format_interval(a.estimate), a.estimate.n,
                 format_interval(run_interval(a.metrics, "compression_ratio")),
                 *[format_interval(run_interval(a.metrics, m)) for m in extras],
                 f"{a.metrics.get('seconds', float('nan')):.0f}" + (" (reused)" if a.reused else ""),
                 f"`{_relative(a.run_dir, runs_dir)}`"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Each score is the mean over items with its 95% percentile-bootstrap interval (2000 resamples, "
              "seed 0); compression is measured from the caches (docs/DESIGN.md §6).", ""]
    if min(c.difference.n for c in outcome.comparisons) < FEW_ITEMS:
        lines += [f"With fewer than {FEW_ITEMS} items the percentile bootstrap tends to be narrower than the true "
                  "95% interval: read a verdict here as indicative, and the `full` profile as the test.", ""]
    lines += [
              "## Paired differences (treatment − control, same items)", "",
              f"| treatment | control | Δ {exp.metric} [95% CI] | pairs | claimed side | verdict |",
              "|---|---|---|---|---|---|"]
    for c in outcome.comparisons:
        name = f"{c.comparison.treatment}" + (f" ({c.comparison.note})" if c.comparison.note else "")
        lines.append(f"| {name} | {c.comparison.control} | {format_interval(c.difference, signed=True)} | "
                     f"{c.difference.n} | {claimed_side(outcome)} | **{c.verdict}** |")
    lines += ["", f"**Verdict rule.** {VERDICT_RULE}", ""]
    if any(a.arm.match_compression_of for a in outcome.arms):
        lines += [f"**Matching rule.** {MATCHING_RULE}", ""]
    lines += ["## Rerun", "", "```bash", outcome.command, "```", "",
              "Each arm as a plain eval run (same run directories, reused when finished"
              + ("; the files its flags name are written by `python -m eval.reproduce` before the arms run"
                 if exp.prepare is not None else "") + "):", "", "```bash",
              *[f"python -m eval {' '.join(a.argv)}" for a in outcome.arms], "```", "",
              f"![{exp.name}]({plot_name})", ""]
    return "\n".join(lines)


def plot_png(outcome: Outcome) -> bytes:
    """Left: each arm's score with its 95% interval. Right: each paired difference with its interval, the
    claimed side of 0 shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exp = outcome.experiment
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    for i, a in enumerate(outcome.arms):
        iv = a.estimate
        err = [[iv.estimate - iv.low], [iv.high - iv.estimate]] if iv.n > 1 else None
        left.errorbar([i], [iv.estimate], yerr=err, fmt="o", capsize=5,
                      color="grey" if a.arm.reference else f"C{i}")
    left.set_xticks(range(len(outcome.arms)), [a.arm.label for a in outcome.arms], fontsize=8, rotation=15)
    means = [a.estimate.estimate for a in outcome.arms]
    if min(means) > 0 and max(means) / min(means) > 20:  # e.g. 4- and 2-bit KL: decades apart
        left.set_yscale("log")
    left.set_ylabel(f"{exp.metric} (mean, 95% CI)")
    left.set_title(f"{exp.metric} per arm ({direction(outcome)})", fontsize=9)
    left.grid(alpha=0.3)
    labels = []
    for j, c in enumerate(outcome.comparisons):
        d = c.difference
        err = [[d.estimate - d.low], [d.high - d.estimate]] if d.n > 1 else None
        right.errorbar([d.estimate], [j], xerr=err, fmt="s", capsize=5, color="green" if c.verdict == PASS else
                       "red" if c.verdict == "FAIL" else "black")
        labels.append(f"{c.comparison.treatment}\n− {c.comparison.control}\n{c.verdict}")
    right.axvline(0.0, color="black", lw=1)
    lo, hi = right.get_xlim()
    span = max(abs(lo), abs(hi))
    right.set_xlim(-span, span)
    if exp.higher_is_better:
        right.axvspan(0, span, alpha=0.08, color="green")
    else:
        right.axvspan(-span, 0, alpha=0.08, color="green")
    right.set_yticks(range(len(labels)), labels, fontsize=7)
    right.set_ylim(-0.6, len(labels) - 0.4)
    right.set_xlabel(f"Δ {exp.metric}, paired (95% CI); shaded: claimed side")
    right.grid(alpha=0.3)
    fig.suptitle(f"{exp.name}: {exp.paper} — {outcome.verdict} (profile {outcome.profile})", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def result_data(outcome: Outcome, runs_dir: Path) -> dict:
    exp = outcome.experiment
    return {"experiment": exp.name, "paper": exp.paper, "claim": exp.claim, "task": exp.task,
            "metric": exp.metric, "higher_is_better": exp.higher_is_better, "profile": outcome.profile,
            "profile_flags": list(exp.profiles[outcome.profile]), "model": outcome.arms[0].metrics.get("model"),
            "date": date.today().isoformat(), "verdict": outcome.verdict, "verdict_rule": VERDICT_RULE,
            "wall_seconds": outcome.wall_seconds, "compute_seconds": outcome.compute_seconds,
            "command": outcome.command, "arms": arm_rows(outcome, runs_dir),
            "matching_rule": MATCHING_RULE if any(a.arm.match_compression_of for a in outcome.arms) else None,
            "comparisons": [{"treatment": c.comparison.treatment, "control": c.comparison.control,
                             "note": c.comparison.note, "difference": c.difference.to_dict(),
                             "verdict": c.verdict} for c in outcome.comparisons]}


def csv_text(rows: list[dict]) -> str:
    return pd.DataFrame(rows).to_csv(index=False)


def write_report(outcome: Outcome, out_dir: Path, runs_dir: Path, overwrite: bool) -> list[Path]:
    files = {"report.md": markdown(outcome, runs_dir), "plot.png": plot_png(outcome),
             "arms.csv": csv_text(arm_rows(outcome, runs_dir)), "items.csv": csv_text(item_rows(outcome)),
             "result.json": json.dumps(result_data(outcome, runs_dir), indent=2, default=str) + "\n"}
    return [atomic_write(out_dir / name, data, overwrite) for name, data in files.items()]


def console_text(outcome: Outcome) -> str:
    """What the runner prints: the claim, each arm's numbers, each paired difference, the verdict."""
    exp = outcome.experiment
    lines = [f"{exp.name}: {exp.paper}", f"claim: {exp.claim}", f"metric: {exp.metric} ({direction(outcome)})"]
    for a in outcome.arms:
        compression = format_interval(run_interval(a.metrics, "compression_ratio"))
        lines.append(f"  {a.arm.label:<18} {exp.metric} = {format_interval(a.estimate)} (n={a.estimate.n})  "
                     f"compression = {compression}")
    for c in outcome.comparisons:
        lines.append(f"  {c.comparison.treatment} − {c.comparison.control}: "
                     f"{format_interval(c.difference, signed=True)} (n={c.difference.n}, "
                     f"claimed {claimed_side(outcome)}) -> {c.verdict}")
    lines.append(f"verdict: {outcome.verdict} (wall {outcome.wall_seconds:.0f} s, "
                 f"runs {outcome.compute_seconds:.0f} s)")
    return "\n".join(lines)


# ---- several experiments ----------------------------------------------------------------------------------


def _interval(mean: float | None, low: float | None, high: float | None, n: int) -> Interval:
    def num(v: float | None) -> float:
        return math.nan if v is None else float(v)

    return Interval(num(mean), num(low), num(high), int(n))


def summary_rows(results: list[dict]) -> list[dict]:
    """One row per comparison, from the experiments' result.json contents (so a summary can be rebuilt from
    the reports alone, whenever each was run)."""
    rows = []
    for r in results:
        arms = {a["arm"]: a for a in r["arms"]}
        for c in r["comparisons"]:
            t, k, d = arms[c["treatment"]], arms[c["control"]], c["difference"]
            rows.append({
                "experiment": r["experiment"], "paper": r["paper"], "claim": r["claim"], "metric": r["metric"],
                "higher_is_better": r["higher_is_better"], "treatment": c["treatment"], "control": c["control"],
                "treatment_value": format_interval(_interval(t["mean"], t["ci_low"], t["ci_high"], t["n"])),
                "control_value": format_interval(_interval(k["mean"], k["ci_low"], k["ci_high"], k["n"])),
                "difference": format_interval(_interval(d["estimate"], d["low"], d["high"], d["n"]), signed=True),
                "n": d["n"], "compression": f"{_ratio(t)} / {_ratio(k)}", "comparison_verdict": c["verdict"],
                "verdict": r["verdict"], "profile": r["profile"],
                "model": r.get("model") or t["run_dir"].split("/")[0],
                "wall_seconds": round(r["wall_seconds"]), "compute_seconds": round(r["compute_seconds"]),
                "date": r["date"]})
    return rows


def _ratio(arm: dict) -> str:
    """The measured compression; where arms were matched, the mean over the scored steps the rule equalised."""
    scored, value = arm.get("scored_compression"), arm.get("compression_ratio")
    if isinstance(scored, int | float):
        return f"{scored:.3f} over the scored steps (final {value:.3f})" if isinstance(value, int | float) \
            else f"{scored:.3f} over the scored steps"
    return f"{value:.3f}" if isinstance(value, int | float) else "?"


def summary_markdown(results: list[dict]) -> str:
    rows = summary_rows(results)
    dates = ", ".join(sorted({r["date"] for r in rows}))
    profiles = ", ".join(sorted({r["profile"] for r in rows}))
    models = ", ".join(sorted({str(r["model"]) for r in rows}))
    lines = ["# Reproducing the papers' claims: summary", "",
             f"{dates}, profile `{profiles}`, model `{models}`. Values: mean over items [95% bootstrap CI]; Δ: "
             "treatment − control on the same items (paired bootstrap) with n pairs; compression: measured, "
             "treatment / control; wall s: the experiment's invocation (runs it shared with an experiment run "
             "before it in the same invocation were reused), run s: what its runs took when computed.", "",
             f"Verdict rule: {VERDICT_RULE}", "",
             "| experiment | claim | metric | treatment | control | Δ [95% CI] (n) | compression | verdict | wall s "
             "| run s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        arrow = "↑" if r["higher_is_better"] else "↓"
        verdict = r["comparison_verdict"] if r["comparison_verdict"] == r["verdict"] else \
            f"{r['comparison_verdict']} (claim: {r['verdict']})"
        lines.append(f"| [{r['experiment']}]({r['experiment']}/report.md) | {r['paper']}: {r['claim']} | "
                     f"{r['metric']} {arrow} | {r['treatment']}: {r['treatment_value']} | "
                     f"{r['control']}: {r['control_value']} | {r['difference']} ({r['n']}) | {r['compression']} | "
                     f"**{verdict}** | {r['wall_seconds']} | {r['compute_seconds']} |")
    return "\n".join(lines) + "\n"


def read_results(root: Path, names: list[str]) -> list[dict]:
    """The result.json of each named experiment found under `root` (registry order); others are skipped."""
    found = []
    for name in names:
        path = root / name / "result.json"
        if path.is_file():
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError) as e:
                raise UserError(f"cannot read {path}: {e}") from None
    if not found:
        raise UserError(f"no experiment reports (NAME/result.json) under {root}")
    return found


def write_summary(results: list[dict], out_dir: Path, overwrite: bool) -> list[Path]:
    return [atomic_write(out_dir / "summary.md", summary_markdown(results), overwrite),
            atomic_write(out_dir / "summary.csv", csv_text(summary_rows(results)), overwrite)]
