"""Numeric flags: a value that passes the type check but not the maths (a count of 0, NaN, a fraction above 1,
a seed past 2^32, a size past the model's context) is refused where it enters: exit 2, one `error:` line
naming the flag, no traceback, nothing written, and (for what the flags alone decide) no model loaded.

Two layers: AUDIT, the table read by a person (entry point, flag, bad values, the error expected), and the
generated matrix of tests/bad_input_matrix.py, every numeric flag of every entry point with the bad values
its declared range implies. In-process through errors.run_cli; one subprocess case checks the real command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bad_input_matrix import (
    ENTRY_POINTS,
    NOT_PROBED,
    probes,
    refused,
    registered_files,
    script_files,
    unranged_flags,
)
from tests.eval_helpers import PYDOC_EXCERPT

ROOT = Path(__file__).resolve().parent.parent


# (entry point, flag, bad values, fragment of the error line, refused before the model loads)
AUDIT: list[tuple[str, str, list[str], str, bool]] = [
    ("generate.py", "--max_new_tokens", ["0", "-1"], "--max_new_tokens", True),
    ("generate.py", "--temperature", ["-1", "nan", "inf", "1e999"], "--temperature", True),
    ("generate.py", "--top_k", ["0", "-3"], "--top_k", True),
    ("generate.py", "--batch_size", ["0", "-2"], "must be at least 1", True),
    ("generate.py", "--seed", ["-1", "4294967296", "99999999999999999999"], "--seed", True),
    ("generate.py", "--max_cache_length", ["0", "-0.5", "nan"], "--max_cache_length", True),
    ("generate.py", "--recent_window", ["-1", "1.5", "inf"], "--recent_window", True),
    ("generate.py", "--min_recovery_frac", ["0", "1.5"], "--min_recovery_frac", True),
    ("generate.py", "--snapkv_kernel", ["2", "0"], "--snapkv_kernel", True),
    ("python -m eval", "--limit", ["0", "-5"], "must be at least 1", True),
    ("python -m eval", "--seq_len", ["0"], "must be at least 1", True),
    ("python -m eval", "--max_new_tokens", ["0"], "must be at least 1", True),
    ("python -m eval", "--prefill_tokens", ["0"], "must be at least 1", True),
    ("python -m eval", "--text_offset", ["-1"], "must be at least 0", True),
    ("python -m eval", "--batch_size", ["0"], "must be at least 1", True),
    ("python -m eval.sweep", "--budgets", ["0", "-0.1"], "must be greater than 0", True),
    ("python -m eval.sweep", "--budgets", ["nan", "inf"], "not a finite number", True),
    ("python -m eval.sweep", "--seeds", ["-1", "4294967296"], "in [0, 2^32)", True),
    ("python -m eval.sweep", "--workers", ["0"], "must be at least 1", True),
    ("python -m eval.sweep", "--gpus_per_run", ["-1", "nan"], "--gpus_per_run", True),
    ("python -m eval.sweep", "--max_retries", ["-1"], "must be at least 0", True),
    ("python -m eval.reproduce", "--limit", ["0"], "must be at least 1", True),
    ("python -m eval.replay", "--item", ["-1"], "must be at least 0", True),
    ("train_gates.py", "--steps", ["0"], "must be at least 1", True),
    ("train_gates.py", "--seq_len", ["1"], "must be at least 2", True),
    ("train_gates.py", "--lr", ["0", "-0.1", "nan"], "--lr", True),
    ("train_gates.py", "--capacity_weight", ["-1", "inf"], "--capacity_weight", True),
    ("train_gates.py", "--seed", ["-1", "4294967296"], "in [0, 2^32)", True),
    ("train_gates.py", "--threads", ["-1", "100000"], "--threads", True),
    ("calibrate_duo.py", "--windows", ["0"], "must be at least 1", True),
    ("calibrate_duo.py", "--recent_window", ["0"], "must be at least 1", True),
    # sizes past the tiny model's context (1024 tokens): known only once the checkpoint is read
    ("generate.py", "--max_new_tokens", ["5000"], "exceeds the model's context", False),
    ("python -m eval", "--seq_len", ["100000"], "context", False),
    ("train_gates.py", "--seq_len", ["5000"], "exceeds the model's context", False),
    ("calibrate_duo.py", "--seq_len", ["5000"], "exceeds the model's context", False),
    ("calibrate_qfilters.py", "--seq_len", ["5000"], "exceeds the model's context", False),
    ("python -m eval.bench", "--batch_context", ["1023", "5000"], "exceeds the model's context", False),
]
# The rest of a command that makes an AUDIT flag mean something (--batch_context sizes --batch_sizes rows only).
AUDIT_MODE = {"python -m eval.bench": ["--batch_sizes", "1", "--new_tokens", "2"]}
AUDIT_CASES = [(e, f, v, frag, early) for e, f, values, frag, early in AUDIT for v in values]


def _with_tiny(entry: str, argv: list[str], tiny: Path) -> list[str]:
    extra = ["--checkpoint_path", str(tiny)]
    if entry == "python -m eval":
        extra += ["--text_file", str(PYDOC_EXCERPT)]
    return extra + AUDIT_MODE.get(entry, []) + argv


@pytest.mark.parametrize(("entry", "flag", "value", "fragment", "early"), AUDIT_CASES,
                         ids=[f"{e} {f} {v}" for e, f, v, _, _ in AUDIT_CASES])
def test_audit(entry, flag, value, fragment, early, tmp_path, capsys, monkeypatch, request):
    argv = [*ENTRY_POINTS[entry].prefix(tmp_path), f"{flag}={value}"]
    if not early:
        argv = _with_tiny(entry, argv, request.getfixturevalue("tiny_dir"))
    line = refused(entry, argv, tmp_path, capsys, monkeypatch, early)
    assert fragment in line, line
    assert flag in line or not early, line


def test_every_numeric_flag_has_a_range():
    assert unranged_flags() == [], "declare these flags' ranges (flag_types) or list them in RANGES_ELSEWHERE"


PROBES = probes()


@pytest.mark.parametrize("probe", PROBES, ids=[p.id for p in PROBES])
def test_generated_probe(probe, tmp_path, capsys, monkeypatch):
    line = refused(probe.entry, probe.argv(tmp_path), tmp_path, capsys, monkeypatch)
    assert probe.flag in line, line


def test_every_entry_point_is_probed():
    probed = {p.entry for p in PROBES}
    assert probed == set(ENTRY_POINTS), set(ENTRY_POINTS) - probed
    assert len(PROBES) >= 200


def test_every_command_line_script_is_in_the_matrix():
    """A new entry point joins the matrix (one EntryPoint line) or says here why not."""
    missing = script_files(ROOT) - registered_files(ROOT) - set(NOT_PROBED)
    assert missing == set(), f"add these to tests/bad_input_matrix.py ENTRY_POINTS: {sorted(missing)}"


@pytest.mark.parametrize("command", ENTRY_POINTS)
def test_help_describes_the_command_in_whole_sentences(command):
    """--help opens with the module's first paragraph whole: its first line alone used to stop mid-sentence
    ("... at a fixed budget: one shot vs")."""
    description = ENTRY_POINTS[command].parser().description
    assert description and "\n" not in description and description.rstrip().endswith((".", ")")), description


def test_the_command_line_refuses_in_one_line(tmp_path):
    """The real command (not main): the argparse refusal is one line and exit 2, before torch loads a model."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train_gates.py", "--steps", "0", "--out", str(tmp_path / "g")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == ["error: argument --steps: must be at least 1, got 0"]
    assert list(tmp_path.iterdir()) == []


def test_weights_that_overflow_the_dtype_are_one_line(tiny_dir, tmp_path, capsys, monkeypatch):
    """A float32 checkpoint with a 1e5 weight passes the finite check, then overflows --dtype float16."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = shutil.copytree(tiny_dir, tmp_path / "model")
    weights = directory / "model.safetensors"
    state = load_file(str(weights))
    state["model.layers.0.self_attn.q_proj.weight"][0, 0] = 1e5
    save_file(state, str(weights))
    argv = [*ENTRY_POINTS["generate.py"].prefix(tmp_path), "--checkpoint_path", str(directory), "--dtype", "float16"]
    line = refused("generate.py", argv, tmp_path, capsys, monkeypatch, early=False)
    assert "beyond float16's range" in line and "--dtype float32" in line, line
