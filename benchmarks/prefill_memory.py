"""Peak memory and speed of prefilling prompts of growing length at a fixed budget: one shot vs
--prefill_chunk, on the CPU with the bundled model.

Each configuration (strategy, length, chunked or not) runs in a fresh process: load the model, attach
caches of `--budget` tokens per layer, reset the kernel's RSS high-water mark (/proc/self/clear_refs),
prefill a prompt of random tokens, and read the high-water mark (VmHWM) back. Reported per row: the
peak RSS, what the prefill added over the RSS before it (the loaded model and caches), and prefill
tokens/s. One-shot memory grows with the prompt (its K/V and activations); chunked memory should not:
the targets are a < 10% difference of the chunked peak between 4× and 16× the budget, and a chunked
prefill speed of at least half the one-shot speed at the same length. With `--rerotate_positions` the
lengths may exceed the model's context (8192 for the bundled model): chunks then run at RoPE ranks below
budget + chunk, and lengths past the context are measured chunked only (a one-shot prefill cannot run them).
Linux only (/proc).

    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory                     # budget 256, 1k..4k tokens
    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory --lengths 1024 8192 --strategies recent_global
    OMP_NUM_THREADS=1 python -m benchmarks.prefill_memory --rerotate_positions --lengths 1024 4096 16384
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(strategy: str, length: int, budget: int, chunk: int | None, dtype_name: str,
            rerotate: bool = False) -> dict:
    """In this (fresh) process: the peak RSS and speed of one prefill of `length` tokens."""
    import torch

    from cache_setup import attach_caches, cache_config
    from checkpoint import load_checkpoint
    from generate import prefill

    torch.manual_seed(0)
    model, tokenizer = load_checkpoint(None, "cpu", getattr(torch, dtype_name))
    flags = ["--cache_strategy", strategy, "--max_cache_length", str(budget)]
    if chunk:
        flags += ["--prefill_chunk", str(chunk)]
    if rerotate:
        flags += ["--rerotate_positions"]
    attach_caches(model, cache_config(flags), length, 1, tokenizer)
    ids = torch.randint(0, model.args.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :64])  # warm-up (first-call allocations), outside the measurement
        model.reset_caches()
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kb("VmRSS") * 1024
        start, cpu_start = time.perf_counter(), time.process_time()
        prefill(model, ids)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _status_kb("VmHWM") * 1024
    return {"strategy": strategy, "prompt_tokens": length, "budget": budget, "prefill_chunk": chunk,
            "rerotate_positions": rerotate, "context_length": model.args.context_length,
            "rss_before_bytes": before, "peak_rss_bytes": peak, "prefill_added_bytes": peak - before,
            "prefill_seconds": round(seconds, 3), "prefill_tokens_per_second": round(length / seconds, 1),
            # CPU time of this process: on a shared machine less disturbed by other processes than wall time
            "prefill_cpu_seconds": round(cpu_seconds, 3),
            "prefill_tokens_per_cpu_second": round(length / cpu_seconds, 1)}


def run_fresh(strategy: str, length: int, budget: int, chunk: int | None, dtype: str, rerotate: bool = False) -> dict:
    command = [sys.executable, "-m", "benchmarks.prefill_memory", "--measure", strategy, str(length), str(budget),
               str(chunk or 0), dtype, str(int(rerotate))]
    proc = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bundled_context_length() -> int:
    import torch

    from checkpoint import load_checkpoint

    return load_checkpoint(None, "cpu", torch.float32)[0].args.context_length


def table(rows: list[dict]) -> str:
    mib = 1 << 20
    lines = ["| strategy | prompt tokens | × budget | prefill | peak RSS MiB | added by prefill MiB "
             "| prefill tok/s (wall) | prefill tok/CPU-s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        how = f"chunks of {r['prefill_chunk']}" if r["prefill_chunk"] else "one shot"
        how += ", re-rotated" if r.get("rerotate_positions") else ""
        how += " (past the context)" if r["prompt_tokens"] > r.get("context_length", r["prompt_tokens"]) else ""
        lines.append(f"| {r['strategy']} | {r['prompt_tokens']} | {r['prompt_tokens'] / r['budget']:g} | {how} | "
                     f"{r['peak_rss_bytes'] / mib:.0f} | {r['prefill_added_bytes'] / mib:.0f} | "
                     f"{r['prefill_tokens_per_second']} | {r['prefill_tokens_per_cpu_second']} |")
    return "\n".join(lines)


def targets(rows: list[dict], budget: int) -> list[str]:
    """The two targets, per strategy, from the rows measured (where the lengths they need were run)."""
    out = []
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        chunked = {r["prompt_tokens"]: r for r in rows if r["strategy"] == strategy and r["prefill_chunk"]}
        whole = {r["prompt_tokens"]: r for r in rows if r["strategy"] == strategy and not r["prefill_chunk"]}
        if 4 * budget in chunked and 16 * budget in chunked:
            a, b = chunked[4 * budget]["peak_rss_bytes"], chunked[16 * budget]["peak_rss_bytes"]
            out.append(f"{strategy}: chunked peak RSS at 16× vs 4× the budget: {b / a - 1:+.1%} (target < 10%)")
        longest = max(chunked, default=0)
        if 4 * budget in chunked and longest > 16 * budget:
            a, b = chunked[4 * budget]["peak_rss_bytes"], chunked[longest]["peak_rss_bytes"]
            out.append(f"{strategy}: chunked peak RSS at {longest / budget:g}× vs 4× the budget: {b / a - 1:+.1%} "
                       "(target < 10%)")
        for n in sorted(set(chunked) & set(whole)):
            wall = chunked[n]["prefill_tokens_per_second"] / whole[n]["prefill_tokens_per_second"]
            cpu = chunked[n]["prefill_tokens_per_cpu_second"] / whole[n]["prefill_tokens_per_cpu_second"]
            out.append(f"{strategy}: {n} tokens, chunked / one-shot prefill speed {wall:.2f} wall, {cpu:.2f} CPU "
                       "(target ≥ 0.5)")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["heavy_hitter", "recent_global"])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rerotate_positions", action="store_true",
                        help="re-rotated positions: lengths may exceed the model's context (measured chunked only)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--measure", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        strategy, length, budget, chunk, dtype, rerotate = args.measure
        print(json.dumps(measure(strategy, int(length), int(budget), int(chunk) or None, dtype, rerotate == "1")))
        return
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, load average {os.getloadavg()}",
          file=sys.stderr)
    context = bundled_context_length()
    if max(args.lengths) > context and not args.rerotate_positions:
        parser.error(f"lengths past the model's context of {context} need --rerotate_positions")
    rows = []
    for strategy in args.strategies:
        for length in args.lengths:
            for chunk in (None, args.chunk):
                if chunk is None and length > context:  # a one-shot prefill cannot run past the context
                    continue
                rows.append(run_fresh(strategy, length, args.budget, chunk, args.dtype, args.rerotate_positions))
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    print("\n".join(targets(rows, args.budget)))
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
