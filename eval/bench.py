"""Decode speed side by side, in one process, same model, dtype and prompt for every row:
Hugging Face `generate` (default dynamic cache, when transformers is installed), ours eager, ours
compiled with the full cache, and ours compiled with each strategy at each budget.

Decode of one sequence is memory-bound: each step reads every weight and the cached K/V once. The
machine's read bandwidth is measured in the same run, and each row is compared with the bound it
implies: bandwidth / (weight bytes + K/V bytes read per step).

Each strategy row also measures its eviction overhead against a full cache of the same size (no eviction
work; as many slots, so attention, weights and K/V reads are the same): both decode `--new_tokens` steps in
alternating blocks (ABBA, robust to other jobs on the machine) and `overhead_vs_same_size_full` compares
their median step times. One same-size reference row per size is shared by every strategy of that size
(the full cache with a prompt of slots - new tokens; its compiled graph is kept for the pairing).

A cold compile of the 30-layer decode step costs 40-60 s per distinct (strategy, shape), so by default
(`--dry_run` prints the plan and an estimate of its duration; 18 compiles, about 24 minutes on 2 idle cores):
- HF generate, ours eager and ours compiled with the full cache at --contexts (512 2048 4096 8192; 8192 is
  cut to 8192 - new tokens to fit the model's context), and ours compiled at --bound_contexts (256);
- every strategy at --speedup_budget (0.1) at --strategy_contexts (4096): the overhead and speed-up targets;
- --budget_strategies (heavy_hitter, whose per-step work grows most with the cache; `all` for every
  strategy, about 15 more minutes) also at each of --budgets (0.1 0.25 0.5) there;
- --speedup_strategies (recent_global) at --speedup_budget at --speedup_contexts (8192), speed-up only;
- once per compiled strategy, --recompile_steps (256) more decode steps on its graph, with a prompt that lets
  the cache fill and then evict, counting new graphs.
bench.json / bench.md end with the targets (TARGET_*) as measured ratios.

    python -m eval.bench                 # the default plan
    python -m eval.bench --dry_run       # the plan, the number of compiles, prefill tokens and steps
    python -m eval.bench --quick         # about a minute: one short context, eager rows
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import resource
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from atomic_files import atomic_write
from cache import cache_statistics
from cache_spec import add_cache_arguments, resolve_cache_spec
from checkpoint import bundled_checkpoint_path, load_checkpoint, parse_dtype
from checkpoint_hf import hf_model_args
from errors import CliParser, UserError, run_cli
from eval.data import pydoc_corpus
from gates import attach_random_gates
from generate import (
    compile_decode_step,
    decode_one_token,
    generate,
    prefill,
    resolve_device,
    setup_caches,
    write_json_atomic,
)
from model import Transformer
from strategies import CACHE_STRATEGIES

FIELDS = ["engine", "strategy", "budget", "context", "new_tokens", "cache_slots", "prefill_tokens_per_second",
          "decode_tokens_per_second", "ms_per_step", "median_ms_per_step", "compression_ratio", "cache_bytes",
          "kv_bytes_read_per_step", "bound_tokens_per_second", "fraction_of_bound", "same_size_full_median_ms",
          "overhead_vs_same_size_full", "speedup_vs_full", "bound_speedup_vs_full", "recompilations",
          "recompile_check_steps", "compile_seconds", "peak_rss_mb", "peak_device_memory_mb"]

# `--random_weights`: real models' shapes as their Hugging Face configs (read by the same code as a checkpoint's
# config.json). Decode speed depends on the shapes only, so nothing is downloaded.
RANDOM_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1000000.0, tie_word_embeddings=False),
}

# Targets, checked in the summary (bench.json "targets", bench.md).
TARGET_FRACTION_OF_BOUND = 0.7  # compiled full cache at the longest of --contexts
TARGET_MAX_OVERHEAD = 0.10  # each strategy over a full cache of the same size (debug_ caches decode the full one)
TARGET_SPEEDUP_OF_PREDICTED = 0.9  # budget over full at the longest context: measured speed-up / the bound's
TARGET_PEAK_KV_SHARE = 0.15  # peak device memory of the budget row ≤ weights + this share of the full cache's K/V
TARGET_SCORED_PREFILL = 0.5  # prefill of caches that score the prompt's attention, over the full cache's
SCORED_PREFILL = ("heavy_hitter", "hybrid")
WARMUP_PROMPT_TOKENS = 16  # the throwaway compile run: the decode graph does not depend on the prompt length

# Costs behind --dry_run's estimate, fitted to runs on this project's 2-core machine, bf16, 2 threads, idle
# (one thread: compile about the same, prefill 1.85x and steps 1.35x these): a cold compile of the decode step;
# prefill of c tokens, c * (A + B * c) s, plus c² * C s of prompt attention for heavy_hitter / hybrid; one
# compiled step over L slots, A + B * L s (eager 1.4x; HF generate about 39 ms + 25 µs per context token).
EST_COMPILE_S = 45.0
EST_PREFILL_A, EST_PREFILL_B, EST_SCORED_PREFILL_C = 8.3e-4, 2.7e-7, 2.4e-6
EST_STEP_A, EST_STEP_B, EST_EAGER_FACTOR = 0.033, 3.2e-6, 1.4
EST_HF_STEP_A, EST_HF_STEP_B = 0.039, 2.5e-5


def measure_read_bandwidth(device: torch.device | str = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum over a buffer much larger than the caches and the
    device's last-level cache), best of n, on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        megabytes = max(megabytes, 4096)
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        x.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    del x
    return megabytes * 2**20 / best


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_device_memory_mb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def random_weight_model(shape: str, device: str, dtype: torch.dtype) -> Transformer:
    """Our model with `shape`'s config (RANDOM_SHAPES) and random weights, built on `device` in `dtype`."""
    args = hf_model_args(RANDOM_SHAPES[shape])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype directly: an 8B model in float32 first would need 32 GB
    try:
        with torch.device(device):
            model = Transformer(args)
    finally:
        torch.set_default_dtype(default_dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.02)
    model.init_rope_tables()
    return model.eval().requires_grad_(False)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (tied embeddings are one parameter, counted once): what one decode
    step reads."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_read(caches: list) -> int:
    """Bytes of K/V storage attention reads per step, all layers (kv_storage: codes, scales, the KIVI residual;
    a debug_ cache's attention reads its full cache, not the shadow)."""
    return sum(c.storage.attention_bytes() for c in caches)


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def cache_args(strategy: str, budget: float) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cache_arguments(parser)
    return parser.parse_args(["--cache_strategy", strategy, "--max_cache_length", str(budget)])


def cache_slots(strategy: str, budget: float, n_layer: int, prompt: int, new: int) -> int:
    """Slots each layer's cache allocates (the largest layer budget) for this strategy and budget."""
    return max(s.max_cache_length for s in resolve_cache_spec(cache_args(strategy, budget), n_layer, prompt, new))


def recompile_check_shape(slots: int, capacity: int, steps: int) -> tuple[int, int]:
    """(prompt length, decode steps) of the recompilation check run on an already compiled cache: the prompt
    leaves room for about half the steps, so the cache fills during the run and then evicts; positions stay
    below the capacity the cache was built for (prompt + steps ≤ capacity)."""
    prompt = max(1, min(slots - steps // 2, capacity - steps))
    return prompt, max(1, min(steps, capacity - prompt))


def _decode_block(model, step, state: dict, steps: int, times: list[float]) -> None:
    """`steps` greedy decode steps on the caches in `state` (attached here): the block's time per step is
    appended `steps` times (one host synchronisation per block, none per step, as in `generate`)."""
    model.setup_caches(state["caches"])
    token, pos = state["token"], state["pos"]
    device = token.device
    synchronize(device)
    s = time.perf_counter()
    for _ in range(steps):
        token = step(model, token.view(1, 1), pos).argmax(dim=-1, keepdim=True)
        pos = pos + 1
    synchronize(device)
    times.extend([(time.perf_counter() - s) / steps] * steps)
    state["token"], state["pos"] = token, pos


def paired_overhead(model, tokenizer, ids: list[int], step, caches: list, slots: int, steps: int,
                    blocks: int, ref_caches: list | None = None) -> tuple[float, float, int]:
    """Median step seconds of (this strategy's caches, a full cache of the same size), decoded in alternating
    blocks (ABBA...) so that other load on the machine hits both alike; and the graphs compiled meanwhile.

    The strategy's caches are prefilled with min(slots, prompt) tokens, so with a budget below the sequence
    every step evicts (as in the timed run); the full cache holds `slots` slots with (slots - steps) prompt
    tokens, so it never evicts and attention, weights and K/V reads are the same size. `ref_caches`: that full
    cache from the reference row, whose compiled graph is then reused."""
    steps = max(2, min(steps, slots - 1))
    device = model.tok_embeddings.weight.device
    if ref_caches is None:
        full_specs = resolve_cache_spec(cache_args("full", 1.0), model.args.n_layer, slots - steps, steps)
        setup_caches(model, full_specs, slots, tokenizer)
        ref_caches = model.caches()
    ref = {"caches": ref_caches}
    ours = {"caches": caches}
    with torch.inference_mode():
        for state, n in ((ours, min(slots, len(ids))), (ref, slots - steps)):
            model.setup_caches(state["caches"])
            if hasattr(step, "prepare"):  # both caches decode through a CUDA graph of their own on a GPU
                step.prepare(model)
            model.reset_caches()
            state["token"] = prefill(model, torch.tensor([ids[:n]], device=device)).argmax(dim=-1, keepdim=True)
            state["pos"] = torch.tensor([n], device=device)
        _decode_block(model, step, ref, 1, [])  # compiles the reference graph unless its row just did
        _decode_block(model, step, ours, 1, [])
        graphs_before = counters["stats"]["unique_graphs"]
        times: dict[int, list[float]] = {id(ours): [], id(ref): []}
        blocks = max(1, min(blocks, steps - 1))  # 1 + blocks × per_block ≤ steps: the full cache never overflows
        per_block = max(1, (steps - 1) // blocks)
        for b in range(blocks):
            for state in (ours, ref) if b % 2 == 0 else (ref, ours):
                _decode_block(model, step, state, per_block, times[id(state)])
    model.setup_caches(caches)
    return (statistics.median(times[id(ours)]), statistics.median(times[id(ref)]),
            counters["stats"]["unique_graphs"] - graphs_before)


def bench_ours(model, tokenizer, ids: list[int], new: int, strategy: str, budget: float, compiled: bool,
               bandwidth: float, recompile_steps: int = 0, engine: str | None = None, pair_blocks: int = 0,
               reset: bool = True, full_caches: dict | None = None, keep_as_reference: bool = False,
               classes: dict | None = None) -> dict:
    """One row: build the caches, (compile and capture before the prompt,) time prefill + `new` tokens; with
    `recompile_steps`, run that many more decode steps on the same compiled step (fill, then evict) and
    count new graphs over both runs; with `pair_blocks`, measure the overhead over a same-size full cache
    (`paired_overhead`). `reset=False` keeps the graphs compiled so far, so that the pairing reuses the
    same-size reference row's graph. `full_caches` maps (compiled, slots) to the caches of same-size reference
    rows: filled by the rows with `keep_as_reference`, read by the pairing."""
    device = model.tok_embeddings.weight.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    specs = resolve_cache_spec(cache_args(strategy, budget), model.args.n_layer, len(ids), new)
    capacity = len(ids) + new
    setup_caches(model, specs, capacity, tokenizer, classes=classes)
    slots = max(s.max_cache_length for s in specs)
    step = decode_one_token
    if compiled:
        if reset:
            torch._dynamo.reset()
        step = compile_decode_step()
    graphs_before = counters["stats"]["unique_graphs"]
    result = generate(model, ids, new, [], step)  # a compiled step is compiled and captured first (prepare)
    stats = cache_statistics(model.caches())
    kv = kv_bytes_read(model.caches())
    check_steps = None
    if compiled and recompile_steps > 0:
        prompt, steps = recompile_check_shape(slots, capacity, recompile_steps)
        check_steps = generate(model, ids[:prompt], steps + 1, [], step).decode_steps
    # The graphs of the timed run itself (one per kind of layer, compiled in prepare) are not recompilations.
    layer_kinds = len({(type(c), c.max_cache_length) for c in model.caches()})
    recompilations = counters["stats"]["unique_graphs"] - graphs_before - layer_kinds if compiled else None
    ref_ms = overhead = None
    if pair_blocks > 0:
        ref_caches = (full_caches or {}).get((compiled, slots))
        ours_s, ref_s, graphs = paired_overhead(model, tokenizer, ids, step, model.caches(), slots, new, pair_blocks,
                                                ref_caches)
        ref_ms, overhead = round(1000 * ref_s, 2), round(ours_s / ref_s - 1, 3)
        if compiled:
            recompilations += graphs
    elif keep_as_reference and full_caches is not None:
        full_caches[(compiled, slots)] = model.caches()
    bound = bandwidth / (weight_bytes(model) + kv)
    tok_s = result.decode_steps / result.decode_seconds
    return {"engine": engine or ("ours compiled" if compiled else "ours eager"), "strategy": strategy,
            "budget": budget, "context": len(ids), "new_tokens": new, "cache_slots": slots,
            "prefill_tokens_per_second": round(len(ids) / result.prefill_seconds, 1),
            "decode_tokens_per_second": round(tok_s, 2), "ms_per_step": round(1000 / tok_s, 3),
            "median_ms_per_step": round(1000 / tok_s, 3),
            "compression_ratio": stats["compression_ratio"], "cache_bytes": stats["cache_bytes"],
            "kv_bytes_read_per_step": kv, "bound_tokens_per_second": round(bound, 1),
            "fraction_of_bound": round(tok_s / bound, 3), "same_size_full_median_ms": ref_ms,
            "overhead_vs_same_size_full": overhead, "speedup_vs_full": None, "bound_speedup_vs_full": None,
            "recompilations": recompilations, "recompile_check_steps": check_steps,
            "compile_seconds": round(result.compile_seconds, 1) if compiled else None, "peak_rss_mb": peak_rss_mb(),
            "peak_device_memory_mb": peak_device_memory_mb(device)}


def load_hf_model(source: dict, dtype: torch.dtype, device: str):
    """transformers' model for the same checkpoint (a directory or the bundled GGUF) or, for random weights,
    the same config with transformers' own random initialisation; None when transformers is absent."""
    try:
        import transformers
    except ImportError:
        return None
    if source.get("random_weights"):
        config = dict(RANDOM_SHAPES[source["random_weights"]])
        config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif source.get("checkpoint_path") and Path(source["checkpoint_path"]).is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(source["checkpoint_path"], dtype=dtype)
    else:
        path = Path(source.get("checkpoint_path") or bundled_checkpoint_path())
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


def bench_hf(source: dict, ids: list[int], new: int, dtype: torch.dtype, device: str, bandwidth: float,
             static_compiled: bool = False) -> dict | None:
    """transformers' generate on the same model: its default dynamic cache, or (`static_compiled`) its
    documented recipe for speed, a static cache with the forward compiled (mode "reduce-overhead": CUDA graphs),
    timed after a first, compiling generate. None when transformers is absent.

    A logits processor timestamps every step, so one generate call gives the prefill (up to the first
    step's logits) and each decode step."""
    model = load_hf_model(source, dtype, device)
    if model is None:
        return None
    import transformers

    class Clock(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    x = torch.tensor([ids], device=device)
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  pad_token_id=0)
    compile_seconds = None
    if static_compiled:
        # transformers compiles the forward itself when the cache is static on a GPU (its CompileConfig:
        # fullgraph, CUDA graphs); on the CPU it does not, so the forward is compiled as its docs show.
        model.generation_config.cache_implementation = "static"
        if torch.device(device).type != "cuda":
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, **kwargs)
        compile_seconds = round(time.perf_counter() - t, 1)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    clock = Clock()
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(x, **kwargs, logits_processor=transformers.LogitsProcessorList([clock]))
    prefill_s = clock.times[0] - t
    steps = [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]
    tok_s = len(steps) / (clock.times[-1] - clock.times[0])
    a = model.config
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    kv = 2 * a.num_hidden_layers * a.num_key_value_heads * head_dim * (
        len(ids) + new // 2) * torch.empty((), dtype=dtype).element_size()  # K/V read per step, on average
    bound = bandwidth / (weight_bytes(model) + kv)
    peak = peak_device_memory_mb(dev)
    del model
    torch._dynamo.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    row = dict.fromkeys(FIELDS)
    row.update({"engine": "hf generate, static cache compiled" if static_compiled else "hf generate",
                "strategy": "full (StaticCache)" if static_compiled else "full (DynamicCache)", "budget": 1.0,
                "context": len(ids), "new_tokens": new, "prefill_tokens_per_second": round(len(ids) / prefill_s, 1),
                "decode_tokens_per_second": round(tok_s, 2), "ms_per_step": round(1000 / tok_s, 3),
                "median_ms_per_step": round(1000 * statistics.median(steps), 3), "compression_ratio": 0.0,
                "kv_bytes_read_per_step": kv, "bound_tokens_per_second": round(bound, 1),
                "fraction_of_bound": round(tok_s / bound, 3), "compile_seconds": compile_seconds,
                "peak_rss_mb": peak_rss_mb(), "peak_device_memory_mb": peak})
    return row


# ---- the plan ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    kind: str  # "hf", "hf_static", "full" (a context's full-cache row), "ref" (same-size full reference), "strategy"
    context: int  # prompt tokens
    strategy: str = "full"
    budget: float = 1.0
    compiled: bool = False
    slots: int = 0  # per-layer cache slots
    recompile_steps: int = 0
    new_tokens: int = 0
    pair_blocks: int = 0  # > 0: paired overhead measurement against a same-size full cache

    def engine(self) -> str:
        if self.kind == "hf":
            return "hf generate"
        if self.kind == "hf_static":
            return "hf generate, static cache compiled"
        mode = "ours compiled" if self.compiled else "ours eager"
        return f"{mode} (same-size ref)" if self.kind == "ref" else mode


def build_plan(args: argparse.Namespace, strategies: list[str], n_layer: int, context_length: int) -> list[Job]:
    """Every row the run measures, in order; the same-size references right before the strategies they serve."""
    new = args.new_tokens
    compiled = not args.no_compile

    def fit(context: int) -> int:  # the prompt, so that prompt + new tokens fit the model's context
        if context < 1:
            raise UserError(f"contexts must be ≥ 1, got {context}")
        return min(context, context_length - new)

    plan: list[Job] = []
    refs: set[tuple[bool, int]] = set()  # (compiled, slots) already measured by a full or ref row
    checked: set[str] = set()  # strategies whose compiled graph got a recompilation check

    def check(strategy: str) -> int:
        if not compiled or args.recompile_steps <= 0 or strategy in checked:
            return 0
        checked.add(strategy)
        return args.recompile_steps

    def full_row(context: int, is_compiled: bool) -> None:
        if any(j.kind == "full" and (j.context, j.compiled) == (context, is_compiled) for j in plan):
            return
        plan.append(Job("full", context, compiled=is_compiled, slots=context + new, new_tokens=new,
                        recompile_steps=check("full") if is_compiled else 0))
        refs.add((is_compiled, context + new))

    def strategy_rows(context: int, budgets: list[float], names: list[str], overhead: bool = True) -> None:
        full_row(context, compiled)  # the speed-up is measured against the full cache at this context
        for b in sorted(set(budgets)):
            for s in names if b == args.speedup_budget else [n for n in names if n in budget_strategies]:
                if any(j.kind == "strategy" and (j.context, j.strategy, j.budget) == (context, s, b) for j in plan):
                    continue
                slots = cache_slots(s, b, n_layer, context, new)
                measure_overhead = overhead and not args.no_same_size_ref
                if measure_overhead and (compiled, slots) not in refs:
                    ref_new = min(new, slots - 1)
                    if ref_new >= 2:
                        plan.append(Job("ref", slots - ref_new, compiled=compiled, slots=slots, new_tokens=ref_new))
                        refs.add((compiled, slots))
                pair = args.overhead_blocks if measure_overhead else 0
                plan.append(Job("strategy", context, s, b, compiled, slots, check(s), new, pair))

    for context in map(fit, args.contexts):
        if not args.no_hf:
            plan.append(Job("hf", context, new_tokens=new))
            if args.hf_static:
                plan.append(Job("hf_static", context, new_tokens=new))
        full_row(context, False)
        if compiled:
            full_row(context, True)
    for context in map(fit, args.bound_contexts):
        full_row(context, compiled)
    budget_strategies = strategies if args.budget_strategies == ["all"] else args.budget_strategies
    for context in map(fit, args.strategy_contexts):
        strategy_rows(context, [args.speedup_budget, *args.budgets], strategies)
    for context in map(fit, args.speedup_contexts):  # the speed-up only: overheads are measured above
        strategy_rows(context, [args.speedup_budget], args.speedup_strategies, overhead=False)
    return plan


def plan_summary(plan: list[Job]) -> str:
    """Size of the plan and its estimated duration from the EST_* costs (2 idle cores)."""

    def prefill_s(tokens: int, strategy: str = "full") -> float:
        scored = EST_SCORED_PREFILL_C * tokens**2 if strategy in ("heavy_hitter", "hybrid") else 0.0
        return tokens * (EST_PREFILL_A + EST_PREFILL_B * tokens) + scored

    def step_s(j: Job, slots: int) -> float:
        return (EST_STEP_A + EST_STEP_B * slots) * (1 if j.compiled else EST_EAGER_FACTOR)

    seconds, prefill, steps = 30.0, 0, 0  # model load, bandwidth
    for j in plan:
        if j.kind == "hf":
            prefill += j.context
            steps += j.new_tokens
            seconds += 5 + prefill_s(j.context) + j.new_tokens * (EST_HF_STEP_A + EST_HF_STEP_B * j.context)
            continue
        seconds += EST_COMPILE_S * j.compiled + prefill_s(j.context, j.strategy) + j.new_tokens * step_s(j, j.slots)
        prefill += j.context
        steps += j.new_tokens
        if j.recompile_steps:
            seconds += prefill_s(j.slots // 2) + j.recompile_steps * step_s(j, j.slots)
            steps += j.recompile_steps
        if j.pair_blocks:  # the strategy's prefill of `slots` tokens, then as many steps on each cache
            seconds += prefill_s(min(j.slots, j.context), j.strategy) + 2 * j.new_tokens * step_s(j, j.slots)
            prefill += min(j.slots, j.context)
            steps += 2 * j.new_tokens
    return (f"{len(plan)} rows, {sum(j.compiled for j in plan)} compiles, {prefill} prefill tokens, {steps} decode "
            f"steps: about {seconds / 60:.0f} min on 2 idle cores (--dry_run's model of this machine)")


# ---- derived columns and the targets -------------------------------------------------------------------


def fill_comparisons(rows: list[dict]) -> None:
    """Speed-up of each strategy row over the full cache at the same context (same engine, same new tokens),
    measured (median step times) and as the bandwidth bound predicts it."""
    for r in rows:
        if r["strategy"] == "full" or r["engine"] == "hf generate":
            continue
        full = next((f for f in rows if f["engine"] == r["engine"] and f["strategy"] == "full"
                     and f["context"] == r["context"] and f["new_tokens"] == r["new_tokens"]), None)
        if full is not None:  # median step times: one slow stretch of a shared machine does not decide it
            r["speedup_vs_full"] = round(full["median_ms_per_step"] / r["median_ms_per_step"], 3)
            r["bound_speedup_vs_full"] = round(r["bound_tokens_per_second"] / full["bound_tokens_per_second"], 3)


def summarize_targets(rows: list[dict], speedup_budget: float, weights: int = 0) -> dict:
    """The targets as measured ratios (`weights`: bytes of the model's weights); `met` is None where the
    run has no row to judge by."""

    def find(engine: str, context: int, strategy: str = "full", budget: float | None = None) -> dict | None:
        return next((r for r in rows if r["engine"] == engine and r["context"] == context
                     and r["strategy"] == strategy and (budget is None or r["budget"] == budget)), None)

    def target(value: object, goal: str, met: bool | None) -> dict:
        return {"value": value, "target": goal, "met": met}

    targets: dict = {}
    hf_contexts = [r["context"] for r in rows if r["engine"].startswith("hf generate")]
    context = max(hf_contexts or [r["context"] for r in rows if r["engine"] == "ours compiled"] or [0])
    ours = find("ours compiled", context)
    frac = ours["fraction_of_bound"] if ours else None
    targets["compiled_fraction_of_bound"] = target(frac, f">= {TARGET_FRACTION_OF_BOUND} (context {context})",
                                                   None if frac is None else frac >= TARGET_FRACTION_OF_BOUND)
    for key, engine, strategy in (("compiled_over_hf_generate", "hf generate", "full (DynamicCache)"),
                                  ("compiled_over_hf_static_compiled", "hf generate, static cache compiled",
                                   "full (StaticCache)")):
        hf = find(engine, context, strategy)
        ratio = round(hf["median_ms_per_step"] / ours["median_ms_per_step"], 2) if hf and ours else None
        targets[key] = target(ratio, "> 1", None if ratio is None else ratio > 1)
    overhead = {}
    for r in rows:
        if r["overhead_vs_same_size_full"] is not None and r["engine"] == "ours compiled":
            overhead[r["strategy"]] = max(overhead.get(r["strategy"], -1.0), r["overhead_vs_same_size_full"])
    judged = [v for s, v in overhead.items() if not s.startswith("debug_")]
    targets["max_eviction_overhead"] = target(overhead, f"<= {TARGET_MAX_OVERHEAD} (debug_* excluded)",
                                              max(judged) <= TARGET_MAX_OVERHEAD if judged else None)
    speedups = {}
    for r in rows:
        if r["engine"] == "ours compiled" and r["budget"] == speedup_budget and r["speedup_vs_full"] is not None:
            speedups[f"{r['strategy']}@{r['context']}"] = {
                "speedup": r["speedup_vs_full"], "predicted": r["bound_speedup_vs_full"],
                "ratio_of_predicted": round(r["speedup_vs_full"] / r["bound_speedup_vs_full"], 3),
                "context": r["context"]}
    longest = max((v["context"] for v in speedups.values()), default=None)
    at_longest = [v["ratio_of_predicted"] for v in speedups.values() if v["context"] == longest]
    targets["speedup_of_predicted"] = target(
        speedups, f"speed-up / predicted >= {TARGET_SPEEDUP_OF_PREDICTED} at {speedup_budget:g} budget, "
        f"longest context ({longest})", min(at_longest) >= TARGET_SPEEDUP_OF_PREDICTED if at_longest else None)
    peak = {}
    if longest is not None:
        full = find("ours compiled", longest)
        for r in rows:
            if (r["engine"] == "ours compiled" and r["context"] == longest and r["strategy"] != "full"
                    and r["budget"] == speedup_budget and full and r["peak_device_memory_mb"] is not None and weights):
                limit = (weights + TARGET_PEAK_KV_SHARE * full["kv_bytes_read_per_step"]) / 2**20
                peak[r["strategy"]] = {"peak_mb": r["peak_device_memory_mb"], "limit_mb": round(limit, 1),
                                       "full_cache_peak_mb": full["peak_device_memory_mb"]}
    targets["peak_memory_at_longest"] = target(
        peak, f"<= weights + {TARGET_PEAK_KV_SHARE} x the full cache's K/V",
        all(v["peak_mb"] <= v["limit_mb"] for v in peak.values()) if peak else None)
    prefill = {}
    for r in rows:
        full = find(r["engine"], r["context"])
        if r["strategy"] in SCORED_PREFILL and r["engine"] == "ours compiled" and full:
            prefill[f"{r['strategy']}@{r['context']}"] = round(
                r["prefill_tokens_per_second"] / full["prefill_tokens_per_second"], 3)
    targets["scored_prefill_of_full"] = target(prefill, f">= {TARGET_SCORED_PREFILL} of the full cache's prefill",
                                               min(prefill.values()) >= TARGET_SCORED_PREFILL if prefill else None)
    checked = [r for r in rows if r["recompile_check_steps"] is not None]
    recompiles = [r["recompilations"] for r in rows if r["recompilations"] is not None]
    check_steps = min((r["recompile_check_steps"] for r in checked), default=None)
    targets["recompilations"] = {"value": max(recompiles) if recompiles else None, "check_steps": check_steps,
                                 "checked": sorted({r["strategy"] for r in checked}), "target": "0 over >= 256 steps",
                                 "met": max(recompiles) == 0 and check_steps >= 256 if checked else None}
    return targets


def format_targets(targets: dict) -> str:
    lines = ["| target | measured | goal | met |", "|---|---|---|---|"]
    for name, t in targets.items():
        value = t["value"]
        if name == "speedup_of_predicted":
            value = ", ".join(f"{k}: {v['speedup']}× vs {v['predicted']}× predicted" for k, v in value.items())
        elif name == "max_eviction_overhead":
            value = ", ".join(f"{k}: {v:+.1%}" for k, v in value.items())
        elif name == "peak_memory_at_longest":
            value = ", ".join(f"{k}: {v['peak_mb']:.0f} MB (limit {v['limit_mb']:.0f}, full cache "
                              f"{v['full_cache_peak_mb']:.0f})" for k, v in value.items())
        elif name == "scored_prefill_of_full":
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif name == "recompilations" and t["check_steps"] is not None:
            value = f"{value} (check runs of {t['check_steps']} steps: {', '.join(t['checked'])})"
        lines.append(f"| {name} | {value} | {t['target']} | {'' if t['met'] is None else t['met']} |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    cols = ["engine", "strategy", "budget", "context", "cache_slots", "prefill_tokens_per_second",
            "decode_tokens_per_second", "median_ms_per_step", "compression_ratio", "fraction_of_bound",
            "overhead_vs_same_size_full", "speedup_vs_full", "bound_speedup_vs_full", "recompilations",
            "compile_seconds", "peak_rss_mb"]
    short = {"prefill_tokens_per_second": "prefill tok/s", "decode_tokens_per_second": "decode tok/s",
             "compression_ratio": "compression", "fraction_of_bound": "of bound", "peak_rss_mb": "peak RSS MB",
             "recompilations": "recompiles", "cache_slots": "slots", "median_ms_per_step": "median ms/step",
             "overhead_vs_same_size_full": "overhead vs same-size full", "speedup_vs_full": "speed-up vs full",
             "bound_speedup_vs_full": "bound speed-up", "compile_seconds": "compile s"}
    lines = ["| " + " | ".join(short.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def build_parser() -> CliParser:
    p = CliParser(prog="python -m eval.bench", description=__doc__.split("\n")[0])
    p.add_argument("--contexts", nargs="*", type=int, default=[512, 2048, 4096, 8192],
                   help="HF, eager and compiled full-cache rows (a context is cut to the model's context "
                        "length minus --new_tokens)")
    p.add_argument("--bound_contexts", nargs="*", type=int, default=[256],
                   help="compiled full-cache rows only (the fraction-of-bound target is at 256)")
    p.add_argument("--strategy_contexts", nargs="*", type=int, default=[4096],
                   help="contexts where every strategy runs at --speedup_budget, and --budget_strategies at each "
                        "of --budgets too")
    p.add_argument("--speedup_contexts", nargs="*", type=int, default=[8192],
                   help="further contexts where --speedup_strategies run at --speedup_budget only, without the "
                        "overhead measurement (none: pass the flag alone)")
    p.add_argument("--speedup_strategies", nargs="+", default=["recent_global"])
    p.add_argument("--speedup_budget", type=float, default=0.1,
                   help="the budget every strategy runs at (the speed-up target's budget)")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--strategies", nargs="+", default=None, help="default: every registered strategy")
    p.add_argument("--budgets", nargs="+", type=float, default=[0.1, 0.25, 0.5])
    p.add_argument("--budget_strategies", nargs="+", default=["heavy_hitter"],
                   help="strategies run at every --budgets at --strategy_contexts (default: heavy_hitter, whose "
                        "per-step work grows with the cache: attention probabilities, an O(slots) state update; "
                        "all: every strategy, about 15 more minutes)")
    p.add_argument("--recompile_steps", type=int, default=256,
                   help="per compiled strategy (once), decode this many more steps on its compiled graph, with a "
                        "prompt that lets the cache fill and then evict, and count new graphs (0: off)")
    p.add_argument("--overhead_blocks", type=int, default=8,
                   help="strategy rows: decode --new_tokens more steps on the strategy's caches and as many on a "
                        "same-size full cache, alternating in this many blocks, for overhead_vs_same_size_full")
    p.add_argument("--no_same_size_ref", action="store_true",
                   help="skip the same-size full-cache references and the overhead measurement")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--inductor_freezing", action="store_true",
                   help="experiment: compile with torch._inductor.config.freezing (weights folded and prepacked for "
                        "oneDNN; faster decode here, but each compile is cold and keeps ~250 MB in the process)")
    p.add_argument("--no_compile", action="store_true", help="eager rows only")
    p.add_argument("--no_hf", action="store_true", help="skip the Hugging Face rows")
    p.add_argument("--hf_static", action="store_true",
                   help="also transformers' static cache with its forward compiled (its documented recipe for speed; "
                        "CUDA graphs on a GPU), at each of --contexts")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--checkpoint_path", default=None,
                   help="a .gguf file or a Hugging Face directory (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--random_weights", choices=sorted(RANDOM_SHAPES), default=None,
                   help="random weights with a real model's shapes instead of a checkpoint (decode speed depends on "
                        "the shapes only; nothing is downloaded); prompts are random token ids")
    p.add_argument("--quick", action="store_true", help="~1 minute: context 256, 16 tokens, eager, 2 strategies")
    p.add_argument("--dry_run", action="store_true", help="print the plan and its estimated duration, run nothing")
    p.add_argument("--out_dir", default="results/bench")
    p.add_argument("--overwrite", action="store_true", help="replace an existing bench.json/csv in --out_dir")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.contexts, args.strategy_contexts, args.speedup_contexts, args.bound_contexts = [256], [256], [], []
        args.new_tokens, args.no_compile = 16, True
        args.strategies = args.strategies or ["recent_global", "heavy_hitter"]
        args.budgets, args.speedup_budget = [0.25], 0.25
    if args.new_tokens < 2:
        raise UserError(f"--new_tokens must be ≥ 2, got {args.new_tokens}")
    strategies = [s for s in (args.strategies or CACHE_STRATEGIES) if s != "full"]
    if args.overhead_blocks < 1:
        raise UserError(f"--overhead_blocks must be ≥ 1, got {args.overhead_blocks}")
    for s in strategies + args.speedup_strategies + [b for b in args.budget_strategies if b != "all"]:
        if s not in CACHE_STRATEGIES:
            raise UserError(f"unknown strategy {s!r}; available: {', '.join(CACHE_STRATEGIES)}")
    if args.random_weights and args.checkpoint_path:
        raise UserError("--random_weights and --checkpoint_path exclude each other")
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    out_dir = Path(args.out_dir)
    if args.dry_run:
        model, _ = load_model(args, "meta" if args.random_weights else "cpu", dtype)
        plan = build_plan(args, strategies, model.args.n_layer, model.args.context_length)
        for job in plan:
            print(f"{job.engine():<30} {job.strategy:<14} budget {job.budget:<5g} context {job.context:<6} "
                  f"slots {job.slots:<6} new {job.new_tokens}"
                  + (f" + {job.recompile_steps}-step recompile check" if job.recompile_steps else ""))
        print(plan_summary(plan))
        return []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out_dir}: {e.strerror}") from None
    if (out_dir / "bench.json").exists() and not args.overwrite:
        raise UserError(f"{out_dir / 'bench.json'} exists; pass --overwrite or another --out_dir")
    torch.set_grad_enabled(False)
    if args.inductor_freezing:
        torch._inductor.config.freezing = True
    bandwidth = measure_read_bandwidth(device)
    print(f"read bandwidth: {bandwidth / 1e9:.2f} GB/s", flush=True)
    source = {"random_weights": args.random_weights, "checkpoint_path": args.checkpoint_path}
    model = tokenizer = None
    if args.random_weights:  # built on the device when its first row runs; its shapes from a meta copy now
        shapes = load_model(args, "meta", dtype)[0]
        model_args, total_weight_bytes = shapes.args, weight_bytes(shapes)
    else:
        model, tokenizer = load_model(args, device, dtype)
        model_args, total_weight_bytes = model.args, weight_bytes(model)
    plan = build_plan(args, strategies, model_args.n_layer, model_args.context_length)
    print(plan_summary(plan), flush=True)
    max_context = max(j.context for j in plan)
    if tokenizer is None:  # random weights: random token ids (the speed does not depend on them)
        generator = torch.Generator().manual_seed(0)
        corpus_ids = torch.randint(0, model_args.vocab_size, (max_context,), generator=generator).tolist()
    else:
        corpus_ids = tokenizer.encode(pydoc_corpus()[: 40 * max_context])
    if len(corpus_ids) < max_context:
        raise UserError(f"the corpus has {len(corpus_ids)} tokens, fewer than the longest context {max_context}")
    # Without a tokenizer, the hybrid cache's special / punctuation classes are empty.
    classes = None if tokenizer is not None else {
        name: torch.zeros(model_args.vocab_size, dtype=torch.bool) for name in ("special", "punct")}
    rows: list[dict] = []
    from tqdm import tqdm

    started = time.perf_counter()
    group = None  # compiled graphs are kept from a same-size reference through the strategy rows of its size
    full_caches: dict = {}
    partial = out_dir / "bench.partial.jsonl"  # each row as it is measured: a run cut short keeps its rows
    partial.write_text("")
    # Ours first, then transformers' rows with our model released: peak device memory is one model's.
    plan = [j for j in plan if not j.kind.startswith("hf")] + [j for j in plan if j.kind.startswith("hf")]
    for job in tqdm(plan, desc="bench"):
        ids = corpus_ids[: job.context]
        if job.kind.startswith("hf"):
            if model is not None:
                model = full_caches = None
                torch._dynamo.reset()
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            try:
                row = bench_hf(source, ids, job.new_tokens, dtype, device, bandwidth, job.kind == "hf_static")
            except Exception as e:  # another library's failure costs its row, not the run's other rows
                tqdm.write(f"warning: {job.engine()} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                row = None
        else:
            if model is None:
                model, _ = load_model(args, device, dtype)
            key = job.slots if job.kind in ("ref", "strategy") else None
            # A group holds the reference and each strategy's graph; allow them all without recompiling.
            with torch._dynamo.config.patch(recompile_limit=max(64, torch._dynamo.config.recompile_limit)):
                row = bench_ours(model, tokenizer, ids, job.new_tokens, job.strategy, job.budget, job.compiled,
                                 bandwidth, job.recompile_steps, job.engine(), job.pair_blocks,
                                 reset=key is None or key != group, full_caches=full_caches,
                                 keep_as_reference=job.kind == "ref", classes=classes)
            group = key
        if row is not None:
            rows.append(row)
            tqdm.write(json.dumps(row))
            with partial.open("a") as f:
                f.write(json.dumps(row) + "\n")
    fill_comparisons(rows)
    targets = summarize_targets(rows, args.speedup_budget, total_weight_bytes)
    table = format_table(rows) + "\n\n" + format_targets(targets)
    print(table)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.machine(),
            "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
            "model": args.random_weights or args.checkpoint_path or "bundled SmolLM2-135M-Instruct",
            "processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "dtype": args.dtype, "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
            "weight_bytes": total_weight_bytes, "argv": argv, "wall_seconds": round(time.perf_counter() - started),
            "graphs_compiled": counters["stats"]["unique_graphs"], "compiled_rows": sum(j.compiled for j in plan),
            "inductor_freezing": bool(torch._inductor.config.freezing)}
    write_json_atomic(out_dir / "bench.json", {"meta": meta, "targets": targets, "rows": rows}, overwrite=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(out_dir / "bench.csv", buffer.getvalue(), overwrite=True)
    atomic_write(out_dir / "bench.md", table + "\n", overwrite=True)
    partial.unlink()
    return rows


def load_model(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[Transformer, object]:
    """(model, tokenizer): `--random_weights` (no tokenizer), else `--checkpoint_path` or the bundled model."""
    if args.random_weights:
        model = random_weight_model(args.random_weights, device, dtype)
        attach_random_gates(model)  # the gated strategy's gates: random too (no trained gates for random weights)
        return model, None
    return load_checkpoint(args.checkpoint_path, device, dtype)


if __name__ == "__main__":
    run_cli(main)
