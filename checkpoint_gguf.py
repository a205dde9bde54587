"""GGUF files (llama.cpp): metadata -> ModelArgs, tensors dequantized one at a time.

Architectures (`general.architecture`): llama (Llama, Mistral and SmolLM GGUFs), qwen2, qwen3, phi3.
llama.cpp stores llama-architecture q/k projections with interleaved RoPE pairs; they are permuted back
to the rotate-half layout here, so one RoPE implementation serves every checkpoint format. Gemma 3 GGUFs
are refused: llama.cpp folds Gemma's norm offset into the weights and picks the attention scale by model
size, which this loader has not been verified against; use the Hugging Face directory.

Everything the loader reads is checked before it is used, with one line naming the file and the key: a
file shorter than its header says is "truncated at byte N of M" (walked here: the `gguf` reader fails
on it deep in numpy), every metadata key the config and the tokenizer need is present, of its type and
consistent, and every tensor is finite as it streams in (a NaN weight changes the greedy answer without
a word) unless the caller allows it.
"""

from __future__ import annotations

import math
import mmap
import numbers
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from checkpoint_hf import check_finite
from errors import UserError
from model import ModelArgs
from tokenizer import Tokenizer, tokenizer_from_gguf_metadata

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")

# ---- the file's extent, from its header --------------------------------------------------------------------

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _HeaderCursor:
    """Reads GGUF header fields in order; a read past the end of the file is a truncation."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos, self.order = buf, path, 0, "<"

    def take(self, n: int) -> int:
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise UserError(f"GGUF file {self.path} is truncated at byte {len(self.buf)} of at least {self.pos} "
                            "(inside its header)")
        return start

    def uint(self, size: int) -> int:
        return struct.unpack_from(self.order + {4: "I", 8: "Q"}[size], self.buf, self.take(size))[0]

    def string(self) -> bytes:
        n = self.uint(8)
        start = self.take(n)
        return self.buf[start:start + n]

    def skip_value(self, kind: int) -> None:
        if kind == _STRING:
            self.take(self.uint(8))
        elif kind == _ARRAY:
            item, count = self.uint(4), self.uint(8)
            if item in _SCALAR_SIZES:
                self.take(_SCALAR_SIZES[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif kind in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[kind])
        else:
            raise UserError(f"{self.path} is not a valid GGUF file (unknown value type {kind} at byte {self.pos})")


def gguf_extent(path: Path) -> int:
    """The size in bytes the file's header says it has (the end of its last tensor's data)."""
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _HeaderCursor(buf, path)
        if buf[:4] != b"GGUF":
            raise UserError(f"{path} is not a GGUF file (it does not start with GGUF)")
        cur.take(4)
        if cur.uint(4) & 0xFFFF == 0:  # a version number read with the wrong byte order
            cur.order = ">"
        n_tensors, n_kv = cur.uint(8), cur.uint(8)
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key, kind = cur.string(), cur.uint(4)
            if key == b"general.alignment" and kind == _UINT32:
                alignment = cur.uint(4)
            else:
                cur.skip_value(kind)
        end = 0
        for _ in range(n_tensors):
            name = cur.string().decode("utf-8", "replace")
            dims = [cur.uint(8) for _ in range(cur.uint(4))]
            kind, offset = cur.uint(4), cur.uint(8)
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise UserError(f"{path}: tensor {name} has an unknown GGUF tensor type {kind}") from None
            end = max(end, offset + math.prod(dims) // block * block_bytes)
        if alignment <= 0:
            raise UserError(f"{path}: GGUF key general.alignment must be positive, got {alignment}")
        return -(-cur.pos // alignment) * alignment + end


def read_gguf_metadata(path: Path) -> tuple[object, dict]:
    from gguf import GGUFReader

    size = path.stat().st_size
    if size == 0:
        raise UserError(f"GGUF file {path} is empty")
    extent = gguf_extent(path)
    if size < extent:
        raise UserError(f"GGUF file {path} is truncated at byte {size} of {extent}")
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError, struct.error) as e:  # what the reader raises on bad data
        raise UserError(f"cannot read GGUF file {path}: {str(e).splitlines()[0]}") from None
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


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_key(meta: dict, key: str, source: str, default: int | None = None, minimum: int = 1) -> int:
    value = meta.get(key, default)
    if value is None:
        raise UserError(f"{source}: GGUF key {key} is missing")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise UserError(f"{source}: GGUF key {key} must be an integer >= {minimum}, got {_show(value)}")
    return int(value)


def _float_key(meta: dict, key: str, source: str, default: float | None = None) -> float:
    """A finite, positive number (epsilons, RoPE bases, scaling factors)."""
    value = meta.get(key, default)
    if value is None:
        raise UserError(f"{source}: GGUF key {key} is missing")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{source}: GGUF key {key} must be a finite positive number, got {_show(value)}")
    return float(value)


def _token_list(meta: dict, source: str) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise UserError(f"{source}: GGUF key tokenizer.ggml.tokens is missing")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise UserError(f"{source}: GGUF key tokenizer.ggml.tokens must be a non-empty list of strings")
    return tokens


def check_tokenizer_keys(meta: dict, source: str) -> None:
    """The tokenizer keys tokenizer_from_gguf_metadata reads, typed and within the vocabulary."""
    vocab = len(_token_list(meta, source))
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in meta and not isinstance(meta[key], str):
            raise UserError(f"{source}: GGUF key {key} must be a string, got {_show(meta[key])}")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list):
        raise UserError(f"{source}: GGUF key tokenizer.ggml.merges must be a list of strings")
    for i, merge in enumerate(merges):
        if not isinstance(merge, str) or len(merge.split(" ")) != 2:
            raise UserError(f"{source}: GGUF key tokenizer.ggml.merges entry {i} is not two tokens separated by a "
                            f"space: {_show(merge)}")
    types = meta.get("tokenizer.ggml.token_type", [])
    if not isinstance(types, list) or (types and len(types) != vocab) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise UserError(f"{source}: GGUF key tokenizer.ggml.token_type must be one integer per token ({vocab})")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if key in meta:
            _int_key(meta, key, source, minimum=0)
            if meta[key] >= vocab:
                raise UserError(f"{source}: GGUF key {key} is {meta[key]}, outside the vocabulary of {vocab} tokens")
    if not isinstance(meta.get("tokenizer.ggml.add_bos_token", False), bool):
        raise UserError(f"{source}: GGUF key tokenizer.ggml.add_bos_token must be true or false")


def _head_dims(meta: dict, arch: str, source: str, dim: int, n_head: int) -> tuple[int, int]:
    """(head_dim, rotary dimension); the model has one head size for keys and values."""
    key = f"{arch}.attention.key_length"
    if key not in meta and dim % n_head:
        raise UserError(f"{source}: {arch}.embedding_length = {dim} is not a multiple of "
                        f"{arch}.attention.head_count = {n_head} (and there is no {key})")
    head_dim = _int_key(meta, key, source, dim // n_head)
    value_dim = _int_key(meta, f"{arch}.attention.value_length", source, head_dim)
    if value_dim != head_dim:
        raise UserError(f"{source}: {arch}.attention.value_length = {value_dim} differs from the key length "
                        f"{head_dim}, which this model does not implement")
    rope_key = f"{arch}.rope.dimension_count"
    rope_dim = _int_key(meta, rope_key, source, head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise UserError(f"{source}: GGUF key {rope_key} = {rope_dim} must be even and at most the head size "
                        f"{head_dim}")
    return head_dim, rope_dim


def gguf_model_args(meta: dict, tensor_names: set[str], source: str = "GGUF file") -> ModelArgs:
    """ModelArgs from GGUF metadata; a missing, mistyped or inconsistent key is a UserError naming it."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        hint = "; use the Hugging Face directory" if arch == "gemma3" else ""
        raise UserError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)}){hint}")
    n_head = _int_key(meta, f"{arch}.attention.head_count", source)
    n_kv_head = _int_key(meta, f"{arch}.attention.head_count_kv", source, n_head)
    if n_head % n_kv_head:
        raise UserError(f"{source}: {arch}.attention.head_count_kv = {n_kv_head} does not divide "
                        f"{arch}.attention.head_count = {n_head}")
    dim = _int_key(meta, f"{arch}.embedding_length", source)
    head_dim, rope_dim = _head_dims(meta, arch, source, dim, n_head)
    args = ModelArgs(
        n_layer=_int_key(meta, f"{arch}.block_count", source),
        n_head=n_head,
        n_kv_head=n_kv_head,
        dim=dim,
        intermediate_size=_int_key(meta, f"{arch}.feed_forward_length", source),
        vocab_size=len(_token_list(meta, source)),
        head_dim=head_dim,
        rope_base=_float_key(meta, f"{arch}.rope.freq_base", source, 10000.0),
        norm_eps=_float_key(meta, f"{arch}.attention.layer_norm_rms_epsilon", source),
        context_length=_int_key(meta, f"{arch}.context_length", source),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        partial_rotary_factor=rope_dim / head_dim,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=_int_key(meta, f"{arch}.attention.sliding_window", source, 0, minimum=0),
    )
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise UserError(f"{source}: unsupported GGUF rope scaling {_show(kind)}")
    if kind == "linear":
        args.rope_scaling = {"rope_type": "linear",
                             "factor": _float_key(meta, f"{arch}.rope.scaling.factor", source)}
    return args


def _our_names(arch: str, gguf_name: str, args: ModelArgs) -> list[tuple[str, slice | None]]:
    parts = gguf_name.split(".")
    if len(parts) != (4 if parts[0] == "blk" else 2):
        raise UserError(f"unexpected GGUF tensor {gguf_name}")
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


def read_gguf(path: Path, *, allow_non_finite: bool = False
              ) -> tuple[ModelArgs, Iterator[tuple[str, torch.Tensor, int]], int, Tokenizer]:
    """(args, tensor stream of (name, float32 tensor, bytes), total bytes, tokenizer). A tensor with a NaN
    or an infinity is refused as it streams in unless `allow_non_finite`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader, meta = read_gguf_metadata(path)
    args = gguf_model_args(meta, {t.name for t in reader.tensors}, str(path))
    check_tokenizer_keys(meta, str(path))
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
                tensor = torch.from_numpy(np.array(part, dtype=np.float32))
                if not allow_non_finite:  # dequantized: a quantized block's NaN scale shows here too
                    check_finite(tensor, t.name, str(path))
                yield name, tensor, int(t.n_bytes) if i == 0 else 0

    return args, stream(), sum(int(t.n_bytes) for t in reader.tensors), tokenizer_from_gguf_metadata(meta)
