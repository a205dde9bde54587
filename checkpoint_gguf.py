"""GGUF files (llama.cpp): metadata -> ModelArgs, tensors dequantized one at a time.

Architectures (`general.architecture`): llama (Llama, Mistral and SmolLM GGUFs), qwen2, qwen3, phi3.
llama.cpp stores llama-architecture q/k projections with interleaved RoPE pairs; they are permuted back
to the rotate-half layout here, so one RoPE implementation serves every checkpoint format. Gemma 3 GGUFs
are refused: llama.cpp folds Gemma's norm offset into the weights and picks the attention scale by model
size, which this loader has not been verified against; use the Hugging Face directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from errors import UserError
from model import ModelArgs
from tokenizer import Tokenizer, tokenizer_from_gguf_metadata

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")


def read_gguf_metadata(path: Path) -> tuple[object, dict]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise UserError(f"cannot read GGUF file {path}: {e}") from None
    return reader, {name: f.contents() for name, f in reader.fields.items()}


def unpermute_rope_pairs(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved RoPE pairs) back to the rotate-half layout.

    llama.cpp's converter maps row (h, i, j) with i in {0, 1} (half), j < head_dim/2 to (h, j, i);
    this is the inverse, so the same RoPE code serves GGUF and Hugging Face checkpoints.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "attn_q_norm": "attention.q_norm",
    "attn_k_norm": "attention.k_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "attn_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
}
_TOP_NAMES = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


def gguf_model_args(meta: dict, tensor_names: set[str]) -> ModelArgs:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        hint = "; use the Hugging Face directory" if arch == "gemma3" else ""
        raise UserError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)}){hint}")
    n_head = int(meta[f"{arch}.attention.head_count"])
    dim = int(meta[f"{arch}.embedding_length"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", dim // n_head))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    args = ModelArgs(
        n_layer=int(meta[f"{arch}.block_count"]),
        n_head=n_head,
        n_kv_head=int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        dim=dim,
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        head_dim=head_dim,
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        context_length=int(meta[f"{arch}.context_length"]),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        partial_rotary_factor=rope_dim / head_dim,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=window,
    )
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise UserError(f"unsupported GGUF rope scaling {kind!r}")
    if kind == "linear":
        args.rope_scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    return args


def _our_names(arch: str, gguf_name: str, args: ModelArgs) -> list[tuple[str, slice | None]]:
    parts = gguf_name.split(".")
    if parts[0] in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
        raise UserError(f"GGUF files with {parts[0]} (long-context RoPE scaling) are not supported; "
                        "use the Hugging Face directory instead")
    if parts[0] != "blk":
        if parts[0] not in _TOP_NAMES:
            raise UserError(f"unexpected GGUF tensor {gguf_name}")
        return [(f"{_TOP_NAMES[parts[0]]}.{parts[1]}", None)]
    layer, kind, leaf = parts[1], parts[2], parts[3]
    q_rows, kv_rows = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    if kind == "attn_qkv":  # Phi-3: fused q, k, v rows
        bounds = [0, q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows]
        return [(f"layers.{layer}.attention.{n}.{leaf}", slice(bounds[i], bounds[i + 1]))
                for i, n in enumerate(("wq", "wk", "wv"))]
    if kind == "ffn_up" and arch == "phi3":  # Phi-3: gate and up fused, gate first
        n = args.intermediate_size
        return [(f"layers.{layer}.feed_forward.w1.{leaf}", slice(0, n)),
                (f"layers.{layer}.feed_forward.w3.{leaf}", slice(n, 2 * n))]
    if kind not in _LAYER_NAMES:
        raise UserError(f"unexpected GGUF tensor {gguf_name}")
    return [(f"layers.{layer}.{_LAYER_NAMES[kind]}.{leaf}", None)]


def read_gguf(path: Path) -> tuple[ModelArgs, Iterator[tuple[str, torch.Tensor, int]], int, Tokenizer]:
    """(args, tensor stream of (name, float32 tensor, bytes), total bytes, tokenizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader, meta = read_gguf_metadata(path)
    args = gguf_model_args(meta, {t.name for t in reader.tensors})
    arch = meta["general.architecture"]
    supported = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                 GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                 GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                 GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise UserError(f"unsupported GGUF tensor type {t.tensor_type.name} for {t.name}")
    plan = [(t, _our_names(arch, t.name, args)) for t in reader.tensors]

    def stream() -> Iterator[tuple[str, torch.Tensor, int]]:
        for t, targets in plan:
            # GGUF lists dimensions fastest-first; numpy's logical shape is the reverse.
            w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                w = unpermute_rope_pairs(w, args.n_head if kind == "attn_q" else args.n_kv_head)
            for i, (name, rows) in enumerate(targets):
                part = w if rows is None else w[rows]
                # A copy: GGUF F32 data is a read-only memmap.
                yield name, torch.from_numpy(np.array(part, dtype=np.float32)), int(t.n_bytes) if i == 0 else 0

    return args, stream(), sum(int(t.n_bytes) for t in reader.tensors), tokenizer_from_gguf_metadata(meta)
