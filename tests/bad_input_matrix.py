"""The shared bad-input matrix: every command-line entry point, and for each the bad values of every numeric
flag its parser defines, derived from the parser itself.

An entry point joins by one line in ENTRY_POINTS (its module, its parser and the argv that makes the rest of
the command valid). Its numeric flags are then found by walking the parser: a flag typed with a
flag_types.Number brings its own range; a strategy's cache.Setting brings its declared range; a flag typed
`int` or `finite_float` in a module that declares no range yet must be listed in RANGES_ELSEWHERE, or
`test_every_numeric_flag_has_a_range` fails naming it. So a new entry point or flag is probed the moment
it exists, and a plain `type=float` cannot slip in unprobed.

Each case (entry point, flag, bad value) must exit 2 with one `error:` line that names the flag, no
traceback, before any model is loaded, and leave the workspace as it was (tests/test_numeric_flags.py).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch._inductor.config

import calibrate_duo
import calibrate_qfilters
import generate
import train_gates
from benchmarks import (
    adakv_allocation,
    adapter_batching,
    batched_prefill,
    gated_fidelity,
    kvpress_scores,
    kvpress_side_by_side,
    prefill_memory,
    quantized_attention,
    received_attention,
    strategy_report,
    streaming_past_context,
)
from cache import finite_float
from cache_spec import strategy_settings
from errors import run_cli
from eval import cli, kvpress_runs, plot, replay, sweep
from eval.bench import cli as bench_cli
from eval.bench import measure as bench_measure
from eval.reproduce import cli as reproduce_cli
from eval.reproduce.experiments import EXPERIMENTS
from flag_types import NON_NEGATIVE, POSITIVE, SEED, Number, count, real


@dataclass(frozen=True)
class EntryPoint:
    command: str  # as a user types it
    main: Callable[[list[str] | None], object]
    parser: Callable[[], argparse.ArgumentParser]
    prefix: Callable[[Path], list[str]]  # argv, in a workspace, that makes the rest of the command valid
    loaders: tuple[ModuleType, ...]  # modules whose load_checkpoint / load_model a probe must never reach


ENTRY_POINTS: dict[str, EntryPoint] = {e.command: e for e in [
    EntryPoint("generate.py", generate.main, generate.build_parser,
               lambda w: ["--prompt", "Hi", "--max_new_tokens", "2", "--stats_json", str(w / "stats.json")],
               (generate,)),
    EntryPoint("python -m eval", cli.main, cli.build_parser,
               lambda w: ["--tasks", "fidelity", "--out_dir", str(w / "results"), "--no-baseline"], (cli,)),
    EntryPoint("python -m eval.sweep", sweep.main, sweep.build_parser,
               lambda w: ["--strategies", "recent_global", "--out_dir", str(w / "results")], (cli,)),
    EntryPoint("python -m eval.bench", bench_cli.main, bench_cli.build_parser,
               lambda w: ["--dry_run", "--out_dir", str(w / "bench")], (bench_cli, bench_measure)),
    EntryPoint("python -m eval.reproduce", reproduce_cli.main, reproduce_cli.build_parser,
               lambda w: [next(iter(EXPERIMENTS)), "--dry_run", "--runs_dir", str(w / "runs")], (cli,)),
    EntryPoint("python -m eval.replay", replay.main, replay.build_parser,
               lambda w: [str(w / "results" / "a-run")], (cli,)),
    EntryPoint("train_gates.py", train_gates.main, train_gates.build_parser,
               lambda w: ["--steps", "1", "--out", str(w / "gates.safetensors")], (train_gates,)),
    EntryPoint("calibrate_duo.py", calibrate_duo.main, calibrate_duo.build_parser,
               lambda w: ["--out", str(w / "duo.json")], (calibrate_duo,)),
    EntryPoint("calibrate_qfilters.py", calibrate_qfilters.main, calibrate_qfilters.build_parser,
               lambda w: ["--out", str(w / "qfilters.json")], (calibrate_qfilters,)),
    EntryPoint("python -m eval.plot", plot.main, plot.build_parser, lambda w: ["--out_dir", str(w)], ()),
    # its run subcommand's own flags; the flags it passes on are python -m eval's, probed above (export,
    # import and table take no numbers; ruler_file passes every flag but --to on to python -m eval)
    EntryPoint("python -m eval.kvpress_runs run", kvpress_runs.main, kvpress_runs.run_parser,
               lambda w: ["run", "--compression_ratio", "0.5", "--out_dir", str(w / "results"), "--no-baseline"],
               (cli,)),
    EntryPoint("python -m benchmarks.gated_fidelity", gated_fidelity.main, gated_fidelity.build_parser,
               lambda w: ["--out", str(w / "gated.json")], (gated_fidelity,)),
    EntryPoint("python -m benchmarks.streaming_past_context", streaming_past_context.main,
               streaming_past_context.build_parser, lambda w: ["--out", str(w / "streaming.json")],
               (streaming_past_context,)),
    EntryPoint("python -m benchmarks.adakv_allocation", adakv_allocation.main, adakv_allocation.build_parser,
               lambda w: ["--out", str(w / "adakv.json")], (adakv_allocation,)),
    EntryPoint("python -m benchmarks.kvpress_side_by_side", kvpress_side_by_side.main,
               kvpress_side_by_side.build_parser, lambda w: ["--out", str(w / "sbs.json")], (kvpress_side_by_side,)),
    EntryPoint("python -m benchmarks.kvpress_scores", kvpress_scores.main, kvpress_scores.build_parser,
               lambda w: ["--out", str(w / "scores.json")], (kvpress_scores,)),
    EntryPoint("python -m benchmarks.adapter_batching", adapter_batching.main, adapter_batching.build_parser,
               lambda w: ["--out", str(w / "adapter_batching.json")], (adapter_batching,)),
    EntryPoint("python -m benchmarks.batched_prefill", batched_prefill.main, batched_prefill.build_parser,
               lambda w: ["--out", str(w / "batched_prefill.json")], (batched_prefill,)),
    EntryPoint("python -m benchmarks.prefill_memory", prefill_memory.main, prefill_memory.build_parser,
               lambda w: ["--out", str(w / "prefill_memory.json")], (prefill_memory,)),
    EntryPoint("python -m benchmarks.received_attention", received_attention.main, received_attention.build_parser,
               lambda w: ["--out", str(w / "received.json")], (received_attention,)),
    EntryPoint("python -m benchmarks.strategy_report", strategy_report.main, strategy_report.build_parser,
               lambda w: ["--strategies", "l2", "--out", str(w / "report.json")], (strategy_report,)),
    EntryPoint("python -m benchmarks.quantized_attention", quantized_attention.main,
               quantized_attention.build_parser, lambda w: ["--out", str(w / "quantized.json")],
               (quantized_attention,)),
]}
# Command-line scripts outside this matrix, each with the reason; any other module that runs `run_cli` must
# join ENTRY_POINTS (test_every_command_line_script_is_in_the_matrix).
NOT_PROBED: dict[str, str] = {
    "benchmarks/foundation_speed.py": "takes no flags (its parser refuses any word)",
    "benchmarks/checkpoint_load_memory.py": "no numeric flags (--size has choices, --dir is a path)",
    "eval/compare.py": "no numeric flags (two run directories and metric names; tests/test_eval_compare.py)",
}

# Ranges of flags typed `int` or `finite_float` in modules that do not declare one yet (cache_spec's shared
# cache flags, generate.py's sampling flags): what the entry point's own checks enforce.
RANGES_ELSEWHERE: dict[str, Number] = {
    "--max_cache_length": POSITIVE,
    "--global_tokens": count(0),
    "--recent_window": NON_NEGATIVE,
    "--seed": SEED,
    "--q_group_size": count(),
    "--residual_length": count(),
    "--adakv_floor": real(0, 1),
    "--prefill_chunk": count(),
    "--max_new_tokens": count(),
    "--top_k": count(),
    "--temperature": NON_NEGATIVE,
}
_PLAIN_NUMBER_TYPES = {int, float, finite_float}


def _setting_ranges() -> dict[str, tuple[Number, list[str]]]:
    """Each strategy setting's flag: its declared range, plus an even value for an odd-only one."""
    out = {}
    for _, s in strategy_settings():
        if s.type in (int, finite_float) and s.choices is None:
            kind = int if s.type is int else float
            extra = ["2"] if s.odd else []
            out[f"--{s.name}"] = (Number(kind, s.low, s.high, s.low_open), extra)
    return out


def numeric_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's optional flags that take numbers (choices-restricted ones are argparse's to check)."""
    return [a for a in parser._actions if a.option_strings and a.choices is None
            and (isinstance(a.type, Number) or a.type in _PLAIN_NUMBER_TYPES)]


def flag_range(action: argparse.Action) -> tuple[Number, list[str]] | None:
    """(the flag's range, extra bad words), or None when nothing declares one."""
    flag = action.option_strings[0]
    if isinstance(action.type, Number):
        return action.type, []
    settings = _setting_ranges()
    if flag in settings:
        return settings[flag]
    if flag in RANGES_ELSEWHERE:
        return RANGES_ELSEWHERE[flag], []
    return None


@dataclass(frozen=True)
class Probe:
    entry: str
    flag: str
    value: str

    @property
    def id(self) -> str:
        return f"{self.entry} {self.flag} {self.value}"

    def argv(self, workspace: Path) -> list[str]:
        return [*ENTRY_POINTS[self.entry].prefix(workspace), f"{self.flag}={self.value}"]


def probes() -> list[Probe]:
    """Every (entry point, numeric flag, bad value) the parsers imply; flags without a range are skipped here
    and reported by test_every_numeric_flag_has_a_range."""
    found = []
    for name, entry in ENTRY_POINTS.items():
        for action in numeric_actions(entry.parser()):
            declared = flag_range(action)
            if declared is None:
                continue
            number, extra = declared
            for value in dict.fromkeys(number.bad_values() + extra):
                found.append(Probe(name, action.option_strings[0], value))
    return found


def unranged_flags() -> list[str]:
    return [f"{name} {a.option_strings[0]}" for name, entry in ENTRY_POINTS.items()
            for a in numeric_actions(entry.parser()) if flag_range(a) is None]


def script_files(root: Path) -> set[str]:
    """Every module that runs as a command (calls errors.run_cli), as the file of the `main` it runs: a
    package's __main__.py stands for the module it imports main from."""
    found = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith((".", "tests/")) or "/." in rel or rel == "errors.py" or "run_cli(" not in path.read_text():
            continue
        imported = re.search(r"^from ([\w.]+) import main$", path.read_text(), re.MULTILINE)
        if path.name == "__main__.py" and imported:
            rel = imported.group(1).replace(".", "/") + ".py"
        found.add(rel)
    return found


def registered_files(root: Path) -> set[str]:
    return {Path(inspect.getsourcefile(e.main)).resolve().relative_to(root).as_posix()
            for e in ENTRY_POINTS.values()}


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def tripwire(*args: object, **kwargs: object) -> None:
    raise AssertionError("a model was loaded before the flags were checked")


def refused(entry: str | EntryPoint, argv: list[str], workspace: Path, capsys, monkeypatch, early: bool = True) -> str:
    """Run the entry point (a name in ENTRY_POINTS, or one outside the matrix) in-process; assert the refusal
    contract and return its error line."""
    entry = ENTRY_POINTS[entry] if isinstance(entry, str) else entry
    cli.load_model.cache_clear()
    if early:
        for module in entry.loaders:
            for name in ("load_checkpoint", "load_model"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, tripwire)
    (workspace / "existing.json").write_text('{"old": true}\n')  # an existing output no refusal may touch
    before = snapshot(workspace)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(entry.main, argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    assert snapshot(workspace) == before, "a refused command wrote files"
    # The process goes on (a notebook, the next test): a refusal leaves torch's global modes as it found them.
    assert torch.is_grad_enabled() and not torch._inductor.config.freezing, "a refused command left torch's modes"
    return errors[0]
