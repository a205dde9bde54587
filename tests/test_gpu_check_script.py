"""benchmarks/gpu_check.sh is run on a lent GPU with minutes to spare: every eval.bench command in it must
plan without a flag error. Here each is planned (--dry_run) on the CPU, where the plan is the same."""

from __future__ import annotations

import re
import shlex

import pytest

from eval.bench.cli import main
from tests.conftest import ROOT

SCRIPT = (ROOT / "benchmarks" / "gpu_check.sh").read_text()


def bench_commands() -> list[list[str]]:
    """The words after `-m eval.bench` of each command, continuation lines joined, shell variables given
    plain values (the cap: 100 GB)."""
    joined = SCRIPT.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        if "-m eval.bench" not in line:
            continue
        words = shlex.split(line.split("-m eval.bench", 1)[1].split(">", 1)[0])
        commands.append([re.sub(r"\$\{?\w+\}?", "100" if w == "$CAP" else "out", w) for w in words])
    return commands


def test_the_script_runs_the_bench_twice():
    assert [("--batch_sizes" in c) for c in bench_commands()] == [False, True]


@pytest.mark.parametrize("command", bench_commands(), ids=["bench", "batched"])
def test_every_bench_command_of_the_gpu_check_plans_on_the_cpu(command, tmp_path, capsys):
    assert command[:2] == ["--device", "cuda"]
    argv = ["--device", "cpu", *command[2:]]
    out = argv.index("--out_dir") + 1
    argv[out] = str(tmp_path / "bench")
    assert main([*argv, "--dry_run"]) == []
    printed = capsys.readouterr().out
    assert ("batch" in printed) if "--batch_sizes" in argv else ("profiled steps" in printed)
    assert not (tmp_path / "bench").exists()


def test_the_prefill_memory_command_plans_on_the_cpu():
    """The script's chunked-prefill command parses, and plans one shot and chunks at 4x the budget and chunks
    only at 16x, for both strategies (its --device cuda replaced: the plan does not depend on it)."""
    from benchmarks.prefill_memory import build_parser, context_length, plan

    line = next(w for w in SCRIPT.replace("\\\n", " ").splitlines() if "-m benchmarks.prefill_memory" in w)
    words = shlex.split(line.split("-m benchmarks.prefill_memory", 1)[1].split(">", 1)[0])
    args = build_parser().parse_args([re.sub(r"\$\{?\w+\}?", "out", w) for w in words])
    assert args.device == "cuda"
    specs = plan(args, context_length(args), "cpu", "bfloat16")
    assert [(s["strategy"], s["length"] // args.budget, bool(s["chunk"])) for s in specs] == [
        (name, n, chunked) for name in ("recent_global", "heavy_hitter")
        for n, chunked in ((4, False), (4, True), (16, True))]


def received_attention_commands() -> list[list[str]]:
    joined = SCRIPT.replace("\\\n", " ")
    return [[re.sub(r"\$\{?\w+\}?", "out", w)
             for w in shlex.split(line.split("-m benchmarks.received_attention", 1)[1].split(">", 1)[0])]
            for line in joined.splitlines() if "-m benchmarks.received_attention" in line]


@pytest.mark.parametrize("index", [0, 1], ids=["whole_prompt", "chunk"])
def test_the_received_attention_commands_run_on_the_cpu(index, tmp_path):
    """Each of the script's received-attention commands parses; run on the CPU with its lengths and first
    query scaled down 64x and small heads, it writes one row per length, the two paths agreeing."""
    from benchmarks.received_attention import build_parser
    from benchmarks.received_attention import main as received_main

    args = build_parser().parse_args(received_attention_commands()[index])
    assert args.device == "cuda" and args.out
    lengths = [str(n // 64) for n in args.lengths]
    report = received_main(["--device", "cpu", "--dtype", args.dtype, "--lengths", *lengths,
                            "--first_query", str(args.first_query // 64), "--repeats", "1", "--heads", "4",
                            "--kv_heads", "1", "--head_dim", "16", "--out", str(tmp_path / "r.json")])
    assert [r["prompt_tokens"] for r in report["rows"]] == [n // 64 for n in args.lengths]
    assert all(r["max_relative_difference"] < 1e-2 for r in report["rows"])  # bfloat16 blocks against fused
    assert (tmp_path / "r.json").exists()


def test_the_batched_prefill_command_parses():
    """The script's packed-prefill command parses with the benchmark's own parser, on CUDA, and its prompts
    fit one packed pass (16 prompts of 64 to 544 tokens: 4864 of the 8192 a pass takes)."""
    from benchmarks.batched_prefill import build_parser
    from packed_prefill import PREFILL_BATCH_TOKENS, packed_groups

    line = next(w for w in SCRIPT.replace("\\\n", " ").splitlines() if "-m benchmarks.batched_prefill" in w)
    words = shlex.split(line.split("-m benchmarks.batched_prefill", 1)[1].split(">", 1)[0])
    args = build_parser().parse_args([re.sub(r"\$\{?\w+\}?", "out", w) for w in words])
    assert args.device == "cuda" and args.random_weights == "llama-3.1-8b"
    lengths = [args.min_tokens + args.step_tokens * i for i in range(args.prompts)]
    assert sum(lengths) <= PREFILL_BATCH_TOKENS and packed_groups(lengths) == [range(args.prompts)]
