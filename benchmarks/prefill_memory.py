"""Peak memory and speed of prefilling prompts of growing length at a fixed budget: one shot vs
--prefill_chunk, on the CPU (peak RSS) or a GPU (peak CUDA memory allocated).

Each configuration (strategy, length, chunked or not) runs in a fresh process: load the model (the bundled
one, `--checkpoint_path`, or `--random_weights` with a real model's shapes, built on the device), attach
caches of `--budget` tokens per layer, reset the peak (the kernel's RSS high-water mark through
/proc/self/clear_refs, or torch's CUDA peak), prefill a prompt of random tokens, and read the peak back.
Reported per row: the peak, what the prefill added over the memory before it (the loaded model and caches),
and prefill tokens/s. One-shot memory grows with the prompt (its K/V and activations); chunked memory should
not: the targets are a < 10% difference of the chunked peak between 4× and 16× the budget, and a chunked
prefill speed of at least half the one-shot speed at the same length. `--profile_lengths N ...` prefills the
rows of those lengths once more under torch.profiler and reports where the time went, by kind of work
(eval.bench.profile's kinds: the weights' products, attention, copies and fills, ...). With `--rerotate_positions` the
lengths may exceed the model's context: chunks then run at RoPE ranks below budget + chunk, and lengths
past the context (or past `--one_shot_max`) are measured chunked only; a strategy that cannot prefill in chunks
(hybrid) is measured one shot only. The storage flags (`--cache_bits`, `--cache_quantization`,
`--think_ratio`, ...: cache_spec.add_storage_arguments, the same definitions as generate.py's) and the head
budgets' (`--budget_allocation adakv`, `--adakv_floor`: cache_spec.add_allocation_arguments) apply to every
row: a chunked prefill under a lossy storage (ThinK, KIVI) keeps the held tokens' exact keys (and values)
until the prompt is in, a pool re-prefills each head over its own held tokens, and these rows measure what that
holds. Linux only on the CPU (/proc).

    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory                     # budget 256, 1k..4k tokens
    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory --lengths 1024 8192 --strategies recent_global
    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory --rerotate_positions --lengths 1024 4096 16384
    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory --cache_bits 2 --cache_quantization kivi
    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory --budget_allocation adakv --strategies heavy_hitter kvzip
    python -m benchmarks.prefill_memory --device cuda --random_weights llama-3.1-8b --budget 8192 --chunk 4096 \\
        --lengths 32768 131072 --one_shot_max 32768 --out results/prefill_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from atomic_files import check_writable, write_json_atomic
from benchmarks.resident_memory import peak_since, reset_peak
from cache_setup import attach_caches, cache_config
from cache_spec import add_allocation_arguments, add_storage_arguments
from checkpoint import add_model_arguments, checkpoint_model_args, parse_dtype, resolve_device
from checkpoint_hf import hf_model_args
from errors import CliParser, UserError, run_cli
from eval.bench.measure import RANDOM_SHAPES, check_model_source, load_model
from eval.bench.profile import KIND_NAMES, group_by_kind
from flag_types import count
from generate import prefill

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("ours", "transformers")


class PeakMemory:
    """The peak of the process's resident memory (CPU) or of torch's CUDA allocations, from `reset()` on."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def reset(self) -> int:
        """Start a new peak; the memory in use now."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        self.start = reset_peak()
        return self.start

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return peak_since(self.start)


def cache_flags(spec: dict) -> list[str]:
    flags = ["--cache_strategy", spec["strategy"], "--max_cache_length", str(spec["budget"])]
    if spec["chunk"]:
        flags += ["--prefill_chunk", str(spec["chunk"])]
    if spec["rerotate_positions"]:
        flags += ["--rerotate_positions"]
    return flags + spec.get("storage", []) + spec.get("allocation", [])


def given_flags(args: argparse.Namespace, add_arguments: Callable[[argparse._ArgumentGroup], None]) -> list[str]:
    """The flags `add_arguments` defines (the storage's, the head budgets') given other values than their
    defaults, as command-line words."""
    defaults = CliParser(add_help=False)
    add_arguments(defaults.add_argument_group())
    flags = []
    for action in defaults._actions:
        value = getattr(args, action.dest)
        if value != action.default:
            flags += [action.option_strings[0], str(value)]
    return flags


def measure(spec: dict) -> dict:
    """In this (fresh) process: the peak memory and speed of one prefill of spec["length"] tokens."""
    torch.manual_seed(0)
    if spec.get("engine") == "transformers":
        return measure_transformers(spec)
    model, tokenizer = load_model(argparse.Namespace(**spec), spec["device"], getattr(torch, spec["dtype"]))
    flags = cache_flags(spec)
    length, device = spec["length"], spec["device"]
    attach_caches(model, cache_config(flags), length, 1, tokenizer)
    ids = torch.randint(0, model.args.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    memory = PeakMemory(device)
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :warm_up_tokens(spec)])  # first-call allocations and kernels, not measured
        model.reset_caches()
        before = memory.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        prefill(model, ids)
        peak = memory.peak()  # synchronizes a GPU before the clock stops
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        profiled = profile_prefill(model, ids) if spec.get("profile") else None
    return measured_row(spec, model.args.context_length, memory, before, peak, seconds, cpu_seconds, profiled)


def warm_up_tokens(spec: dict) -> int:
    """The warm-up prefill's length: a chunked row's warm-up runs a second chunk, so that the re-prefill's
    first-call allocations (code paths a one-chunk prompt never takes) stay out of the measurement."""
    return min(spec["length"], spec["chunk"] + 64 if spec["chunk"] else 64)


def measured_row(spec: dict, context: int, memory: PeakMemory, before: int, peak: int, seconds: float,
                 cpu_seconds: float, profiled: dict | None = None) -> dict:
    length = spec["length"]
    return {"strategy": spec["strategy"], "prompt_tokens": length, "budget": spec["budget"],
            "prefill_chunk": spec["chunk"] or None, "rerotate_positions": spec["rerotate_positions"],
            "engine": spec.get("engine", "ours"), "storage": " ".join(spec.get("storage", [])) or "dense",
            "allocation": " ".join(spec.get("allocation", [])) or "uniform",
            "context_length": context, "device": spec["device"],
            "memory": "CUDA allocated" if memory.cuda else "RSS",
            "before_bytes": before, "peak_bytes": peak, "prefill_added_bytes": peak - before,
            "prefill_seconds": round(seconds, 3), "prefill_tokens_per_second": round(length / seconds, 1),
            # CPU time of this process: on a shared machine less disturbed by other processes than wall time
            "prefill_cpu_seconds": round(cpu_seconds, 3),
            "prefill_tokens_per_cpu_second": round(length / cpu_seconds, 1), "profile": profiled}


def measure_transformers(spec: dict) -> dict:
    """`measure` through transformers' `generate` (the GGUF's transformers model and transformers_adapter's cache,
    one new token): its own chunked prefill (`prefill_chunk_size`) feeds the chunks to --prefill_chunk caches."""
    from transformers_adapter import load_gguf_model, make_cache

    model, tokenizer = load_gguf_model(spec["checkpoint_path"], getattr(torch, spec["dtype"]))
    model = model.to(spec["device"])
    length, flags = spec["length"], cache_flags(spec)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    ids = ids.to(spec["device"])
    memory = PeakMemory(spec["device"])

    def prefill_of(n: int, cache) -> None:
        model.generate(ids[:, :n], attention_mask=torch.ones_like(ids[:, :n]), cache=cache, max_new_tokens=1,
                       do_sample=False, eos_token_id=None, pad_token_id=0, prefill_chunk_size=spec["chunk"] or None)

    with torch.inference_mode():
        warm_up = warm_up_tokens(spec)  # outside the measurement
        prefill_of(warm_up, make_cache(model, flags, warm_up, 1, tokenizer=tokenizer))
        cache = make_cache(model, flags, length, 1, tokenizer=tokenizer)
        before = memory.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        prefill_of(length, cache)
        peak = memory.peak()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return measured_row(spec, model.config.max_position_embeddings, memory, before, peak, seconds, cpu_seconds)


def profile_prefill(model, ids: torch.Tensor) -> dict:
    """One more prefill of `ids` (caches reset) under torch.profiler: ms by kind of work (on the CPU the main
    thread's ops' self times, which split the wall time; on CUDA the kernels' device times, the rest of the wall
    time being the GPU waiting for the host) and the five costliest ops or kernels."""
    on_device = ids.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    model.reset_caches()
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        prefill(model, ids)
        if on_device:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    by_kind, top = group_by_kind(prof.key_averages(), 1, on_device)
    return {"timeline": "cuda kernels" if on_device else "cpu ops", "profiled_ms": round(1000 * wall, 1),
            "recorded_ms": round(sum(by_kind.values()), 1), "ms_by_kind": by_kind, "top": top}


def run_fresh(spec: dict) -> dict:
    """`measure(spec)` in a new process; its refusal (exit 2) as a UserError naming the configuration."""
    command = [sys.executable, "-m", "benchmarks.prefill_memory", "--measure", json.dumps(spec)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode == 2:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1].removeprefix("error: ")
        raise UserError(f"{spec['strategy']}, {spec['length']} tokens: {last}")
    if proc.returncode != 0:
        raise RuntimeError(f"the measurement of {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_transformers_engine(args: argparse.Namespace) -> None:
    """What `--engine transformers` cannot measure, refused before anything runs."""
    for flag, given in [("--random_weights", args.random_weights), ("--rerotate_positions", args.rerotate_positions),
                        ("--profile_lengths", args.profile_lengths)]:
        if given:
            raise UserError(f"{flag} is not measured with --engine transformers (it loads a GGUF file through "
                            "transformers; the adapter has no re-rotation; the profile is of our prefill)")
    if args.checkpoint_path is not None and not str(args.checkpoint_path).endswith(".gguf"):
        raise UserError(f"--engine transformers loads a GGUF file, not {args.checkpoint_path}")
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise UserError(f"--engine transformers needs transformers (pip install -r requirements-dev.txt): {e}") \
            from None


def context_length(args: argparse.Namespace) -> int:
    """The model's context, read from its config or header (no weights loaded)."""
    if args.random_weights:
        return hf_model_args(RANDOM_SHAPES[args.random_weights]).context_length
    return checkpoint_model_args(args.checkpoint_path).context_length


def prefill_label(row: dict) -> str:
    return f"chunks of {row['prefill_chunk']}" if row["prefill_chunk"] else "one shot"


def table(rows: list[dict]) -> str:
    mib = 1 << 20
    lines = ["| strategy | prompt tokens | × budget | prefill | peak MiB | added by prefill MiB "
             "| prefill tok/s (wall) | prefill tok/CPU-s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        how = prefill_label(r)
        how += ", re-rotated" if r.get("rerotate_positions") else ""
        how += ", transformers' generate" if r.get("engine") == "transformers" else ""
        how += f", {r['storage']}" if r.get("storage", "dense") != "dense" else ""
        how += f", {r['allocation']}" if r.get("allocation", "uniform") != "uniform" else ""
        how += " (past the context)" if r["prompt_tokens"] > r.get("context_length", r["prompt_tokens"]) else ""
        lines.append(f"| {r['strategy']} | {r['prompt_tokens']} | {r['prompt_tokens'] / r['budget']:g} | {how} | "
                     f"{r['peak_bytes'] / mib:.0f} | {r['prefill_added_bytes'] / mib:.0f} | "
                     f"{r['prefill_tokens_per_second']} | {r['prefill_tokens_per_cpu_second']} |")
    return "\n".join(lines)


def profile_table(rows: list[dict]) -> str:
    """The profiled rows' time by kind (ms of one prefill), or "" when none was profiled."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return ""
    cols = ["strategy", "prompt tokens", "prefill", "profiled ms", "recorded ms", *KIND_NAMES, "top"]
    lines = [f"Where a prefill's time goes (torch.profiler, {profiled[0]['profile']['timeline']}; ms):", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in profiled:
        p = r["profile"]
        top = "; ".join(f"{name} ({ms})" for name, ms in p["top"][:3])
        how = prefill_label(r)
        kinds = (round(p["ms_by_kind"][k], 1) for k in KIND_NAMES)
        cells = [r["strategy"], r["prompt_tokens"], how, p["profiled_ms"], p["recorded_ms"], *kinds, top]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def targets(rows: list[dict], budget: int) -> list[str]:
    """The two targets, per strategy, from the rows measured (where the lengths they need were run)."""
    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        chunked = {r["prompt_tokens"]: r for r in rows if r["strategy"] == strategy and r["prefill_chunk"]}
        whole = {r["prompt_tokens"]: r for r in rows if r["strategy"] == strategy and not r["prefill_chunk"]}
        longest = max(chunked, default=0)
        for far in sorted({16 * budget, longest} & set(chunked)):
            if 4 * budget in chunked and far > 4 * budget:
                a, b = chunked[4 * budget]["peak_bytes"], chunked[far]["peak_bytes"]
                out.append(f"{strategy}: chunked peak at {far / budget:g}× vs 4× the budget: {b / a - 1:+.1%} "
                           "(target < 10%)")
        for n in sorted(set(chunked) & set(whole)):
            wall = chunked[n]["prefill_tokens_per_second"] / whole[n]["prefill_tokens_per_second"]
            cpu = chunked[n]["prefill_tokens_per_cpu_second"] / whole[n]["prefill_tokens_per_cpu_second"]
            out.append(f"{strategy}: {n} tokens, chunked / one-shot prefill speed {wall:.2f} wall, {cpu:.2f} CPU "
                       "(target ≥ 0.5)")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m benchmarks.prefill_memory", description=__doc__)
    p.add_argument("--strategies", nargs="+", default=["heavy_hitter", "recent_global"])
    p.add_argument("--budget", type=count(), default=256, help="cache slots per layer (tokens)")
    p.add_argument("--chunk", type=count(), default=256, help="--prefill_chunk of the chunked rows")
    p.add_argument("--lengths", nargs="+", type=count(), default=[1024, 2048, 4096], help="prompt tokens")
    p.add_argument("--one_shot_max", type=count(), default=None,
                   help="lengths above this run chunked only (default: the model's context)")
    p.add_argument("--rerotate_positions", action="store_true",
                   help="re-rotated positions: lengths may exceed the model's context (measured chunked only)")
    p.add_argument("--random_weights", choices=sorted(RANDOM_SHAPES), default=None,
                   help="random weights with a real model's shapes, built on the device (memory and speed "
                        "depend on the shapes only)")
    p.add_argument("--engine", choices=ENGINES, default=ENGINES[0],
                   help="ours: this project's model and generate.prefill; transformers: transformers' model of the "
                        "GGUF and generate (its prefill_chunk_size) with transformers_adapter's caches")
    p.add_argument("--profile_lengths", nargs="+", type=count(), default=[],
                   help="prefill the rows of these lengths once more under torch.profiler (time by kind of work)")
    p.add_argument("--out", default=None, help="also write the rows here (JSON)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # one configuration, in a fresh process
    add_storage_arguments(p.add_argument_group("storage of the held K/V (every row)"))
    add_allocation_arguments(p.add_argument_group("head budgets (every row)"))
    add_model_arguments(p, compile_flag=False, batch_flag=False)
    return p


def plan(args: argparse.Namespace, context: int, device: str, dtype: str) -> list[dict]:
    if max(args.lengths) > context and not args.rerotate_positions:
        raise UserError(f"lengths past the model's context of {context} need --rerotate_positions")
    one_shot_max = min(args.one_shot_max or context, context)  # a one-shot prefill cannot run past the context
    if set(args.profile_lengths) - set(args.lengths):
        raise UserError(f"--profile_lengths {' '.join(map(str, args.profile_lengths))}: each must be one of --lengths")
    source = {"device": device, "dtype": dtype, "random_weights": args.random_weights, "engine": args.engine,
              "checkpoint_path": args.checkpoint_path, "allow_non_finite_weights": args.allow_non_finite_weights,
              "budget": args.budget, "storage": given_flags(args, add_storage_arguments),
              "allocation": given_flags(args, add_allocation_arguments),
              "rerotate_positions": args.rerotate_positions}
    chunked = {strategy: prefills_in_chunks(strategy, source, args.chunk) for strategy in args.strategies}
    specs = [{**source, "strategy": strategy, "length": length, "chunk": chunk,
              "profile": length in args.profile_lengths}
             for strategy in args.strategies for length in args.lengths for chunk in (0, args.chunk)
             if (chunk and chunked[strategy]) or (not chunk and length <= one_shot_max)]
    if idle := [s for s in args.strategies if not any(spec["strategy"] == s for spec in specs)]:
        raise UserError(f"nothing to measure for {', '.join(idle)}: it prefills one shot only, and every length is "
                        f"past the one-shot limit of {one_shot_max} tokens")
    return specs


def prefills_in_chunks(strategy: str, source: dict, chunk: int) -> bool:
    """Whether `strategy` accepts --prefill_chunk (if not, its rows are one-shot only, said on stderr why); a
    strategy the cache flags refuse altogether is refused here, before any run."""
    cache_config(cache_flags({**source, "strategy": strategy, "chunk": 0}))
    try:
        cache_config(cache_flags({**source, "strategy": strategy, "chunk": chunk}))
    except UserError as e:
        print(f"{strategy}: one-shot rows only ({e})", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return []
    check_model_source(args)
    if args.engine == "transformers":
        check_transformers_engine(args)
    device = resolve_device(args.device)
    dtype = str(parse_dtype(args.dtype, device)).removeprefix("torch.")
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    specs = plan(args, context_length(args), device, dtype)
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average {os.getloadavg()}",
          file=sys.stderr)
    rows = []
    for spec in tqdm(specs, desc="prefill_memory", unit="run"):
        rows.append(run_fresh(spec))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    print("\n".join(targets(rows, args.budget)))
    if any(r["profile"] for r in rows):
        print("\n" + profile_table(rows))
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "measure"}
        write_json_atomic(args.out, {"config": {**config, "device": device, "dtype": dtype}, "rows": rows},
                          overwrite=args.overwrite)
    return rows


if __name__ == "__main__":
    run_cli(main)
