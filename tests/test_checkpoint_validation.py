"""Checkpoints are validated at load: every field the loaders read is present, typed and consistent, with
one line naming the file and the field; a truncated file says where it ends and where it should; a NaN or
an infinity in a weight is refused as it streams in unless allowed. The files are the tiny random model
written here as a GGUF (with the `gguf` package's own writer) or as a Hugging Face directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint import load_checkpoint
from checkpoint_gguf import read_gguf
from checkpoint_hf import check_finite, iter_safetensors
from errors import UserError
from model import ModelArgs
from tests.conftest import TINY_ARGS, make_tiny_model

A = TINY_ARGS
NORM_EPS = ModelArgs(**TINY_ARGS).norm_eps  # make_tiny_model's, so the loaded model is the same model
_GGUF_LAYER = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
               "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up",
               "feed_forward.w2": "ffn_down", "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}
_GGUF_TOP = {"tok_embeddings": "token_embd", "norm": "output_norm", "output": "output"}


def gguf_metadata() -> dict:
    """The llama keys of the tiny model and a byte-level vocabulary of its size (no merges)."""
    return {"llama.block_count": A["n_layer"], "llama.context_length": A["context_length"],
            "llama.embedding_length": A["dim"], "llama.feed_forward_length": A["intermediate_size"],
            "llama.attention.head_count": A["n_head"], "llama.attention.head_count_kv": A["n_kv_head"],
            "llama.rope.freq_base": A["rope_base"], "llama.attention.layer_norm_rms_epsilon": NORM_EPS,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [chr(0x100 + i) for i in range(A["vocab_size"])],
            "tokenizer.ggml.eos_token_id": 2}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's layout of llama q/k rows (interleaved RoPE pairs), which the loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors() -> dict[str, np.ndarray]:
    """make_tiny_model(0)'s weights under their GGUF names, in llama.cpp's layout."""
    tensors = {}
    for name, tensor in make_tiny_model(0).state_dict().items():
        parts = name.split(".")
        w = tensor.numpy().copy()
        if parts[0] == "layers":
            kind = _GGUF_LAYER[".".join(parts[2:-1])]
            if kind in ("attn_q", "attn_k"):
                w = llama_cpp_permute(w, A["n_head"] if kind == "attn_q" else A["n_kv_head"])
            tensors[f"blk.{parts[1]}.{kind}.{parts[-1]}"] = w
        else:
            tensors[f"{_GGUF_TOP[parts[0]]}.{parts[-1]}"] = w
    return tensors


def write_gguf(path: Path, meta: dict | None = None, tensors: dict[str, np.ndarray] | None = None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (gguf_metadata() if meta is None else meta).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, array in (gguf_tensors() if tensors is None else tensors).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refused(path: Path, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        load_checkpoint(path, "cpu", torch.float32)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_tiny_gguf_loads_and_matches_the_model(tmp_path):
    """The fixture is a valid checkpoint: every refusal below is caused by its one edit."""
    model, tokenizer = load_checkpoint(write_gguf(tmp_path / "m.gguf"), "cpu", torch.float32)
    reference = make_tiny_model(0)
    ids = torch.arange(12)[None]
    assert torch.allclose(model(ids, torch.arange(12)), reference(ids, torch.arange(12)), atol=1e-5)
    assert tokenizer.vocab_size == A["vocab_size"]


# ---- GGUF metadata --------------------------------------------------------------------------------------

REQUIRED_GGUF_KEYS = ["llama.block_count", "llama.context_length", "llama.embedding_length",
                      "llama.feed_forward_length", "llama.attention.head_count",
                      "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens"]


@pytest.mark.parametrize("key", REQUIRED_GGUF_KEYS)
def test_a_gguf_without_a_required_key_names_it(tmp_path, key):
    meta = gguf_metadata()
    del meta[key]
    path = write_gguf(tmp_path / "m.gguf", meta)
    assert refused(path, "is missing") == f"{path}: GGUF key {key} is missing"


BAD_GGUF_KEYS = {
    "head count as text": ({"llama.attention.head_count": "four"}, "GGUF key llama.attention.head_count must be an "
                                                                   "integer >= 1, got 'four'"),
    "head count per layer": ({"llama.attention.head_count": [4, 4]}, "llama.attention.head_count must be an integer"),
    "zero layers": ({"llama.block_count": 0}, "llama.block_count must be an integer >= 1, got 0"),
    "kv heads do not divide": ({"llama.attention.head_count_kv": 3}, "llama.attention.head_count_kv = 3 does not "
                                                                     "divide llama.attention.head_count = 4"),
    "width not a multiple": ({"llama.attention.head_count": 5, "llama.attention.head_count_kv": 5},
                             "llama.embedding_length = 64 is not a multiple of llama.attention.head_count = 5"),
    "zero epsilon": ({"llama.attention.layer_norm_rms_epsilon": 0.0}, "layer_norm_rms_epsilon must be a finite "
                                                                      "positive number, got 0.0"),
    "nan rope base": ({"llama.rope.freq_base": float("nan")}, "llama.rope.freq_base must be a finite positive"),
    "odd rotary dimension": ({"llama.rope.dimension_count": 7}, "llama.rope.dimension_count = 7 must be even"),
    "values wider than keys": ({"llama.attention.value_length": 32}, "value_length = 32 differs from the key "
                                                                     "length 16"),
    "tokens not text": ({"tokenizer.ggml.tokens": list(range(A["vocab_size"]))}, "tokenizer.ggml.tokens must be a "
                                                                                   "non-empty list of strings"),
    "merge of one token": ({"tokenizer.ggml.merges": ["ĀāĂ"]}, "tokenizer.ggml.merges entry 0 is not two tokens"),
    "eos outside the vocabulary": ({"tokenizer.ggml.eos_token_id": 300}, "tokenizer.ggml.eos_token_id is 300, "
                                                                         "outside the vocabulary of 256 tokens"),
    "token types short": ({"tokenizer.ggml.token_type": [1, 1]}, "token_type must be one integer per token"),
}


@pytest.mark.parametrize("case", list(BAD_GGUF_KEYS), ids=list(BAD_GGUF_KEYS))
def test_a_gguf_key_of_the_wrong_type_or_inconsistent_names_it(tmp_path, case):
    edit, message = BAD_GGUF_KEYS[case]
    path = write_gguf(tmp_path / "m.gguf", {**gguf_metadata(), **edit})
    assert refused(path, "GGUF key|llama|tokenizer").startswith(f"{path}: ")
    refused(path, message.replace("(", r"\(").replace("[", r"\["))


# ---- truncated files ------------------------------------------------------------------------------------


def gguf_data_end(path: Path) -> int:
    """Where the last tensor's data ends, as the `gguf` package's reader places it in the intact file."""
    from gguf import GGUFReader

    return max(t.data_offset + t.n_bytes for t in GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("cut", ["in the data", "one byte short", "in the tensor table", "in the metadata"])
def test_a_truncated_gguf_says_where_it_ends(tmp_path, cut):
    path = write_gguf(tmp_path / "m.gguf")
    content, end = path.read_bytes(), gguf_data_end(path)
    keep = {"in the data": end // 2, "one byte short": end - 1, "in the tensor table": 2000,
            "in the metadata": 100}[cut]
    path.write_bytes(content[:keep])
    if cut in ("in the data", "one byte short"):
        assert refused(path, "truncated") == f"GGUF file {path} is truncated at byte {keep} of {end}"
    else:
        assert f"is truncated at byte {keep} of at least" in refused(path, "inside its header")


def test_a_vocabulary_cut_or_not_utf8_is_refused_where_it_breaks(tmp_path):
    """The vocabulary's strings, read in one loop (gguf_reader's texts): a file cut within a token's length or
    bytes says where, a token that is not UTF-8 names its key and the byte it ends before."""
    path = write_gguf(tmp_path / "m.gguf")
    content = path.read_bytes()
    key = b"tokenizer.ggml.tokens"
    first = content.index(key) + len(key) + 4 + 4 + 8  # past the value type, the item type and the count
    token = 10  # each token: an 8-byte length and one 2-byte character
    sixth = first + 5 * token
    for keep, needed in ((sixth + 3, sixth + 8), (sixth + 9, sixth + 10)):  # within its length, then its bytes
        path.write_bytes(content[:keep])
        assert f"is truncated at byte {keep} of at least {needed} " in refused(path, "inside its header")
    damaged = bytearray(content)
    damaged[sixth + 8 : sixth + token] = b"\xff\xff"
    path.write_bytes(bytes(damaged))
    assert refused(path, "not valid UTF-8").endswith(
        f"GGUF key tokenizer.ggml.tokens is not valid UTF-8 (before byte {sixth + token})")


def test_an_empty_or_foreign_file_named_gguf_is_one_line(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    refused(path, "is empty")
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    refused(path, "is not a GGUF file")


def test_a_truncated_safetensors_file_says_where_it_ends(tiny_dir, tmp_path):
    directory = shutil.copytree(tiny_dir, tmp_path / "m")
    weights = directory / "model.safetensors"
    content = weights.read_bytes()
    weights.write_bytes(content[:-10])
    assert refused(directory, "truncated") == f"{weights} is truncated at byte {len(content) - 10} of {len(content)}"
    weights.write_bytes(content[:20])
    refused(directory, "truncated at byte 20 of at least .* \\(inside its header\\)")


def test_a_malformed_safetensors_header_entry_is_named(tiny_dir, tmp_path):
    directory = shutil.copytree(tiny_dir, tmp_path / "m")
    weights = directory / "model.safetensors"
    content = weights.read_bytes()
    length = int.from_bytes(content[:8], "little")
    header = json.loads(content[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [end, start]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)  # the same length: data stays put
    assert len(text) == length
    weights.write_bytes(content[:8] + text + content[8 + length:])
    refused(directory, f"header entry of tensor {name} has malformed data_offsets")


# ---- config.json ----------------------------------------------------------------------------------------


def with_config(tiny_dir: Path, tmp_path: Path, edit: dict | None = None, raw: bytes | None = None) -> Path:
    directory = shutil.copytree(tiny_dir, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    for key, value in (edit or {}).items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (directory / "config.json").write_bytes(json.dumps(config).encode() if raw is None else raw)
    return directory


BAD_CONFIGS = {
    "not UTF-8": (None, b'{"model_type": "\xff"}', r"config.json is not UTF-8 text \(byte 16\)"),
    "a JSON list": (None, b"[1, 2]", "config.json must hold a JSON object, got a JSON list"),
    "no num_hidden_layers": ({"num_hidden_layers": None}, None, "config.json: num_hidden_layers is missing"),
    "kv heads do not divide": ({"num_key_value_heads": 3}, None, "config.json: num_key_value_heads = 3 does not "
                                                                 "divide num_attention_heads = 4"),
    "width not a multiple": ({"num_attention_heads": 5, "num_key_value_heads": 5}, None,
                             "hidden_size = 64 is not a multiple of num_attention_heads = 5"),
    "heads as text": ({"num_attention_heads": "4"}, None, 'num_attention_heads must be an integer >= 1, got "4"'),
    "layers as a float": ({"num_hidden_layers": 2.0}, None, "num_hidden_layers must be an integer >= 1, got 2.0"),
    "negative epsilon": ({"rms_norm_eps": -1e-5}, None, "rms_norm_eps must be a finite positive number"),
    "tie as text": ({"tie_word_embeddings": "false"}, None, 'tie_word_embeddings must be true or false, got "false"'),
    "activation a list": ({"hidden_act": ["silu"]}, None, "hidden_act must be a string"),
    "scaling not an object": ({"rope_scaling": "linear"}, None, "rope_scaling must be a JSON object or null"),
    "linear without factor": ({"rope_scaling": {"rope_type": "linear"}}, None,
                              "RoPE scaling 'linear' needs factor, which is missing"),
    "llama3 ramp reversed": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                               "high_freq_factor": 1.0, "original_max_position_embeddings": 512}},
                             None, "low_freq_factor \\(4.0\\) must be below high_freq_factor"),
    "layer types not text": ({"layer_types": [1, 2]}, None, "layer_types must be a list of strings"),
    "eos id as text": ({"eos_token_id": "</s>"}, None, "eos_token_id must be a token id"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_a_bad_config_field_is_one_line_naming_the_file_and_the_field(tiny_dir, tmp_path, case):
    edit, raw, message = BAD_CONFIGS[case]
    refused(with_config(tiny_dir, tmp_path, edit, raw), message)


def test_a_shard_index_that_is_not_an_object_is_named(tiny_dir, tmp_path):
    directory = with_config(tiny_dir, tmp_path)
    (directory / "model.safetensors.index.json").write_text('["model.safetensors"]')
    refused(directory, "model.safetensors.index.json must hold a JSON object, got a JSON list")


# ---- non-finite weights ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gguf_weight_is_refused_unless_allowed(tmp_path, value):
    tensors = gguf_tensors()
    tensors["blk.1.ffn_down.weight"][3, 5] = value
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    refused(path, f"{path}: tensor blk.1.ffn_down.weight has 1 non-finite values \\(NaN or inf\\) of 8192")
    _, stream, _, _ = read_gguf(path, allow_non_finite=True)
    loaded = dict((name, t) for name, t, _ in stream)["layers.1.feed_forward.w2.weight"]
    assert int((~torch.isfinite(loaded)).sum()) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_non_finite_safetensors_weight_is_refused_unless_allowed(tiny_dir, tmp_path, dtype):
    directory = shutil.copytree(tiny_dir, tmp_path / "m")
    weights = directory / "model.safetensors"
    state = {k: v.to(dtype) for k, v in load_file(str(weights)).items()}
    state["model.layers.0.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(state, str(weights))
    refused(directory, "tensor model.layers.0.self_attn.k_proj.weight has 1 non-finite values")
    loaded = dict((name, t) for name, t, _ in iter_safetensors([weights], allow_non_finite=True))
    assert torch.isnan(loaded["model.layers.0.self_attn.k_proj.weight"][0, 0])


def test_finite_weights_whose_sum_overflows_are_not_refused():
    """The check's fast path sums the tensor; an overflowing sum of finite values is not a NaN weight."""
    big = torch.full((4,), 3e38)
    assert torch.isinf(big.sum())
    check_finite(big, "big", "test")
    check_finite(torch.full((70000,), 60000.0, dtype=torch.float16), "wide", "test")
    with pytest.raises(UserError, match="has 1 non-finite"):
        check_finite(torch.cat([big, torch.tensor([float("inf")])]), "big", "test")


def test_finite_float32_weights_that_overflow_float16_are_refused(tiny_dir, tmp_path):
    """The finite check reads the file's float32; 1e5 becomes inf only in the float16 copy."""
    directory = shutil.copytree(tiny_dir, tmp_path / "m")
    weights = directory / "model.safetensors"
    state = load_file(str(weights))
    state["model.layers.1.mlp.down_proj.weight"][2, 3] = 1e5
    save_file(state, str(weights))
    with pytest.raises(UserError) as info:
        load_checkpoint(directory, "cpu", torch.float16)
    assert str(info.value) == (f"{directory}: tensor layers.1.feed_forward.w2.weight holds values up to 100000, "
                               "beyond float16's range (largest 65504): they would load as inf; use --dtype "
                               "float32 or bfloat16")
    for dtype in (torch.float32, torch.bfloat16):  # both hold 1e5
        model, _ = load_checkpoint(directory, "cpu", dtype)
        assert float(model.layers[1].feed_forward.w2.weight[2, 3]) == pytest.approx(1e5, rel=1e-2)
    model, _ = load_checkpoint(directory, "cpu", torch.float16, allow_non_finite=True)
    assert torch.isinf(model.layers[1].feed_forward.w2.weight[2, 3])


def test_load_checkpoint_allows_non_finite_when_asked(tmp_path):
    tensors = gguf_tensors()
    tensors["blk.1.ffn_down.weight"][3, 5] = float("nan")
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    model, _ = load_checkpoint(path, "cpu", torch.float32, allow_non_finite=True)
    assert torch.isnan(model.layers[1].feed_forward.w2.weight).sum() == 1


def test_config_messages_name_the_full_path(tiny_dir, tmp_path):
    directory = with_config(tiny_dir, tmp_path, {"num_hidden_layers": None})
    assert refused(directory, "missing") == f"{directory / 'config.json'}: num_hidden_layers is missing"
