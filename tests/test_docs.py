"""The documentation against the code. Every flag README.md and docs/*.md name is one a command of this tool
defines (or another tool's, listed here); every flag of the tool's commands is in them (the benchmark scripts' in
their --help only); every cache flag (cache_spec.add_cache_arguments, every strategy's settings included) is in
docs/strategies.md; every file of the repository they name in backticks exists; and every relative link points
at a file that exists and, with an anchor, at one of its headings (GitHub's anchors: the heading lowercased,
punctuation but `-` and `_` dropped, spaces made `-`, a repeated heading numbered). A renamed or removed flag,
file or heading fails here until the docs follow."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from cache_spec import add_cache_arguments
from eval import compare, kvpress_runs
from tests.bad_input_matrix import ENTRY_POINTS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Flags of other tools the docs show commands of, and DESIGN.md's example of a strategy's own setting.
OTHER_TOOLS_FLAGS = {
    "--dist": "pytest-xdist", "--durations": "pytest", "--no-deps": "pip",
    "--head": "ray start", "--port": "ray start", "--num-cpus": "ray start", "--address": "ray start",
    "--odd_weight": "docs/DESIGN.md's example of a hypothetical strategy setting",
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]*(?:-[a-z0-9_]+)*")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def defined_flags() -> set[str]:
    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    for parser in [e.parser() for e in ENTRY_POINTS.values()] + [compare.build_parser(), kvpress_runs.build_parser()]:
        walk(parser)
    return flags


def heading_anchors(path: Path) -> set[str]:
    anchors, seen, in_code = set(), {}, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_flag_the_docs_name_is_defined():
    defined = defined_flags()
    assert {"--cache_strategy", "--max_cache_length", "--batch_size", "--prefill_chunk"} <= defined
    unknown = {(flag, doc.name) for doc in DOCS for flag in FLAG.findall(doc.read_text())
               if flag not in defined and flag not in OTHER_TOOLS_FLAGS}
    assert not unknown, sorted(unknown)


def mentioned(flag: str, text: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


def test_every_flag_of_the_tools_commands_is_documented():
    """generate.py, python -m eval and its subcommands, train_gates.py and the calibrations: each flag is named
    in README.md or docs/*.md (an on/off pair by either of its two forms)."""
    text = "\n".join(doc.read_text() for doc in DOCS)
    missing = []
    for command, entry in ENTRY_POINTS.items():
        if command.startswith("python -m benchmarks."):
            continue
        for action in entry.parser()._actions:
            flags = [f for f in action.option_strings if f.startswith("--") and f != "--help"]
            if flags and action.help != argparse.SUPPRESS and not any(mentioned(f, text) for f in flags):
                missing.append((command, flags[0]))
    assert missing == []


def test_every_cache_flag_is_in_the_strategies_doc():
    """docs/cli.md sends a reader there for "every cache flag"; a strategy's new setting joins the check."""
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    assert "--cache_strategy" in flags and "--snapkv_pooling" in flags
    text = (ROOT / "docs" / "strategies.md").read_text()
    assert [f for f in flags if f != "--help" and not mentioned(f, text)] == []


# A file path in backticks (`tests/test_docs.py`, `generate.py`), not a placeholder (`configs/NAME.yaml`).
PATH_IN_BACKTICKS = re.compile(r"`([a-z0-9_./-]+\.(?:py|md|sh|yaml|yml|json|toml|txt))`")


def test_every_repository_file_the_docs_name_exists():
    """A path under one of the repository's folders must be a tracked file; a bare file name (`runner.py`, in a
    section on eval/reproduce) the name of one. Output files the docs show (`results/summary.md`) are under no
    folder of the repository and are not checked."""
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    folders = {path.split("/")[0] for path in tracked if "/" in path}
    names = {path.rsplit("/", 1)[-1] for path in tracked}
    missing = set()
    for doc in DOCS:
        for path in PATH_IN_BACKTICKS.findall(doc.read_text()):
            in_repo = path.split("/")[0] in folders if "/" in path else path.endswith(".py")
            if in_repo and path not in tracked and ("/" in path or path not in names):
                missing.add((path, doc.name))
    assert not missing, sorted(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_heading(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_heading_anchors_follow_githubs_rule(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# Batches (`--batch_size`)\n```\n# not a heading\n```\n## GPU\n## GPU\n")
    assert heading_anchors(doc) == {"batches---batch_size", "gpu", "gpu-1"}
