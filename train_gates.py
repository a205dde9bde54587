"""Train the forget gates of the `gated` cache (gates.py) by distillation, on a CPU, offline.

    python train_gates.py        # the bundled model -> gates/SmolLM2-135M-Instruct.safetensors
    python train_gates.py --steps 2 --seq_len 64 --out /tmp/gates.safetensors   # a smoke run

The model's weights are frozen; only the gates (a Linear per layer, ~1.7k parameters each for SmolLM2)
are trained. Teacher and student are the same model: the teacher attends normally; the student's
attention adds (t − j)·log_gate_j to the logit of key j seen from query t (soft eviction: the key's
attention is scaled by its retention g_j^(t−j), per KV head), except for the keys the cache protects
(the first --global_tokens, the --recent_window newest). The loss, per training sequence:

    KL(teacher ‖ student) of the next-token distributions, averaged over positions
    + λ · mean over layers, KV heads and queries t of relu(R_t − M) / M

Where this differs from TRIM-KV's training (arXiv 2512.03324 and its code): there the retention multiplies the
logit itself, β_j^(t−j)·(q·k), so a decayed key tends to logit 0 (a uniform share); here it multiplies the
key's attention weight (the log added to the logit), so a decayed key leaves the softmax, what evicting it does.
TRIM-KV's gate is a small MLP (hidden 512) and its loss adds next-token prediction to the distillation; here a
Linear per layer and the KL alone, and the cache's sinks and recent window are protected while training. The
eviction score, log_gate × age, is the paper's.

R_t = Σ_j g_j^(t−j) over the decayable keys is the soft number of tokens beyond the protected ones a
cache would still hold at query t, M = --capacity the target and λ = --capacity_weight. The KL term alone
would keep every gate at 1 (forgetting never helps the student); the capacity term makes the gates
forget until about M tokens remain, and the KL term decides which ones. Its gradient only exists where
a sequence holds more than M decayable tokens, so M should be well below --seq_len.

Data: CPython's reference documentation (`pydoc_data.topics`), split by topic: a topic whose key's
sha256 starts with a byte ≡ 0 (mod 8) is held out (11 topics, ~11k tokens on Python 3.11) and never
trained on; benchmarks/gated_fidelity.py evaluates on it. Training windows are non-overlapping
--seq_len slices of the other topics, visited in a seeded random order. The same seed and thread
count give the same file; it is written atomically and never replaced without --overwrite.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from atomic_files import check_writable
from checkpoint import add_checkpoint_argument, bundled_checkpoint_path, load_checkpoint, read_gguf_metadata
from errors import CliParser, UserError, run_cli
from flag_types import NON_NEGATIVE, POSITIVE, SEED, THREADS, count
from gates import GATES_DIR, attach_gates, new_gates, save_gates
from model import Transformer

HELD_OUT_MODULUS = 8


def is_held_out(topic: str) -> bool:
    return hashlib.sha256(topic.encode()).digest()[0] % HELD_OUT_MODULUS == 0


def pydoc_split(held_out: bool) -> str:
    """The training (held_out=False) or held-out (True) part of the pydoc corpus, topics in key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics) if is_held_out(key) == held_out)


def model_name(checkpoint_path: str | None) -> tuple[str, str]:
    """(default output stem, descriptive name) read from the checkpoint: GGUF general.name or config.json."""
    path = bundled_checkpoint_path() if checkpoint_path is None else Path(checkpoint_path)
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if path.is_dir():
        import json

        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        return path.name, str(config.get("_name_or_path") or path.name)
    stem = re.sub(r"\.(q\d\w*|f16|f32|bf16)$", "", path.stem, flags=re.IGNORECASE)  # drop the quantization tag
    if path.suffix != ".gguf":
        return stem, path.name  # load_checkpoint says what is wrong with it
    _, meta = read_gguf_metadata(path)
    return stem, f"{meta.get('general.name', stem)} ({path.name})"


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="train_gates.py", description=__doc__)
    add_checkpoint_argument(p)
    p.add_argument("--out", default=None, help="output file (default: gates/<checkpoint name>.safetensors)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--steps", type=count(), default=240, help="optimizer steps, one sequence each")
    p.add_argument("--seq_len", type=count(2), default=256, help="tokens per training sequence")
    p.add_argument("--lr", type=POSITIVE, default=0.01, help="Adam learning rate of the gate weights")
    p.add_argument("--bias_lr", type=POSITIVE, default=0.05,
                   help="Adam learning rate of the gate biases (they start far out at +6, where the gates ≈ 1)")
    p.add_argument("--capacity", type=POSITIVE, default=32,
                   help="M: soft number of decayable tokens a query may still see before the capacity term acts")
    p.add_argument("--capacity_weight", type=NON_NEGATIVE, default=0.5, help="λ, the weight of the capacity term")
    p.add_argument("--global_tokens", type=count(0), default=4,
                   help="keys never decayed (attention sinks), as in the cache")
    p.add_argument("--recent_window", type=count(0), default=10, help="newest keys never decayed, as in the cache")
    p.add_argument("--max_train_tokens", type=count(), default=None, help="use only the first N training tokens")
    p.add_argument("--seed", type=SEED, default=0)
    # One thread by default: the result then does not depend on the machine's core count, and on these 2
    # shared cores 2 threads measured 3-5x slower per step than 1 (they spin against other jobs).
    p.add_argument("--threads", type=THREADS, default=1, help="torch threads (1: reproducible; 0: torch's choice)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """What the flags' own ranges (flag_types) cannot say: how they relate."""
    if args.max_train_tokens is not None and args.max_train_tokens < args.seq_len:
        raise UserError(f"--max_train_tokens must be ≥ --seq_len ({args.seq_len}), got {args.max_train_tokens}")


class Calibration(NamedTuple):
    """What a calibration script (calibrate_duo.py, calibrate_qfilters.py) starts from."""
    out: Path  # where its file goes, checked writable before any work
    name: str  # the model's name, recorded in the file
    model: Transformer
    chosen: list[int]  # the calibration windows' indices among the training windows
    windows: list[Tensor]  # each [1, seq_len]


def start_calibration(args: argparse.Namespace, default_dir: Path) -> Calibration:
    """The shared start of a calibration: the output path (--out, else `default_dir`/<model>.json) refused
    before anything loads if it cannot be written, --threads, the model in float32 on the CPU, and
    --windows evenly spaced windows of --seq_len tokens."""
    stem, name = model_name(args.checkpoint_path)
    out = Path(args.out) if args.out else default_dir / f"{stem}.json"
    check_writable(out, args.overwrite, "--out")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_checkpoint(args.checkpoint_path, "cpu", torch.float32)
    chosen, windows = calibration_windows(tokenizer, args.seq_len, args.windows, model.args.context_length)
    return Calibration(out, name, model, chosen, windows)


def calibration_windows(tokenizer, seq_len: int, count: int, context: int) -> tuple[list[int], list[Tensor]]:
    """`count` evenly spaced training windows (their indices, and each as [1, seq_len]): what the
    calibrations (calibrate_duo.py, calibrate_qfilters.py) measure."""
    windows = training_windows(tokenizer, seq_len, None, context)
    chosen = torch.linspace(0, len(windows) - 1, min(count, len(windows))).round().long().tolist()
    return chosen, [windows[i].view(1, -1) for i in chosen]


def training_windows(tokenizer, seq_len: int, max_tokens: int | None, context: int) -> Tensor:
    """Non-overlapping windows [N, seq_len] of the training split; a window longer than the model's
    `context` is refused (RoPE has no rows past it)."""
    if seq_len > context:
        raise UserError(f"--seq_len {seq_len} exceeds the model's context of {context}")
    ids = tokenizer.encode(pydoc_split(held_out=False))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = len(ids) // seq_len
    if n == 0:
        raise UserError(f"the training text has {len(ids)} tokens, fewer than --seq_len {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def set_soft_gating(model: Transformer, protected: tuple[int, int] | None) -> None:
    """Student mode (protected = (global_tokens, recent_window)) or teacher mode (None)."""
    for layer in model.layers:
        layer.attention.soft_gating = protected
        layer.attention.retained = None


def distillation_step(model: Transformer, ids: Tensor, args: argparse.Namespace) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, kl, capacity term) of one sequence ids [1, T]; the loss carries gradients to the gates."""
    pos = torch.arange(ids.shape[1])
    with torch.no_grad():
        set_soft_gating(model, None)
        teacher = F.log_softmax(model(ids, pos)[0], dim=-1)
    set_soft_gating(model, (args.global_tokens, args.recent_window))
    student = F.log_softmax(model(ids, pos)[0], dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1).mean()
    retained = torch.stack([layer.attention.retained for layer in model.layers])  # [n_layer, B, n_kv, T]
    capacity = F.relu(retained - args.capacity).mean() / args.capacity
    set_soft_gating(model, None)
    return kl + args.capacity_weight * capacity, kl, capacity


def mean_log_gate(model: Transformer, ids: Tensor) -> float:
    """Average log-gate of a sequence's tokens over layers and heads (reported in the metadata)."""
    values = []
    handles = [layer.attention_norm.register_forward_hook(
        lambda module, inputs, x, gate=layer.attention.gate: values.append(gate(x).mean())) for layer in model.layers]
    with torch.no_grad():
        model(ids, torch.arange(ids.shape[1]))
    for h in handles:
        h.remove()
    return float(torch.stack(values).mean())


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    check_args(args)
    stem, name = model_name(args.checkpoint_path)
    out = Path(args.out) if args.out else GATES_DIR / f"{stem}.safetensors"
    check_writable(out, args.overwrite, "--out")  # now, not after minutes of training
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_checkpoint(args.checkpoint_path, "cpu", torch.float32)
    windows = training_windows(tokenizer, args.seq_len, args.max_train_tokens, model.args.context_length)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed))

    gates = new_gates(model)
    attach_gates(model, gates)
    weights = [g.proj.weight for g in gates]
    biases = [g.proj.bias for g in gates]
    optimizer = torch.optim.Adam([{"params": weights, "lr": args.lr}, {"params": biases, "lr": args.bias_lr}])

    from tqdm import tqdm

    history: list[tuple[float, float]] = []
    bar = tqdm(range(args.steps), desc="train gates", unit="step", mininterval=5)
    for step in bar:
        ids = windows[order[step % len(windows)]].view(1, -1)
        loss, kl, capacity = distillation_step(model, ids, args)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        history.append((float(kl.detach()), float(capacity.detach())))
        bar.set_postfix(kl=f"{history[-1][0]:.4f}", capacity=f"{history[-1][1]:.3f}")
    bar.close()

    last = history[-min(len(history), 20):]
    info = {
        "model_name": name, "steps": args.steps, "seq_len": args.seq_len, "lr": args.lr, "bias_lr": args.bias_lr,
        "capacity": args.capacity, "capacity_weight": args.capacity_weight, "global_tokens": args.global_tokens,
        "recent_window": args.recent_window, "seed": args.seed, "train_tokens": int(windows.numel()),
        "train_text": f"pydoc_data.topics, topics with sha256(key)[0] % {HELD_OUT_MODULUS} != 0",
        "train_text_sha256": hashlib.sha256(pydoc_split(held_out=False).encode()).hexdigest(),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "final_kl": round(sum(k for k, _ in last) / len(last), 5),
        "final_capacity": round(sum(c for _, c in last) / len(last), 5),
        "final_mean_log_gate": round(mean_log_gate(model, windows[order[0]].view(1, -1)), 5),
    }
    save_gates(gates, model, out, info, overwrite=args.overwrite)
    minutes = (time.perf_counter() - t0) / 60
    print(f"wrote {out} ({out.stat().st_size / 1024:.1f} KiB) in {minutes:.1f} min: final KL {info['final_kl']}, "
          f"capacity term {info['final_capacity']}, mean log-gate {info['final_mean_log_gate']}")
    return out


if __name__ == "__main__":
    run_cli(main)
