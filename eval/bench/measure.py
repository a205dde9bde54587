"""Measuring one bench row: the machine (bandwidth, memory), the models (a checkpoint or random weights of
a real model's shapes; transformers' for its rows), and the timed runs of ours and of transformers."""


from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import torch

from cache import cache_statistics
from cache_setup import attach_caches
from checkpoint import bundled_checkpoint_path, load_checkpoint
from checkpoint_hf import hf_model_args
from compiled_step import compile_decode_step, graphs_compiled
from errors import UserError
from eval.bench.plan import cache_args, recompile_check_shape
from eval.bench.profile import profile_decode_steps
from gates import attach_random_gates
from generate import decode_one_token, generate, prefill
from model import Transformer
from weight_arena import pack_parameters

FIELDS = ["engine", "strategy", "budget", "context", "new_tokens", "batch_size", "kv_memory_cap_gb", "cache_slots",
          "prefill_tokens_per_second",
          "decode_tokens_per_second", "ms_per_step", "median_ms_per_step", "compression_ratio", "cache_bytes",
          "kv_bytes_read_per_step", "bound_tokens_per_second", "fraction_of_bound", "fraction_of_bound_paired",
          "same_size_full_median_ms",
          "overhead_vs_same_size_full", "speedup_vs_full", "bound_speedup_vs_full", "recompilations",
          "recompile_check_steps", "compile_seconds", "peak_rss_mb", "peak_device_memory_mb", "cache_bits"]

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
def measure_read_bandwidth(device: torch.device | str = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum over a buffer much larger than the caches and the
    device's last-level cache), best of n, on `device`."""
    return read_rate(probe_buffer(device, megabytes), repeats)


def probe_buffer(device: torch.device | str, megabytes: int = 512) -> torch.Tensor:
    """The read probe's buffer: `megabytes` of float32 ones (at least 4 GB on a GPU), touched once."""
    device = torch.device(device)
    if device.type == "cuda":
        megabytes = max(megabytes, 4096)
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    x.sum()
    return x


def read_rate(x: torch.Tensor, repeats: int = 5) -> float:
    """Bytes per second of summing `x` (a probe_buffer), best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        synchronize(x.device)
        t = time.perf_counter()
        x.sum()
        synchronize(x.device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best


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
    if torch.device(device).type == "cpu":
        model.weight_arena = pack_parameters(model)  # as build_model does for a loaded checkpoint
    else:
        model.fuse_projections()
    return model.eval().requires_grad_(False)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (tied embeddings are one parameter, counted once): what one decode
    step reads."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_read(caches: list) -> int:
    """Bytes of K/V storage attention reads per step, all layers (kv_storage: codes, scales, the KIVI residual;
    a debug_ cache's attention reads its full cache, not the shadow)."""
    return sum(c.storage.attention_bytes() for c in caches)


def bandwidth_bound(bandwidth: float, weights: int, kv_read: int, batch_size: int = 1) -> float:
    """Tokens per second (summed over the rows) if a step took only its reads: the weights once for the
    whole batch and every row's K/V (`kv_read`: all rows' bytes), at `bandwidth` bytes per second."""
    return batch_size * bandwidth / (weights + kv_read)


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


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
        attach_caches(model, cache_args("full", 1.0), slots - steps, steps, tokenizer)
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
        graphs_before = graphs_compiled()
        times: dict[int, list[float]] = {id(ours): [], id(ref): []}
        blocks = max(1, min(blocks, steps - 1))  # 1 + blocks × per_block ≤ steps: the full cache never overflows
        per_block = max(1, (steps - 1) // blocks)
        for b in range(blocks):
            for state in (ours, ref) if b % 2 == 0 else (ref, ours):
                _decode_block(model, step, state, per_block, times[id(state)])
    model.setup_caches(caches)
    return (statistics.median(times[id(ours)]), statistics.median(times[id(ref)]),
            graphs_compiled() - graphs_before)


# Blocks of decode steps in the paired bound measurement (paired_fraction_of_bound).
BOUND_BLOCKS = 4


def paired_fraction_of_bound(model, ids: list[int], step, steps: int, weights: int, kv: int,
                             blocks: int = BOUND_BLOCKS) -> float:
    """The fraction of the bandwidth bound with each block of decode steps paired with the read rate probed
    just before and just after it (their mean), the median over `blocks` blocks: on a shared host the rate
    moves by up to 2x within minutes, so one probe taken before the rows (`fraction_of_bound`) can be far
    from the rate the steps had. The caches (full, `len(ids) + steps` slots) are prefilled again with `ids`;
    one step, then up to `blocks` blocks of (steps - 1) // blocks steps (fewer blocks where fewer steps are left:
    the cache has room for `steps`)."""
    device = model.tok_embeddings.weight.device
    blocks = max(1, min(blocks, steps - 1))
    state = {"caches": model.caches()}
    buffer = probe_buffer(device)
    with torch.inference_mode():
        model.reset_caches()
        state["token"] = prefill(model, torch.tensor([ids], device=device)).argmax(dim=-1, keepdim=True)
        state["pos"] = torch.tensor([len(ids)], device=device)
        _decode_block(model, step, state, 1, [])
        rates, fractions = [read_rate(buffer)], []
        for _ in range(blocks):
            times: list[float] = []
            _decode_block(model, step, state, (steps - 1) // blocks, times)
            rates.append(read_rate(buffer))
            fractions.append(1 / times[0] / bandwidth_bound((rates[-2] + rates[-1]) / 2, weights, kv))
    del buffer
    return statistics.median(fractions)


def bench_ours(model, tokenizer, ids: list[int], new: int, strategy: str, budget: float, compiled: bool,
               bandwidth: float, recompile_steps: int = 0, engine: str | None = None, pair_blocks: int = 0,
               reset: bool = True, full_caches: dict | None = None, keep_as_reference: bool = False,
               classes: dict | None = None, compile_scope: str = "block", profile_steps: int = 0) -> dict:
    """One row: build the caches, (compile and capture before the prompt,) time prefill + `new` tokens; with
    `recompile_steps`, run that many more decode steps on the same compiled step (fill, then evict) and
    count new graphs over both runs; with `pair_blocks`, measure the overhead over a same-size full cache
    (`paired_overhead`). `reset=False` keeps the graphs compiled so far, so that the pairing reuses the
    same-size reference row's graph. `full_caches` maps (compiled, slots) to the caches of same-size reference
    rows: filled by the rows with `keep_as_reference`, read by the pairing. With `profile_steps`, the row's
    "profile": that many more steps under torch.profiler (eval/bench/profile.py)."""
    device = model.tok_embeddings.weight.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    specs = attach_caches(model, cache_args(strategy, budget), len(ids), new, tokenizer, classes=classes)
    slots = max(s.max_cache_length for s in specs)
    step = decode_one_token
    if compiled:
        if reset:
            torch._dynamo.reset()
        step = compile_decode_step(scope=compile_scope)
    graphs_before = graphs_compiled()
    result = generate(model, ids, new, [], step)  # a compiled step is compiled and captured first (prepare)
    stats = cache_statistics(model.caches())
    kv = kv_bytes_read(model.caches())
    check_steps = recompilations = None
    if compiled:
        check_steps, recompilations = recompile_check(model, ids, new, step, slots, recompile_steps, graphs_before)
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
    bound = bandwidth_bound(bandwidth, weight_bytes(model), kv)
    tok_s = result.decode_steps / result.decode_seconds
    paired = None
    if compiled and strategy == "full" and pair_blocks == 0 and not keep_as_reference:  # the bound targets' rows
        paired = round(paired_fraction_of_bound(model, ids, step, new, weight_bytes(model), kv), 3)
    row = {"engine": engine or ("ours compiled" if compiled else "ours eager"), "strategy": strategy,
           "budget": budget, "context": len(ids), "new_tokens": new, "batch_size": 1, "kv_memory_cap_gb": None,
           "cache_slots": slots,
           "prefill_tokens_per_second": round(len(ids) / result.prefill_seconds, 1),
           "decode_tokens_per_second": round(tok_s, 2), "ms_per_step": round(1000 / tok_s, 3),
           "median_ms_per_step": round(1000 / tok_s, 3),
           "compression_ratio": stats["compression_ratio"], "cache_bytes": stats["cache_bytes"],
           "kv_bytes_read_per_step": kv, "bound_tokens_per_second": round(bound, 1),
           "fraction_of_bound": round(tok_s / bound, 3), "fraction_of_bound_paired": paired,
           "same_size_full_median_ms": ref_ms,
           "overhead_vs_same_size_full": overhead, "speedup_vs_full": None, "bound_speedup_vs_full": None,
           "recompilations": recompilations, "recompile_check_steps": check_steps,
           "compile_seconds": round(result.compile_seconds, 1) if compiled else None, "peak_rss_mb": peak_rss_mb(),
           "peak_device_memory_mb": peak_device_memory_mb(device), "cache_bits": 16}
    if profile_steps:  # not a CSV column: bench.json and bench.md's profile table
        row["profile"] = profile_decode_steps(model, ids, step, profile_steps)
    return row


def recompile_check(model, ids: list[int], new: int, step, slots: int, recompile_steps: int,
                    graphs_before: int) -> tuple[int | None, int]:
    """(decode steps of the check run, graphs compiled since `graphs_before`): with `recompile_steps`, that
    many more steps on the same compiled step, the cache filling and then evicting. The graphs of the timed
    run itself (compiled in prepare) are not recompilations."""
    check_steps = None
    if recompile_steps > 0:
        prompt, steps = recompile_check_shape(slots, len(ids) + new, recompile_steps)
        check_steps = generate(model, ids[:prompt], steps + 1, [], step).decode_steps
    return check_steps, graphs_compiled() - graphs_before - step.graphs_per_set(model)


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


def timed_hf_generate(model, x: torch.Tensor, kwargs: dict) -> tuple[float, list[float]]:
    """(prefill seconds, each decode step's seconds) of one transformers generate call: a logits processor
    timestamps every step, so the prefill ends at the first step's logits."""
    import transformers

    class Clock(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    clock = Clock()
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(x, **kwargs, logits_processor=transformers.LogitsProcessorList([clock]))
    return clock.times[0] - t, [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]


def bench_hf(source: dict, ids: list[int], new: int, dtype: torch.dtype, device: str, bandwidth: float,
             static_compiled: bool = False) -> dict | None:
    """transformers' generate on the same model: its default dynamic cache, or (`static_compiled`) its
    documented recipe for speed, a static cache with the forward compiled (mode "reduce-overhead": CUDA graphs),
    timed after a first, compiling generate (timed_hf_generate). None when transformers is absent."""
    model = load_hf_model(source, dtype, device)
    if model is None:
        return None
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
    prefill_s, steps = timed_hf_generate(model, x, kwargs)
    tok_s = len(steps) / sum(steps)
    a = model.config
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    kv = 2 * a.num_hidden_layers * a.num_key_value_heads * head_dim * (
        len(ids) + new // 2) * torch.empty((), dtype=dtype).element_size()  # K/V read per step, on average
    bound = bandwidth_bound(bandwidth, weight_bytes(model), kv)
    peak = peak_device_memory_mb(dev)
    del model
    torch._dynamo.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    row = dict.fromkeys(FIELDS)
    row.update({"engine": "hf generate, static cache compiled" if static_compiled else "hf generate",
                "strategy": "full (StaticCache)" if static_compiled else "full (DynamicCache)", "budget": 1.0,
                "context": len(ids), "new_tokens": new, "batch_size": 1,
                "prefill_tokens_per_second": round(len(ids) / prefill_s, 1),
                "decode_tokens_per_second": round(tok_s, 2), "ms_per_step": round(1000 / tok_s, 3),
                "median_ms_per_step": round(1000 * statistics.median(steps), 3), "compression_ratio": 0.0,
                "kv_bytes_read_per_step": kv, "bound_tokens_per_second": round(bound, 1),
                "fraction_of_bound": round(tok_s / bound, 3), "compile_seconds": compile_seconds,
                "peak_rss_mb": peak_rss_mb(), "peak_device_memory_mb": peak})
    return row


def check_model_source(args: argparse.Namespace) -> None:
    """`--random_weights` or `--checkpoint_path` (or neither: the bundled model), as load_model reads them."""
    if args.random_weights and args.checkpoint_path:
        raise UserError("--random_weights and --checkpoint_path exclude each other")


def load_model(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[Transformer, object]:
    """(model, tokenizer): `--random_weights` (no tokenizer), else `--checkpoint_path` or the bundled model."""
    if args.random_weights:
        model = random_weight_model(args.random_weights, device, dtype)
        attach_random_gates(model)  # the gated strategy's gates: random too (no trained gates for random weights)
        return model, None
    return load_checkpoint(args.checkpoint_path, device, dtype, allow_non_finite=args.allow_non_finite_weights)
