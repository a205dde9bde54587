"""GGUF files written with the `gguf` package's own writer and tensor-name map, in llama.cpp's
conventions (llama q/k rows permuted into interleaved RoPE pairs; Phi-3 projections fused), from a tiny
random transformers model; our loader vs transformers' GGUF loader on the same file, float32.
Tolerance: max |Δlogit| ≤ 1e-3 over 48 positions and the same argmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoint import load_checkpoint
from tests.arch_helpers import VOCAB, add_gguf_shape, save_tiny_model

LOGIT_ATOL = 1e-3


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permutation of llama q/k rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(reference, arch: str, path, extra: dict[str, np.ndarray] | None = None) -> None:
    import gguf

    c = reference.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    add_gguf_shape(writer, c, head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0)))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # A byte-level BPE vocabulary of single characters (no merges) of the model's size.
    byte_chars = [chr(b) for b in range(ord("!"), ord("!") + VOCAB)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(byte_chars)
    writer.add_token_types([gguf.TokenType.NORMAL] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)  # transformers would otherwise keep Phi3Config's default, outside this vocabulary
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH_NAMES_INV[arch] if hasattr(gguf, "MODEL_ARCH_NAMES_INV")
                                     else {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], c.num_hidden_layers)
    for hf_name, tensor in reference.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w = tensor.float().numpy().copy()
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_cpp_permute(w, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        writer.add_tensor(name, w)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, gguf_arch", [("llama_plain", "llama"), ("qwen2", "qwen2"), ("qwen3_gguf", "qwen3"),
                                            ("phi3_full", "phi3")])
def test_gguf_matches_transformers_gguf_loader(tmp_path, arch, gguf_arch):
    import transformers

    reference = save_tiny_model(arch, tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_gguf(reference, gguf_arch, path)
    hf_gguf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                dtype=torch.float32).eval()
    model, tokenizer = load_checkpoint(path, "cpu", torch.float32)
    assert tokenizer.vocab_size == VOCAB
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours, ref, hf = model(ids, torch.arange(48)), hf_gguf(ids).logits.float(), reference(ids).logits.float()
    assert (ours - ref).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ours - hf).abs().max().item() <= LOGIT_ATOL  # and the directory it was converted from


def llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `rope_freqs` for a Llama 3.1 `rope_scaling`: per rotated frequency the
    divisor llama.cpp applies (1 for short wavelengths, `factor` for long ones, a smooth ramp between)."""
    base, factor, low, high = rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama_3_1_gguf_rope_freqs_give_the_scaled_rope(tmp_path):
    """A Llama 3.1-style GGUF (its RoPE scaling only in the `rope_freqs` tensor, as llama.cpp writes it) gives
    the logits of the Hugging Face model with the `llama3` rope_scaling it was converted from (48 positions;
    the tiny model's frequencies fall in all three of its bands); the same file without the tensor does not."""
    reference = save_tiny_model("llama", tmp_path / "hf")
    c = reference.config
    factors = llama_cpp_rope_factors(c.rope_parameters, c.hidden_size // c.num_attention_heads)
    assert len(set(factors.round(4).tolist())) >= 3  # unscaled, scaled and ramped frequencies all present
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = reference(ids).logits.float()
        logits = {}
        for name, extra in {"with": {"rope_freqs.weight": factors}, "without": {}}.items():
            write_gguf(reference, "llama", tmp_path / f"{name}.gguf", extra)
            model, _ = load_checkpoint(tmp_path / f"{name}.gguf", "cpu", torch.float32)
            logits[name] = model(ids, torch.arange(48))
    assert (logits["with"] - want).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(logits["with"].argmax(-1), want.argmax(-1))
    assert (logits["without"] - want).abs().max().item() > 100 * LOGIT_ATOL


@pytest.mark.parametrize("values", [np.ones(3, dtype=np.float32), np.array([1, 2, 0, 4, 8, 8, 8, 8], dtype=np.float32),
                                    np.array([1, 2, np.nan, 4, 8, 8, 8, 8], dtype=np.float32)])
def test_bad_gguf_rope_freqs_are_refused(tmp_path, values):
    from errors import UserError

    reference = save_tiny_model("llama", tmp_path / "hf")
    write_gguf(reference, "llama", tmp_path / "bad.gguf", {"rope_freqs.weight": values})
    with pytest.raises(UserError, match="rope_freqs.weight must hold 8 positive finite factors"):
        load_checkpoint(tmp_path / "bad.gguf", "cpu", torch.float32)


def test_an_unsupported_gguf_architecture_is_refused_naming_the_supported_ones(tmp_path):
    """Gemma 2 (not Gemma 3, which loads: tests/test_gemma3_gguf.py) is one line listing what loads."""
    import gguf

    from errors import UserError

    path = tmp_path / "gemma2.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match=r"unsupported GGUF architecture 'gemma2' \(supported: llama, qwen2, qwen3, "
                                        r"phi3, gemma3\)$"):
        load_checkpoint(path, "cpu", torch.float32)


TOKENIZER_TEXTS = ["Hello, world! I'M here; you're THERE.", "In 2024, 1234567 apples cost $3.50.",
                   "def f(x):\n\treturn x ** 2   \n\n\n  end", "Ünïcödé, 日本語 and emoji 🤖 they'll"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_gguf_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    """Llama 3 ("llama-bpe", digits by three) and Qwen2 ("qwen2", digits one by one) GGUF vocabularies:
    our encoding of varied text equals transformers' tokenizer built from the same GGUF file."""
    import gguf
    import transformers
    from tokenizers import pre_tokenizers

    from checkpoint import read_gguf_metadata
    from tokenizer import tokenizer_from_gguf_metadata

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "12 3", "e r", "Ġ 2", "' s", "' M"]
    tokens = byte_chars + [a + b for a, b in (m.split(" ") for m in merges)]
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, meta = read_gguf_metadata(path)
    ours = tokenizer_from_gguf_metadata(meta)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TOKENIZER_TEXTS:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(ours.encode(text)) == text
    digits = [ours.decode([i]) for i in ours.encode("1234567")]
    assert digits == {"llama-bpe": ["123", "4", "5", "6", "7"], "qwen2": list("1234567"),
                      "default": ["123", "4", "5", "6", "7"]}[pre]


QUANTIZED_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]


@pytest.mark.parametrize("kind", QUANTIZED_TYPES)
def test_the_loaders_dequantizer_equals_gguf_s_bit_for_bit(kind, monkeypatch):
    """checkpoint_gguf.dequantize_rows (gguf's per-type code over groups of rows, a last group shorter) against
    gguf's `dequantize` (16 rows at a time) on random bytes: every code and scale a block can hold, NaN and
    infinite scales included."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    import checkpoint_gguf

    qtype = GGMLQuantizationType[kind]
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, row_values = 37, 2 * max(block, 256)  # two K-quant superblocks a row
    data = np.random.default_rng(0).integers(0, 256, (rows, row_values // block * block_bytes), dtype=np.uint8)
    monkeypatch.setattr(checkpoint_gguf, "DEQUANTIZE_GROUP_VALUES", 5 * row_values)  # groups of 5 rows, then 2
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and infinite scales: random bytes hold them
        ours = checkpoint_gguf.dequantize_rows(data, qtype)
        reference = dequantize(data, qtype).reshape(-1)
    assert ours.dtype == np.float32 and ours.shape == (rows * row_values,)
    assert np.array_equal(ours, reference, equal_nan=True)
