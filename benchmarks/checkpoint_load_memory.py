"""Peak memory of loading a sharded safetensors checkpoint onto the CPU, relative to its size.

Writes a random Llama-shaped checkpoint (sharded, with model.safetensors.index.json and a tokenizer),
then loads it with `load_checkpoint` in a fresh process and reports the peak RSS the load added over the
process's RSS just before it (the kernel's high-water mark, reset after the imports through
/proc/self/clear_refs), divided by the checkpoint's size on disk. Linux only (/proc).

    python -m benchmarks.checkpoint_load_memory               # 1B-shaped (Llama 3.2 1B), bfloat16, ~2.5 GB
    python -m benchmarks.checkpoint_load_memory --size tiny   # ~130 MB, float32 (what the test runs)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.resident_memory import peak_since, reset_peak
from errors import CliParser, run_cli  # no torch: the measured child imports it after its baseline

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    # Llama 3.2 1B: 1.24 B parameters with tied embeddings.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, dtype="bfloat16",
               shard_bytes=1 << 30),
    "tiny": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=16000, tie_word_embeddings=False, dtype="float32",
                 shard_bytes=50 << 20),
}


def write_checkpoint(directory: Path, size: str) -> int:
    """A random checkpoint of shape `size`, written shard by shard (never all in memory); its bytes."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    s = SHAPES[size]
    dtype = getattr(torch, s["dtype"])
    d, f, n_layer = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    hd = d // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (s["vocab_size"], d), "model.norm.weight": (d,)}
    if not s["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (s["vocab_size"], d)
    for i in range(n_layer):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
    directory.mkdir(parents=True, exist_ok=True)
    weight_map, shard, shard_bytes, total, n = {}, {}, 0, 0, 0
    gen = torch.Generator().manual_seed(0)

    def flush() -> None:
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
            shard, shard_bytes, n = {}, 0, n + 1

    for key, shape in shapes.items():
        t = torch.randn(shape, generator=gen).mul_(0.02).to(dtype)
        shard[key] = t
        shard_bytes += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if shard_bytes >= s["shard_bytes"]:
            flush()
    flush()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {k: v for k, v in s.items() if k not in ("dtype", "shard_bytes")}
    config |= {"model_type": "llama", "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "torch_dtype": s["dtype"],
               "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2}
    (directory / "config.json").write_text(json.dumps(config))
    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(
        str(directory / "tokenizer.json"))
    return total


def measure(directory: Path, dtype_name: str) -> dict:
    """Run in a fresh process: load the checkpoint and report the peak RSS the load added."""
    import torch

    from checkpoint import load_checkpoint
    from checkpoint_hf import total_bytes, weight_files

    size = total_bytes(weight_files(directory))
    # After the imports. The model is built on the meta device without computing there (model.Transformer),
    # which would import torch._dynamo (~75 MB of code, whatever the model's size): the load imports nothing.
    before = reset_peak()
    start = time.perf_counter()
    model, _ = load_checkpoint(directory, "cpu", getattr(torch, dtype_name))
    seconds = time.perf_counter() - start
    peak = peak_since(before)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"checkpoint_bytes": size, "model_bytes": params, "rss_before_bytes": before, "peak_rss_bytes": peak,
            "peak_rss_increase_ratio": round((peak - before) / size, 3), "load_seconds": round(seconds, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = CliParser(prog="python -m benchmarks.checkpoint_load_memory", description=__doc__)
    parser.add_argument("--size", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the fresh child process
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(Path(args.measure), SHAPES[args.size]["dtype"])))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp) / f"random-{args.size}"
        write_checkpoint(directory, args.size)
        proc = subprocess.run([sys.executable, "-m", "benchmarks.checkpoint_load_memory", "--size", args.size,
                               "--measure", str(directory)], capture_output=True, text=True, check=True, cwd=ROOT)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(result))
        return
    gib = 2**30
    print(f"checkpoint {result['checkpoint_bytes'] / gib:.2f} GiB ({SHAPES[args.size]['dtype']}, {args.size} shape), "
          f"RSS before load {result['rss_before_bytes'] / gib:.2f} GiB, peak {result['peak_rss_bytes'] / gib:.2f} GiB: "
          f"the load added {result['peak_rss_increase_ratio']}× the checkpoint size "
          f"in {result['load_seconds']} s")


if __name__ == "__main__":
    run_cli(main)
