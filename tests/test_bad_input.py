"""The bad-input matrix: every entry point (generate.py, python -m eval, eval.sweep, eval.plot, train_gates.py)
given hostile input answers with exit status 2 and exactly one `error:` line, no traceback, leaves every
file that existed before unchanged and no temporary file behind. Cases marked `early` must fail before
any model is loaded (the loaders are replaced by a tripwire).

In-process through `errors.run_cli` (what `python X.py` runs) to stay fast: the command-line wrapper
itself is covered by subprocess tests in test_generate_cli.py and test_eval_cli.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import generate
import train_gates
from errors import run_cli
from eval import cli, plot, sweep
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    )

BINARY = bytes(range(256)) * 4  # not UTF-8 (0xff never is)


def _gates_file(tiny_dir: Path, path: Path, edit: Callable[[dict], None]) -> Path:
    """Gates saved for the tiny model (so the identity matches), then edited tensor by tensor."""
    from safetensors import safe_open

    from gates import new_gates, save_gates

    model, _ = cli.load_model(str(tiny_dir), "cpu", torch.float32)
    save_gates(new_gates(model), model, path, {"model_name": "tiny"})
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    edit(tensors)
    path.unlink()
    save_file(tensors, str(path), metadata=metadata)
    return path


@dataclass
class Workspace:
    root: Path
    tiny: Path

    def file(self, name: str, content: str | bytes) -> str:
        path = self.root / "inputs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def jsonl(self, name: str, rows: list[dict]) -> str:
        return self.file(name, "".join(json.dumps(r) + "\n" for r in rows))

    def broken_checkpoint(self, content: bytes | None, name: str = "model.safetensors") -> str:
        """A copy of the tiny checkpoint whose file `name` is `content` (None: cut in half)."""
        path = self.root / "inputs" / "broken_model"
        shutil.copytree(self.tiny, path)
        broken = path / name
        broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2] if content is None else content)
        return str(path)

    @property
    def stats(self) -> str:
        return str(self.root / "out" / "stats.json")

    @property
    def results(self) -> str:
        return str(self.root / "results")

    def eval_flags(self, *flags: str) -> list[str]:
        return ["--checkpoint_path", str(self.tiny), "--tasks", "fidelity", "--text_file", str(PYDOC_EXCERPT),
                "--seq_len", "64", "--prefill_tokens", "16", "--out_dir", self.results, "--no-baseline", *flags]

    def gen(self, *flags: str) -> list[str]:
        return ["--prompt", "Hello there", "--max_new_tokens", "2", "--stats_json", self.stats, *flags]


@pytest.fixture
def ws(tmp_path, tiny_dir) -> Workspace:
    """Pre-existing outputs the failed commands must not touch: a stats file, a finished-looking run and
    its results.csv, a plots directory."""
    w = Workspace(tmp_path, tiny_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stats.json").write_text('{"old": true}\n')
    run = tmp_path / "results" / "tiny" / "fidelity" / "recent_global-b0.5-s0-0123456789"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"model": "tiny", "task": "fidelity", "strategy": "recent_global",
                                                  "budget": 0.5, "identity": "0" * 16, "kl_mean": 0.1}))
    (run / "config.json").write_text("{}\n")
    (tmp_path / "results" / "results.csv").write_text("model,task\ntiny,fidelity\n")
    return w


def grid(w: Workspace, text: str | bytes) -> list[str]:
    return ["--grid", w.file("grid.yaml", text), "--out_dir", w.results]


def preset(w: Workspace, text: str | bytes) -> list[str]:
    return ["--cache_config", w.file("preset.yaml", text)]


def qa(w: Workspace, rows: list[dict], *flags: str) -> list[str]:
    return ["--checkpoint_path", str(w.tiny), "--tasks", "qa", "--dataset", w.jsonl("rows.jsonl", rows),
            "--prompt_column", "q", "--answer_column", "a", "--limit", "3", "--max_new_tokens", "1",
            "--out_dir", w.results, "--no-baseline", *flags]


def mc(w: Workspace, rows: list[dict]) -> list[str]:
    return ["--checkpoint_path", str(w.tiny), "--tasks", "multiple_choice", "--dataset", w.jsonl("mc.jsonl", rows),
            "--prompt_column", "q", "--answer_column", "a", "--choices_column", "c", "--out_dir", w.results,
            "--no-baseline"]


def gated(w: Workspace, edit: Callable[[dict], None]) -> list[str]:
    path = _gates_file(w.tiny, w.root / "inputs" / "gates.safetensors", edit)
    # 60 prompt tokens (one per byte): a budget of half holds more than the protected 4 + 10 tokens
    return ["--prompt", "Hello there " * 5, "--max_new_tokens", "2", "--checkpoint_path", str(w.tiny), "--no-chat",
            "--cache_strategy", "gated", "--max_cache_length", "0.5", "--gates_path", str(path)]


def nan_first(tensors: dict) -> None:
    tensors["layers.0.weight"][0, 0] = float("nan")


def wrong_shape(tensors: dict) -> None:
    tensors["layers.1.bias"] = torch.zeros(7)


GEN, EVAL, SWEEP, PLOT, TRAIN = generate.main, cli.main, sweep.main, plot.main, train_gates.main

# name: (entry point, argv builder, fragment of the error line, fails before any model is loaded)
CASES: dict[str, tuple[Callable, Callable[[Workspace], list[str]], str, bool]] = {
    # ---- generate.py: numbers finite and in range -------------------------------------------------------
    "gen budget nan": (GEN, lambda w: w.gen("--max_cache_length", "nan"), "not a finite number", True),
    "gen budget inf": (GEN, lambda w: w.gen("--max_cache_length", "0.5", "inf"), "not a finite number", True),
    "gen recent window 1.5": (GEN, lambda w: w.gen("--recent_window", "1.5"), "integer", True),
    "gen recent window nan": (GEN, lambda w: w.gen("--recent_window", "nan"), "not a finite number", True),
    "gen recovery inf": (GEN, lambda w: w.gen("--min_recovery_frac", "inf"), "not a finite number", True),
    "gen temperature -1": (GEN, lambda w: w.gen("--temperature", "-1"), "--temperature", True),
    "gen temperature nan": (GEN, lambda w: w.gen("--temperature", "nan"), "not a finite number", True),
    "gen top_k 0": (GEN, lambda w: w.gen("--top_k", "0"), "--top_k", True),
    "gen top_k -3": (GEN, lambda w: w.gen("--top_k", "-3"), "--top_k", True),
    "gen top_k 1.5": (GEN, lambda w: w.gen("--top_k", "1.5"), "invalid int value", True),
    # ---- prompts -----------------------------------------------------------------------------------------
    "gen binary prompt .txt": (GEN, lambda w: ["--prompt", w.file("p.txt", BINARY)], "not UTF-8", True),
    "gen binary prompt .md": (GEN, lambda w: ["--prompt", w.file("notes.md", BINARY)], "not UTF-8", True),
    "gen empty prompt .md": (GEN, lambda w: ["--prompt", w.file("empty.md", " \n")], "empty", True),
    "gen missing prompt .txt": (GEN, lambda w: ["--prompt", str(w.root / "nope.txt")], "not found", True),
    "gen prompt is a directory": (GEN, lambda w: ["--prompt", str(w.root)], "directory", True),
    "gen second prompt empty": (GEN, lambda w: w.gen("--prompt", "   "), "empty", True),
    "gen batch_size 0": (GEN, lambda w: w.gen("--prompt", "Hi", "--batch_size", "0"), "batch_size", True),
    # A batch is checked whole before any row decodes: one prompt past the context fails the run.
    "gen one batched prompt too long": (GEN, lambda w: w.gen("--prompt", "Hello there " * 200, "--checkpoint_path",
                                                             str(w.tiny), "--no-chat", "--overwrite"),
                                        "exceeds the model's context", False),
    # ---- where the statistics go: refused before the run -------------------------------------------------
    "gen stats exists": (GEN, lambda w: w.gen(), "--overwrite", True),
    "gen stats is a directory": (GEN, lambda w: w.gen("--stats_json", str(w.root / "out"), "--overwrite"),
                                 "is a directory", True),
    "gen stats unwritable": (GEN, lambda w: w.gen("--stats_json", "/proc/kv-evict/stats.json"), "cannot write", True),
    # ---- presets: one typed schema -----------------------------------------------------------------------
    "preset empty": (GEN, lambda w: w.gen(*preset(w, "# nothing\n")), "is empty", True),
    "preset binary": (GEN, lambda w: w.gen(*preset(w, BINARY)), "not UTF-8", True),
    "preset malformed": (GEN, lambda w: w.gen(*preset(w, "cache_strategy: [l2\n")), "malformed YAML", True),
    "preset a list": (GEN, lambda w: w.gen(*preset(w, "- l2\n")), "mapping", True),
    "preset stats_json": (GEN, lambda w: w.gen(*preset(w, f"stats_json: {w.stats}\n"), "--overwrite"),
                          "unknown cache flag 'stats_json'", True),
    "preset overwrite": (GEN, lambda w: w.gen(*preset(w, "overwrite: true\n")), "unknown cache flag 'overwrite'", True),
    "preset chat": (GEN, lambda w: w.gen(*preset(w, "chat: true\n")), "unknown cache flag 'chat'", True),
    "preset switch as text": (GEN, lambda w: w.gen(*preset(w, 'attn_thresholding: "no"\n')), "true or false", True),
    "preset nan": (GEN, lambda w: w.gen(*preset(w, "recent_window: .nan\n")), "finite", True),
    "preset bad list item": (GEN, lambda w: w.gen(*preset(w, "max_cache_length: [0.5, half]\n")), "finite", True),
    "preset fractional int": (GEN, lambda w: w.gen(*preset(w, "global_tokens: 1.5\n")), "integer", True),
    "preset mapping value": (GEN, lambda w: w.gen(*preset(w, "cache_strategy: {l2: 1}\n")), "string", True),
    "preset bool as number": (GEN, lambda w: w.gen(*preset(w, "snapkv_window: true\n")), "integer", True),
    "preset duplicate key": (GEN, lambda w: w.gen(*preset(w, "max_cache_length: 0.5\nmax_cache_length: 0.25\n")),
                             "preset.yaml line 2: key 'max_cache_length' is given twice", True),
    "preset 1e-1": (GEN, lambda w: w.gen(*preset(w, "max_cache_length: 1e-1\n")), "text in YAML 1.1, not a number "
                    "(its floats need a dot and a signed exponent): write 1.0e-1", True),
    # ---- model and gates files (the model loads: these are found while reading the files) ----------------
    "garbage safetensors": (GEN, lambda w: ["--prompt", "Hi", "--checkpoint_path", w.broken_checkpoint(BINARY)],
                            "not a safetensors file", False),
    "truncated safetensors": (GEN, lambda w: ["--prompt", "Hi", "--checkpoint_path", w.broken_checkpoint(None)],
                              "is truncated", False),
    "garbage tokenizer.json": (GEN, lambda w: ["--prompt", "Hi", "--checkpoint_path",
                                               w.broken_checkpoint(BINARY, "tokenizer.json")], "cannot read", False),
    "truncated config.json": (GEN, lambda w: ["--prompt", "Hi", "--checkpoint_path",
                                              w.broken_checkpoint(None, "config.json")], "not valid JSON", False),
    "gates with NaN": (GEN, lambda w: gated(w, nan_first), "layers.0.weight has non-finite", False),
    "gates of a wrong shape": (GEN, lambda w: gated(w, wrong_shape), "layers.1.bias has shape", False),
    "gates garbage": (GEN, lambda w: ["--prompt", "Hi", "--checkpoint_path", str(w.tiny), "--cache_strategy",
                                      "gated", "--gates_path", w.file("g.safetensors", BINARY)],
                      "cannot read gates file", False),
    # ---- python -m eval ----------------------------------------------------------------------------------
    "eval budget nan": (EVAL, lambda w: w.eval_flags("--cache_strategy", "l2", "--max_cache_length", "nan"),
                        "not a finite number", True),
    "eval recent window 1.5": (EVAL, lambda w: w.eval_flags("--cache_strategy", "l2", "--recent_window", "1.5"),
                               "integer", True),
    "eval preset query_aware": (EVAL, lambda w: w.eval_flags(*preset(w, "query_aware: true\n")),
                                "unknown cache flag 'query_aware'", True),
    "eval out_dir is a file": (EVAL, lambda w: w.eval_flags("--out_dir", str(Path(w.stats))),
                               "is not a directory", True),
    "eval prompt as long as the window": (EVAL, lambda w: w.eval_flags("--prefill_tokens", "64"),
                                          "--prefill_tokens must be in [1, --seq_len 64), got 64", True),
    "eval dataset without its column": (EVAL, lambda w: w.eval_flags("--dataset", "some/corpus"),
                                        "fidelity with --dataset needs --text_column", True),
    "eval kvpress protocol decoding first": (EVAL, lambda w: qa(w, [{"q": "one?", "a": "1"}], "--protocol", "kvpress",
                                                               "--decode_first_token"),
                                             "does not combine with --decode_first_token", True),
    "eval kvpress protocol two budgets": (EVAL, lambda w: qa(w, [{"q": "one?", "a": "1"}], "--protocol", "kvpress",
                                                             "--cache_strategy", "l2", "--max_cache_length", "0.5",
                                                             "0.25"),
                                          "takes one --max_cache_length", True),
    "eval binary text file": (EVAL, lambda w: w.eval_flags("--text_file", w.file("t.txt", BINARY)),
                              "not UTF-8", False),
    "eval binary haystack": (EVAL, lambda w: ["--checkpoint_path", str(w.tiny), "--tasks", "niah_single",
                                              "--haystack", w.file("h.txt", BINARY), "--limit", "1",
                                              "--out_dir", w.results, "--no-baseline"], "not UTF-8", False),
    "qa row without answer": (EVAL, lambda w: qa(w, [{"q": "one?", "a": "1"}, {"q": "two?", "a": None}]),
                              "row 1 of", False),
    "qa row with empty answers": (EVAL, lambda w: qa(w, [{"q": "one?", "a": []}]), "no reference answer", False),
    "qa row without question": (EVAL, lambda w: qa(w, [{"q": "one?", "a": "1"}, {"q": None, "a": "2"}]),
                                "row 1 of", False),
    "mc choices not a list": (EVAL, lambda w: mc(w, [{"q": "pick", "a": 0, "c": "not a list"}]),
                              "must be a list", False),
    "mc answer out of range": (EVAL, lambda w: mc(w, [{"q": "pick", "a": 5, "c": ["x", "y"]}]),
                               "row 0 of", False),
    # ---- python -m eval.sweep: grids typed like the command line -----------------------------------------
    "sweep budgets nan": (SWEEP, lambda w: ["--budgets", "nan", "0.5", "--out_dir", w.results],
                          "not a finite number", True),
    "grid budget text": (SWEEP, lambda w: grid(w, "budgets: [half]\n"), "budgets takes a finite number", True),
    "grid args a list": (SWEEP, lambda w: grid(w, "args: [seq_len, 64]\n"), "args must be a mapping", True),
    "grid args overwrite": (SWEEP, lambda w: grid(w, "args: {overwrite: true}\n"), "set by the sweep", True),
    "grid args unknown": (SWEEP, lambda w: grid(w, "args: {seq_length: 64}\n"), "unknown eval flag 'seq_length'",
                          True),
    "grid args switch as text": (SWEEP, lambda w: grid(w, "args: {chat: 'yes'}\n"), "true or false", True),
    "grid unknown key": (SWEEP, lambda w: grid(w, "strategy: [l2]\n"), "unknown key 'strategy'", True),
    "grid seeds text": (SWEEP, lambda w: grid(w, "seeds: [zero]\n"), "seeds takes an integer", True),
    "grid empty": (SWEEP, lambda w: grid(w, ""), "is empty", True),
    "grid duplicate key": (SWEEP, lambda w: grid(w, "budgets: [0.5]\nseeds: [0]\nbudgets: [0.25]\n"),
                           "grid.yaml line 3: key 'budgets' is given twice (first on line 1)", True),
    "grid args duplicate key": (SWEEP, lambda w: grid(w, "args: {seq_len: 64, seq_len: 32}\n"),
                                "key 'seq_len' is given twice", True),
    "grid budget 1e-1": (SWEEP, lambda w: grid(w, "budgets: [0.5, 1e-1]\n"), "write 1.0e-1", True),
    "grid binary": (SWEEP, lambda w: grid(w, BINARY), "not UTF-8", True),
    # ---- python -m eval.plot -----------------------------------------------------------------------------
    "plot missing dir": (PLOT, lambda w: ["--out_dir", str(w.root / "nothing")], "not found", True),
    "plot only damaged runs": (PLOT, lambda w: ["--out_dir", w.file("damaged/m/t/r/metrics.json", "{")[:-len(
        "/m/t/r/metrics.json")]], "no finished runs", True),
    "plot smooth 0": (PLOT, lambda w: ["--out_dir", w.results, "--smooth", "0"], "--smooth", True),
    # ---- train_gates.py ----------------------------------------------------------------------------------
    "train lr nan": (TRAIN, lambda w: ["--lr", "nan", "--out", str(w.root / "g.safetensors")], "finite", True),
    "train capacity inf": (TRAIN, lambda w: ["--capacity", "inf", "--out", str(w.root / "g.safetensors")],
                           "finite", True),
    "train out is a directory": (TRAIN, lambda w: ["--checkpoint_path", str(w.tiny), "--out", str(w.root / "out"),
                                                   "--overwrite"], "is a directory", True),
    "train out exists": (TRAIN, lambda w: ["--checkpoint_path", str(w.tiny), "--out", w.stats], "--overwrite", True),
}


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def tripwire(*args: object, **kwargs: object) -> None:
    raise AssertionError("a model was loaded before the input was validated")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case, ws, capsys, monkeypatch):
    main, build, fragment, early = CASES[case]
    argv = build(ws)
    if early:
        for module in (generate, cli, train_gates):
            monkeypatch.setattr(module, "load_checkpoint", tripwire)
        cli.load_model.cache_clear()
    before = snapshot(ws.root)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2, err
    assert len(errors) == 1 and "Traceback" not in err, err
    assert fragment in errors[0], errors[0]
    after = snapshot(ws.root)
    assert {k: after.get(k) for k in before} == before  # every file that existed is unchanged
    assert not [k for k in after if ".tmp" in k], after  # and no temporary file is left behind


def test_the_matrix_is_large_enough():
    assert len(CASES) >= 40
