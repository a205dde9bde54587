"""What a task is: a small class in a registry (kvpress-style). A task turns flags into examples, runs
them through the harness under the configured cache, and scores them.

Most tasks generate an answer (`GenerationTask`): each example is a context, a question and the
expected answers. The context is what a query-agnostic run compresses before the question is seen.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from tqdm import tqdm

from cache_spec import tokens_from_budget
from errors import UserError
from eval.batching import longest_first, rows_per_batch
from eval.harness import (
    Answer,
    AnswerJob,
    Runtime,
    Timings,
    answer_alone,
    attach_caches,
    average_stats,
    cache_specs,
    prefill_length,
    prefill_limit,
    prepare_answer_step,
)
from eval.rows import greedy_answers
from tokenizer import Tokenizer


@dataclass
class Example:
    context: str  # compressed before the question is seen (query-agnostic mode)
    question: str = ""
    answer_prefix: str = ""  # starts the answer (RULER appends it to the prompt)
    answers: list[str] = field(default_factory=list)
    choices: list[str] | None = None
    label: int | None = None  # index of the right choice
    meta: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.context + self.question + self.answer_prefix


@dataclass
class TaskResult:
    predictions: list[dict]  # one JSON line each
    metrics: dict  # task scores, averaged over items
    stats: dict  # measured cache statistics, averaged over items
    timings: Timings
    config: dict = field(default_factory=dict)  # what the run used beyond the flags (text hash, spec)
    # One per item (see item_record): its metrics, for confidence intervals and paired comparisons, and
    # what is needed to replay it: the exact token ids fed and the positions kept after prefill.
    items: list[dict] = field(default_factory=list)


def item_record(index: int, ids: list[int], n_context: int, n_prefill: int, metrics: dict,
                kept: list | None, **extra: object) -> dict:
    """One item of items.jsonl (plus its kept positions, which results.py writes to kept_positions.npz).

    ids[:n_context] is the context (what a query-agnostic run compresses before the question), the rest
    the question and answer prefix; ids[:n_prefill] went through prefill, the rest one token at a time.
    """
    return {"index": index, "metrics": {k: v for k, v in metrics.items() if v is not None},
            "context_ids": list(ids[:n_context]), "question_ids": list(ids[n_context:]),
            "n_prefill": n_prefill, **extra, "kept_positions": kept or []}


# --protocol values that compress each context once and evict nothing after (kvpress's pipeline). kvpress:
# the context alone is compressed, or with --query_aware context and question to the context's budget + the
# question (the question kept whole); kvpress_compress_questions: kvpress's compress_questions, context and
# question compressed together to int((context + question) x (1 - ratio)) tokens, the question can be evicted.
KVPRESS_PROTOCOLS = ("kvpress", "kvpress_compress_questions")
COMPRESS_QUESTIONS = KVPRESS_PROTOCOLS[1]


def is_kvpress(protocol: str | None) -> bool:
    return protocol in KVPRESS_PROTOCOLS


class Task:
    name: ClassVar[str] = ""
    # Scores, best first: the first is the headline in plots and the summary.
    metrics: ClassVar[tuple[str, ...]] = ()
    lower_is_better: ClassVar[tuple[str, ...]] = ()
    # Task flags this task reads (they identify a run), with the task's defaults for those left unset.
    reads: ClassVar[tuple[str, ...]] = ("limit", "seq_len", "max_new_tokens", "chat", "query_aware",
                                        "decode_first_token")
    defaults: ClassVar[dict] = {}
    # Flags the task cannot run without (its data source, the columns it reads), and what they name: refused
    # when the runs are planned, before any run of the command starts.
    required: ClassVar[tuple[str, ...]] = ()
    required_note: ClassVar[str] = ""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.options = {k: self.defaults.get(k) if getattr(args, k, None) is None else getattr(args, k)
                        for k in self.reads}
        if getattr(args, "protocol", "decode") != "decode" and "protocol" not in self.reads:
            raise UserError(f"{self.name}: --protocol {args.protocol} applies to tasks that answer a question "
                            "after a context (the RULER tasks, qa)")
        if self.options.get("protocol") == COMPRESS_QUESTIONS:
            self.options["query_aware"] = True  # compression sees the question: query-aware by definition
        for key, least in (("limit", 1), ("seq_len", 1), ("max_new_tokens", 1), ("prefill_tokens", 1),
                           ("text_offset", 0)):
            value = self.options.get(key)
            if value is not None and value < least:
                raise UserError(f"--{key} must be ≥ {least}, got {value}")
        missing = [f"--{flag}" for flag in self.required if not self.options.get(flag)]
        if missing:
            raise UserError(f"{self.name} needs {', '.join(missing)}{self.required_note}")

    def run(self, rt: Runtime) -> TaskResult:
        raise NotImplementedError

    def prepared(self, rt: Runtime) -> object:
        """What a run reads, built and checked (its examples, text or dataset rows, against the model's context),
        and the caches' specs it resolves; the first thing `run` does."""
        raise NotImplementedError

    def check_inputs(self, rt: Runtime) -> None:
        """`prepared`, computing nothing more: eval calls it for every run it is about to start, before the first
        starts, so bad input found only there is refused at once, not after hours of other runs."""
        self.prepared(rt)

    def derived_intervals(self, items: list[dict]) -> dict:
        """Intervals of aggregates that are functions of item means rather than means themselves
        (eval.uncertainty.bootstrap_function); metric name -> Interval. None by default."""
        return {}


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    if not cls.name or cls.name in TASKS:
        raise ValueError(f"task name {cls.name!r} is empty or already registered")
    TASKS[cls.name] = cls
    return cls


def get_task(name: str) -> type[Task]:
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    return TASKS[name]


# ---- prompts ------------------------------------------------------------------------------------------


def use_chat(rt: Runtime) -> bool:
    chat = getattr(rt.args, "chat", None)
    return bool(rt.tokenizer.chat_template) if chat is None else chat


def continuation_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of text that follows other text: no BOS in front."""
    ids = tokenizer.encode(text) if text else []
    if ids and tokenizer.add_bos and ids[0] == tokenizer.bos_id:
        ids = ids[1:]
    return ids


def encode_example(tokenizer: Tokenizer, example: Example, chat: bool,
                   compress_questions: bool = False) -> tuple[list[int], int]:
    """Token ids of the whole prompt, and how many of them are the context.

    Context and question are tokenized separately (and concatenated in both modes), so query-aware
    and query-agnostic runs see the very same tokens. With `compress_questions` (kvpress's setting of that
    name) the "context" is the context and question, tokenized together as kvpress does, and what follows
    (the chat template's end of turn, the answer prefix) is the rest; with nothing after the question, its
    last token is the rest, so the first answer token is always computed over the compressed cache.
    """
    user = example.context + example.question
    # In a chat, the answer prefix opens the assistant's turn (no leading newline there).
    if chat:
        text = tokenizer.apply_chat_template(user) + example.answer_prefix.lstrip()
    else:
        text = user + example.answer_prefix
    if compress_questions:
        split = text.rfind(user) + len(user) if user else len(text)
        if split < len(user):
            raise UserError("the chat template rewrote the prompt; pass --no-chat")
    else:
        split = text.rfind(example.question) if example.question else len(text)
    if split < 0:
        raise UserError("the chat template rewrote the question; pass --no-chat or --query_aware")
    context = tokenizer.encode(text[:split])
    ids = context + continuation_ids(tokenizer, text[split:])
    if compress_questions and len(context) == len(ids) > 1:
        return ids, len(ids) - 1
    return ids, len(context)


def fit_to_length(build: Callable[[int], Example], count: Callable[[Example], int], target: int, most: int,
                  task: str) -> Example:
    """The example built with the largest size n ≤ most whose prompt has at most `target` tokens.

    `build(n)` must be deterministic and grow with n (haystack lines, words): a binary search then
    finds the size in log2(most) tokenizations.
    """
    smallest = build(0)
    if count(smallest) > target:
        raise UserError(f"--seq_len {target} is too short for {task} (its smallest prompt has "
                        f"{count(smallest)} tokens)")
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(build(mid)) <= target:
            lo = mid
        else:
            hi = mid - 1
    return build(lo)


# ---- tasks that generate an answer ----------------------------------------------------------------------


@dataclass
class PreparedAnswers:
    """What a GenerationTask's run answers: its examples, each encoded (ids, context length), the longest prompt,
    the new tokens, each item's context budget (kvpress protocol; else None) and the caches' specs."""

    examples: list[Example]
    encoded: list[tuple[list[int], int]]
    longest: int
    max_new: int
    context_budgets: list[int] | None
    specs: list


class GenerationTask(Task):
    """Greedy answers under the configured cache, scored with `score` (RULER's string match by default)."""

    metrics = ("string_match",)
    reads = Task.reads + ("protocol",)

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        if is_kvpress(self.options["protocol"]):
            check_kvpress_flags(args)

    def examples(self, rt: Runtime) -> list[Example]:
        raise NotImplementedError

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        from eval.metrics import string_match_all

        return {"string_match": string_match_all(prediction, example.answers)}

    def prepared(self, rt: Runtime) -> PreparedAnswers:
        """The examples encoded, checked against the model's context, and the caches' specs they resolve."""
        examples = self.examples(rt)
        if not examples:
            raise UserError(f"{self.name}: no examples")
        chat = use_chat(rt)
        compress_questions = self.options["protocol"] == COMPRESS_QUESTIONS
        encoded = [encode_example(rt.tokenizer, ex, chat, compress_questions) for ex in examples]
        max_new = self.options["max_new_tokens"]
        longest = max(len(ids) for ids, _ in encoded)
        if longest + max_new > rt.model.args.context_length:
            raise UserError(f"{self.name}: prompts of {longest} tokens plus {max_new} new tokens exceed the "
                            f"model's context of {rt.model.args.context_length}")
        kvpress = is_kvpress(self.options["protocol"])
        context_budgets = kvpress_budgets(rt.args, encoded) if kvpress else None
        args = kvpress_cache_args(rt.args, encoded, context_budgets, max_new) if kvpress else rt.args
        return PreparedAnswers(examples, encoded, longest, max_new, context_budgets,
                               cache_specs(rt, args, longest, max_new))

    def run(self, rt: Runtime) -> TaskResult:
        prep = self.prepared(rt)
        examples, encoded, longest, max_new = prep.examples, prep.encoded, prep.longest, prep.max_new
        context_budgets, specs = prep.context_budgets, prep.specs
        kvpress = context_budgets is not None
        jobs = [self.answer_job(rt, specs, ids, n_context, None if context_budgets is None else context_budgets[i])
                for i, (ids, n_context) in enumerate(encoded)]
        timings = Timings()
        answers = answer_jobs(rt, specs, jobs, longest + max_new, max_new, timings, kvpress, self.name)
        predictions, items = [], []
        for i, (ex, (ids, n_context), job, answer) in enumerate(zip(examples, encoded, jobs, answers, strict=True)):
            text = rt.tokenizer.decode(answer.tokens, skip_special_tokens=True)
            scores = self.score(text, ex)
            ratio = answer.stats.get("compression_ratio")
            budget_note = {"context_budget": context_budgets[i]} if kvpress else {}
            predictions.append({"index": i, "prompt_tokens": len(ids), "prefill_tokens": job.n_prefill,
                                **budget_note, "answers": ex.answers, "prediction": text, **scores,
                                "compression_ratio": ratio, **ex.meta})
            items.append(item_record(i, ids, n_context, job.n_prefill, {**scores, "compression_ratio": ratio},
                                     answer.kept, answers=ex.answers, output_ids=answer.tokens))
        metrics = {k: sum(p[k] for p in predictions) / len(predictions) for k in scores}
        return TaskResult(predictions, metrics, average_stats([a.stats for a in answers]), timings,
                          {"cache_spec": [s.to_dict() for s in specs], "prompt_tokens_max": longest}, items)

    def answer_job(self, rt: Runtime, specs: list, ids: list[int], n_context: int,
                   context_budget: int | None) -> AnswerJob:
        """What an item prefills; under the kvpress protocol (a context budget) what that is compressed to:
        the context alone to its budget, the question then appended; query-aware (SnapKV's setting), the
        whole prompt to the same slots, budget + question. Under kvpress_compress_questions the "context"
        holds the question (encode_example): it is compressed to its budget and the rest appended."""
        if context_budget is not None:
            keep_question = self.options["query_aware"] and self.options["protocol"] != COMPRESS_QUESTIONS
            n_prefill = len(ids) if keep_question else n_context
            return AnswerJob(ids, n_prefill, kvpress_prompt_budget(context_budget, len(ids), n_prefill, n_context))
        n_prefill = prefill_length(len(ids), n_context, self.options["query_aware"], self.options["decode_first_token"],
                                   prefill_limit(rt, specs))
        return AnswerJob(ids, n_prefill)


def answer_jobs(rt: Runtime, specs: list, jobs: list[AnswerJob], capacity: int, max_new: int, timings: Timings,
                chunk: bool, desc: str) -> list[Answer]:
    """Every job's answer, in the jobs' order. One set of caches for all of them (budgets resolved for the
    longest prompt; under the kvpress protocol room for the largest context budget + question + answer):
    static shapes, so a compiled decode step is compiled once. With --batch_size B > 1 they have B rows and
    the jobs go through them longest prompt first (batching.longest_first, rows.greedy_answers); a row's
    answer and statistics are what it gets alone (batch 1)."""
    rows = min(rows_per_batch(rt.model, specs, getattr(rt.args, "batch_size", 1) or 1), len(jobs))
    attach_caches(rt, specs, capacity, rows)
    bar = tqdm(total=len(jobs), desc=desc, leave=False, disable=rt.progress)
    try:
        prepare_answer_step(rt, jobs, rows, timings, bar)
        if rows == 1:
            answers = []
            for job in jobs:
                answers.append(answer_alone(rt, job, max_new, timings, chunk))
                bar.update()
            return answers
        return longest_first([job.ids for job in jobs], lambda order: greedy_answers(
            rt, [jobs[i] for i in order], max_new, timings, chunk, done=lambda _: bar.update()))
    finally:
        bar.close()
        rt.model.remove_caches()


def check_kvpress_flags(args: argparse.Namespace) -> None:
    """The cache flags the kvpress protocols cannot take; checked where a generation task is built (as a run is
    planned, before any model loads, or replayed). Flags a namespace lacks are their defaults (a task is built
    from the flags it reads)."""
    if getattr(args, "decode_first_token", False) or getattr(args, "feed_long_prompts", False):
        raise UserError("--protocol kvpress compresses the prompt once and answers without evicting: it does not "
                        "combine with --decode_first_token or --feed_long_prompts")
    if getattr(args, "prefill_chunk", None) == 1:
        raise UserError("--protocol kvpress compresses the prompt once and answers without evicting: --prefill_chunk 1 "
                        "feeds the prompt token by token as decode steps (as --feed_long_prompts); use chunks of 2 or "
                        "more tokens")
    budgets = getattr(args, "max_cache_length", None) or [None]
    if len(budgets) != 1 or getattr(args, "cache_length_pattern", "tile") not in ("tile", "repeat"):
        raise UserError("--protocol kvpress takes one --max_cache_length (per item, of its context) and no "
                        "funnel / pyramid pattern")


def kvpress_budgets(args: argparse.Namespace, encoded: list[tuple[list[int], int]]) -> list[int]:
    """Each item's context budget under the kvpress protocol: --max_cache_length as a fraction of that
    item's context (or tokens), as kvpress sizes a press per input (its flags checked as the task was built:
    check_kvpress_flags). The full cache keeps every token."""
    if any(n_context == 0 or n_context == len(ids) for ids, n_context in encoded):
        raise UserError("--protocol kvpress needs items with a context and a question after it")
    if all(s.removeprefix("debug_") == "full" for s in args.cache_strategy):
        return [n_context for _, n_context in encoded]
    return [kvpress_kept(args.max_cache_length[0], n_context) for _, n_context in encoded]


def kvpress_kept(budget: float, n_context: int) -> int:
    """Tokens kept of a context of n_context under --max_cache_length `budget`: a fraction f keeps
    int(n_context * f), as kvpress's ScorerPress keeps int(k_len * (1 - compression_ratio)) (rounded down,
    where tokens_from_budget rounds to nearest), at least 1; a token count keeps that many, at most all."""
    if 0 < budget <= 1:
        return max(1, int(n_context * budget))
    return min(tokens_from_budget(budget, n_context, "--max_cache_length"), n_context)


def kvpress_prompt_budget(context_budget: int, n_tokens: int, n_prefill: int, n_context: int) -> int:
    """What the kvpress protocol compresses a prefill of `n_prefill` tokens to: the context's budget, plus the
    question when it is prefilled with the context (query-aware), so both settings use the same slots."""
    return context_budget + (n_tokens - n_context if n_prefill == n_tokens else 0)


def kvpress_cache_args(args: argparse.Namespace, encoded: list[tuple[list[int], int]], budgets: list[int],
                       max_new: int) -> argparse.Namespace:
    """The flags with the cache's slots set to the largest context budget + its question + the answer: the
    slots past an item's compressed context stay empty for its question and answer, so nothing is evicted."""
    slots = max(b + len(ids) - n_context + max_new for b, (ids, n_context) in zip(budgets, encoded, strict=True))
    return argparse.Namespace(**{**vars(args), "max_cache_length": [float(slots)], "cache_length_pattern": "tile"})


class SyntheticTask(GenerationTask):
    """RULER-style task (arXiv 2404.06654): examples generated locally from `--seed`, each grown to at
    most `--seq_len` prompt tokens (chat template and answer prefix included)."""

    reads = GenerationTask.reads + ("haystack",)
    # 50 items: a 20-point accuracy gap then clears the 95% interval of the difference even in the worst case
    # (two independent accuracies near 0.5: half-width 1.96 * sqrt(0.5 / 50) = 0.196); paired items do better.
    defaults = {"limit": 50, "seq_len": 1024, "max_new_tokens": 32, "haystack": "pydoc"}

    def builder(self, rng: random.Random) -> Callable[[int], Example]:
        """Draw everything random for one example from `rng`; return size -> example (deterministic)."""
        raise NotImplementedError

    def examples(self, rt: Runtime) -> list[Example]:
        chat = use_chat(rt)
        seq_len = self.options["seq_len"]

        def count(ex: Example) -> int:
            return len(encode_example(rt.tokenizer, ex, chat)[0])

        # A string seed is hashed with SHA-512 by `random`: the same examples on every machine and run.
        return [fit_to_length(self.builder(random.Random(f"{self.name}:{self.args.seed}:{i}")), count,
                              seq_len, seq_len, self.name) for i in range(self.options["limit"])]


def insert_at_depths(units: list[str], needles: list[tuple[float, str]]) -> list[str]:
    """Put each needle between units at its relative depth in [0, 1]."""
    out = list(units)
    for depth, needle in sorted(needles, key=lambda n: n[0], reverse=True):
        out.insert(round(depth * len(units)), needle)
    return out
