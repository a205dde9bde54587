"""GGUF files (llama.cpp): metadata -> ModelArgs, tensors dequantized one at a time.

Architectures (`general.architecture`): llama (Llama, Mistral and SmolLM GGUFs), qwen2, qwen3, phi3,
gemma3 (text-only Gemma 3). llama.cpp stores llama-architecture q/k projections with interleaved RoPE
pairs; they are permuted back to the rotate-half layout here, so one RoPE implementation serves every
checkpoint format. Gemma 3 files leave out what llama.cpp hard-codes for the architecture: the local
(sliding) layers' RoPE base, the local/global layer pattern and the attention scale (see
`_gemma3_settings`); its converter stores every RMSNorm weight with Gemma's +1 folded in, which is taken
out again here so the model runs the Hugging Face convention (norm_offset 1).

Everything the loader reads is checked before it is used, with one line naming the file and the key: a
file shorter than its header says is "truncated at byte N of M" (gguf_reader.py walks the header), every
metadata key the config and the tokenizer need is present, of its type and consistent, and every tensor
is finite as it streams in (a NaN weight changes the greedy answer without a word) unless the caller
allows it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from checkpoint_hf import check_finite
from errors import UserError
from gguf_reader import GGUFHeader, read_gguf_header
from model import ModelArgs
from tokenizer import Tokenizer, tokenizer_from_gguf_metadata

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")


def read_gguf_metadata(path: Path) -> tuple[GGUFHeader, dict]:
    """(the header, with its tensors; its metadata as a dict of Python values)."""
    header = read_gguf_header(path)
    return header, header.meta


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
# Gemma 3's norms on the sublayer outputs (its ffn_norm is the pre-feed-forward norm, as elsewhere).
_SANDWICH_NAMES = {"post_attention_norm": "post_attention_norm", "post_ffw_norm": "post_ffn_norm"}
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
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix"):
        if not isinstance(meta.get(key, False), bool):
            raise UserError(f"{source}: GGUF key {key} must be true or false")


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
        raise UserError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})")
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
    if arch == "gemma3":
        _gemma3_settings(meta, args, source)
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise UserError(f"{source}: unsupported GGUF rope scaling {_show(kind)}")
    if kind == "linear":
        args.rope_scaling = {"rope_type": "linear",
                             "factor": _float_key(meta, f"{arch}.rope.scaling.factor", source)}
    return args


# llama.cpp's Gemma 3 hyper-parameters that its GGUF files do not carry (llama-model.cpp, LLM_ARCH_GEMMA3):
# every sixth layer global, local layers at RoPE base 10000 unscaled, and an attention scale of
# head_dim ** -0.5 except for the 27B (62 layers), whose query_pre_attn_scalar is dim / n_head.
GEMMA3_LAYER_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_27B_LAYERS = 62


def _gemma3_settings(meta: dict, args: ModelArgs, source: str) -> None:
    """Gemma 3's architecture on top of the common keys: GeGLU, sandwich norms, embeddings × sqrt(dim),
    its query scale, the local/global layer pattern (with the sliding layers' own RoPE base) and an
    optional final logit soft-cap; the same ModelArgs the Hugging Face gemma3_text config gives."""
    if "gemma3.attn_logit_softcapping" in meta:
        raise UserError(f"{source}: attention logit soft-capping (gemma3.attn_logit_softcapping) is not supported")
    args.hidden_act = "gelu_tanh"
    args.norm_offset = 1.0  # the +1 llama.cpp folded into the norm weights is taken out as they stream in
    args.sandwich_norms = True
    args.embedding_scale = math.sqrt(args.dim)
    scalar = args.dim // args.n_head if args.n_layer == GEMMA3_27B_LAYERS else args.head_dim
    args.query_scale = scalar ** -0.5
    cap_key = "gemma3.final_logit_softcapping"
    args.final_logit_softcap = _float_key(meta, cap_key, source) if cap_key in meta else 0.0
    if not args.sliding_window:
        return  # llama.cpp: no sliding window key, every layer global
    every = _int_key(meta, "gemma3.attention.sliding_window_pattern", source, GEMMA3_LAYER_PATTERN)
    args.layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(args.n_layer)]
    args.local_rope_base = _float_key(meta, "gemma3.rope.freq_base_swa", source, GEMMA3_LOCAL_ROPE_BASE)


def _our_names(arch: str, gguf_name: str, args: ModelArgs) -> list[tuple[str, slice | None]]:
    parts = gguf_name.split(".")
    if len(parts) != (4 if parts[0] == "blk" else 2):
        raise UserError(f"unexpected GGUF tensor {gguf_name}")
    if parts[0] in ("rope_factors_long", "rope_factors_short"):
        raise UserError(f"GGUF files with {parts[0]} (Phi-3's LongRoPE scaling) are not supported; "
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
    names = {**_LAYER_NAMES, **_SANDWICH_NAMES} if arch == "gemma3" else _LAYER_NAMES
    if kind not in names:
        raise UserError(f"unexpected GGUF tensor {gguf_name}")
    return [(f"layers.{layer}.{names[kind]}.{leaf}", None)]


# Llama 3.1 / 3.2 GGUF files carry their RoPE scaling as this tensor (llama.cpp's converter computes it from the
# Hugging Face `rope_scaling`; the metadata has no scaling keys): each rotated frequency's divisor.
ROPE_FREQS = "rope_freqs.weight"


def _rope_freq_factors(values: np.ndarray, args: ModelArgs, source: str) -> list[float]:
    factors = np.asarray(values, dtype=np.float64).reshape(-1)
    if factors.size != args.rope_dim // 2 or not np.all(np.isfinite(factors)) or not np.all(factors > 0):
        raise UserError(f"{source}: {ROPE_FREQS} must hold {args.rope_dim // 2} positive finite factors (one per "
                        f"rotated pair of dimensions), got {factors.size} values")
    return factors.tolist()


# Values a dequantized group of rows holds at most: gguf's `dequantize` takes 16 rows at a time, which for
# the bundled model's 135M values is ~13k groups whose per-group cost (views of the memmap, their checks)
# exceeded the arithmetic (1.41 s against 0.64 s for the same values, bit for bit, in groups of this size);
# bounded, so the temporaries stay a few MiB whatever the tensor.
DEQUANTIZE_GROUP_VALUES = 1 << 20


def dequantize_rows(data: np.ndarray, qtype: object) -> np.ndarray:
    """A GGUF tensor's rows of bytes `data` [rows, row bytes] as float32 values, flat: gguf's own dequantizer
    for `qtype`, over groups of about DEQUANTIZE_GROUP_VALUES values."""
    from gguf import GGML_QUANT_SIZES, quants

    # The per-type classes are gguf's internals: a version without them dequantizes in its own groups.
    quant = getattr(quants, "_type_traits", {}).get(qtype)
    if quant is None or not hasattr(quant, "dequantize_rows"):  # also F32, F16, BF16: views, nothing to group
        return quants.dequantize(data, qtype).reshape(-1)
    quant.init_grid()
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    out = np.empty((data.shape[0], data.shape[1] // block_bytes * block), dtype=np.float32)
    rows = max(1, DEQUANTIZE_GROUP_VALUES // max(1, out.shape[1]))
    for first in range(0, data.shape[0], rows):
        out[first:first + rows] = quant.dequantize_rows(np.asarray(data[first:first + rows]))
    return out.reshape(-1)


def read_gguf(path: Path, *, allow_non_finite: bool = False
              ) -> tuple[ModelArgs, Iterator[tuple[str, torch.Tensor, int]], int, Tokenizer]:
    """(args, tensor stream of (name, float32 tensor, bytes), total bytes, tokenizer). A tensor with a NaN
    or an infinity is refused as it streams in unless `allow_non_finite`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    header, meta = read_gguf_metadata(path)
    args = gguf_model_args(meta, {t.name for t in header.tensors}, str(path))
    check_tokenizer_keys(meta, str(path))
    arch = meta["general.architecture"]
    factors = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if factors is not None:
        args.rope_freq_factors = _rope_freq_factors(dequantize(factors.data, factors.tensor_type), args, str(path))
    supported = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                 GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                 GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                 GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
    for t in header.tensors:
        if t.tensor_type not in supported:
            raise UserError(f"unsupported GGUF tensor type {t.tensor_type.name} for {t.name}")
    plan = [(t, _our_names(arch, t.name, args)) for t in header.tensors if t is not factors]

    def stream() -> Iterator[tuple[str, torch.Tensor, int]]:
        for t, targets in plan:
            # GGUF lists dimensions fastest-first; numpy's logical shape is the reverse.
            w = dequantize_rows(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
            kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                w = unpermute_rope_pairs(w, args.n_head if kind == "attn_q" else args.n_kv_head)
            if arch == "gemma3" and t.name.endswith("norm.weight"):
                w = w - args.norm_offset  # stored as 1 + weight (llama.cpp's Gemma converter)
            for i, (name, rows) in enumerate(targets):
                part = w if rows is None else w[rows]
                # GGUF F32 data is a read-only memmap, copied; a dequantized tensor is already the loader's own.
                tensor = torch.from_numpy(np.array(part, dtype=np.float32, copy=not part.flags.writeable))
                if not allow_non_finite:  # dequantized: a quantized block's NaN scale shows here too
                    check_finite(tensor, t.name, str(path))
                yield name, tensor, int(t.n_bytes) if i == 0 else 0

    return args, stream(), sum(int(t.n_bytes) for t, _ in plan), tokenizer_from_gguf_metadata(meta)
