"""Items decoded in rows (--batch_size B > 1 for generation and multiple-choice tasks): each item holds a row of
the caches, at its own positions, and is replaced by the next item as soon as it stops (greedy_answers,
option_logliks_rows). Rows that take their items at the same time prefill them together (generate.prefill_rows:
packed into one forward pass where the prefill can be shared), and every row records what a batch-1 run of
its item records (tests/test_eval_generation_batching.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from eval.harness import (
    Answer,
    AnswerJob,
    Runtime,
    Timings,
    configure_prompt_budget,
    graphs_before_step,
    kept_positions,
    measure_caches,
    record_step,
    sync,
)
from generate import decode_one_token, prefill, prefill_rows


@dataclass
class _Row:
    """A batch row's item: `job` None for a row left idle (no items left), which decodes a placeholder.
    `token` is fed next at position `pos`; `result` is set when the item is done."""

    job: AnswerJob | None
    index: int = -1  # the item's place in the jobs
    pos: int = 1
    token: int = 0
    kept: list[np.ndarray] = field(default_factory=list)
    result: object = None


@dataclass
class _AnswerRow(_Row):
    tokens: list[int] = field(default_factory=list)


def _run_rows(rt: Runtime, jobs: list[AnswerJob], timings: Timings, kind: type[_Row], chunk: bool,
              begin: Callable[[int, _Row, Tensor], None],
              advance: Callable[[int, _Row, Tensor, int, float | None], None], done: Callable[[int], None] | None,
              wanted: Callable[[_Row], int | None] | None = None) -> list:
    """The row loop of greedy_answers and option_logliks_rows, on caches of B rows. Each row holds one item
    at a time: rows free at the same time take the next items and prefill them together (_start_rows), and
    `begin(b, row, logits)` takes each one's logits [vocab] after what went in; every row is then fed its
    `token` in one decode step, each at its own position, and `advance(b, row, logits, top, logp)` takes that
    row's logits [vocab], their argmax and the log-probability of the token `wanted(row)` names (None where it
    names none); the rows' argmaxes and log-probabilities are read in one host sync a step, not one a row. When an
    item is done (its `result` set, with its statistics taken before anything else reaches its cache) its row
    takes the next item; with none left it idles on a one-token placeholder (positions stay small), no longer
    counted. When one item is left it decodes alone in its row context (eager; a compiled step keeps stepping
    every row, see _step_rows). Results in the jobs' order."""
    model = rt.model
    results: list = [None] * len(jobs)
    upcoming = iter(range(len(jobs)))
    slots = [_Row(None) for _ in range(model.caches()[0].pos.shape[0])]

    def finish(row: _Row) -> None:
        results[row.index] = row.result
        if done is not None:
            done(row.index)

    def fill(free: list[int]) -> None:
        while free:  # an item done as it starts (an EOS first) hands its row to the next item
            taken = list(zip(free, upcoming, strict=False))  # stops at the free rows: no item drawn for nothing
            for b in free[len(taken):]:
                with model.cache_row(b):
                    model.reset_caches()
                    prefill(model, torch.zeros(1, 1, dtype=torch.long, device=rt.device))
                slots[b] = _Row(None)
            free = []
            for (b, _), (row, logits) in zip(taken, _start_rows(rt, taken, jobs, timings, chunk, kind), strict=True):
                begin(b, row, logits)
                slots[b] = row
                if row.result is not None:
                    finish(row)
                    free.append(b)

    model.reset_caches()
    fill(list(range(len(slots))))
    while active := [b for b, row in enumerate(slots) if row.job is not None and row.result is None]:
        logits = _step_rows(rt, slots, active, timings)
        top, logp = _read_step(logits, {b: wanted(slots[b]) for b in active} if wanted else {})
        stopped = []
        for b in active:
            advance(b, slots[b], logits[b], top[b], logp.get(b))
            if slots[b].result is not None:
                finish(slots[b])
                stopped.append(b)
        fill(stopped)
    return results


def _read_step(logits: Tensor, wanted: dict[int, int | None]) -> tuple[list[int], dict[int, float]]:
    """A step's argmax of every row, and row b's log-probability of token wanted[b] where one is named, read off
    the device together (one host sync)."""
    top = logits.argmax(dim=-1)
    rows = [b for b, token in wanted.items() if token is not None]
    if not rows:
        return top.tolist(), {}
    index = torch.tensor(rows, device=logits.device)
    tokens = torch.tensor([wanted[b] for b in rows], device=logits.device)
    logp = torch.log_softmax(logits[index].float(), dim=-1).gather(1, tokens[:, None])[:, 0]
    values = torch.cat([top.double(), logp.double()]).tolist()  # argmaxes are exact in float64
    return [int(t) for t in values[: len(top)]], dict(zip(rows, values[len(top):], strict=True))


def greedy_answers(rt: Runtime, jobs: list[AnswerJob], max_new_tokens: int, timings: Timings, chunk: bool = False,
                   done: Callable[[int], None] | None = None) -> list[Answer]:
    """greedy_answer for every job, on caches of B rows (attach_caches(..., rows=B)), in the jobs' order
    (see _run_rows): a row is fed the rest of its prompt, then its answer; where its item stops (EOS, or
    max_new_tokens) its answer and statistics are taken, so they count its own tokens only, as at batch 1.
    `done(i)` is called as job i finishes."""
    model, eos = rt.model, set(rt.tokenizer.eos_ids)

    def next_token(b: int, row: _AnswerRow, token: int) -> None:
        row.tokens.append(token)
        if row.tokens[-1] in eos or len(row.tokens) == max_new_tokens:
            with model.cache_row(b):
                row.result = Answer(row.tokens, measure_caches(model.caches()), row.kept)
        row.token = token

    def begin(b: int, row: _AnswerRow, logits: Tensor) -> None:
        if row.pos == len(row.job.ids):
            next_token(b, row, int(logits.argmax()))

    def advance(b: int, row: _AnswerRow, logits: Tensor, top: int, logp: float | None) -> None:
        row.pos += 1
        if row.pos < len(row.job.ids):
            row.token = row.job.ids[row.pos]
        else:
            next_token(b, row, top)

    return _run_rows(rt, jobs, timings, _AnswerRow, chunk, begin, advance, done)


@dataclass
class _OptionsRow(_Row):
    options: list[list[int]] = field(default_factory=list)
    prompt_logits: Tensor | None = None
    saved: list[list[Tensor]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    scored: int = 0  # tokens of the current option scored so far
    total: float = 0.0  # their log-likelihood


def option_logliks_rows(rt: Runtime, jobs: list[AnswerJob], options: list[list[list[int]]], timings: Timings,
                        done: Callable[[int], None] | None = None) -> list[tuple[list[float], dict, list]]:
    """option_logliks for every job on caches of B rows (see _run_rows), in the jobs' order: per job its
    options' log-likelihoods, and the statistics and kept positions a batch-1 run records (the caches as the
    last option left them). A row saves its caches after the prompt and restores them before each option."""
    model = rt.model

    def first_logp(logits: Tensor, token: int) -> float:  # an option's first token, scored off the prompt's logits
        return float(torch.log_softmax(logits.float(), dim=-1)[token])

    def settle(b: int, row: _OptionsRow) -> None:
        """Score what needs no step (a new option's first token), until a token must be fed or all is done."""
        while row.scored == len(row.options[len(row.scores)]):
            row.scores.append(row.total)
            if len(row.scores) == len(row.options):
                with model.cache_row(b):
                    row.result = (row.scores, measure_caches(model.caches()), row.kept)
                return
            row.scored = 0
        option = row.options[len(row.scores)]
        if row.scored == 0:
            with model.cache_row(b):
                for cache, buffers in zip(model.caches(), row.saved, strict=True):
                    for buf, kept in zip(cache.buffers(), buffers, strict=True):
                        buf.copy_(kept)
            row.total, row.scored = first_logp(row.prompt_logits, option[0]), 1
            settle(b, row)
            return
        row.token, row.pos = option[row.scored - 1], len(row.job.ids) + row.scored - 1

    def prompt_done(b: int, row: _OptionsRow, logits: Tensor) -> None:
        row.prompt_logits = logits
        with model.cache_row(b):
            row.saved = [[buf.clone() for buf in cache.buffers()] for cache in model.caches()]
        settle(b, row)

    def begin(b: int, row: _OptionsRow, logits: Tensor) -> None:
        row.options = options[row.index]
        if row.pos == len(row.job.ids):
            prompt_done(b, row, logits)

    def wanted(row: _OptionsRow) -> int | None:
        """The option token this step's logits score (None while the row is fed its prompt)."""
        return None if row.prompt_logits is None else row.options[len(row.scores)][row.scored]

    def advance(b: int, row: _OptionsRow, logits: Tensor, top: int, logp: float | None) -> None:
        if row.prompt_logits is None:
            row.pos += 1
            if row.pos < len(row.job.ids):
                row.token = row.job.ids[row.pos]
            else:
                prompt_done(b, row, logits)
            return
        row.total += logp
        row.scored += 1
        settle(b, row)

    return _run_rows(rt, jobs, timings, _OptionsRow, False, begin, advance, done, wanted)


def _start_rows(rt: Runtime, taken: list[tuple[int, int]], jobs: list[AnswerJob], timings: Timings, chunk: bool,
                kind: type[_Row]) -> list[tuple[_Row, Tensor]]:
    """Rows b reset and given jobs[i], for (b, i) in `taken`: their prompts prefilled together where they can
    share forward passes (generate.prefill_rows, each compressed to its job's prompt budget), then with `chunk`
    the rest of each prompt appended in its row as one chunk where every cache has room (as run_prompt). Per
    row: the row, at the position it is fed next, and the logits [vocab] after what is in."""
    if not taken:
        return []
    model, device = rt.model, rt.device
    for b, i in taken:
        with model.cache_row(b):
            model.reset_caches()
            configure_prompt_budget(model.caches(), jobs[i].prompt_budget)  # and evicts_after_prompt
    t0 = time.perf_counter()
    prompts = [torch.tensor(jobs[i].ids[:jobs[i].n_prefill], device=device) for _, i in taken]
    logits = prefill_rows(model, prompts, rows=[b for b, _ in taken],
                          prompt_budgets=[jobs[i].prompt_budget for _, i in taken])
    sync(device)
    timings.prefill_tokens += sum(len(p) for p in prompts)
    timings.prefill_seconds += time.perf_counter() - t0
    started = []
    for (b, i), row_logits in zip(taken, logits, strict=True):
        job = jobs[i]
        row = kind(job, i, job.n_prefill, kept=kept_positions(model.caches(), b))
        if chunk:
            row_logits = _append_rest(rt, b, row, timings, row_logits)
        if row.pos < len(job.ids):
            row.token = job.ids[row.pos]
        started.append((row, row_logits))
    return started


def _append_rest(rt: Runtime, b: int, row: _Row, timings: Timings, logits: Tensor) -> Tensor:
    """The rest of row b's prompt (the kvpress question) appended in its row context as one chunk, when every
    cache has room for it (KVCache.append); the logits [vocab] after what is in."""
    model, device, ids = rt.model, rt.device, row.job.ids
    rest = len(ids) - row.pos
    with model.cache_row(b):
        if rest <= 0 or any(c.room() < rest for c in model.caches()):
            return logits
        t0 = time.perf_counter()
        positions = torch.arange(row.pos, len(ids), device=device)
        logits = model(torch.tensor([ids[row.pos:]], device=device), positions, last_logits_only=True,
                       append=True)[0, -1]
        sync(device)
    timings.prefill_tokens += rest
    timings.prefill_seconds += time.perf_counter() - t0
    row.pos = len(ids)
    return logits


def _step_rows(rt: Runtime, slots: list[_Row], active: list[int], timings: Timings) -> Tensor:
    """One decode step: every row's `token` at its own position ([B] positions), or, with one row active and
    the eager step, that row alone in its row context (the idle rows wait). Logits [B, vocab] (rows not
    stepped: zeros); only active rows count as decoded tokens.

    A compiled step keeps stepping every row when one is left: in a row context the model is a batch-1 model,
    for which it would compile again (and, on CUDA, capture again). On this project's 2-core CPU the compiled
    step of 4 rows took 24.5 ms against 30.7 ms for the eager row, 8 rows 34.4 against 31.1 (float32)."""
    model, device = rt.model, rt.device
    graphs = graphs_before_step(rt)
    t0 = time.perf_counter()
    if len(active) == 1 and not hasattr(rt.step, "prepare"):  # the eager step (compiled steps are prepared)
        (b,) = active
        with model.cache_row(b):
            token = torch.tensor([[slots[b].token]], device=device)
            row_logits = decode_one_token(model, token, torch.tensor([slots[b].pos], device=device))
        logits = row_logits.new_zeros(len(slots), row_logits.shape[-1])
        logits[b] = row_logits[0]
    else:
        tokens = torch.tensor([[row.token] for row in slots], device=device)
        logits = rt.step(model, tokens, torch.tensor([row.pos for row in slots], device=device))
        for row in slots:
            if row.job is None:  # an idle row moves on too: a placeholder at a position of its own
                row.pos += 1
    sync(device)
    record_step(timings, time.perf_counter() - t0, len(active), graphs)
    return logits
