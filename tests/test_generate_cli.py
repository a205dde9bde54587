"""generate.py end to end on the bundled model, and bad input: one line on stderr, non-zero exit."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run_generate(*flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "generate.py"), *flags], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    assert fragment in lines[0], lines[0]


def test_generate_end_to_end_writes_stats(tmp_path):
    stats_path = tmp_path / "stats.json"
    proc = run_generate("--prompt", "What is the capital of France?", "--max_new_tokens", "8",
                        "--stats_json", str(stats_path))
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout  # float32 greedy answer of SmolLM2-135M-Instruct
    assert "---- statistics ----" in proc.stdout
    stats = json.loads(stats_path.read_text())
    for key in ["prompt_tokens", "generated_tokens", "prefill_tokens_per_second", "decode_tokens_per_second",
                "total_seconds", "cache_bytes", "compression_ratio", "config", "cache_spec", "model"]:
        assert key in stats, key
    assert stats["generated_tokens"] <= 8 and stats["compression_ratio"] == 0.0
    assert stats["cache_bytes"] > 0 and len(stats["cache_spec"]) == stats["model"]["n_layer"] == 30
    # An existing stats file is never overwritten silently.
    again = run_generate("--prompt", "Hi", "--max_new_tokens", "2", "--stats_json", str(stats_path))
    assert_one_line_error(again, "--overwrite")
    assert json.loads(stats_path.read_text()) == stats


@pytest.fixture(scope="module")
def long_prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "long.txt"
    path.write_text("token " * 9000)
    return path


BAD_INPUTS = {
    "unknown strategy": (["--prompt", "Hi", "--cache_strategy", "nonsense"], "unknown cache strategy"),
    "a paper's name": (["--prompt", "Hi", "--cache_strategy", "SnapKV"], "runs here as --cache_strategy heavy_hitter"),
    "missing checkpoint": (["--prompt", "Hi", "--checkpoint_path", "/nonexistent/model.gguf"], "not found"),
    "empty prompt": (["--prompt", "   "], "empty"),
    "missing prompt file": (["--prompt", "/nonexistent/prompt.txt"], "not found"),
    "bad dtype": (["--prompt", "Hi", "--dtype", "float8"], "dtype"),
    "bad device": (["--prompt", "Hi", "--device", "tpu"], "device"),
    "unknown flag": (["--prompt", "Hi", "--no_such_flag"], "unrecognized"),
    "zero budget": (["--prompt", "Hi", "--max_cache_length", "0"], "positive"),
    "zero new tokens": (["--prompt", "Hi", "--max_new_tokens", "0"], "max_new_tokens"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_one_line(case):
    flags, fragment = BAD_INPUTS[case]
    assert_one_line_error(run_generate(*flags), fragment)


def test_prompt_longer_than_context(long_prompt_file):
    assert_one_line_error(run_generate("--prompt", str(long_prompt_file), "--no-chat"), "context")


def test_batched_prompts_give_each_prompt_its_own_run(tmp_path, tiny_dir, capsys):
    """Three prompts of different lengths, two rows at a time: batched longest first (the first and third
    prompts, then the second), and every row's tokens and cache statistics, recorded in the prompts' order,
    are those of the prompt run alone."""
    import generate

    prompts = ["Hello there, how are you", "Hi", "What is a KV cache?"]
    common = ["--checkpoint_path", str(tiny_dir), "--no-chat", "--max_new_tokens", "6", "--cache_strategy",
              "l2", "--max_cache_length", "0.5", "--global_tokens", "1", "--recent_window", "2"]
    batched = tmp_path / "batched.json"
    stats = generate.main([arg for p in prompts for arg in ("--prompt", p)] + ["--batch_size", "2",
                          "--stats_json", str(batched), *common])
    payload = json.loads(batched.read_text())
    rows = payload["row_statistics"]
    assert stats["rows"] == len(rows) == 3 and stats["batch_size"] == 2 and stats["batches"] == [[0, 2], [1]]
    for key in ("prompt_tokens", "generated_tokens"):  # the batches' totals: their rows'
        assert stats[key] == sum(r[key] for r in rows), key
    assert stats["decode_tokens_per_second"] > 0 and stats["prefill_tokens_per_second"] > 0
    assert payload["config"]["batch_size"] == 2 and "prompt" not in payload["config"]  # the prompts' text: rows
    for prompt, row, spec in zip(prompts, rows, payload["cache_spec"], strict=True):
        alone = tmp_path / "alone.json"
        generate.main(["--prompt", prompt, "--stats_json", str(alone), "--overwrite", *common])
        single = json.loads(alone.read_text())
        assert row["tokens"] == single["tokens"] and row["text"] == single["text"] and spec == single["cache_spec"]
        for key in ("prompt_tokens", "compression_ratio", "tokens_held_per_head", "cache_budget_per_layer"):
            assert row[key] == single[key], key
    out = capsys.readouterr().out
    assert "---- row 2 ----" in out
    assert f"({rows[2]['prompt_tokens']} prompt + {rows[2]['generated_tokens']} new tokens, compression " \
           f"{rows[2]['compression_ratio']})" in out


@pytest.mark.parametrize("batch_size", ["1", "2"])
def test_a_later_batchs_budget_is_refused_before_any_row_decodes(tiny_dir, tmp_path, capsys, batch_size):
    """Prompts batched longest first: a short prompt whose budget (half of prompt + new tokens) cannot hold the
    protected tokens is in the last batch; it is refused before the first batch decodes: no row printed, no
    statistics written (it used to come after the rows before it had printed)."""
    import generate
    from errors import UserError

    stats = tmp_path / "stats.json"
    flags = ["--checkpoint_path", str(tiny_dir), "--no-chat", "--max_new_tokens", "4", "--cache_strategy", "tova",
             "--max_cache_length", "0.5", "--batch_size", batch_size, "--stats_json", str(stats),
             "--prompt", "a prompt long enough for its budget to hold the protected tokens", "--prompt",
             "another prompt long enough for the budget", "--prompt", "hi"]
    with pytest.raises(UserError, match="budget of 3 tokens is smaller than the protected tokens"):
        generate.main(flags)
    assert "---- row" not in capsys.readouterr().out and not stats.exists()


def test_a_bfloat16_batch_past_its_batch_invariant_rows_says_so(tiny_dir, capsys, monkeypatch):
    """Past the rows the model keeps batch-invariant (8 with the CPU kernels; 2 here, set by hand) a bfloat16
    batch notes once that a row may keep other tokens than alone; a batch-invariant batch and float32 say
    nothing."""
    import cpu_bf16_kernels
    import generate

    monkeypatch.setattr(cpu_bf16_kernels, "batch_invariant", lambda weight, rows: rows <= 2)
    generate._note_rows.cache_clear()  # noted once per process: another test may have said it
    prompts = [arg for p in ("Hello there, how are you", "Hi", "What is a KV cache?") for arg in ("--prompt", p)]
    common = [*prompts, "--checkpoint_path", str(tiny_dir), "--no-chat", "--max_new_tokens", "6",
              "--cache_strategy", "heavy_hitter", "--max_cache_length", "0.5", "--global_tokens", "1",
              "--recent_window", "2"]
    generate.main([*common, "--batch_size", "3", "--dtype", "bfloat16"])
    assert capsys.readouterr().err.count("note: 3 rows in bfloat16 on cpu round their products by the batch, so a "
                                         "row may keep other tokens than in a batch-1 run") == 1
    for extra in (["--batch_size", "2", "--dtype", "bfloat16"], ["--batch_size", "3", "--dtype", "float32"]):
        generate.main([*common, *extra])
        assert "note:" not in capsys.readouterr().err


def test_batched_debug_rows_report_their_attention_loss(tiny_dir, capsys):
    """A debug_ twin over several prompts: each row's line gives its own attention loss, and the batch's
    statistics their mean over the rows (the row means of its per-row statistics, computed by hand)."""
    import generate

    stats = generate.main(["--prompt", "Hello there, how are you", "--prompt", "What is a KV cache?", "--batch_size",
                           "2", "--checkpoint_path", str(tiny_dir), "--no-chat", "--max_new_tokens", "6",
                           "--cache_strategy", "debug_heavy_hitter", "--max_cache_length", "0.5",
                           "--global_tokens", "1", "--recent_window", "2"])
    out = capsys.readouterr().out
    losses = [float(x) for x in re.findall(r"attention loss ([0-9.e-]+)\)", out)]
    assert len(losses) == 2 and any(x > 0 for x in losses)
    assert stats["attention_loss_mean"] == pytest.approx(sum(losses) / 2, abs=1e-5)
    assert re.search(r"^attention_loss_mean\s+[0-9.]+$", out, re.MULTILINE)


def test_ignore_eos_decodes_every_token_past_the_eos(tmp_path):
    """A short chat answer stops at its EOS; with --ignore_eos the same tokens go on to --max_new_tokens, one
    prompt and a batch alike (a batch's tok/s then counts equal tokens whatever the cache)."""
    import generate

    common = ["--prompt", "What is the capital of France?", "--max_new_tokens", "14"]
    for extra in ([], ["--prompt", "Hi", "--batch_size", "2"]):
        runs = {}
        for flag in ([], ["--ignore_eos"]):
            path = tmp_path / f"{len(extra)}{len(flag)}.json"
            generate.main([*common, *extra, *flag, "--stats_json", str(path)])
            payload = json.loads(path.read_text())
            runs[bool(flag)] = [r["tokens"] for r in payload.get("row_statistics", [payload])]
        for stopped, free in zip(runs[False], runs[True], strict=True):
            assert len(stopped) < 14 and len(free) == 14, (stopped, free)
            assert free[: len(stopped)] == stopped
