"""fidelity: teacher forcing over a long real text (docs/DESIGN.md §6).

Each window of `--seq_len` tokens is fed through the configured cache: the first `--prefill_tokens`
through prefill, the rest one token at a time through the decode path, where the caches evict; the
full cache's logits come from one causal forward pass over the window (exact attention). Windows have
one length, so `--batch_size` of them decode together as rows sharing positions. Every later position is
scored: KL(full ‖ compressed) of the next-token distributions, top-1 agreement, perplexity of both.
It needs no labels and works for any model size.

Text: CPython's reference documentation (`pydoc_data.topics`, offline) by default, or `--text_file`,
or the `--text_column` of a `--dataset`; `--limit` consecutive windows from `--text_offset` tokens.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from errors import UserError
from eval.batching import rows_per_batch
from eval.data import check_columns, load_rows, pydoc_corpus, read_text_file, text_sha256
from eval.harness import FidelityTrace, Runtime, Timings, average_stats, cache_specs, teacher_force
from eval.metrics import summarize_fidelity
from eval.tasks.base import Task, TaskResult, item_record, register_task
from eval.uncertainty import bootstrap_function

# Characters per token is about 4 for English; 16 leaves room when joining dataset rows.
_CHARS_PER_TOKEN_BOUND = 16


def text_windows(ids: list[int], offset: int, seq_len: int, limit: int, bos: int | None) -> list[list[int]]:
    """Up to `limit` consecutive windows of `seq_len` tokens of `ids` from `offset` (the text's tokens, so
    BOS excluded, when `bos` is given). A tokenizer that starts every text with a BOS (`bos`: its id) gets
    it at the head of every window, followed by seq_len − 1 text tokens: a model trained that way (Gemma)
    reads a window without it as out of distribution, and its BOS is the attention sink that
    StreamingLLM's first tokens stand for."""
    if bos is None:
        windows = [ids[offset + i * seq_len: offset + (i + 1) * seq_len] for i in range(limit)]
    else:
        body, n = (ids[1:] if ids and ids[0] == bos else ids), seq_len - 1
        windows = [[bos, *body[offset + i * n: offset + (i + 1) * n]] for i in range(limit)]
    return [w for w in windows if len(w) == seq_len]


@dataclass
class Collected:
    """What a run has gathered so far: per window its item and statistics, per scored position a prediction."""

    predictions: list[dict] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)
    trace: dict[str, list] = field(default_factory=lambda: {"kl": [], "agree": [], "nll_full": [], "nll": []})

    def add(self, w: int, window: list[int], n_prompt: int, trace: FidelityTrace, cache_stats: dict) -> None:
        # A matched budget (eval.reproduce) needs the mean over the scored steps, not the final state.
        cache_stats["compression_ratio_scored_mean"] = sum(trace.compression) / len(trace.compression)
        self.stats.append(cache_stats)
        # A window is the item: its positions share one text and one cache, so they are not
        # independent draws. Every window scores the same number of positions, so the means of
        # the windows' means are the pooled kl_mean and top1_agreement.
        window_metrics = {"kl_mean": sum(trace.kl) / len(trace.kl),
                          "top1_agreement": sum(trace.agree) / len(trace.agree),
                          "nll_mean": sum(trace.nll) / len(trace.nll),
                          "nll_full_mean": sum(trace.nll_full) / len(trace.nll_full),
                          "compression_ratio": cache_stats.get("compression_ratio"),
                          "compression_ratio_scored_mean": cache_stats["compression_ratio_scored_mean"]}
        self.items.append(item_record(w, window, n_prompt, trace.n_prefill, window_metrics, trace.kept))
        for key, values in self.trace.items():
            values += getattr(trace, key)
        for i, pos in enumerate(trace.positions):
            self.predictions.append({"window": w, "position": pos, "token": window[pos], "kl": trace.kl[i],
                                     "top1_agree": trace.agree[i], "nll_full": trace.nll_full[i],
                                     "nll": trace.nll[i]})


@register_task
class Fidelity(Task):
    name = "fidelity"
    metrics = ("kl_mean", "top1_agreement", "perplexity_delta", "kl_p95")
    lower_is_better = ("kl_mean", "kl_p95", "kl_max", "perplexity_delta", "perplexity", "perplexity_ratio")
    reads = ("limit", "seq_len", "prefill_tokens", "text_file", "text_offset", "dataset", "dataset_config",
             "split", "text_column", "decode_first_token")
    defaults = {"limit": 1, "seq_len": 2048, "prefill_tokens": 128, "text_offset": 0, "split": "train"}

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)  # checked as the run is planned: before any model loads or any run of a sweep
        o = self.options
        if not 1 + bool(o["decode_first_token"]) <= o["prefill_tokens"] < o["seq_len"]:
            raise UserError(f"--prefill_tokens must be in [{1 + bool(o['decode_first_token'])}, --seq_len "
                            f"{o['seq_len']}), got {o['prefill_tokens']}")
        if o["dataset"] and not o["text_column"]:
            raise UserError("fidelity with --dataset needs --text_column")

    def derived_intervals(self, items: list[dict]) -> dict:
        """Perplexities are exp(mean NLL) over the pooled positions, i.e. (equal windows) of the mean of
        the windows' mean NLLs: resampling windows and recomputing gives their intervals."""
        if not items or not all("nll_mean" in it["metrics"] and "nll_full_mean" in it["metrics"] for it in items):
            return {}
        columns = {"nll": [it["metrics"]["nll_mean"] for it in items],
                   "nll_full": [it["metrics"]["nll_full_mean"] for it in items]}
        functions = {"perplexity": lambda nll, nll_full: np.exp(nll),
                     "perplexity_delta": lambda nll, nll_full: np.exp(nll) - np.exp(nll_full),
                     "perplexity_ratio": lambda nll, nll_full: np.exp(nll - nll_full)}
        return {name: bootstrap_function(columns, fn) for name, fn in functions.items()}

    def text(self, tokens_needed: int) -> tuple[str, str]:
        """(text, where it came from)."""
        o = self.options
        if o["text_file"]:
            return read_text_file(o["text_file"]), o["text_file"]
        if o["dataset"]:
            rows = load_rows(o["dataset"], o["dataset_config"], o["split"])
            check_columns(rows, {"text_column": o["text_column"]}, o["dataset"])
            parts, size = [], 0
            for row in rows:  # only as many rows as the windows can use
                parts.append(str(row[o["text_column"]]))
                size += len(parts[-1])
                if size > tokens_needed * _CHARS_PER_TOKEN_BOUND:
                    break
            return "\n\n".join(parts), f"{o['dataset']}:{o['text_column']}"
        return pydoc_corpus(), "pydoc_data.topics"

    def prepared(self, rt: Runtime) -> tuple[str, str, list[int], list[list[int]], list]:
        """The text, where it came from, its token ids, the windows cut from it, and the caches' specs."""
        o = self.options
        seq_len, n_prompt, offset = o["seq_len"], o["prefill_tokens"], o["text_offset"]
        if seq_len > rt.model.args.context_length:
            raise UserError(f"--seq_len {seq_len} exceeds the model's context of {rt.model.args.context_length}")
        text, source = self.text(offset + o["limit"] * seq_len)
        ids = rt.tokenizer.encode(text)
        bos = rt.tokenizer.bos_id if rt.tokenizer.add_bos else None
        windows = text_windows(ids, offset, seq_len, o["limit"], bos)
        if not windows:
            raise UserError(f"the text ({source}) has {max(len(ids) - offset, 0)} tokens after --text_offset "
                            f"{offset}; fidelity needs --seq_len {seq_len}")
        return text, source, ids, windows, cache_specs(rt, rt.args, n_prompt, seq_len - n_prompt)

    def run(self, rt: Runtime) -> TaskResult:
        o = self.options
        seq_len, n_prompt = o["seq_len"], o["prefill_tokens"]
        text, source, ids, windows, specs = self.prepared(rt)  # the specs as teacher_force resolves them
        timings, got = Timings(), Collected()
        batch = rows_per_batch(rt.model, specs, getattr(rt.args, "batch_size", 1))
        with tqdm(total=len(windows) * (seq_len - n_prompt), desc="fidelity", unit="tok", leave=False,
                  disable=rt.progress) as bar:
            for start in range(0, len(windows), batch):
                group = windows[start: start + batch]
                # Windows of one length share positions: they decode together as rows of one batch.
                done = teacher_force(rt, group, n_prompt, o["decode_first_token"], timings, bar)
                for w, (window, (trace, cache_stats)) in enumerate(zip(group, done, strict=True), start):
                    got.add(w, window, n_prompt, trace, cache_stats)
        t = got.trace
        metrics = summarize_fidelity(t["kl"], t["agree"], t["nll_full"], t["nll"])
        config = {"text_source": source, "text_sha256": text_sha256(text), "text_tokens": len(ids),
                  "windows": len(windows), "batch_size": batch,
                  "cache_spec": [s.to_dict() for s in specs]}
        return TaskResult(got.predictions, metrics, average_stats(got.stats), timings, config, got.items)
