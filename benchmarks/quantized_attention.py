"""A decode step's attention over quantized storage on the CPU, per layer, three ways: from the codes (the
storage's `attend`, cpu_quantized_attention.c, what a decode step runs), over K and V rebuilt from the codes
(`keys()` / `values()`, the path it replaced), and over a dense cache of the same slots (the yardstick).
Random K/V of a model's head shapes are written as a prompt plus decode steps (so a KIVI residual holds
tokens). Reported per slot count: the median milliseconds of each over `--repeats` alternating calls, the
rebuild's time over the codes' time, and their largest difference relative to the largest output. Numbers
are reported, never asserted.

    OMP_NUM_THREADS=2 python -m benchmarks.quantized_attention --slots 1024 4096 --batch 4   # the bundled model
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import cpu_bf16_kernels
from atomic_files import check_writable, write_json_atomic
from checkpoint import parse_dtype
from errors import CliParser, UserError, run_cli
from flag_types import count
from kv_storage import StorageSpec, make_storage
from quantization_utils import SUPPORTED_BITS

WAYS = ("codes", "rebuilt", "dense")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m benchmarks.quantized_attention", description=__doc__,
                       allow_abbrev=False)
    parser.add_argument("--slots", nargs="+", type=count(), default=[1024], help="cache slots per head")
    parser.add_argument("--bits", type=int, choices=SUPPORTED_BITS, default=4)
    parser.add_argument("--schemes", nargs="+", choices=("per_token", "kivi"), default=["per_token", "kivi"])
    parser.add_argument("--batch", type=count(), default=4, help="rows decoded together")
    parser.add_argument("--heads", type=count(), default=9, help="query heads (the bundled model's by default)")
    parser.add_argument("--kv_heads", type=count(), default=3)
    parser.add_argument("--head_dim", type=count(), default=64)
    parser.add_argument("--q_group_size", type=count(), default=64, help="kivi: tokens a key group, channels a "
                        "value group")
    parser.add_argument("--residual_length", type=count(), default=128, help="kivi: newest tokens kept whole")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--repeats", type=count(), default=20, help="timed calls of each way, alternating")
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def filled_storage(scheme: str, slots: int, args: argparse.Namespace, dtype: torch.dtype, g: torch.Generator):
    """A storage of `slots` slots: three quarters written as a prompt, the rest one decode step at a time."""
    B, H, D = args.batch, args.kv_heads, args.head_dim
    spec = StorageSpec(args.bits, scheme, args.q_group_size, args.residual_length)
    storage = make_storage(spec, B, H, slots, D, dtype, "cpu", slots)
    offsets = 3 * torch.randn(D, generator=g)  # keys have per-channel offsets after RoPE
    prompt = slots * 3 // 4
    storage.write(torch.arange(prompt).expand(B, H, prompt), (torch.randn(B, H, prompt, D, generator=g) + offsets)
                  .to(dtype), torch.randn(B, H, prompt, D, generator=g).to(dtype))
    for slot in range(prompt, slots):
        storage.write(torch.full((B, H, 1), slot), (torch.randn(B, H, 1, D, generator=g) + offsets).to(dtype),
                      torch.randn(B, H, 1, D, generator=g).to(dtype))
    return storage


def measure(scheme: str, slots: int, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(slots)
    storage = filled_storage(scheme, slots, args, dtype, g)
    q = torch.randn(args.batch, args.kv_heads, args.heads // args.kv_heads, args.head_dim, generator=g).to(dtype)
    mask = torch.ones(args.batch, args.kv_heads, 1, slots, dtype=torch.bool)
    dense_k, dense_v = storage.keys().clone(), storage.values().clone()
    calls = {"codes": lambda: storage.attend(q, mask),
             "rebuilt": lambda: cpu_bf16_kernels.decode_attention(q, storage.keys(), storage.values(), mask),
             "dense": lambda: cpu_bf16_kernels.decode_attention(q, dense_k, dense_v, mask)}
    with torch.inference_mode():
        if calls["codes"]() is None:
            raise UserError(f"the kernel does not take --head_dim {args.head_dim} at --bits {args.bits} here "
                            f"(head_dim × bits must be a multiple of 64, on a CPU with the kernels built)")
        outputs = {way: call()[0].double() for way, call in calls.items()}  # warm-up, and the outputs
        seconds: dict[str, list[float]] = {way: [] for way in WAYS}
        for i in range(args.repeats):
            for way in WAYS if i % 2 == 0 else WAYS[::-1]:
                start = time.perf_counter()
                calls[way]()
                seconds[way].append(time.perf_counter() - start)
    ms = {way: statistics.median(seconds[way]) * 1e3 for way in WAYS}
    rebuilt = outputs["rebuilt"]
    return {"scheme": scheme, "slots": slots, **{f"{way}_ms": round(ms[way], 3) for way in WAYS},
            "rebuilt_over_codes": round(ms["rebuilt"] / ms["codes"], 2),
            "max_relative_difference": float((outputs["codes"] - rebuilt).abs().max() / rebuilt.abs().max())}


def table(rows: list[dict]) -> str:
    lines = ["| storage | slots | from codes ms | rebuilt K/V ms | dense ms | rebuilt / codes | max rel. diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['slots']} | {r['codes_ms']} | {r['rebuilt_ms']} | {r['dense_ms']} | "
                     f"{r['rebuilt_over_codes']} | {r['max_relative_difference']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    dtype = parse_dtype(args.dtype, "cpu")
    if dtype not in (torch.float32, torch.bfloat16):
        raise UserError(f"--dtype {args.dtype}: the kernels take float32 or bfloat16")
    if args.heads % args.kv_heads:
        raise UserError(f"--kv_heads {args.kv_heads} does not divide --heads {args.heads}")
    if "kivi" in args.schemes and (args.residual_length % args.q_group_size or args.head_dim % min(
            args.q_group_size, args.head_dim)):
        raise UserError(f"kivi needs --residual_length ({args.residual_length}) a multiple of --q_group_size "
                        f"({args.q_group_size}), and value groups that divide --head_dim ({args.head_dim})")
    rows = [measure(scheme, n, args, dtype) for scheme in args.schemes for n in args.slots]
    report = {"dtype": str(dtype).removeprefix("torch."), "bits": args.bits, "batch": args.batch,
              "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "kernels": cpu_bf16_kernels.kernel_status(), "threads": torch.get_num_threads(), "rows": rows}
    print(table(rows))
    if args.out:
        write_json_atomic(args.out, report, overwrite=args.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
