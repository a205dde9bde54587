"""Hugging Face directories: config.json -> ModelArgs, and safetensors weights streamed tensor by tensor.

Architectures (config `model_type`): llama (with llama3 / linear RoPE scaling), mistral, qwen2, qwen3,
gemma3_text (Gemma 3 text-only checkpoints), phi3. The config is read from the
checkpoint; a key this loader does not know, or a known one set to something it does not implement, is
refused with a UserError naming it: a silently ignored key could change the model's math.

Every field the loader reads is checked for presence, type and consistency (one line naming the file and
the field), a file shorter than its header says is "truncated at byte N of M", and every tensor is
finite as it streams in (a NaN weight changes the greedy answer without a word) unless the caller allows
non-finite weights.

Weights are read straight from the files with plain `readinto` into each tensor's own buffer (no mmap,
no safetensors handle keeping pages mapped), converted to the target device and dtype one tensor at a
time, so loading never holds a second copy of the model in CPU memory. Sharded checkpoints
(`model.safetensors.index.json`) are read shard by shard in file order.
"""

from __future__ import annotations

import io
import json
import math
import numbers
from collections.abc import Iterator
from pathlib import Path

import numpy as np
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


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object (config.json, the shard index), or a UserError naming the file."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} must hold a JSON object, got a JSON {type(value).__name__}")
    return value


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if path.is_dir():
        raise UserError(f"{path} is a directory, not a file")
    if not path.is_file():
        raise UserError(f"{directory} has no config.json")
    return read_json_object(path)


# ---- the fields hf_model_args reads: present, typed, consistent --------------------------------------------

_REQUIRED_SIZES = ("num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size")
_SIZES = ("max_position_embeddings", "sliding_window_pattern", "_sliding_window_pattern")  # integers >= 1
_NULLABLE_SIZES = ("num_key_value_heads", "head_dim")  # integers >= 1, or null: derived from the others
_COUNTS = ("sliding_window", "max_window_layers")  # integers >= 0 (null: none)
_POSITIVE = ("rms_norm_eps", "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "partial_rotary_factor")
_NULLABLE_POSITIVE = ("final_logit_softcapping", "attn_logit_softcapping")
_SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
             "use_bidirectional_attention", "lm_head_bias")
_STRINGS = ("hidden_act", "hidden_activation")
_MAPPINGS = ("rope_scaling", "rope_parameters")


def _show(value: object) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | list | dict | None) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def _is_positive(value: object) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _field_error(config: dict) -> str | None:
    """What is wrong with the first field of the wrong type, or None."""
    for key in _REQUIRED_SIZES:
        if key not in config:
            return f"{key} is missing"
    checks = [(_REQUIRED_SIZES + _SIZES, False, lambda v: _is_int(v, 1), "an integer >= 1"),
              (_NULLABLE_SIZES, True, lambda v: _is_int(v, 1), "an integer >= 1 or null"),
              (_COUNTS, True, lambda v: _is_int(v, 0), "an integer >= 0 or null"),
              (_POSITIVE, False, _is_positive, "a finite positive number"),
              (_NULLABLE_POSITIVE, True, _is_positive, "a finite positive number or null"),
              (_SWITCHES, True, lambda v: isinstance(v, bool), "true or false"),
              (_STRINGS, False, lambda v: isinstance(v, str), "a string"),
              (_MAPPINGS, True, lambda v: isinstance(v, dict), "a JSON object or null")]
    for keys, nullable, ok, kind in checks:
        for key in keys:
            if key in config and not (ok(config[key]) or (nullable and config[key] is None)):
                return f"{key} must be {kind}, got {_show(config[key])}"
    layer_types = config.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        return f"layer_types must be a list of strings, got {_show(layer_types)}"
    if not 0 < config.get("partial_rotary_factor", 1.0) <= 1:
        return f"partial_rotary_factor must be in (0, 1], got {_show(config['partial_rotary_factor'])}"
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # read by tokenizer.py
        value = config.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(_is_int(v, 0) for v in ids):
            return f"{key} must be a token id (an integer >= 0), a list of them, or null; got {_show(value)}"
    return None


def check_config_fields(config: dict, source: str) -> None:
    """Every field hf_model_args reads: present when required, of its type, and consistent with the others."""
    error = _field_error(config)
    if error:
        raise UserError(f"{source}: {error}")
    n_head, n_kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if n_head % n_kv:
        raise UserError(f"{source}: num_key_value_heads = {n_kv} does not divide num_attention_heads = {n_head}")
    if not config.get("head_dim") and config["hidden_size"] % n_head:
        raise UserError(f"{source}: hidden_size = {config['hidden_size']} is not a multiple of num_attention_heads "
                        f"= {n_head} (and there is no head_dim)")


def _check_rope(glob: dict, local: dict | None, kind: str, source: str) -> None:
    """The RoPE parameters model.py reads for `kind`: present, finite, positive; llama3's ramp needs
    low_freq_factor < high_freq_factor (it divides by their difference)."""
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")}.get(kind, ())
    for name in needed:
        if name not in glob:
            raise UserError(f"{source}: RoPE scaling {kind!r} needs {name}, which is missing")
    for params in (glob, local or {}):
        for name in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings", "partial_rotary_factor"):
            if name in params and not _is_positive(params[name]):
                raise UserError(f"{source}: RoPE parameter {name} must be a finite positive number, got "
                                f"{_show(params[name])}")
    if kind == "llama3" and not glob["low_freq_factor"] < glob["high_freq_factor"]:
        raise UserError(f"{source}: RoPE low_freq_factor ({glob['low_freq_factor']}) must be below high_freq_factor "
                        f"({glob['high_freq_factor']})")


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
            full, sliding = params["full_attention"], params.get("sliding_attention") or {}
            if not isinstance(full, dict) or not isinstance(sliding, dict):
                raise UserError("config.json: rope_parameters.full_attention and .sliding_attention must be objects")
            return dict(full), dict(sliding)
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


def hf_model_args(config: dict, source: str = "config.json") -> ModelArgs:
    """ModelArgs from a (text) config.json, or a UserError for anything this model does not implement;
    `source` names the file in the messages."""
    model_type = config.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UserError(f"unsupported model_type {model_type!r} (supported: {', '.join(HF_MODEL_TYPES)})")
    unknown = sorted(set(config) - _HARMLESS_KEYS - _READ_KEYS)
    if "quantization_config" in unknown:
        raise UserError("quantized checkpoints (config.json has quantization_config) are not supported")
    _refuse(bool(unknown), f"config.json has keys this loader does not implement: {', '.join(unknown)} "
                           "(they may change the model's math, so the checkpoint is refused)")
    check_config_fields(config, source)
    gemma = model_type == "gemma3_text"
    act = config.get("hidden_activation" if gemma else "hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    _refuse_unsupported_math(config, model_type, act)

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

    rope_base, scaling, partial, local_rope_base = _rope_args(config, model_type, head_dim, source)

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
        local_rope_base=local_rope_base,
    )


def _refuse_unsupported_math(config: dict, model_type: str, act: str) -> None:
    """A UserError for each setting that would change the math in a way this model does not implement."""
    _refuse(act not in _ACTIVATIONS, f"unsupported activation {act!r} (supported: {', '.join(_ACTIVATIONS)})")
    _refuse(bool(config.get("mlp_bias")), "MLP biases (mlp_bias: true) are not supported")
    _refuse(config.get("attn_logit_softcapping") is not None, "attention logit soft-capping is not supported")
    _refuse(bool(config.get("use_bidirectional_attention")), "bidirectional attention is not supported")
    _refuse(bool(config.get("lm_head_bias")), "an output-projection bias (lm_head_bias: true) is not supported")
    # attention_bias puts a bias on the output projection too in these architectures (not in Qwen2, whose
    # q/k/v biases are built in); the model has none there.
    _refuse(model_type != "qwen2" and bool(config.get("attention_bias")),
            f"{model_type} with attention_bias: true (biases on the attention projections) is not supported")


def _rope_args(config: dict, model_type: str, head_dim: int, source: str) -> tuple[float, dict, float, float]:
    """(rope_base, rope_scaling, partial_rotary_factor, local_rope_base: 0 without local layers), checked."""
    glob, local = _rope_settings(config, model_type)
    kind = glob.get("rope_type", "default")
    _refuse(kind not in SUPPORTED_ROPE_TYPES,
            f"unsupported RoPE scaling {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    known_rope = {"rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings", "partial_rotary_factor"}
    extra = sorted(set(glob) - known_rope)
    _refuse(bool(extra), f"unsupported RoPE parameters {', '.join(extra)}")
    _check_rope(glob, local, kind, source)
    if local is not None:
        _refuse(local.get("rope_type", "default") != "default" or bool(set(local) - {"rope_type", "rope_theta"}),
                f"unsupported RoPE parameters for sliding layers: {local}")
    partial = float(glob.pop("partial_rotary_factor", 1.0))
    _refuse(int(head_dim * partial) % 2 != 0, f"partial_rotary_factor {partial} gives an odd rotary dimension")
    rope_base = float(glob.pop("rope_theta", 10_000.0))
    scaling = {} if kind == "default" else glob
    local_base = float(local.get("rope_theta", 10_000.0)) if local is not None else 0.0
    return rope_base, scaling, partial, local_base


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


def check_finite(tensor: torch.Tensor, name: str, source: str) -> None:
    """Refuse a weight holding a NaN or an infinity: it changes the model's output without a word.

    One reduction reads the tensor once without allocating a mask of its size: a sum is finite whenever
    every entry is, except when finite entries overflow it, which the exact count then clears."""
    if not tensor.is_floating_point():
        return
    accumulate = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    if math.isfinite(tensor.sum(dtype=accumulate).item()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise UserError(f"{source}: tensor {name} has {bad} non-finite values (NaN or inf) of {tensor.numel()}; "
                        "refused (allow_non_finite=True loads it anyway)")


def _header_entry_error(info: object) -> str | None:
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return "has no dtype"
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(_is_int(d, 0) for d in shape):
        return f"has a malformed shape {_show(shape)}"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o, 0) for o in offsets)
            or offsets[0] > offsets[1]):
        return f"has malformed data_offsets {_show(offsets)}"
    return None


def safetensors_header(path: Path) -> tuple[dict, int]:
    """The tensor table of a .safetensors file and the offset its data starts at; a file shorter than
    its header says is refused as truncated, at the byte it ends at."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise UserError(f"{path} is not a safetensors file ({size} bytes)")
        length = int.from_bytes(f.read(8), "little")
        if length <= 0 or length > 100 * 2**20:
            raise UserError(f"{path} is not a safetensors file")
        if 8 + length > size:
            raise UserError(f"{path} is truncated at byte {size} of at least {8 + length} (inside its header)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path} has a corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise UserError(f"{path} has a corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    for name, info in header.items():
        error = _header_entry_error(info)
        if error:
            raise UserError(f"{path}: the header entry of tensor {name} {error}")
    expected = 8 + length + max((info["data_offsets"][1] for info in header.values()), default=0)
    if size < expected:
        raise UserError(f"{path} is truncated at byte {size} of {expected}")
    return header, 8 + length


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: weight_map must be an object mapping tensor names to file names")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{directory} is missing shards named in its index: {', '.join(missing[:3])}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory} has no *.safetensors weights (pickled checkpoints are never loaded)")
    return files


def _read_into(f: io.RawIOBase, buffer: np.ndarray) -> int:
    """Fill `buffer` from `f`; the bytes read (fewer only at the end of the file). One raw read returns at
    most about 2 GiB on Linux, less than one large embedding matrix."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def iter_safetensors(files: list[Path], *, allow_non_finite: bool = False) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(name, CPU tensor in the file's dtype, bytes read) for every tensor, in file order; a tensor with a
    NaN or an infinity is refused unless `allow_non_finite`.

    Each tensor is read into its own fresh buffer; nothing else of the file stays in this process.
    """
    for path in files:
        header, base = safetensors_header(path)
        with open(path, "rb", buffering=0) as f:
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise UserError(f"unsupported tensor type {info['dtype']} for {name} in {path}")
                start, end = info["data_offsets"]
                tensor = torch.empty(info["shape"], dtype=dtype)
                buffer = tensor.view(-1).view(torch.uint8).numpy()
                if buffer.nbytes != end - start:
                    raise UserError(f"{path}: {name} has {end - start} bytes for shape {info['shape']}")
                f.seek(base + start)
                read = _read_into(f, buffer)
                if read != buffer.nbytes:  # shrunk since its header was read
                    raise UserError(f"{path} is truncated at byte {base + start + read} of {base + end} "
                                    f"(while reading {name})")
                if not allow_non_finite:
                    check_finite(tensor, name, str(path))
                yield name, tensor, end - start


def total_bytes(files: list[Path]) -> int:
    return sum(end - start for f in files for start, end in
               (info["data_offsets"] for info in safetensors_header(f)[0].values()))
