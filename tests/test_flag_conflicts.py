"""Flags that the rest of the command would ignore: typed explicitly, each is refused where it enters (exit 2,
one `error:` line naming it, no traceback, nothing written, no model loaded) rather than accepted and dropped
without a word. A task flag no selected task reads (Task.reads), a strategy flag no cache of the
configuration reads (its strategies' hyper-parameters, its prompt rules' settings), a storage flag without its
storage, a sampling flag under greedy decoding, a flag of another mode of the same command.

CONFLICTS is the table: (entry point, argv after the entry point's valid prefix, fragment of the error line).
Refused on the command line (eval's main, not its parse_args, which also reads the runs of a sweep or an
experiment): the sweep checks its flags against the whole grid, passes a run only the task flags its task
reads, and lets a strategy flag that some run of the grid reads reach the others, whose identity leaves it
out (the tests at the end).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eval import cli, sweep
from tests.bad_input_matrix import ENTRY_POINTS, refused

GEN, EVAL, SWEEP, BENCH = "generate.py", "python -m eval", "python -m eval.sweep", "python -m eval.bench"
REPRODUCE, GATED = "python -m eval.reproduce", "python -m benchmarks.gated_fidelity"
STREAMING = "python -m benchmarks.streaming_past_context"
QA_DATA = ["--dataset", "rows.jsonl", "--prompt_column", "q", "--answer_column", "a"]  # what qa needs to be planned

CONFLICTS: list[tuple[str, list[str], str]] = [
    # ---- strategy settings and shared cache flags no cache of the configuration reads ----------------------
    (GEN, ["--cache_strategy", "heavy_hitter", "--lag_size", "4"], "--lag_size would be ignored: no cache of "
     "--cache_strategy heavy_hitter reads it (read by lagkv)"),
    (GEN, ["--cache_strategy", "l2", "--snapkv_window", "16"], "--snapkv_window would be ignored"),
    (GEN, ["--cache_strategy", "full", "--global_tokens", "8"], "--global_tokens would be ignored"),
    (GEN, ["--cache_strategy", "recent_global", "--recent_window", "4"], "--recent_window would be ignored"),
    (GEN, ["--cache_strategy", "l2", "--gates_path", "gates.safetensors"], "--gates_path would be ignored"),
    (GEN, ["--cache_strategy", "l2", "--duo_retrieval_fraction", "0.3"], "--duo_retrieval_fraction would be ignored"),
    (GEN, ["--cache_strategy", "heavy_hitter", "--chunk_size", "4"], "--chunk_size would be ignored"),
    (GEN, ["--adakv_floor", "0.3"], "--adakv_floor applies to --budget_allocation adakv only"),
    (GEN, ["--max_cache_length", "0.25"], "--max_cache_length would be ignored: the full cache keeps every token"),
    (EVAL, ["--max_cache_length", "0.25"], "--max_cache_length would be ignored"),
    (SWEEP, ["--strategies", "full", "--budgets", "0.5"], "--budgets would be ignored: --strategies is full alone"),
    (EVAL, ["--cache_strategy", "l2", "--lag_size", "8"], "--lag_size would be ignored"),
    (SWEEP, ["--strategies", "l2", "heavy_hitter", "--lag_size", "8"], "--lag_size would be ignored: no cache of "
     "the grid reads it"),
    # ---- storage flags without their storage ---------------------------------------------------------------
    (GEN, ["--cache_quantization", "per_token"], "--cache_quantization would be ignored: --cache_bits 16"),
    (GEN, ["--q_group_size", "32"], "apply to --cache_quantization kivi only"),
    (EVAL, ["--residual_length", "64"], "apply to --cache_quantization kivi only"),
    (SWEEP, ["--cache_quantization", "per_token"], "--cache_quantization would be ignored"),
    # ---- sampling flags under greedy decoding --------------------------------------------------------------
    (GEN, ["--top_k", "5"], "--temperature 0 decodes greedily"),
    # ---- task flags no selected task reads (Task.reads) ----------------------------------------------------
    (EVAL, ["--math_format", "gsm8k"], "--math_format is read by none of the selected tasks (fidelity)"),
    (EVAL, ["--tasks", "niah_single", "--dataset", "x.jsonl"], "--dataset is read by none of the selected tasks "
     "(niah_single)"),
    (EVAL, ["--max_new_tokens", "4"], "--max_new_tokens is read by none"),
    (EVAL, ["--query_aware"], "--query_aware is read by none"),
    (EVAL, ["--no-chat"], "--chat is read by none"),
    (EVAL, ["--haystack", "noise"], "--haystack is read by none"),
    (EVAL, ["--protocol", "kvpress"], "fidelity: --protocol kvpress applies to tasks that answer"),
    (EVAL, ["--protocol", "decode"], "--protocol is read by none"),
    (EVAL, ["--tasks", "niah_single", "qa", *QA_DATA, "--text_offset", "3"], "--text_offset is read by none of the "
     "selected tasks (niah_single, qa)"),
    (EVAL, ["--tasks", "multiple_choice", *QA_DATA, "--choices_column", "c", "--max_new_tokens", "4"],
     "--max_new_tokens is read by none"),
    (SWEEP, ["--tasks", "fidelity", "--math_format", "gsm8k"], "--math_format is read by none of the selected "
     "tasks (fidelity)"),
    (SWEEP, ["--grid", "{grid}"], "--haystack is read by none of the selected tasks (fidelity, qa)"),
    # ---- flags of another mode of the same command ---------------------------------------------------------
    (BENCH, ["--quick", "--contexts", "128"], "--contexts would be ignored: --quick sets it"),
    (BENCH, ["--quick", "--budgets", "0.5"], "--budgets would be ignored: --quick sets it"),
    (BENCH, ["--batch_sizes", "1", "--no_hf"], "--no_hf would be ignored: --batch_sizes measures batched"),
    (BENCH, ["--batch_sizes", "1", "--strategy_contexts", "64"], "--strategy_contexts would be ignored"),
    (BENCH, ["--kv_memory_gb", "1"], "--kv_memory_gb would be ignored: it applies to --batch_sizes only"),
    (BENCH, ["--no_compile", "--compile_scope", "step"], "--compile_scope would be ignored: no row is compiled"),
    (BENCH, ["--batch_sizes", "1", "--no_compile", "--compile_scope", "step"],
     "--compile_scope would be ignored: no row is compiled"),
    (GEN, ["--compile_scope", "step"], "--compile_scope would be ignored: it chooses what --compile compiles"),
    (EVAL, ["--compile_scope", "block"], "--compile_scope would be ignored"),
    (STREAMING, ["--compile_scope", "step"], "--compile_scope would be ignored"),
    (BENCH, ["--batch_context", "64"], "--batch_context would be ignored: it applies to --batch_sizes only"),
    (BENCH, ["--batch_cache_bits", "4"], "--batch_cache_bits would be ignored: it applies to --batch_sizes only"),
    (BENCH, ["--batch_sizes", "1", "--profile_steps", "4"], "--profile_steps would be ignored: --batch_sizes"),
    (REPRODUCE, ["--summarize"], "--runs_dir would be ignored: --summarize only rebuilds"),
    (REPRODUCE, ["--list"], "--list takes no experiment names"),
    (REPRODUCE, ["--out_dir", "reports"], "--out_dir would be ignored: --dry_run prints"),
    (GATED, ["--strategies", "l2", "--gates_path", "g.safetensors"], "--gates_path would be ignored"),
    # ---- sizes that leave a benchmark nothing to measure ---------------------------------------------------
    (GATED, ["--seq_len", "64", "--prefill_tokens", "64"], "leaves no token of the --seq_len 64 window to score"),
    (STREAMING, ["--budget", "64", "--tokens", "64"], "--tokens 64 must exceed --budget 64"),
    (BENCH, ["--bound_contexts", "16", "--contexts", "--strategy_contexts", "--speedup_contexts", "--profile_steps",
             "16"], "--profile_steps 16 needs prompts longer than 18 tokens; context 16 is not"),
    (STREAMING, ["--budget", "64", "--global_tokens", "4", "64"], "--global_tokens 64 leaves no slot"),
    (STREAMING, ["--strategies", "no_such_rule"], "no_such_rule"),
]
GRID = "tasks: [fidelity, qa]\nargs: {haystack: noise}\n"


@pytest.mark.parametrize(("entry", "argv", "fragment"), CONFLICTS,
                         ids=[f"{e} {' '.join(a)}" for e, a, _ in CONFLICTS])
def test_conflicting_flags_are_refused(entry, argv, fragment, tmp_path, capsys, monkeypatch):
    grid = tmp_path / "inputs" / "grid.yaml"
    if "{grid}" in argv:
        grid.parent.mkdir()
        grid.write_text(GRID)
    words = [str(grid) if w == "{grid}" else w for w in argv]
    line = refused(entry, [*ENTRY_POINTS[entry].prefix(tmp_path), *words], tmp_path, capsys, monkeypatch)
    assert fragment in line, line


def test_every_entry_point_with_a_conflict_rule_is_in_the_table():
    assert {e for e, _, _ in CONFLICTS} >= {GEN, EVAL, SWEEP, BENCH, REPRODUCE, GATED, STREAMING}


def _task_flags(job: list[str]) -> set[str]:
    return cli.explicit_dests(cli.build_parser(), job) & set(cli.task_flags())


def test_a_sweep_passes_each_run_only_the_task_flags_its_task_reads(tmp_path: Path):
    """--haystack is read by niah_single, not fidelity: the sweep accepts it and only niah runs get it."""
    args, rest = sweep.parse_sweep(["--tasks", "fidelity", "niah_single", "--haystack", "noise", "--seq_len", "64",
                                    "--prefill_tokens", "16", "--strategies", "l2", "--budgets", "0.5",
                                    "--out_dir", str(tmp_path / "results")])
    jobs = sweep.grid_jobs(args, rest)
    by_task = {task: [j for j in jobs if j[j.index("--tasks") + 1] == task] for task in ("fidelity", "niah_single")}
    assert all(_task_flags(j) == {"seq_len", "prefill_tokens"} for j in by_task["fidelity"]), by_task["fidelity"]
    assert all(_task_flags(j) == {"seq_len", "haystack"} for j in by_task["niah_single"]), by_task["niah_single"]
    assert len(sweep.plan_jobs(jobs)) == len(jobs) == 4  # every run's flags pass eval's own checks
    assert not (tmp_path / "results").exists()


def test_a_strategy_flag_some_run_of_the_grid_reads_is_accepted(tmp_path: Path):
    """--lag_size reaches the l2 runs too; their identity leaves it out, so it changes nothing there."""
    argv = ["--strategies", "l2", "lagkv", "--budgets", "0.5", "--lag_size", "8", "--out_dir", str(tmp_path / "r")]
    args, rest = sweep.parse_sweep(argv)
    planned = sweep.plan_jobs(sweep.grid_jobs(args, rest))
    sweep.check_flags_read(rest, [job for job, _ in planned])
    without = sweep.plan_jobs(sweep.grid_jobs(*sweep.parse_sweep([w for w in argv if w not in ("--lag_size", "8")])))
    paths = {tuple(job[job.index("--cache_strategy") + 1:][:1]): path for job, path in planned}
    paths_without = {tuple(job[job.index("--cache_strategy") + 1:][:1]): path for job, path in without}
    assert paths[("l2",)] == paths_without[("l2",)] and paths[("full",)] == paths_without[("full",)]
    assert paths[("lagkv",)] != paths_without[("lagkv",)]


@pytest.mark.parametrize("argv", [
    ["--tasks", "fidelity", "niah_single", "--haystack", "noise"],  # read by one of the selected tasks
    ["--cache_strategy", "l2", "--prompt_compression_strategy", "heavy_hitter", "--snapkv_window", "16"],
    ["--cache_strategy", "heavy_hitter", "--snapkv_window", "16"],  # its own prompt rule (auto)
    ["--cache_strategy", "full", "l2", "--global_tokens", "8"],
    ["--budget_allocation", "adakv", "--cache_strategy", "l2", "--adakv_floor", "0.3"],
    ["--cache_bits", "4", "--cache_quantization", "per_token"],
], ids=["task flag one task reads", "prompt rule setting", "own prompt rule", "some layer reads it", "adakv floor",
        "quantized"])
def test_flags_the_configuration_reads_pass(argv, tmp_path: Path):
    from ignored_flags import check_typed_flags

    full = [*ENTRY_POINTS[EVAL].prefix(tmp_path), *argv]
    args = cli.parse_args(full)
    check_typed_flags(cli.build_parser(), args, full)


def test_without_flags_drops_the_flags_and_their_values_only():
    argv = ["--seq_len", "64", "--haystack", "noise", "--no-chat", "--max_cache_length", "0.5", "0.25",
            "--text_file=notes.txt", "--limit", "3", "--budget_allocation", "adakv"]
    kept = cli.without_flags(argv, {"haystack", "chat", "text_file", "limit", "max_cache_length"})
    assert kept == ["--seq_len", "64", "--budget_allocation", "adakv"]


def test_reproduce_list_refuses_the_flags_it_ignores(capsys):
    from errors import UserError
    from eval.reproduce import cli as reproduce_cli

    with pytest.raises(UserError, match="--profile would be ignored: --list only lists the experiments"):
        reproduce_cli.main(["--list", "--profile", "full"])
    reproduce_cli.main(["--list"])
    assert "streamingllm" in capsys.readouterr().out


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "run"])
@pytest.mark.parametrize(("new_tokens", "fragment"), [
    ("8188", "--profile_steps 4 needs prompts longer than 6 tokens; context 8000 is cut to 4 so that --new_tokens "
     "8188 fit the model's context of 8192"),
    ("9000", "--new_tokens 9000 leaves no room for a prompt in the model's context of 8192 tokens"),
])
def test_bench_refuses_a_context_that_new_tokens_cut_below_the_profile(new_tokens, fragment, dry_run, tmp_path,
                                                                       capsys, monkeypatch):
    """The model's context is known once its config is read: the bench fits each prompt to it (prompt + new
    tokens), so a prompt that passed the profile's length check can still be cut below it. Refused then, after
    the model loads and before the output directory exists."""
    argv = ["--out_dir", str(tmp_path / "bench"), "--bound_contexts", "8000", "--contexts", "--strategy_contexts",
            "--speedup_contexts", "--new_tokens", new_tokens, "--profile_steps", "4", "--no_hf",
            *(["--dry_run"] if dry_run else [])]
    line = refused(BENCH, argv, tmp_path, capsys, monkeypatch, early=False)
    assert fragment in line, line


def test_a_budget_below_the_protected_tokens_says_how_to_fix_it(tmp_path, capsys, monkeypatch):
    """A quarter of a short prompt + 2 new tokens is fewer slots than the sinks and the recent window keep:
    known once the prompt is tokenized, so after the model loads."""
    argv = [*ENTRY_POINTS[GEN].prefix(tmp_path), "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25"]
    line = refused(GEN, argv, tmp_path, capsys, monkeypatch, early=False)
    assert "is smaller than the protected tokens (global_tokens 4 + recent_window 10 + 1): raise " \
           "--max_cache_length (a fraction is of prompt + new tokens" in line, line
