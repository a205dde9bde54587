"""`python -m eval.reproduce`: the verdict rule, the experiments' arms as eval flags, bad input, and one run
end to end on the tiny random model."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from errors import UserError
from eval import cli as eval_cli
from eval.reproduce import cli, duo_controls, runner
from eval.reproduce.experiments import EXPERIMENTS, PROFILES, Arm, Comparison, Experiment, register
from eval.reproduce.report import common_text
from eval.reproduce.runner import FAIL, INCONCLUSIVE, PASS, combine, verdict
from eval.tasks import TASKS
from eval.uncertainty import Interval, paired_difference
from strategies import CACHE_STRATEGIES, get_strategy
from strategies.duo_attention import SHIPPED, retrieval_heads
from tests.conftest import ROOT

RUNS = Path("/nonexistent-runs")  # parsing never writes; a path that cannot exist shows it


# ---- the verdict rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("interval, higher, expected", [
    (Interval(0.2, 0.05, 0.35, 40), True, PASS),  # entirely above 0, claimed above
    (Interval(0.2, 0.05, 0.35, 40), False, FAIL),  # the same interval when lower was claimed
    (Interval(-0.3, -0.5, -0.1, 8), False, PASS),  # KL went down, as claimed
    (Interval(-0.3, -0.5, -0.1, 8), True, FAIL),
    (Interval(0.1, -0.02, 0.2, 40), True, INCONCLUSIVE),  # straddles 0
    (Interval(0.1, 0.0, 0.2, 40), True, INCONCLUSIVE),  # touches 0: not entirely on one side
    (Interval(0.0, 0.0, 0.0, 40), False, INCONCLUSIVE),  # no difference at all
    (Interval(0.5, math.nan, math.nan, 1), True, INCONCLUSIVE),  # one item: no interval
])
def test_verdict_from_interval(interval: Interval, higher: bool, expected: str) -> None:
    assert verdict(interval, higher) == expected


def test_verdict_on_two_items_is_their_sign() -> None:
    """With two items the bootstrap means are d1, (d1+d2)/2, d2 with probability 1/4, 1/2, 1/4, so the 2.5% and
    97.5% percentiles are exactly min(d) and max(d): the verdict is PASS iff both differences have the claimed
    sign."""
    both = paired_difference([0.5, 0.9], [0.4, 0.6])  # differences 0.1 and 0.3
    assert (both.low, both.high) == pytest.approx((0.1, 0.3))
    assert verdict(both, higher_is_better=True) == PASS
    mixed = paired_difference([0.3, 0.9], [0.4, 0.6])  # -0.1 and +0.3
    assert (mixed.low, mixed.high) == pytest.approx((-0.1, 0.3))
    assert verdict(mixed, higher_is_better=True) == INCONCLUSIVE
    assert verdict(paired_difference([0.1, 0.2], [0.4, 0.6]), higher_is_better=True) == FAIL


def test_verdict_on_twenty_items_by_the_binomial() -> None:
    """19 items improve by 1, one worsens by 1. A resample with k copies of the bad item has mean 1 − 2k/20,
    k ~ Binomial(20, 1/20): P(k ≥ 4) = 0.016 < 0.025 < P(k ≥ 3) = 0.075, so the lower bound is about
    1 − 6/20 = 0.7 (0.6 to 0.7 with the resampling noise), well above 0: PASS."""
    d = paired_difference([1.0] * 19 + [0.0], [0.0] * 19 + [1.0])
    assert d.estimate == pytest.approx(0.9)
    assert 0.6 - 1e-9 <= d.low <= 0.7 + 1e-9
    assert verdict(d, higher_is_better=True) == PASS
    assert verdict(d, higher_is_better=False) == FAIL


@pytest.mark.parametrize("verdicts, expected", [
    ([PASS], PASS), ([PASS, PASS], PASS), ([PASS, INCONCLUSIVE], INCONCLUSIVE), ([PASS, FAIL], FAIL),
    ([INCONCLUSIVE, FAIL], FAIL), ([INCONCLUSIVE], INCONCLUSIVE),
])
def test_a_claim_with_several_comparisons_needs_them_all(verdicts: list[str], expected: str) -> None:
    assert combine(verdicts) == expected


# ---- the experiments' arms --------------------------------------------------------------------------------


def test_the_papers_claims_are_registered() -> None:
    assert {"streamingllm", "h2o", "snapkv", "pyramidkv", "fastgen", "kivi", "duoattention",
            "duoattention_needle"} <= set(EXPERIMENTS)
    for exp in EXPERIMENTS.values():
        # Where to read it: an arXiv id, or a venue and year for a paper that has none.
        assert re.search(r"arXiv \d{4}\.\d{4,5}|(ICML|ICLR|NeurIPS|ACL|MLSys) \d{4}", exp.paper), exp.paper
        assert exp.claim.endswith(".")
        assert exp.task in TASKS and set(exp.profiles) == set(PROFILES)
        # The declared direction is the task's own.
        assert exp.higher_is_better == (exp.metric not in TASKS[exp.task].lower_is_better), exp.name


def parsed(exp, arm, profile: str) -> dict:
    return vars(eval_cli.parse_args(runner.arm_argv(exp, arm, profile, RUNS, [])))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_arms_parse_and_differ_only_in_what_the_claim_is_about(name: str, profile: str) -> None:
    exp = EXPERIMENTS[name]
    runner.check_experiment(exp, profile, RUNS, [])
    args = {arm.label: parsed(exp, arm, profile) for arm in exp.arms}
    for a in args.values():
        assert a["tasks"] == [exp.task] and a["baseline"] is False and a["out_dir"] == str(RUNS)
    for c in exp.comparisons:
        t, k = args[c.treatment], args[c.control]
        differ = {key for key in t if t[key] != k[key]}
        assert differ, f"{name}: {c.treatment} and {c.control} are the same configuration"
        assert differ <= exp.varies, f"{name}: {c.treatment} vs {c.control} also differ in {differ - exp.varies}"
        if "max_cache_length" in differ:  # only at a budget matched to the treatment's measured compression
            assert exp.arm(c.control).match_compression_of == c.treatment
        else:
            assert t["max_cache_length"] == k["max_cache_length"]
        assert t["cache_bits"] == k["cache_bits"]
        # The same items: every task option is equal (query_aware aside, which keeps the same tokens).
        task_options = set(TASKS[exp.task].reads) - {"query_aware"}
        assert {o: t[o] for o in task_options} == {o: k[o] for o in task_options}


def test_pyramid_and_uniform_hold_the_same_total() -> None:
    from cache_spec import resolve_cache_spec

    exp = EXPERIMENTS["pyramidkv"]
    totals = {}
    for label in ("pyramid", "uniform"):
        args = eval_cli.parse_args(runner.arm_argv(exp, exp.arm(label), "quick", RUNS, []))
        budgets = [s.max_cache_length for s in resolve_cache_spec(args, 30, 500, 16)]
        totals[label] = sum(budgets)
        if label == "pyramid":
            assert budgets[0] > budgets[-1] and budgets == sorted(budgets, reverse=True)
        else:
            assert len(set(budgets)) == 1
    assert totals["pyramid"] == totals["uniform"] == 30 * round(0.5 * (500 + 16))


def held_by_fixed_budget(tokens: int, steps: range) -> list[int]:
    """A fixed-budget cache, step by step: it fills its slots, then evicts one token per new one."""
    held, out = 0, []
    for _ in range(steps.stop):
        held = min(held + 1, tokens)
        out.append(held)
    return [out[t - 1] for t in steps]


def test_the_matched_budget_equals_the_mean_compression_over_the_scored_steps() -> None:
    """FastGen's quick profile: windows of 224 tokens, a 128-token prompt, positions 128..223 scored, each
    predicted from the tokens before it. 1 − a final compression of 0.18 (186 slots) evicts nothing for the
    first 59 steps (t ≤ 186; mean compression 0.035); the fair budget has FastGen's 0.18 as its mean."""
    exp = EXPERIMENTS["fastgen"]
    steps = range(128, 224)
    mean = {n: sum(1 - h / t for h, t in zip(held_by_fixed_budget(n, steps), steps, strict=True)) / len(steps)
            for n in range(2, 225)}
    assert sum(h == t for h, t in zip(held_by_fixed_budget(186, steps), steps, strict=True)) == 59
    assert mean[186] == pytest.approx(0.035, abs=5e-4)
    source = runner.ArmResult(exp.arm("fastgen"), [], Path("."), {"compression_ratio": 0.18}, {},
                              Interval(0, 0, 0, 2), True)
    placeholder = runner.arm_argv(exp, exp.arm("heavy hitters"), "quick", RUNS, [])
    tokens, text, compared, fixed = runner.matched_budget(source, placeholder)
    assert tokens == min(mean, key=lambda n: abs(mean[n] - 0.18)) == 142
    assert (compared, fixed) == (0.18, pytest.approx(mean[142]))
    assert "mean compression 0.178 over the 96 scored steps" in text and "final, standing in" in text
    # Once eval records the mean over the scored steps, it is matched instead of the final ratio.
    stepped = runner.ArmResult(exp.arm("fastgen"), [], Path("."),
                               {"compression_ratio": 0.18, runner.STEPS_MEAN: 0.341}, {}, Interval(0, 0, 0, 2), True)
    assert runner.matched_budget(stepped, placeholder)[0] == min(mean, key=lambda n: abs(mean[n] - 0.341)) == 113
    argv = runner.arm_argv(exp, exp.arm("heavy hitters"), "quick", RUNS, [], tokens)
    assert eval_cli.parse_args(argv).max_cache_length == [142]
    # The rule follows the profile: the full profile scores positions 256..1023.
    full = runner.arm_argv(exp, exp.arm("heavy hitters"), "full", RUNS, [])
    tokens = runner.matched_budget(source, full)[0]
    steps = range(256, 1024)
    held = held_by_fixed_budget(tokens, steps)
    assert sum(1 - h / t for h, t in zip(held, steps, strict=True)) / len(steps) == pytest.approx(0.18, abs=2e-3)


def test_duo_controls_change_only_which_heads_retrieve(tmp_path: Path) -> None:
    """The inverse file makes the shipped calibration's least lossy half of the heads the retrieval heads, the
    random file a seeded half; both keep the calibration's shape, so the strategy takes them for the model."""
    shipped = json.loads(SHIPPED.read_text())
    flat = [s for layer in shipped["scores"] for s in layer]
    half = round(0.5 * len(flat))
    ranked = sorted(range(len(flat)), key=lambda i: -flat[i])  # written from the definition, not the strategy
    assert flat[ranked[half - 1]] != flat[ranked[half]]  # no tie at the boundary: the halves are well defined
    calibrated, least_lossy = set(ranked[:half]), set(ranked[half:])
    paths = duo_controls.write_control_files(SHIPPED, tmp_path)
    assert [p.name for p in paths] == [duo_controls.CALIBRATED_PATH.name, duo_controls.INVERSE_PATH.name,
                                       duo_controls.RANDOM_PATH.name]
    assert json.loads(paths[0].read_text()) == shipped  # the treatment's file: the calibration itself
    paths = paths[1:]

    def retrieval(path: Path) -> set[int]:
        data = json.loads(path.read_text())
        assert {k: v for k, v in data.items() if k not in ("scores", "measure")} == \
            {k: v for k, v in shipped.items() if k not in ("scores", "measure")}
        roles = retrieval_heads(data["scores"], 0.5)
        assert [len(layer) for layer in roles] == [len(layer) for layer in shipped["scores"]]
        return {i for i, r in enumerate(r for layer in roles for r in layer) if r}

    assert retrieval(paths[0]) == least_lossy
    random_roles = retrieval(paths[1])
    assert len(random_roles) == half and random_roles not in (calibrated, least_lossy)
    first = paths[1].read_bytes()
    duo_controls.write_control_files(SHIPPED, tmp_path)
    assert paths[1].read_bytes() == first  # seeded: the same control every run
    exp = EXPERIMENTS["duoattention"]
    for label, path in (("duo", duo_controls.CALIBRATED_PATH), ("inverse ranking", duo_controls.INVERSE_PATH),
                        ("random heads", duo_controls.RANDOM_PATH)):
        args = eval_cli.parse_args(runner.arm_argv(exp, exp.arm(label), "quick", RUNS, []))
        assert args.duo_heads_path == str(path)


@pytest.mark.parametrize("name", ["duoattention", "duoattention_needle"])
def test_duoattention_refuses_a_model_without_a_calibration_before_anything_runs(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()  # a Hugging Face directory: calibrate_duo.py's default output is duo/model.json
    monkeypatch.setattr(duo_controls, "DUO_DIR", tmp_path / "duo")
    with pytest.raises(UserError, match="no DuoAttention calibration for .*calibrate_duo.py --checkpoint_path"):
        cli.main([name, "--checkpoint_path", str(checkpoint), "--runs_dir", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()


def test_duoattention_derives_its_arms_from_the_checkpoints_own_calibration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another model's calibration (calibrate_duo.py's default output name) is the one the three head files come
    from, so no arm falls back to the shipped file, which fits the bundled model only."""
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    monkeypatch.setattr(duo_controls, "DUO_DIR", tmp_path / "duo")
    (tmp_path / "duo").mkdir()
    own = {**json.loads(SHIPPED.read_text()), "n_layer": 2, "n_kv_head": 1, "scores": [[0.3], [0.1]]}
    (tmp_path / "duo" / "model.json").write_text(json.dumps(own))
    assert duo_controls.calibration_for(str(checkpoint)) == tmp_path / "duo" / "model.json"
    assert duo_controls.calibration_for(None) == SHIPPED
    paths = duo_controls.write_control_files(duo_controls.calibration_for(str(checkpoint)), tmp_path / "controls")
    assert [json.loads(p.read_text())["scores"] for p in paths[:2]] == [[[0.3], [0.1]], [[-0.3], [-0.1]]]


def test_a_dry_run_prepares_nothing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def refuse(*sources: Path) -> None:
        raise AssertionError("prepare ran on a dry run")

    monkeypatch.setitem(EXPERIMENTS, "duoattention", dataclasses.replace(EXPERIMENTS["duoattention"], prepare=refuse))
    cli.main(["duoattention", "--dry_run", "--runs_dir", str(RUNS)])
    assert "--duo_heads_path" in capsys.readouterr().out


def test_a_matched_arm_needs_a_task_whose_scored_steps_are_known() -> None:
    exp = Experiment(name="x", paper="P (A, arXiv 1)", claim="c.", task="niah_single", metric="string_match",
                     higher_is_better=True,
                     arms=(Arm("a", ("--cache_strategy", "hybrid")),
                           Arm("b", ("--cache_strategy", "heavy_hitter"), match_compression_of="a")),
                     comparisons=(Comparison("a", "b"),), varies=frozenset({"cache_strategy", "max_cache_length"}),
                     profiles=dict.fromkeys(PROFILES, ("--limit", "2")))
    with pytest.raises(UserError, match="arm b: a matched budget needs the fidelity task"):
        runner.check_experiment(exp, "quick", RUNS, [])


def test_notes_written_as_one_string_are_refused() -> None:
    with pytest.raises(TypeError, match="notes must be a tuple"):
        register(dataclasses.replace(EXPERIMENTS["h2o"], name="x", notes="one sentence"))
    assert "x" not in EXPERIMENTS


def test_an_undeclared_inert_flag_is_refused() -> None:
    exp = dataclasses.replace(EXPERIMENTS["h2o"], unread={})
    with pytest.raises(UserError, match=r"arm recent window: its strategies do not read \['recent_window'\]"):
        runner.check_experiment(exp, "quick", RUNS, [])
    wrong = dataclasses.replace(EXPERIMENTS["h2o"], unread={"recent_window": ("heavy hitters",)})
    with pytest.raises(UserError, match="arm heavy hitters: its strategies do not read \\[\\]"):
        runner.check_experiment(wrong, "quick", RUNS, [])


def option_dests(words: tuple[str, ...]) -> set[str]:
    """The argparse dests eval's own parser gives the options in `words`."""
    actions = {o: a.dest for a in eval_cli.build_parser()._actions for o in a.option_strings}
    return {actions[w] for w in words if w.startswith("--")}


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_flags_of_every_compared_arm_reach_it_or_the_experiment_says_which_do_not(name: str) -> None:
    """A strategy reads only the hyper-parameters it declares (cache_spec hands it no others): a flag of
    `common` that is some strategy's hyper-parameter and not one of an arm's strategies' is inert there, and
    the experiment must declare it in `unread`, exactly."""
    exp = EXPERIMENTS[name]
    hyper = {h for cls in CACHE_STRATEGIES.values() for h in cls.hyperparameters}
    common = option_dests(exp.common) & hyper
    for arm in exp.arms:
        if arm.reference:
            continue
        args = eval_cli.parse_args(runner.arm_argv(exp, arm, "quick", RUNS, []))
        read = {h for s in args.cache_strategy for h in get_strategy(s).hyperparameters}
        declared = {dest for dest, arms in exp.unread.items() if arm.label in arms}
        assert common - read == declared, f"{name}, {arm.label}: unread {common - read}, declared {declared}"


def test_the_report_names_the_flags_an_arm_does_not_read() -> None:
    exp = EXPERIMENTS["fastgen"]
    outcome = runner.Outcome(exp, "quick", [], [], PASS, 0.0, "")
    text = common_text(outcome)
    assert "not read by fastgen: `--global_tokens`" in text
    assert "not read by fastgen, recent window: `--recent_window`" in text
    assert "not read by heavy hitters, recent window: `--min_recovery_frac`" in text


def test_overrides_replace_the_profiles_flags() -> None:
    exp = EXPERIMENTS["h2o"]
    argv = runner.arm_argv(exp, exp.arms[0], "quick", RUNS, ["--limit", "2"])
    assert argv.count("--limit") == 1 and argv[argv.index("--limit") + 1] == "2"
    given = cli.overrides(cli.build_parser().parse_args(["h2o", "--limit", "2", "--batch_size", "4"]))
    assert given == ["--limit", "2", "--batch_size", "4"]
    argv = runner.arm_argv(exp, exp.arms[0], "quick", RUNS, given)
    assert argv[argv.index("--batch_size") + 1] == "4"


# ---- bad input ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["nope"], "unknown experiment 'nope'"),
    (["h2o", "--profile", "huge"], "invalid choice: 'huge'"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "eval.reproduce", *argv, "--runs_dir", str(tmp_path / "runs")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize("argv, message", [
    ([], "name an experiment"),
    (["--list", "h2o"], "--list takes no experiment names"),
    (["h2o", "--limit", "0"], "--limit: must be at least 1"),
    (["all", "nope"], "unknown experiment 'nope'"),
])
def test_bad_input_raises_user_error(argv: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=message):
        cli.main([*argv, "--runs_dir", str(tmp_path / "runs")])
    assert not (tmp_path / "runs").exists()


def test_an_existing_report_is_refused_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("earlier\n")
    with pytest.raises(UserError, match="exists; pass --overwrite"):
        cli.main(["h2o", "--out_dir", str(out), "--runs_dir", str(tmp_path / "runs"),
                  "--checkpoint_path", str(tmp_path / "no-model")])
    assert (out / "report.md").read_text() == "earlier\n" and not (tmp_path / "runs").exists()


def test_list_and_dry_run_name_every_arm(capsys: pytest.CaptureFixture) -> None:
    cli.main(["--list"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPERIMENTS)
    cli.main(["all", "--dry_run", "--runs_dir", str(RUNS)])
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python -m eval ")]
    assert len(commands) == sum(len(e.arms) for e in EXPERIMENTS.values())


# ---- end to end ---------------------------------------------------------------------------------------------


def test_end_to_end_on_the_tiny_model(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, runs = tmp_path / "reports" / "streamingllm", tmp_path / "runs"
    argv = ["streamingllm", "--limit", "3", "--checkpoint_path", str(tiny_dir), "--out_dir", str(out),
            "--runs_dir", str(runs)]
    (outcome,) = cli.main(argv)
    printed = capsys.readouterr().out
    assert EXPERIMENTS["streamingllm"].claim in printed and f"verdict: {outcome.verdict}" in printed
    assert {p.name for p in out.iterdir()} == {"report.md", "plot.png", "arms.csv", "items.csv", "result.json"}
    result = json.loads((out / "result.json").read_text())
    # The verdict again, from the per-item scores the report wrote (the same items, paired by key).
    items = pd.read_csv(out / "items.csv")
    sinks, window = (items[items["arm"] == a].set_index("item_key")["kl_mean"] for a in ("sinks + window", "window"))
    assert len(sinks) == 3 and set(sinks.index) == set(window.index)
    diff = paired_difference(sinks.to_numpy(), window.loc[sinks.index].to_numpy())
    assert result["comparisons"][0]["difference"]["estimate"] == pytest.approx(diff.estimate)
    assert result["verdict"] == verdict(diff, higher_is_better=False) == outcome.verdict
    report = (out / "report.md").read_text()
    assert f"**Verdict: {outcome.verdict}**" in report and "python -m eval.reproduce streamingllm" in report
    # the items are --limit's, not the profile's 8: the setup says so
    assert "--limit 8`; given instead for every arm: `--limit 3 --checkpoint_path" in report
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Never replaced silently; with --overwrite the finished runs are reused, not computed again.
    with pytest.raises(UserError, match="exists"):
        cli.main(argv)
    # --batch_size is not part of a run's identity: the finished runs are reused, and the rerun command says it.
    (again,) = cli.main([*argv, "--overwrite", "--batch_size", "3"])
    assert all(a.reused for a in again.arms) and again.verdict == outcome.verdict
    assert "--batch_size 3" in (out / "report.md").read_text()
    # A summary rebuilt from the reports alone.
    cli.main(["--summarize", "--out_dir", str(tmp_path / "reports")])
    summary = (tmp_path / "reports" / "summary.md").read_text()
    assert "[streamingllm](streamingllm/report.md)" in summary and f"**{outcome.verdict}**" in summary
    with pytest.raises(UserError, match="no experiment reports"):
        cli.main(["--summarize", "--out_dir", str(tmp_path / "nothing")])
