"""Tasks over rows of a local JSON/JSONL/CSV/parquet file (parsed from its bytes, eval/data.py) or of a hub
dataset when online (through `datasets`).
Columns are mapped with flags: `--prompt_column` (the question), `--context_column` (optional: a document
that query-agnostic runs compress before the question is seen), `--answer_column`, `--choices_column`.

- qa: a greedy answer scored by exact match, substring match and ROUGE-L against the reference(s)
  (a string or a list of strings).
- multiple_choice: the option with the highest log-likelihood after the prompt, under the configured
  cache; accuracy, and accuracy with the log-likelihood divided by the option's length in characters.
  The answer is the option's index, its letter (A, B, ...) or its text.
"""

from __future__ import annotations

from tqdm import tqdm

from errors import UserError
from eval.batching import longest_first, rows_per_batch
from eval.data import check_columns, load_rows
from eval.harness import (
    AnswerJob,
    Runtime,
    Timings,
    attach_caches,
    average_stats,
    cache_specs,
    measure_caches,
    option_logliks,
    prefill_length,
    prefill_limit,
    prepare_answer_step,
)
from eval.metrics import exact_match, rouge_l, substring_match
from eval.rows import option_logliks_rows
from eval.tasks.base import (
    Example,
    GenerationTask,
    Task,
    TaskResult,
    continuation_ids,
    encode_example,
    item_record,
    register_task,
    use_chat,
)

DATASET_FLAGS = ("dataset", "dataset_config", "split", "prompt_column", "context_column", "answer_column")


def dataset_rows(task: Task) -> list[dict]:
    """The rows of the task's --dataset (its `required` flags checked when it was made), up to --limit."""
    o = task.options
    rows = load_rows(o["dataset"], o["dataset_config"], o["split"])
    columns = {flag: o[flag] for flag in o if flag.endswith("_column")}
    check_columns(rows, columns, o["dataset"])
    return rows[: o["limit"]] if o["limit"] else rows


def text_cell(task: Task, row: dict, index: int, flag: str) -> str:
    """The row's value in the column of --flag as text; a missing or non-text value names the row."""
    column = task.options[flag]
    value = row.get(column)
    if value is None or isinstance(value, bool | dict | list) or (isinstance(value, str) and not value.strip()):
        raise UserError(f"row {index} of {task.options['dataset']}: column {column!r} (--{flag}) has no text "
                        f"(got {value!r})")
    return str(value)


def row_example(task: Task, row: dict, index: int) -> Example:
    o = task.options
    question = f"Question: {text_cell(task, row, index, 'prompt_column')}\n"
    if o["context_column"]:
        return Example(f"{text_cell(task, row, index, 'context_column')}\n\n", question, "Answer:")
    return Example(question, "", "Answer:")  # nothing to hold back: the whole prompt is context


def answer_list(task: Task, row: dict, index: int) -> list[str]:
    """Reference answers: a string or a list of strings; an empty or missing one names the row (it would
    otherwise be scored against the text "None")."""
    column = task.options["answer_column"]
    value = row.get(column)
    values = value if isinstance(value, list) else [value]
    if not values or any(v is None or isinstance(v, bool | dict | list) or not str(v).strip() for v in values):
        raise UserError(f"row {index} of {task.options['dataset']}: column {column!r} (--answer_column) has no "
                        f"reference answer (got {value!r})")
    return [str(v) for v in values]


def choice_list(task: Task, row: dict, index: int) -> list[str]:
    """The options of a multiple-choice row: a list of at least two texts (a string is not a list)."""
    column = task.options["choices_column"]
    value = row.get(column)
    where = f"row {index} of {task.options['dataset']}: column {column!r} (--choices_column)"
    if not isinstance(value, list):
        raise UserError(f"{where} must be a list of options, got {type(value).__name__} {value!r:.60}")
    if len(value) < 2:
        raise UserError(f"{where} has fewer than two choices")
    if any(v is None or isinstance(v, bool | dict | list) for v in value):
        raise UserError(f"{where} has an option that is not text: {value!r:.80}")
    return [str(v) for v in value]


@register_task
class QA(GenerationTask):
    name = "qa"
    metrics = ("substring_match", "exact_match", "rouge_l")
    reads = GenerationTask.reads + DATASET_FLAGS
    defaults = {"max_new_tokens": 32, "split": "train"}
    required = ("dataset", "prompt_column", "answer_column")

    def examples(self, rt: Runtime) -> list[Example]:
        examples = []
        for index, row in enumerate(dataset_rows(self)):
            example = row_example(self, row, index)
            example.answers = answer_list(self, row, index)
            examples.append(example)
        return examples

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        # Greedy answers run on past the answer; the first line is the answer.
        first_line = prediction.strip().split("\n")[0]
        return {"substring_match": substring_match(prediction, example.answers),
                "exact_match": exact_match(first_line, example.answers),
                "rouge_l": rouge_l(first_line, example.answers)}


def choice_label(answer: object, choices: list[str], where: str = "") -> int:
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(choices):
        return answer
    text = str(answer).strip()
    if text in choices:
        return choices.index(text)
    if len(text) == 1 and "A" <= text.upper() < chr(ord("A") + len(choices)):
        return ord(text.upper()) - ord("A")
    if text.isdigit() and int(text) < len(choices):
        return int(text)
    raise UserError(f"{where}answer {answer!r} is neither an index, a letter nor the text of one of {choices}")


@register_task
class MultipleChoice(Task):
    name = "multiple_choice"
    metrics = ("accuracy", "accuracy_norm")
    reads = ("limit", "chat", "query_aware", "decode_first_token", *DATASET_FLAGS, "choices_column")
    defaults = {"split": "train"}
    required = ("dataset", "prompt_column", "answer_column", "choices_column")

    def prepared(self, rt: Runtime) -> tuple[list[tuple], int, int, list]:
        """Each row as (ids, context length, choices, their option ids, label), the longest prompt, the longest
        option, and the caches' specs; checked against the model's context."""
        rows = dataset_rows(self)
        chat, o = use_chat(rt), self.options
        items = []
        for index, row in enumerate(rows):
            choices = choice_list(self, row, index)
            label = choice_label(row.get(o["answer_column"]), choices, f"row {index} of {o['dataset']}: ")
            ids, n_context = encode_example(rt.tokenizer, row_example(self, row, index), chat)
            options = [continuation_ids(rt.tokenizer, " " + c) for c in choices]
            items.append((ids, n_context, choices, options, label))
        longest = max(len(ids) for ids, *_ in items)
        max_option = max(len(opt) for *_, options, _ in items for opt in options)
        if longest + max_option > rt.model.args.context_length:
            raise UserError(f"multiple_choice: prompts of {longest} tokens exceed the model's context")
        return items, longest, max_option, cache_specs(rt, rt.args, longest, max_option)

    def run(self, rt: Runtime) -> TaskResult:
        o = self.options
        items, longest, max_option, specs = self.prepared(rt)
        jobs = [AnswerJob(ids, prefill_length(len(ids), n_context, o["query_aware"], o["decode_first_token"],
                                              prefill_limit(rt, specs))) for ids, n_context, *_ in items]
        timings, scored = self.score_options(rt, specs, jobs, [opts for *_, opts, _ in items], longest + max_option)
        predictions, stats, records = [], [], []
        for i, ((ids, n_context, choices, options, label), job, (logliks, item_stats, kept)) in enumerate(
                zip(items, jobs, scored, strict=True)):
            stats.append(item_stats)
            norm = [ll / max(len(c), 1) for ll, c in zip(logliks, choices, strict=True)]
            pick, pick_norm = logliks.index(max(logliks)), norm.index(max(norm))
            predictions.append({"index": i, "prompt_tokens": len(ids), "prefill_tokens": job.n_prefill, "label": label,
                                "prediction": pick, "prediction_norm": pick_norm, "logliks": logliks,
                                "accuracy": float(pick == label), "accuracy_norm": float(pick_norm == label)})
            scores = {k: predictions[-1][k] for k in self.metrics}
            records.append(item_record(i, ids, n_context, job.n_prefill,
                                       {**scores, "compression_ratio": stats[-1].get("compression_ratio")}, kept,
                                       choices=choices, option_ids=options, label=label))
        metrics = {k: sum(p[k] for p in predictions) / len(predictions) for k in self.metrics}
        return TaskResult(predictions, metrics, average_stats(stats), timings,
                          {"cache_spec": [s.to_dict() for s in specs], "prompt_tokens_max": longest}, records)

    def score_options(self, rt: Runtime, specs: list, jobs: list[AnswerJob], options: list[list[list[int]]],
                      capacity: int) -> tuple[Timings, list[tuple[list[float], dict, list]]]:
        """Per job, in order: its options' log-likelihoods, statistics and kept positions. One set of caches for
        all; with --batch_size B > 1, of B rows, the jobs longest prompt first (rows.option_logliks_rows)."""
        timings = Timings()
        rows = min(rows_per_batch(rt.model, specs, getattr(rt.args, "batch_size", 1) or 1), len(jobs))
        attach_caches(rt, specs, capacity, rows)
        bar = tqdm(total=len(jobs), desc=self.name, leave=False, disable=rt.progress)
        try:
            prepare_answer_step(rt, jobs, rows, timings, bar)
            if rows == 1:
                scored = []
                for job, opts in zip(jobs, options, strict=True):
                    logliks = option_logliks(rt, job.ids, job.n_prefill, opts, timings)
                    scored.append((logliks, measure_caches(rt.model.caches()), rt.kept))
                    bar.update()
                return timings, scored
            return timings, longest_first([job.ids for job in jobs], lambda order: option_logliks_rows(
                rt, [jobs[i] for i in order], [options[i] for i in order], timings, done=lambda _: bar.update()))
        finally:
            bar.close()
            rt.model.remove_caches()
