"""Hugging Face directories: config.json -> ModelArgs, and safetensors weights streamed tensor by tensor.

Architectures (config `model_type`): llama (with llama3 / linear RoPE scaling), mistral, qwen2, qwen3,
gemma3_text (Gemma 3 text-only checkpoints), phi3. The config is read from the
checkpoint; a key this loader does not know, or a known one set to something it does not implement, is
refused with a UserError naming it: a silently ignored key could change the model's math.

Weights are read straight from the files with plain `readinto` into each tensor's own buffer (no mmap,
no safetensors handle keeping pages mapped), converted to the target device and dtype one tensor at a
time, so loading never holds a second copy of the model in CPU memory. Sharded checkpoints
(`model.safetensors.index.json`) are read shard by shard in file order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from errors import UserError
from model import ModelArgs

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

# Keys that never change a forward pass in eval mode (bookkeeping, token ids, dropout, generation
# defaults of old configs). Everything else must be read below or the checkpoint is refused.
_HARMLESS_KEYS = {
    "transformers_version", "architectures", "output_hidden_states", "output_attentions", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    "initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id",
    "decoder_start_token_id", "attention_dropout", "resid_pdrop", "embd_pdrop", "_name_or_path", "model_type",
    "tokenizer_class", "cache_implementation", "pretraining_tp", "use_bfloat16", "torchscript", "pruned_heads",
    "tie_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "finetuning_task",
    "prefix", "task_specific_params", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "tf_legacy_loss", "classifier_dropout", "max_window_layers", "use_sliding_window",
    "original_max_position_embeddings", "_sliding_window_pattern", "sliding_window_pattern", "unsloth_fixed",
    "_attn_implementation_autoset", "model_name", "vocab_file",
    # Remote-code class names: transformers ignores them for these natively supported types, as we do.
    "auto_map",
}
# Keys read by hf_model_args (any model type; a key a model type does not have is simply absent).
_READ_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq",
    "partial_rotary_factor", "attention_bias", "mlp_bias", "sliding_window", "layer_types", "query_pre_attn_scalar",
    "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention", "lm_head_bias",
}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def check_text_only(config: dict) -> None:
    """Multimodal Gemma 3 directories (model_type gemma3: 4B and larger) nest the text model under tensor
    prefixes that differ between the Hub's original files and transformers 5's; they are refused rather
    than guessed at."""
    if config.get("model_type") == "gemma3":
        raise UserError("multimodal gemma3 checkpoints are not supported; use a text-only gemma3_text checkpoint "
                        "(e.g. Gemma 3 1B)")


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise UserError(message)


def _rope_settings(config: dict, model_type: str) -> tuple[dict, dict | None]:
    """(global RoPE parameters, sliding-layer RoPE parameters or None), in transformers 5's
    `rope_parameters` shape, from either that key or the older rope_theta / rope_scaling keys."""
    params = config.get("rope_parameters")
    if model_type == "gemma3_text":
        if isinstance(params, dict) and "full_attention" in params:
            return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
        glob = {"rope_type": "default", "rope_theta": config.get("rope_theta", 1_000_000.0)}
        glob.update(config.get("rope_scaling") or {})
        return glob, {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    if isinstance(params, dict):
        return dict(params), None
    glob = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10_000.0)}
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:  # the pre-2024 spelling
        scaling["rope_type"] = scaling.pop("type")
    glob.update(scaling)
    if "partial_rotary_factor" in config:
        glob["partial_rotary_factor"] = config["partial_rotary_factor"]
    return glob, None


def _layer_types(config: dict, model_type: str, n_layer: int, window: int) -> list[str]:
    if config.get("layer_types"):
        return list(config["layer_types"])
    if model_type == "gemma3_text":
        every = int(config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6)))
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layer)]
    if model_type in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers", n_layer))
        return ["sliding_attention" if window and i >= first else "full_attention" for i in range(n_layer)]
    return ["sliding_attention" if window else "full_attention"] * n_layer  # mistral, phi3: every layer


def hf_model_args(config: dict) -> ModelArgs:
    """ModelArgs from a (text) config.json, or a UserError for anything this model does not implement."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UserError(f"unsupported model_type {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})")
    unknown = sorted(set(config) - _HARMLESS_KEYS - _READ_KEYS)
    if "quantization_config" in unknown:
        raise UserError("quantized checkpoints (config.json has quantization_config) are not supported")
    _refuse(bool(unknown), f"config.json has keys this loader does not implement: {', '.join(unknown)} "
                           "(they may change the model's math, so the checkpoint is refused)")
    gemma = model_type == "gemma3_text"
    act = config.get("hidden_activation" if gemma else "hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    _refuse(act not in _ACTIVATIONS, f"unsupported activation {act!r} (supported: {', '.join(_ACTIVATIONS)})")
    _refuse(bool(config.get("mlp_bias")), "MLP biases (mlp_bias: true) are not supported")
    _refuse(config.get("attn_logit_softcapping") is not None, "attention logit soft-capping is not supported")
    _refuse(bool(config.get("use_bidirectional_attention")), "bidirectional attention is not supported")
    _refuse(bool(config.get("lm_head_bias")), "an output-projection bias (lm_head_bias: true) is not supported")
    # attention_bias puts a bias on the output projection too in these architectures (not in Qwen2, whose
    # q/k/v biases are built in); the model has none there.
    _refuse(model_type != "qwen2" and bool(config.get("attention_bias")),
            f"{model_type} with attention_bias: true (biases on the attention projections) is not supported")

    n_layer, n_head = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // n_head)
    # Qwen2/Qwen3 declare a sliding_window that only applies with use_sliding_window (as in transformers).
    window = config.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        window = None
    window = int(window or 0)
    layer_types = _layer_types(config, model_type, n_layer, window)
    _refuse(len(layer_types) != n_layer, f"layer_types has {len(layer_types)} entries for {n_layer} layers")
    _refuse(bool(set(layer_types) - {"full_attention", "sliding_attention"}),
            f"unsupported layer_types {sorted(set(layer_types))}")
    _refuse("sliding_attention" in layer_types and not window, "sliding layers without a sliding_window")

    glob, local = _rope_settings(config, model_type)
    kind = glob.get("rope_type", "default")
    _refuse(kind not in SUPPORTED_ROPE_TYPES,
            f"unsupported RoPE scaling {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    known_rope = {"rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings", "partial_rotary_factor"}
    extra = sorted(set(glob) - known_rope)
    _refuse(bool(extra), f"unsupported RoPE parameters {', '.join(extra)}")
    if local is not None:
        _refuse(local.get("rope_type", "default") != "default" or bool(set(local) - {"rope_type", "rope_theta"}),
                f"unsupported RoPE parameters for sliding layers: {local}")
    partial = float(glob.pop("partial_rotary_factor", 1.0))
    _refuse(int(head_dim * partial) % 2 != 0, f"partial_rotary_factor {partial} gives an odd rotary dimension")
    rope_base = float(glob.pop("rope_theta", 10_000.0))
    scaling = {} if kind == "default" else glob

    tie_default = gemma
    return ModelArgs(
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=int(config.get("num_key_value_heads") or n_head),
        dim=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        head_dim=head_dim,
        rope_base=rope_base,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        context_length=int(config.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(config.get("tie_word_embeddings", tie_default)),
        attention_bias=model_type == "qwen2",
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        hidden_act=_ACTIVATIONS[act],
        embedding_scale=math.sqrt(config["hidden_size"]) if gemma else 1.0,
        query_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else 0.0,
        final_logit_softcap=float(config.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        sliding_window=window,
        layer_types=layer_types if window else [],
        local_rope_base=float(local.get("rope_theta", 10_000.0)) if local is not None else 0.0,
    )


# ---- tensor names ------------------------------------------------------------------------------------------

_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Gemma 3 normalises before and after each sublayer: its post_attention_layernorm is an output norm.
_SANDWICH_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffn_norm",
}
_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}


def map_tensor(key: str, tensor: torch.Tensor, args: ModelArgs) -> list[tuple[str, torch.Tensor]]:
    """Our (name, tensor) pairs for one checkpoint tensor: none for tensors the model does not use
    (a tied lm_head, precomputed RoPE frequencies), two or three for fused projections (Phi-3).
    Anything else unknown is a UserError: an unused weight means a computation we would skip."""
    if key in _TOP_NAMES:
        if key == "lm_head.weight" and args.tie_embeddings:
            return []
        return [(_TOP_NAMES[key], tensor)]
    parts = key.split(".")  # model.layers.N.<module>.<sub>.weight
    module, leaf = ".".join(parts[3:-1]), parts[-1]
    if parts[:2] != ["model", "layers"] or len(parts) < 5:
        raise UserError(f"unexpected tensor {key} in the checkpoint")
    layer = f"layers.{parts[2]}"
    if module.endswith("rotary_emb"):
        return []  # old checkpoints store inv_freq, recomputed from the config
    q_rows, kv_rows = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    if module == "self_attn.qkv_proj":  # Phi-3: q, k and v stacked along the output rows
        q, k, v = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
        return [(f"{layer}.attention.{n}.{leaf}", t.clone()) for n, t in (("wq", q), ("wk", k), ("wv", v))]
    if module == "mlp.gate_up_proj":  # Phi-3: gate then up
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{layer}.feed_forward.w1.{leaf}", gate.clone()), (f"{layer}.feed_forward.w3.{leaf}", up.clone())]
    names = _SANDWICH_NAMES if args.sandwich_norms else _LAYER_NAMES
    if module not in names:
        raise UserError(f"unexpected tensor {key} in the checkpoint (no such module in this architecture)")
    return [(f"{layer}.{names[module]}.{leaf}", tensor)]


# ---- streaming safetensors ---------------------------------------------------------------------------------


def safetensors_header(path: Path) -> tuple[dict, int]:
    """The tensor table of a .safetensors file and the offset its data starts at."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size <= 0 or size > 100 * 2**20:
            raise UserError(f"{path.name} is not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path.name} has a corrupt safetensors header") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{directory} is missing shards named in its index: {', '.join(missing[:3])}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} has no *.safetensors weights (pickled checkpoints are never loaded)")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(name, CPU tensor in the file's dtype, bytes read) for every tensor, in file order.

    Each tensor is read into its own fresh buffer; nothing else of the file stays in this process.
    """
    for path in files:
        header, base = safetensors_header(path)
        with open(path, "rb", buffering=0) as f:
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise UserError(f"unsupported tensor type {info['dtype']} for {name} in {path.name}")
                start, end = info["data_offsets"]
                tensor = torch.empty(info["shape"], dtype=dtype)
                buffer = tensor.view(-1).view(torch.uint8).numpy()
                if buffer.nbytes != end - start:
                    raise UserError(f"{path.name}: {name} has {end - start} bytes for shape {info['shape']}")
                f.seek(base + start)
                if f.readinto(buffer) != buffer.nbytes:
                    raise UserError(f"{path.name} is truncated (while reading {name})")
                yield name, tensor, end - start


def total_bytes(files: list[Path]) -> int:
    return sum(end - start for f in files for start, end in
               (info["data_offsets"] for info in safetensors_header(f)[0].values()))
