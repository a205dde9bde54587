"""kvpress_dataset: rows in kvpress's layout (NVIDIA/kvpress `evaluation/benchmarks/*/create_huggingface_dataset.py`),
from a local JSON/JSONL/CSV/parquet file or, online and when asked for, its hub copy (`simonjegou/ruler` with
`--dataset_config 4096`, `Xnhyacinth/LongBench` with `--dataset_config <task>`; split `test`).

Columns: `context`, `question`, `answer_prefix`, the references (`answer` in the RULER copy, `answers` in the
LongBench one: a string or a list of strings), `task` (RULER's or LongBench's task name), `max_new_tokens`
(per row; `--max_new_tokens` overrides it, as kvpress's config does), and for LongBench's classification
tasks `all_classes`. Rows run in groups of one task and answer length under `--protocol kvpress` (each
context compressed once, the question appended uncompressed); `--limit` takes the first rows of each task.

Scores follow kvpress's calculate_metrics (eval/scorers.py, flavor "kvpress"): RULER string_match_all, or
string_match_part for qa_*; LongBench the task's own metric. A task's score is its item mean x100 rounded
to 2 decimals (`score_<task>`); `score`, the headline, is the mean over tasks, as the leaderboard averages
them. `context_compression_ratio` is kvpress's compression ratio as applied: 1 - kept / context tokens,
per item (the measured `compression_ratio` also counts the question and answer, which are never evicted).
"""

from __future__ import annotations

import ast
import io
import math
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from errors import UserError
from eval import scorers
from eval.data import LOCAL_FORMATS, load_rows, local_rows
from eval.harness import Runtime, Timings, average_stats
from eval.tasks.base import COMPRESS_QUESTIONS, Example, GenerationTask, TaskResult, is_kvpress, register_task, use_chat

T = TypeVar("T")
TEXT_COLUMNS = ("context", "question", "answer_prefix", "task")
ANSWER_COLUMNS = ("answer", "answers")  # the RULER copy's name, the LongBench copy's
LAYOUT = "context, question, answer_prefix, answer (or answers), task, max_new_tokens"
SCORER_FLAVOR = "kvpress"
SCORE = "score"


def score_key(task: str) -> str:
    return f"{SCORE}_{task}"


@dataclass
class Row:
    """One validated row of a kvpress-layout dataset."""

    example: Example
    task: str
    max_new_tokens: int | None
    all_classes: list[str] | None


def _where(source: str, index: int, column: str) -> str:
    return f"{source} row {index}, column {column!r}"


def _text(row: dict, column: str, source: str, index: int, required: bool) -> str:
    value = row.get(column)
    if value is None or (isinstance(value, float) and math.isnan(value)):  # CSV reads an empty cell as NaN
        value = ""
    if not isinstance(value, str):
        raise UserError(f"{_where(source, index, column)} must be text, got {type(value).__name__} {value!r:.60}")
    if required and not value.strip():
        raise UserError(f"{_where(source, index, column)} is empty")
    return value


def list_literal(text: str) -> list[str] | None:
    """The strings of a list written as text: JSON, a Python list (what pandas writes for a list cell) or a
    numpy array's repr (what pandas writes for one, as kvpress's predictions.csv holds: `['a' 'b']`, where
    Python's literal_eval would join the two into 'ab'); None when it is none of them."""
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    body = [t for t in tokens if t.type not in (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER)]
    if body[0].string != "[" or body[-1].string != "]":
        return None
    values = []
    for t in body[1:-1]:
        if t.type == tokenize.STRING:
            values.append(ast.literal_eval(t.string))
        elif t.string != ",":
            return None
    return values


def _string_list(value: object, where: str, what: str) -> list[str]:
    """A string or a list of strings; a cell holding a list written as text (list_literal) is parsed first."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        parsed = list_literal(value)
        if parsed is None:
            raise UserError(f"{where}: {what} looks like a list but is not one of strings: {value!r:.60}")
        value = parsed
    if isinstance(value, tuple):
        value = list(value)
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise UserError(f"{where} must be {what}: a string or a non-empty list of strings, got "
                        f"{type(value).__name__} {value!r:.60}")
    return values


def _max_new_tokens(row: dict, source: str, index: int, override: int | None) -> int | None:
    if override is not None:
        return None
    value = row.get("max_new_tokens")
    if isinstance(value, float) and value.is_integer():  # parquet/CSV columns with a gap turn float
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{_where(source, index, 'max_new_tokens')} must be a positive integer (or pass "
                        f"--max_new_tokens), got {value!r:.60}")
    return value


def check_layout(rows: list[dict], source: str, max_new_tokens: int | None) -> str:
    """The answer column's name, once every column kvpress's layout needs is there."""
    columns = list(rows[0])
    needed = [*TEXT_COLUMNS, *([] if max_new_tokens is not None else ["max_new_tokens"])]
    answer = next((c for c in ANSWER_COLUMNS if c in columns), None)
    missing = [c for c in needed if c not in columns] + ([] if answer else ["answer (or answers)"])
    if missing:
        raise UserError(f"{source}: no column {', '.join(repr(m) for m in missing)} (kvpress's layout: {LAYOUT}); "
                        f"its columns: {', '.join(columns)}")
    return answer


def parse_rows(rows: list[dict], source: str, max_new_tokens: int | None) -> list[Row]:
    """Every row checked (text columns, a known task, references, answer length), naming the first bad one;
    RULER and LongBench tasks are not mixed (their averages mean different things)."""
    answer = check_layout(rows, source, max_new_tokens)
    parsed, benchmarks = [], {}
    for index, row in enumerate(rows):
        task = _text(row, "task", source, index, required=True)
        benchmark = scorers.benchmark_of(task)
        try:
            scorers.task_metric(task)
        except UserError as e:
            raise UserError(f"{_where(source, index, 'task')}: {e}") from None
        benchmarks.setdefault(benchmark, index)
        if len(benchmarks) > 1:
            first = dict(zip(benchmarks.values(), benchmarks, strict=True))
            raise UserError(f"{source} mixes RULER and LongBench tasks (row {min(first)} is {first[min(first)]}, "
                            f"row {index} {benchmark}); score them as separate datasets")
        refs = _string_list(row.get(answer), _where(source, index, answer), "the references")
        classes = row.get("all_classes")
        if scorers.task_metric(task) == "classification_score":
            classes = _string_list(classes, _where(source, index, "all_classes"), "the classes")
        example = Example(_text(row, "context", source, index, required=True),
                          _text(row, "question", source, index, required=False),
                          _text(row, "answer_prefix", source, index, required=False), answers=refs)
        parsed.append(Row(example, task, _max_new_tokens(row, source, index, max_new_tokens),
                          classes if isinstance(classes, list) else None))
    return parsed


def task_groups(rows: list[Row], limit: int | None) -> dict[tuple[str, int | None], list[Row]]:
    """Rows by (task, answer length), in order of first appearance; the first `limit` rows of each task."""
    groups: dict[tuple[str, int | None], list[Row]] = {}
    taken: dict[str, int] = {}
    for row in rows:
        if limit is not None and taken.get(row.task, 0) >= limit:
            continue
        taken[row.task] = taken.get(row.task, 0) + 1
        groups.setdefault((row.task, row.max_new_tokens), []).append(row)
    return groups


@register_task
class KvpressDataset(GenerationTask):
    name = "kvpress_dataset"
    metrics = (SCORE,)
    reads = GenerationTask.reads + ("dataset", "dataset_config", "split")
    defaults = {"split": "test"}
    required = ("dataset",)
    required_note = " (a local file in kvpress's layout, or its hub name)"

    def __init__(self, args) -> None:
        super().__init__(args)
        if not is_kvpress(self.options["protocol"]):
            raise UserError("kvpress_dataset runs under --protocol kvpress (each context compressed once to its "
                            "budget, as kvpress does); pass it, or use python -m eval.kvpress_runs run")
        self._group: list[Row] = []
        source = Path(self.options["dataset"])
        if source.suffix.lower() in LOCAL_FORMATS or source.exists():  # a local file: refused before any model loads
            parse_rows(local_rows(source), str(source), self.options["max_new_tokens"])

    def examples(self, rt: Runtime) -> list[Example]:
        # kvpress without a chat template: `question + "\n" + answer_prefix` (pipeline.py preprocess).
        newline = "" if use_chat(rt) else "\n"
        # Under compress_questions kvpress compresses context + question and feeds "\n" + answer_prefix after.
        after = self.options["protocol"] == COMPRESS_QUESTIONS
        out = []
        for row in self._group:
            ex = row.example
            question, prefix = (ex.question, newline + ex.answer_prefix) if after else (ex.question + newline,
                                                                                      ex.answer_prefix)
            # The classes go into the predictions so an exported run rescores (kvpress's predictions.csv keeps them).
            classes = {"all_classes": row.all_classes} if row.all_classes else {}
            out.append(Example(ex.context, question, prefix, answers=ex.answers,
                               meta={"task": row.task, "question": ex.question, "answer_prefix": ex.answer_prefix,
                                     "max_new_tokens": self.options["max_new_tokens"], **classes}))
        return out

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        task = example.meta["task"]
        value = scorers.item_score(task, prediction, example.answers, self._classes[task], SCORER_FLAVOR)
        return {SCORE: 100 * value}

    def by_task(self, rt: Runtime, what: Callable[[Runtime], T]) -> list[tuple[str, T]]:
        """`what` (a GenerationTask's run or check) over each task's rows in turn, with its answer length."""
        o = self.options
        source = o["dataset"]
        rows = parse_rows(load_rows(source, o["dataset_config"], o["split"]), source, o["max_new_tokens"])
        self._classes = {r.task: r.all_classes for r in rows}  # LongBench's classes are the same for a task
        results = []
        fixed = o["max_new_tokens"]
        try:
            for (task, max_new), group in task_groups(rows, o["limit"]).items():
                self._group, o["max_new_tokens"] = group, fixed or max_new
                results.append((task, what(rt)))
        finally:
            o["max_new_tokens"], self._group = fixed, []
        return results

    def check_inputs(self, rt: Runtime) -> None:
        self.by_task(rt, super().check_inputs)

    def run(self, rt: Runtime) -> TaskResult:
        return merged_result(self.by_task(rt, super().run))


def merged_result(results: list[tuple[str, TaskResult]]) -> TaskResult:
    """One result from the runs of each group: items renumbered in order, scores per task and their mean."""
    predictions, items, stats, per_task = [], [], [], {}
    timings = Timings()
    for _, result in results:
        offset = len(predictions)
        predictions += [{**p, "index": p["index"] + offset} for p in result.predictions]
        items += [{**it, "index": it["index"] + offset} for it in result.items]
        stats += [result.stats] * len(result.predictions)  # weighted by the group's items
        for name in ("prefill_tokens", "prefill_seconds", "decode_tokens", "decode_seconds", "compile_seconds",
                     "compiling_steps"):
            setattr(timings, name, getattr(timings, name) + getattr(result.timings, name))
        timings.step_seconds += result.timings.step_seconds
    for p in predictions:
        per_task.setdefault(p["task"], []).append(p[SCORE] / 100)
    task_scores = {score_key(t): scorers.task_score(t, v) for t, v in per_task.items()}
    context_ratio = [1 - p["context_budget"] / len(it["context_ids"]) for p, it in zip(predictions, items,
                                                                                        strict=True)]
    for p, ratio in zip(predictions, context_ratio, strict=True):
        p["context_compression_ratio"] = ratio
    metrics = {SCORE: sum(task_scores.values()) / len(task_scores), **task_scores,
               "context_compression_ratio": sum(context_ratio) / len(context_ratio)}
    config = {"groups": [{"task": t, "n_items": len(r.predictions), **r.config} for t, r in results],
              "benchmark": scorers.benchmark_of(results[0][0]), "scorer_flavor": SCORER_FLAVOR}
    return TaskResult(predictions, metrics, average_stats(stats), timings, config, items)
