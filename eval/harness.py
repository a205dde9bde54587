"""The evaluation engine, shared by every task: caches for one configuration, prefill plus one-token
feeding through the decode path, greedy answers, teacher forcing against the full cache, option
log-likelihoods, and the measured statistics of each run.

After the prompt's prefill, tokens go through `decode_one_token` one at a time, so eviction happens token
by token; under the kvpress protocol the question is appended as one chunk into slots left empty for it
(KVCache.append), and nothing is evicted while answering.

With --batch_size B the caches have B rows: fidelity windows share positions (teacher_force), generation
and multiple-choice items each hold a row at their own positions (greedy_answers, option_logliks_rows),
and every row records what it records at batch 1.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

import cache_setup
from cache import KVCache, cache_statistics
from cache_spec import LayerCacheSpec, cache_flag_defaults
from compiled_step import graphs_compiled
from errors import UserError
from eval.batching import ReferenceLogits, reference_hidden, step_compression
from eval.metrics import rows_fidelity
from generate import decode_one_token, prefill
from model import Transformer
from strategies.debug import attention_loss_curve
from tokenizer import Tokenizer


@dataclass
class Runtime:
    """What a task needs to run: the model, its tokenizer, the parsed flags and the decode step."""

    model: Transformer
    tokenizer: Tokenizer
    args: argparse.Namespace
    step: Callable = decode_one_token  # generate.compile_decode_step() under --compile
    progress: bool | None = None  # tqdm's `disable`: None = only on a terminal, True = never
    # Positions each layer's cache holds right after the latest prefill (see kept_positions): what prompt
    # compression chose, recorded per item so a run can be audited or replayed by another tool.
    kept: list[np.ndarray] | None = None

    @property
    def device(self) -> torch.device:
        return self.model.tok_embeddings.weight.device


@dataclass
class Timings:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    # --compile: the step compiled before timed steps (prepare_step), and any step during which dynamo compiled
    # (record_step): decode speed is the steps' own, never a compile's.
    compile_seconds: float = 0.0
    compiling_steps: int = 0  # steps whose time went to compile_seconds (none where prepare_step covered them)

    def to_dict(self) -> dict:
        steps = sorted(self.step_seconds)
        return {
            "prefill_tokens_per_second": self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else None,
            "decode_tokens_per_second": self.decode_tokens / self.decode_seconds if self.decode_seconds else None,
            "decode_step_ms_median": 1000 * steps[len(steps) // 2] if steps else None,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "compile_seconds": self.compile_seconds or None,
        }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on a GPU; peak resident memory of the whole process on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ---- caches -------------------------------------------------------------------------------------------


def full_cache_args(args: argparse.Namespace) -> argparse.Namespace:
    """The reference every configuration is compared with: the same flags, every cache flag at its default
    (the full cache, 16-bit, no prompt compression or feeding)."""
    return argparse.Namespace(**{**vars(args), **cache_flag_defaults(), "cache_strategy": ["full"]})


def cache_specs(rt: Runtime, args: argparse.Namespace, prompt_length: int, max_new_tokens: int) -> list[LayerCacheSpec]:
    total = prompt_length + max_new_tokens
    if args.cache_strategy != ["full"]:
        for value in args.max_cache_length:
            if value > total:
                raise UserError(f"--max_cache_length {value:g} tokens is larger than the sequence ({total} tokens: "
                                f"{prompt_length} prompt + {max_new_tokens} new); use a smaller budget or a fraction")
    return cache_setup.cache_specs(args, rt.model.args, prompt_length, max_new_tokens)


def attach_caches(rt: Runtime, specs: list[LayerCacheSpec], capacity: int, rows: int = 1) -> list:
    """Caches of `specs` for `rows` rows of `capacity` tokens each (every row the same budgets), attached."""
    cache_setup.setup_caches(rt.model, specs, capacity, tokenizer=rt.tokenizer, batch_size=rows)
    return rt.model.caches()


def prefill_limit(rt: Runtime, specs: list[LayerCacheSpec]) -> int | None:
    """With --feed_long_prompts, prefill only what fits the smallest layer budget (the rest is fed)."""
    return min(s.max_cache_length for s in specs) if getattr(rt.args, "feed_long_prompts", False) else None


def measure_caches(caches: list) -> dict:
    """The numeric part of cache_statistics (numbers, nested lists of numbers), whatever keys appear:
    strategies add their own (debug_<s>: attention_loss_mean / _per_layer / _per_head), plus the
    attention loss over decode steps (cumulative mean at log-spaced steps) for debug_ caches."""
    def numeric(v: object) -> bool:
        if isinstance(v, list):
            return all(numeric(x) for x in v)
        return isinstance(v, int | float) and not isinstance(v, bool)

    stats = {k: v for k, v in cache_statistics(caches).items() if numeric(v)}
    curve = attention_loss_curve(caches)
    if curve:
        stats["attention_loss_curve"] = curve
    return stats


def average_stats(rows: list[dict]) -> dict:
    """Mean over items of every statistic: lists (per layer, per head) element-wise, curves per step."""
    def mean(values: list) -> object:
        if isinstance(values[0], dict):
            keys = [k for k in values[0] if all(k in v for v in values)]
            return {k: mean([v[k] for v in values]) for k in keys}
        if isinstance(values[0], list):
            if len({len(v) for v in values}) != 1:
                return values[0]
            return [mean(list(col)) for col in zip(*values, strict=True)]
        return sum(values) / len(values)

    keys = [k for k in rows[0] if all(k in r for r in rows)]
    return {k: mean([r[k] for r in rows]) for k in keys}


def kept_positions(caches: list, row: int = 0) -> list[np.ndarray]:
    """Per layer, the original positions its cache holds in batch row `row`: [heads, n] int32, ascending per
    head.

    `heads` is the number of KV heads for strategies that evict per head, else 1 (one set for all heads).
    Rows of unequal length (a head that holds fewer tokens) are padded with -1 at the end; a cache without
    a position buffer (none today) gives an empty [0, 0] array, so the layer count stays right.
    """
    layers = []
    for cache in caches:
        pos = getattr(cache, "pos", None)
        if pos is None:
            layers.append(np.zeros((0, 0), dtype=np.int32))
            continue
        rows = [np.sort(r[r >= 0]) for r in pos[row].cpu().numpy().astype(np.int32)]
        width = max((len(r) for r in rows), default=0)
        layers.append(np.stack([np.pad(r, (0, width - len(r)), constant_values=-1) for r in rows]))
    return layers


# ---- feeding tokens -----------------------------------------------------------------------------------


def prefill_length(
    n_tokens: int, n_context: int, query_aware: bool, decode_first_token: bool, limit: int | None = None
) -> int:
    """How many prompt tokens go through prefill; the rest is fed one token at a time.

    Query-agnostic runs prefill only the context, so prompt compression cannot see the question.
    `decode_first_token` keeps the last prompt token out of prefill, so even the first answer token is
    computed over the compressed cache (prefill attends over the whole prompt whatever the budget).
    `limit` (see prefill_limit) caps it for --feed_long_prompts.
    """
    n = n_tokens if query_aware or n_context == 0 else n_context
    if limit is not None:
        n = min(n, limit)
    if decode_first_token:
        n = min(n, n_tokens - 1)
    return max(n, 1)


def run_prompt(rt: Runtime, ids: list[int], n_prefill: int, timings: Timings, chunk: bool = False) -> Tensor:
    """Reset the caches, prefill ids[:n_prefill], then the rest: one by one through the decode path, or with
    `chunk` appended in one forward step when every cache has room for it (KVCache.append; same logits as
    one by one, nothing evicted); logits after the last, [vocab]."""
    model, device = rt.model, rt.device
    model.reset_caches()
    t0 = time.perf_counter()
    logits = prefill(model, torch.tensor([ids[:n_prefill]], device=device))
    sync(device)
    timings.prefill_tokens += n_prefill
    timings.prefill_seconds += time.perf_counter() - t0
    rt.kept = kept_positions(model.caches())
    rest = len(ids) - n_prefill
    if chunk and rest > 0 and all(c.room() >= rest for c in model.caches()):
        t0 = time.perf_counter()
        positions = torch.arange(n_prefill, len(ids), device=device)
        logits = model(torch.tensor([ids[n_prefill:]], device=device), positions, last_logits_only=True,
                       append=True)[:, -1]
        sync(device)
        timings.prefill_tokens += rest
        timings.prefill_seconds += time.perf_counter() - t0
        return logits[0]
    for pos in range(n_prefill, len(ids)):
        logits = timed_step(rt, ids[pos], pos, timings)
    return logits[0]


def timed_step(rt: Runtime, token: int | Tensor, pos: int, timings: Timings) -> Tensor:
    """One decode step at position `pos`: a token id, or a [B, 1] tensor of one token per row."""
    device = rt.device
    tokens = token if isinstance(token, Tensor) else torch.tensor([[token]], device=device)
    graphs = graphs_before_step(rt)
    t0 = time.perf_counter()
    logits = rt.step(rt.model, tokens, torch.tensor([pos], device=device))
    sync(device)
    record_step(timings, time.perf_counter() - t0, tokens.shape[0], graphs)
    return logits


def graphs_before_step(rt: Runtime) -> int | None:
    """Under --compile, the graphs dynamo has compiled so far (record_step compares); None for the eager step."""
    return graphs_compiled() if hasattr(rt.step, "prepare") else None


def record_step(timings: Timings, seconds: float, tokens: int, graphs_before: int | None) -> None:
    """A decode step's time and tokens: decode time, or compile time where dynamo compiled during the step (a
    shape or setting prepare_step did not cover: its seconds are mostly the compile, and would read as a slow
    decode)."""
    if graphs_before is not None and graphs_compiled() != graphs_before:
        timings.compile_seconds += seconds
        timings.compiling_steps += 1
        return
    timings.decode_tokens += tokens
    timings.decode_seconds += seconds
    timings.step_seconds.append(seconds)


def greedy_answer(rt: Runtime, ids: list[int], n_prefill: int, max_new_tokens: int, timings: Timings,
                  chunk: bool = False) -> list[int]:
    """Greedy continuation of the prompt `ids`, stopping at EOS or after `max_new_tokens` tokens."""
    logits = run_prompt(rt, ids, n_prefill, timings, chunk)
    eos = set(rt.tokenizer.eos_ids)
    tokens: list[int] = []
    while True:
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos or len(tokens) == max_new_tokens:
            return tokens
        logits = timed_step(rt, tokens[-1], len(ids) + len(tokens) - 1, timings)[0]


@dataclass
class AnswerJob:
    """One item to answer: its prompt, how much of it is prefilled (the rest goes through the decode path,
    or with `chunk` as one appended chunk), and under the kvpress protocol what its prefill is compressed to."""

    ids: list[int]
    n_prefill: int
    prompt_budget: int | None = None


@dataclass
class Answer:
    """An item's greedy answer, and its caches' statistics (measure_caches) and kept positions (kept_positions,
    right after prefill) as they stood when it stopped."""

    tokens: list[int]
    stats: dict
    kept: list[np.ndarray]


def configure_prompt_budget(caches: list, budget: int | None) -> None:
    """The kvpress protocol's per-item prompt budget (None: not that protocol). Its slots hold the question
    and answer, so nothing is evicted after the prompt: every cache is told (`evicts_after_prompt`), so it may
    skip the statistics only decode eviction reads."""
    if budget is not None:
        for cache in caches:
            cache.configure(prompt_budget=budget)
        keep_after_prompt(caches)


def keep_after_prompt(caches: list) -> None:
    """Tell every cache (a debug cache's shadow too) that nothing is evicted after the prompt."""
    for cache in caches:
        for layer in cache.modules():
            if isinstance(layer, KVCache):
                layer.configure(evicts_after_prompt=False)


def prepare_answer_step(rt: Runtime, jobs: list[AnswerJob], rows: int, timings: Timings, bar: object = None) -> None:
    """Under --compile, a generation or multiple-choice task's step compiled before its items (prepare_step), for
    `rows` rows at positions of their own (rows.greedy_answers) or one row. Under the kvpress protocol the caches
    are first told what every item will tell them (`evicts_after_prompt` False, a setting the compiled step
    reads), so that no item's step compiles again."""
    if any(job.prompt_budget is not None for job in jobs):
        keep_after_prompt(rt.model.caches())
    prepare_step(rt, rows, timings, per_row_positions=rows > 1, bar=bar)


def answer_alone(rt: Runtime, job: AnswerJob, max_new_tokens: int, timings: Timings, chunk: bool) -> Answer:
    """One item on batch-1 caches (greedy_answer)."""
    configure_prompt_budget(rt.model.caches(), job.prompt_budget)
    tokens = greedy_answer(rt, job.ids, job.n_prefill, max_new_tokens, timings, chunk)
    return Answer(tokens, measure_caches(rt.model.caches()), rt.kept)


def option_logliks(
    rt: Runtime, ids: list[int], n_prefill: int, options: list[list[int]], timings: Timings
) -> list[float]:
    """Sum of log-probabilities of each option's tokens after the prompt, under the configured cache.

    The caches after the prompt are saved once and restored before each option (their state is all in
    registered buffers, docs/DESIGN.md §4), so the prompt is processed a single time.
    """
    logits = run_prompt(rt, ids, n_prefill, timings)
    saved = [[b.clone() for b in c.buffers()] for c in rt.model.caches()]
    scores = []
    for option in options:
        for cache, buffers in zip(rt.model.caches(), saved, strict=True):
            for b, s in zip(cache.buffers(), buffers, strict=True):
                b.copy_(s)
        step_logits = logits
        total = 0.0
        for i, token in enumerate(option):
            total += float(torch.log_softmax(step_logits.float(), dim=-1)[token])
            if i + 1 < len(option):
                step_logits = timed_step(rt, token, len(ids) + i, timings)[0]
        scores.append(total)
    return scores


@dataclass
class FidelityTrace:
    """Per predicted position: KL(full ‖ compressed), top-1 agreement, NLL under both caches."""

    positions: list[int] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    agree: list[bool] = field(default_factory=list)
    nll_full: list[float] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)
    compression: list[float] = field(default_factory=list)  # the caches' compression ratio (§6) at the step
    n_prefill: int = 0  # tokens that went through prefill (the rest through the decode path)
    kept: list[np.ndarray] | None = None  # positions held right after prefill (kept_positions)


def reference_is_run(args: argparse.Namespace) -> bool:
    """Whether the configured caches are the full cache itself (the baseline run): its own logits are the
    reference, and no reference pass is needed."""
    return vars(full_cache_args(args)) == vars(args)


def teacher_force(
    rt: Runtime, windows: list[list[int]], n_prompt: int, decode_first_token: bool, timings: Timings,
    bar: object = None,
) -> list[tuple[FidelityTrace, dict]]:
    """Feed the windows (all of one length) with the configured cache, as one batch of rows sharing
    positions, and score them against the full cache. Per window: its trace and the compressed caches'
    statistics at the end (see measure_caches), as a batch-1 run of that window gives them.

    The full cache is exact attention, so its logits come from one causal forward pass per window
    (batching.reference_hidden) rather than a second decode. Where a row's caches are still lossless
    (every token held at full precision: batching.step_compression) its own logits are exact attention
    and stand as the reference, so the KL is exactly 0 until the first loss, not the two kernels' float
    noise. The baseline run (reference_is_run) is not decoded at all (exact_attention_traces), unless a model's
    sliding-window layers give it window caches: it is then decoded, its own reference throughout.
    Positions n_prompt..len-1 are scored; nothing of vocabulary size is kept beyond a chunk of reference
    logits.
    """
    model, device = rt.model, rt.device
    n, rows = len(windows[0]), len(windows)
    if any(len(w) != n for w in windows):
        raise ValueError("teacher_force batches windows of one length (their positions are shared)")
    ids = torch.tensor(windows, device=device)
    specs = cache_specs(rt, rt.args, n_prompt, n - n_prompt)
    n_prefill = prefill_length(n_prompt, n_prompt, True, decode_first_token, prefill_limit(rt, specs))
    baseline = reference_is_run(rt.args)
    if baseline and all(s.strategy == "full" for s in specs):  # not a model's sliding-window layers
        return exact_attention_traces(rt, ids, specs, n_prompt, n_prefill, timings, bar)
    reference = None if baseline else ReferenceLogits(model, reference_hidden(model, ids))
    ours = attach_caches(rt, specs, n, rows)
    logits, traces = prefill_windows(rt, ours, ids, n_prefill, timings, bar)
    lossy = [False] * rows  # once a row has lost a token, the one-pass reference stays its reference
    for pos in range(n_prefill, n):
        if pos >= n_prompt:  # the logits in hand predict token `pos`
            compression, lossless = step_compression(ours)
            lossy = [d or not ok for d, ok in zip(lossy, lossless, strict=True)]
            ref = logits if reference is None else reference.at(pos - 1)
            if reference is not None and not all(lossy):
                ref = torch.where(torch.tensor(lossy, device=device)[:, None], ref, logits)
            score_position(traces, pos, ref, logits, ids[:, pos], compression, bar)
        if pos == n - 1:
            break
        logits = timed_step(rt, ids[:, pos: pos + 1], pos, timings)
    return finish_traces(model, traces)


def exact_attention_traces(rt: Runtime, ids: Tensor, specs: list[LayerCacheSpec], n_prompt: int, n_prefill: int,
                           timings: Timings, bar: object = None) -> list[tuple[FidelityTrace, dict]]:
    """teacher_force for the baseline run, the full cache itself: its logits at every position are exact
    attention, which one causal forward pass per window gives (equal to decoding token by token within float
    noise: tests/test_eval_fidelity.py), so KL is 0 and agreement 1 by definition, and the window is not
    decoded step by step (a 2048-token window: a few forward passes and 32 steps instead of ~1900 steps).
    Its caches are prefilled three times: the prefill (what was kept is recorded); up to the window's middle,
    where `SPEED_SAMPLE_STEPS` decode steps time its decode speed (a full cache's step costs an affine function
    of its length, so the step at the window's middle costs the mean of the steps decoding the window takes);
    and every token decoding would feed (all but the last), whose caches are measured."""
    model = rt.model
    rows, n = ids.shape
    reference = ReferenceLogits(model, reference_hidden(model, ids))
    ours = attach_caches(rt, specs, n, rows)
    _, traces = prefill_windows(rt, ours, ids, n_prefill, timings, bar)
    steps = min(SPEED_SAMPLE_STEPS, n - 1 - n_prefill)
    middle = n_prefill + (n - 1 - n_prefill - steps) // 2
    model.reset_caches()
    prefill(model, ids[:, :middle])
    for pos in range(middle, middle + steps):
        timed_step(rt, ids[:, pos: pos + 1], pos, timings)
    model.reset_caches()
    prefill(model, ids[:, : n - 1])
    compression, lossless = step_compression(ours)
    if not all(lossless):
        raise RuntimeError(f"the baseline's caches lost tokens ({compression}): it is not the full cache")
    for pos in range(n_prompt, n):
        logits = reference.at(pos - 1)
        score_position(traces, pos, logits, logits, ids[:, pos], compression, bar)
    return finish_traces(model, traces)


def prefill_windows(rt: Runtime, ours: list, ids: Tensor, n_prefill: int, timings: Timings,
                    bar: object = None) -> tuple[Tensor, list[FidelityTrace]]:
    """The windows' prefill (ids[:, :n_prefill]) into the attached caches `ours`, timed, after a compiled step is
    prepared (prepare_step): its logits, and a trace per window holding what each row's caches kept."""
    model, device = rt.model, rt.device
    prepare_step(rt, ids.shape[0], timings, bar=bar)
    model.reset_caches()
    t0 = time.perf_counter()
    logits = prefill(model, ids[:, :n_prefill])
    sync(device)
    timings.prefill_tokens += ids.shape[0] * n_prefill
    timings.prefill_seconds += time.perf_counter() - t0
    traces = [FidelityTrace(n_prefill=n_prefill, kept=kept_positions(ours, r)) for r in range(ids.shape[0])]
    rt.kept = traces[-1].kept
    return logits, traces


# Decode steps that time the baseline's decode speed in exact_attention_traces.
SPEED_SAMPLE_STEPS = 32


def prepare_step(rt: Runtime, rows: int, timings: Timings, per_row_positions: bool = False,
                 bar: object = None) -> None:
    """Under --compile, compile the step for `rows` rows (sharing positions, or each at its own) before any step is
    timed: decode speed is then the steps' (a fidelity baseline's, a few steps, would otherwise be mostly its
    compile), and the compile is its own figure. It resets the caches. Eval's compiled step captures no CUDA graph
    (eval.cli): eval attaches new caches for each batch of windows, and a graph would replay on the buffers it
    was captured with."""
    prepare = getattr(rt.step, "prepare", None)
    if prepare is not None:
        before = rt.step.compile_seconds
        if bar is not None:  # a cold compile takes seconds to a minute: say so where progress shows
            bar.set_postfix_str("compiling the decode step")
        prepare(rt.model, rows, per_row_positions)
        if bar is not None:
            bar.set_postfix_str("")
        timings.compile_seconds += rt.step.compile_seconds - before


def score_position(traces: list[FidelityTrace], pos: int, ref: Tensor, logits: Tensor, targets: Tensor,
                   compression: list[float], bar: object = None) -> None:
    """Each row's fidelity at `pos`: the logits in hand (after feeding pos − 1) against the reference's."""
    scores = rows_fidelity(ref, logits, targets)
    for r, trace in enumerate(traces):
        kl, agree, nll_full, nll = (values[r] for values in scores)
        for values, v in ((trace.positions, pos), (trace.kl, kl), (trace.agree, agree),
                          (trace.nll_full, nll_full), (trace.nll, nll), (trace.compression, compression[r])):
            values.append(v)
    if bar is not None:
        bar.update(len(traces))


def finish_traces(model: Transformer, traces: list[FidelityTrace]) -> list[tuple[FidelityTrace, dict]]:
    """The traces with each row's cache statistics, the caches detached."""
    stats = []
    for r in range(len(traces)):
        with model.cache_row(r):  # row r alone, a batch-1 cache: its statistics as a batch-1 run measures them
            stats.append(measure_caches(model.caches()))
    model.remove_caches()
    return list(zip(traces, stats, strict=True))
