"""The declarations of the experiments on the newer strategies (kvzip, compactor, curdkv, capkv, simlayerkv, cam, and
the scoring rules of experiments_scoring.py): what their arms run and what their claims compare (no model is
loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval import cli as eval_cli
from eval.reproduce import cli, runner
from eval.reproduce.experiments import EXPERIMENTS, PROFILES

RUNS = Path("/nonexistent-runs")  # parsing never writes; a path that cannot exist shows it


def parsed(experiment: str, label: str, profile: str = "quick") -> dict:
    exp = EXPERIMENTS[experiment]
    return vars(eval_cli.parse_args(runner.arm_argv(exp, exp.arm(label), profile, RUNS, [])))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("experiment, budget", [("kvzip", 0.25), ("compactor", 0.5), ("capkv", 0.5)])
def test_query_agnostic_rules_are_compared_with_snapkv_both_blind_to_the_question(experiment, budget, profile) -> None:
    exp = EXPERIMENTS[experiment]
    assert [(c.treatment, c.control) for c in exp.comparisons][0] == (experiment, "snapkv query-agnostic")
    assert exp.higher_is_better and exp.metric == "string_match"
    ours, snapkv = parsed(experiment, experiment, profile), parsed(experiment, "snapkv query-agnostic", profile)
    assert ours["cache_strategy"] == [experiment] and snapkv["cache_strategy"] == ["heavy_hitter"]
    for args in (ours, snapkv):
        assert args["query_aware"] is False and args["protocol"] == "kvpress" and args["max_cache_length"] == [budget]
    assert {key for key in ours if ours[key] != snapkv[key]} == {"cache_strategy"}


@pytest.mark.parametrize("profile", PROFILES)
def test_curdkv_is_compared_with_snapkv_and_chunkkv_blind_to_the_question_on_compactors_items(profile) -> None:
    exp = EXPERIMENTS["curdkv"]
    assert [(c.treatment, c.control) for c in exp.comparisons] == [("curdkv", "snapkv query-agnostic"),
                                                                   ("curdkv", "chunkkv query-agnostic")]
    assert exp.higher_is_better and exp.metric == "string_match" and exp.arm("compactor").reference
    runs = {label: parsed("curdkv", label, profile)
            for label in ("curdkv", "snapkv query-agnostic", "chunkkv query-agnostic", "compactor")}
    assert [args["cache_strategy"] for args in runs.values()] == [["curdkv"], ["heavy_hitter"], ["chunkkv"],
                                                                 ["compactor"]]
    for args in runs.values():
        assert {key for key in args if args[key] != runs["curdkv"][key]} <= {"cache_strategy"}
    # The compactor experiment's arms on the same items: one --runs_dir computes them once.
    assert runs["compactor"] == parsed("compactor", "compactor", profile)
    assert runs["snapkv query-agnostic"] == parsed("compactor", "snapkv query-agnostic", profile)


def test_capkv_is_also_compared_with_expected_attention_blind_to_the_question() -> None:
    exp = EXPERIMENTS["capkv"]
    assert [(c.treatment, c.control) for c in exp.comparisons] == [("capkv", "snapkv query-agnostic"),
                                                                   ("capkv", "expected attention")]
    ours, theirs = parsed("capkv", "capkv"), parsed("capkv", "expected attention")
    assert theirs["cache_strategy"] == ["expected_attention"]
    assert {key for key in ours if ours[key] != theirs[key]} == {"cache_strategy"}
    # compactor's and curdkv's SnapKV arm: one --runs_dir computes it once.
    assert parsed("capkv", "snapkv query-agnostic") == parsed("compactor", "snapkv query-agnostic")


def test_the_query_aware_reference_differs_from_the_control_only_in_seeing_the_question() -> None:
    exp = EXPERIMENTS["kvzip"]
    assert exp.arm("snapkv query-aware").reference
    aware, blind = parsed("kvzip", "snapkv query-aware"), parsed("kvzip", "snapkv query-agnostic")
    assert {key for key in aware if aware[key] != blind[key]} == {"query_aware"}
    # The same configurations as the snapkv experiment's two arms: one --runs_dir computes them once.
    assert aware == parsed("snapkv", "query-aware") and blind == parsed("snapkv", "query-agnostic")


def test_a_dry_run_prints_every_arm_and_runs_nothing(capsys: pytest.CaptureFixture) -> None:
    cli.main(["kvzip", "--dry_run", "--runs_dir", str(RUNS)])
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python -m eval ")]
    assert len(commands) == len(EXPERIMENTS["kvzip"].arms) == 3
    assert sum("--cache_strategy kvzip" in c for c in commands) == 1
    assert not RUNS.exists()


def test_simlayerkv_is_compared_with_streamingllm_at_its_measured_compression() -> None:
    """The layers' roles are an outcome, so StreamingLLM is the matched arm; both keep 4 sinks, and SimLayerKV's
    lazy layers the same 32-token window StreamingLLM's budget is matched against."""
    exp = EXPERIMENTS["simlayerkv"]
    assert [(c.treatment, c.control) for c in exp.comparisons] == [("simlayerkv", "streamingllm")]
    assert not exp.higher_is_better and exp.metric == "kl_mean"
    assert exp.arm("streamingllm").match_compression_of == "simlayerkv"
    ours, theirs = parsed("simlayerkv", "simlayerkv"), parsed("simlayerkv", "streamingllm")
    assert ours["cache_strategy"] == ["simlayerkv"] and ours["max_cache_length"] == [1.0]
    assert ours["simlayer_threshold"] == 0.9 and theirs["cache_strategy"] == ["recent_global"]
    assert ours["global_tokens"] == theirs["global_tokens"] == 4 and ours["recent_window"] == 32
    assert {key for key in ours if ours[key] != theirs[key]} == {"cache_strategy", "max_cache_length"}


@pytest.mark.parametrize("profile", PROFILES)
def test_cam_merging_is_compared_with_the_same_evictions_dropping_the_values(profile) -> None:
    exp = EXPERIMENTS["cam"]
    assert [(c.treatment, c.control) for c in exp.comparisons] == [("merging", "dropping")]
    assert exp.task == "fidelity" and exp.metric == "kl_mean" and not exp.higher_is_better
    merging, dropping = parsed("cam", "merging", profile), parsed("cam", "dropping", profile)
    assert merging["cache_strategy"] == dropping["cache_strategy"] == ["cam"]
    assert merging["cam_no_merge"] is False and dropping["cam_no_merge"] is True
    assert {key for key in merging if merging[key] != dropping[key]} == {"cam_no_merge"}


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize(("experiment", "treatment", "control"),
                         [("criticalkv", "output-aware", "attention only"), ("chunkkv", "chunks", "tokens"),
                          ("rkv", "redundancy-aware", "attention only")])
def test_refinements_of_tova_are_compared_with_tova_itself(experiment, treatment, control, profile) -> None:
    """CriticalKV's value norm, ChunkKV's chunks and R-KV's redundancy are each one factor on TOVA's score (their
    classes derive from TovaCache), so the control is tova with every other flag equal: the comparison isolates the
    factor."""
    from strategies import get_strategy
    from strategies.tova import TovaCache

    ours, theirs = parsed(experiment, treatment, profile), parsed(experiment, control, profile)
    assert theirs["cache_strategy"] == ["tova"] and issubclass(get_strategy(ours["cache_strategy"][0]), TovaCache)
    assert {key for key in ours if ours[key] != theirs[key]} == {"cache_strategy"}


@pytest.mark.parametrize("profile", PROFILES)
def test_tova_protects_nothing_and_its_baselines_run_as_their_papers(profile) -> None:
    exp = EXPERIMENTS["tova"]
    assert [(c.treatment, c.control) for c in exp.comparisons] == [("tova", "streamingllm"), ("tova", "h2o")]
    tova, sinks, h2o = (parsed("tova", label, profile) for label in ("tova", "streamingllm", "h2o"))
    assert (tova["global_tokens"], tova["recent_window"]) == (0, 0)
    assert sinks["cache_strategy"] == ["recent_global"] and sinks["global_tokens"] == 4
    assert h2o["cache_strategy"] == ["heavy_hitter"] and (h2o["global_tokens"], h2o["recent_window"]) == (0, 0.5)
    assert tova["max_cache_length"] == sinks["max_cache_length"] == h2o["max_cache_length"] == [0.2]


def test_adakv_differs_from_snapkv_in_the_allocation_alone() -> None:
    ours, theirs = parsed("adakv", "adaptive heads"), parsed("adakv", "uniform heads")
    assert ours["cache_strategy"] == theirs["cache_strategy"] == ["heavy_hitter"]
    assert (ours["budget_allocation"], theirs["budget_allocation"]) == ("adakv", "uniform")
    assert {key for key in ours if ours[key] != theirs[key]} == {"budget_allocation"}


@pytest.mark.parametrize("profile", PROFILES)
def test_lagkv_is_compared_with_snapkv_and_streamingllm_before_the_question(profile) -> None:
    exp = EXPERIMENTS["lagkv"]
    assert [(c.treatment, c.control) for c in exp.comparisons] == [("lagkv", "snapkv query-agnostic"),
                                                                   ("lagkv", "streamingllm")]
    assert exp.higher_is_better and exp.metric == "string_match"
    ours = parsed("lagkv", "lagkv", profile)
    for label, strategy in (("snapkv query-agnostic", "heavy_hitter"), ("streamingllm", "recent_global")):
        theirs = parsed("lagkv", label, profile)
        assert theirs["cache_strategy"] == [strategy] and theirs["query_aware"] is False
        assert theirs["protocol"] == "kvpress" and theirs["max_cache_length"] == [0.5]
        assert {key for key in ours if ours[key] != theirs[key]} == {"cache_strategy"}
