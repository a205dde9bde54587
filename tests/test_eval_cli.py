"""`python -m eval` end to end on the tiny checkpoint: run directories, the results table, finished runs
skipped unless --overwrite, presets, and bad input as one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from errors import UserError
from eval import cli, results
from tests.conftest import ROOT
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    read_results,
)


def fidelity_flags(tiny_dir, out_dir) -> list[str]:
    return ["--tasks", "fidelity", "--checkpoint_path", str(tiny_dir), "--text_file", str(PYDOC_EXCERPT),
            "--seq_len", "120", "--prefill_tokens", "20", "--out_dir", str(out_dir)]


def run_dirs(out_dir) -> list:
    return sorted(p.parent for p in out_dir.glob("*/*/*/metrics.json"))


def test_runs_are_written_next_to_the_baseline_and_skipped_when_finished(tiny_dir, tmp_path):
    flags = fidelity_flags(tiny_dir, tmp_path) + ["--cache_strategy", "recent_global", "--max_cache_length", "0.5"]
    full, ours = cli.main(flags)
    assert full["strategy"] == "full" and full["kl_mean"] == 0.0 and full["budget"] == 1.0
    assert ours["strategy"] == "recent_global" and ours["budget"] == 0.5 and ours["kl_mean"] > 0
    assert ours["compression_ratio"] == pytest.approx(1 - 60 / 119, abs=1e-3)  # measured: 60 held of 119 seen
    dirs = run_dirs(tmp_path)
    assert [d.parent.name for d in dirs] == ["fidelity", "fidelity"] and dirs[0].parent.parent.name == tiny_dir.name
    for d in dirs:
        assert {p.name for p in d.iterdir()} == {"config.json", "predictions.jsonl", "metrics.json", "items.jsonl",
                                                 "kept_positions.npz"}
    config = json.loads((dirs[1] / "config.json").read_text())
    assert [s["strategy"] for s in config["cache_spec"]] == ["recent_global"] * 2
    assert config["cache_spec"][0]["max_cache_length"] == 60 and config["identity"]["seed"] == 0
    assert config["versions"]["torch"].startswith("2.13") and "git_commit" in config
    assert len((dirs[1] / "predictions.jsonl").read_text().splitlines()) == 100
    table = read_results(tmp_path / "results.csv")
    assert list(table["strategy"]) == ["full", "recent_global"]
    for column in ["task", "budget", "compression_ratio", "cache_bytes", "kl_mean", "kl_p95", "top1_agreement",
                   "perplexity", "perplexity_delta", "decode_tokens_per_second", "peak_memory_mb"]:
        assert table[column].notna().all(), column

    stamps = {d: (d / "metrics.json").stat().st_mtime_ns for d in dirs}
    assert cli.main(flags) == [full, ours]  # finished: skipped, same results
    assert {d: (d / "metrics.json").stat().st_mtime_ns for d in dirs} == stamps
    cli.main(flags[:-1] + ["0.25"])  # another budget: the finished baseline is reused
    assert len(run_dirs(tmp_path)) == 3
    cli.main(flags + ["--overwrite"])
    assert all((d / "metrics.json").stat().st_mtime_ns != stamps[d] for d in dirs)


def test_cache_config_preset_and_explicit_flags(tiny_dir, tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("cache_strategy: recent_global\nmax_cache_length: 0.25\nglobal_tokens: 2\n")
    cli.main(fidelity_flags(tiny_dir, tmp_path / "out") + ["--cache_config", str(preset), "--global_tokens", "3",
                                                            "--no-baseline"])
    (run,) = run_dirs(tmp_path / "out")
    assert run.name.startswith("recent_global-b0.25-s0-")
    config = json.loads((run / "config.json").read_text())
    assert config["cache_spec"][0]["hyperparameters"]["global_tokens"] == 3  # typed flags win over the preset


def test_full_cache_ignores_budget_flags_in_its_identity(tiny_dir, tmp_path):
    """A sweep's shared flags reach its full-cache runs: they leave such a run's identity (its directory) as it
    is. Typed on the command line of a full-cache run, --global_tokens is refused (tests/test_flag_conflicts.py)."""
    cli.main(fidelity_flags(tiny_dir, tmp_path))
    shared = fidelity_flags(tiny_dir, tmp_path) + ["--max_cache_length", "0.5", "--global_tokens", "7"]
    assert [path for _, _, path in cli.plan(cli.parse_args(shared))] == run_dirs(tmp_path)
    with pytest.raises(UserError, match="--global_tokens would be ignored"):
        cli.main(shared)


BAD_INPUTS = {
    "unknown task": (["--tasks", "nope"], "unknown task 'nope'"),
    "unknown strategy": (["--cache_strategy", "nope"], "unknown cache strategy"),
    "budget larger than the sequence": (["--cache_strategy", "keep_it_odd", "--max_cache_length", "500"],
                                        "larger than the sequence"),
    "prefill longer than the window": (["--prefill_tokens", "120"], "--prefill_tokens"),
    "zero limit": (["--limit", "0"], "--limit: must be at least 1"),
    "unknown flag": (["--no_such_flag"], "unrecognized"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_a_user_error(tiny_dir, tmp_path, case):
    flags, message = BAD_INPUTS[case]
    with pytest.raises(UserError, match=message):
        cli.main(fidelity_flags(tiny_dir, tmp_path) + flags)


@pytest.mark.parametrize("task, message", [("qa", "qa needs --dataset, --prompt_column, --answer_column"),
                                           ("multiple_choice", "multiple_choice needs --dataset, --prompt_column, "
                                                               "--answer_column, --choices_column"),
                                           ("qa_1", "qa_1 needs --dataset: a local file with question, answers "
                                                    "and context"),
                                           ("math", "math needs --dataset")])
def test_a_task_without_its_data_is_refused_before_any_run(tiny_dir, tmp_path, task, message):
    """Not after the tasks before it have run (it used to come when its own run began)."""
    with pytest.raises(UserError, match=f"^{message}$"):
        cli.main(fidelity_flags(tiny_dir, tmp_path / "out") + ["--tasks", "fidelity", task])
    assert run_dirs(tmp_path / "out") == []


def test_unwritable_out_dir_and_short_text_are_user_errors(tiny_dir, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError, match="cannot write to --out_dir"):
        cli.main(fidelity_flags(tiny_dir, blocker / "results"))
    short = tmp_path / "short.txt"
    short.write_text("far too short")
    with pytest.raises(UserError, match="fidelity needs --seq_len 120"):
        cli.main(fidelity_flags(tiny_dir, tmp_path / "out") + ["--text_file", str(short)])


def test_bad_input_from_the_command_line_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "eval", "--tasks", "nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: unknown task")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_batch_size_below_one_is_one_error_line_and_writes_nothing(tmp_path, value):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "eval", "--batch_size", value, "--out_dir", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error:")
    assert "--batch_size" in proc.stderr and not out.exists()


def test_batched_fidelity_run_writes_the_batch_1_records(tiny_dir, tmp_path):
    """End to end: --batch_size 3 over 3 windows gives the per-item metrics of a batch-1 run, and a run
    finished at one batch size is reused at another (batch_size is not in the run's identity)."""
    def flags(out_dir) -> list[str]:
        return fidelity_flags(tiny_dir, out_dir) + ["--limit", "3", "--cache_strategy", "heavy_hitter",
                                                    "--max_cache_length", "40"]

    cli.main(flags(tmp_path / "batched") + ["--batch_size", "3"])
    cli.main(flags(tmp_path / "alone"))
    batched = {d.name: results.read_items(d) for d in run_dirs(tmp_path / "batched")}
    alone = {d.name: results.read_items(d) for d in run_dirs(tmp_path / "alone")}
    assert batched.keys() == alone.keys() and len(batched) == 2  # the full cache and heavy_hitter
    for d in run_dirs(tmp_path / "batched"):
        assert json.loads((d / "config.json").read_text())["batch_size"] == 3
    for name, items in alone.items():
        for a, b in zip(items, batched[name], strict=True):
            assert a["context_ids"] == b["context_ids"]
            for key, value in a["metrics"].items():
                assert b["metrics"][key] == pytest.approx(value, abs=1e-5), (name, key)
    before = {d: (d / "metrics.json").read_bytes() for d in run_dirs(tmp_path / "batched")}
    cli.main(flags(tmp_path / "batched") + ["--batch_size", "2"])  # finished: skipped, not rerun
    assert {d: (d / "metrics.json").read_bytes() for d in run_dirs(tmp_path / "batched")} == before



QA_ROWS = {"an answer without text": {"doc": "Paris is in France.", "q": "Where is Paris?", "a": ""},
           "a context overrun": {"doc": "Paris is in France. " * 60, "q": "Where is Paris?", "a": "France"}}


@pytest.mark.parametrize("task, row, message", [
    ("common_words_extraction", None, "--seq_len 400 is too short for common_words_extraction"),
    ("qa", "an answer without text", "row 0 of .*: column 'a' \\(--answer_column\\) has no"),
    ("qa", "a context overrun", "qa: prompts of .* tokens plus 4 new tokens exceed the model's context of 1024"),
], ids=["a task's smallest prompt", "an answer without text", "a context overrun"])
def test_a_tasks_inputs_are_refused_before_any_run(tiny_dir, tmp_path, task, row, message):
    """Inputs found bad only when built (a task's examples against --seq_len, a dataset's rows, the model's
    context) are built and checked for every run before the first starts (Task.check_inputs): the needle runs
    listed first do not run, nothing is written (they used to run, and the bad task's run then stopped)."""
    rows = tmp_path / "qa.jsonl"
    rows.write_text(json.dumps(QA_ROWS.get(row, {})) + "\n")
    data = ["--dataset", str(rows), "--prompt_column", "q", "--context_column", "doc", "--answer_column", "a"]
    flags = ["--tasks", "niah_single", task, "--checkpoint_path", str(tiny_dir), "--seq_len", "400", "--limit", "1",
             "--max_new_tokens", "4", "--cache_strategy", "keep_it_odd", "--max_cache_length", "0.5",
             "--out_dir", str(tmp_path / "out"), *(data if task == "qa" else [])]
    with pytest.raises(UserError, match=message):
        cli.main(flags)
    assert list((tmp_path / "out").rglob("*/*")) == []
    cli.main([*flags[:2], *flags[3:17]])  # the needle runs alone run
    assert len(run_dirs(tmp_path / "out")) == 2
