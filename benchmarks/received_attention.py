"""H2O's received attention over a prompt (what heavy_hitter's prefill seeds its decode-time scores with), the two
ways `prompt_compression.prompt_attention_received` computes it, timed per layer on random queries and keys
of a model's head shapes: in blocks of materialized probabilities (the CPU's default) and by two fused
attention passes (the GPUs'). Reported per prompt length: the median milliseconds of each over `--repeats`
alternating calls, the fused path's time as a fraction of the blocks', their peak CUDA memory, and how far
the two agree (the largest difference relative to the blocks' sum, floored at 1e-3). Numbers are reported,
never asserted.

    python -m benchmarks.received_attention --device cuda --lengths 4096 32768     # Llama-3.1-8B's heads
    OMP_NUM_THREADS=2 python -m benchmarks.received_attention --lengths 1024 2048 --heads 9 --kv_heads 3 \\
        --head_dim 64                                                              # the bundled model's
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomic_files import check_writable, write_json_atomic
from checkpoint import parse_dtype, resolve_device
from errors import CliParser, UserError, run_cli
from flag_types import count
from prompt_compression import prompt_attention_received

PATHS = ("blocks", "fused")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m benchmarks.received_attention", description=__doc__,
                       allow_abbrev=False)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument("--lengths", nargs="+", type=count(), default=[4096], help="prompt tokens")
    parser.add_argument("--heads", type=count(), default=32, help="query heads (Llama-3.1-8B's by default)")
    parser.add_argument("--kv_heads", type=count(), default=8)
    parser.add_argument("--head_dim", type=count(), default=128)
    parser.add_argument("--first_query", type=count(0), default=0,
                        help="count the queries from this one on (a chunked prefill's re-prefill)")
    parser.add_argument("--repeats", type=count(), default=5, help="timed calls of each path, alternating")
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def timed_call(q: torch.Tensor, k: torch.Tensor, path: str, first_query: int) -> tuple[float, torch.Tensor, int]:
    """(seconds, received sums, peak CUDA bytes allocated during the call; 0 on the CPU)."""
    cuda = q.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(q.device)
        torch.cuda.reset_peak_memory_stats(q.device)
    before = torch.cuda.memory_allocated(q.device) if cuda else 0
    start = time.perf_counter()
    received = prompt_attention_received(q, k, first_query=first_query, path=path)
    if cuda:
        torch.cuda.synchronize(q.device)
    seconds = time.perf_counter() - start
    return seconds, received, (torch.cuda.max_memory_allocated(q.device) - before) if cuda else 0


def measure_length(length: int, args: argparse.Namespace, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, args.heads, length, args.head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, args.kv_heads, length, args.head_dim, generator=g).to(device, dtype)
    results = {path: timed_call(q, k, path, args.first_query)[1] for path in PATHS}  # warm-up, and the sums
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    peak = dict.fromkeys(PATHS, 0)
    for i in range(args.repeats):
        for path in PATHS if i % 2 == 0 else PATHS[::-1]:
            elapsed, _, peak_bytes = timed_call(q, k, path, args.first_query)
            seconds[path].append(elapsed)
            peak[path] = max(peak[path], peak_bytes)
    blocks, fused = results["blocks"].double(), results["fused"].double()
    ms = {path: statistics.median(seconds[path]) * 1e3 for path in PATHS}
    return {"prompt_tokens": length, "blocks_ms": round(ms["blocks"], 3), "fused_ms": round(ms["fused"], 3),
            "fused_over_blocks": round(ms["fused"] / ms["blocks"], 3),
            "blocks_peak_bytes": peak["blocks"], "fused_peak_bytes": peak["fused"],
            "max_relative_difference": float(((fused - blocks).abs() / blocks.clamp(min=1e-3)).max())}


def table(rows: list[dict]) -> str:
    lines = ["| prompt tokens | blocks ms | fused ms | fused / blocks | peak MiB, blocks / fused | max rel. diff |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {r['blocks_ms']} | {r['fused_ms']} | {r['fused_over_blocks']} | "
                     f"{r['blocks_peak_bytes'] / 2**20:.0f} / {r['fused_peak_bytes'] / 2**20:.0f} | "
                     f"{r['max_relative_difference']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    if args.heads % args.kv_heads:
        raise UserError(f"--kv_heads {args.kv_heads} does not divide --heads {args.heads}")
    if args.first_query >= min(args.lengths):
        raise UserError(f"--first_query {args.first_query} must be below every length (shortest: {min(args.lengths)})")
    rows = [measure_length(n, args, device, dtype) for n in args.lengths]
    report = {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "heads": args.heads, "kv_heads": args.kv_heads,
              "head_dim": args.head_dim, "first_query": args.first_query, "threads": torch.get_num_threads(),
              "rows": rows}
    print(table(rows))
    if args.out:
        write_json_atomic(args.out, report, overwrite=args.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
