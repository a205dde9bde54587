"""Helpers for the evaluation tests: the tiny random-weight model saved as a Hugging Face directory with a
byte-level tokenizer (one token per byte, no merges), so `python -m eval` and its sweeps can run in a
subprocess on it through the real loader, in seconds."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from eval.results import is_finished
from tests.conftest import ROOT, TINY_ARGS, make_tiny_model

PYDOC_EXCERPT = ROOT / "tests" / "data" / "pydoc_excerpt.txt"  # pinned: pydoc text differs between Pythons

_HF_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return backend


SLIDING_WINDOW = 64  # write_tiny_sliding_checkpoint's window: shorter than the eval tests' contexts


def write_tiny_sliding_checkpoint(directory: Path) -> Path:
    """A tiny random Gemma 3 (layers 0, 1 and 3 slide over SLIDING_WINDOW tokens, layer 2 attends to everything),
    written by transformers, with the byte-level tokenizer: a model whose sliding layers get window caches."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)  # sharp attention, as tests/arch_helpers.py's models
    model.save_pretrained(str(directory))
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def write_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """make_tiny_model(seed) as config.json + model.safetensors + tokenizer.json (vocab: the 256 bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    a = TINY_ARGS
    config = {"model_type": "llama", "num_hidden_layers": a["n_layer"], "num_attention_heads": a["n_head"],
              "num_key_value_heads": a["n_kv_head"], "hidden_size": a["dim"],
              "intermediate_size": a["intermediate_size"], "vocab_size": a["vocab_size"],
              "rope_theta": a["rope_base"], "max_position_embeddings": a["context_length"],
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    state = {}
    for name, tensor in make_tiny_model(seed).state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            module = ".".join(parts[2:-1])
            state[f"model.layers.{parts[1]}.{_HF_NAMES[module]}.{parts[-1]}"] = tensor.contiguous()
        else:
            top = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}[parts[0]]
            state[f"{top}.{parts[-1]}"] = tensor.contiguous()
    save_file(state, str(directory / "model.safetensors"))
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def tiny_runtime(checkpoint: Path, *flags: str):  # returns an eval.harness.Runtime
    """A Runtime on the tiny checkpoint with `python -m eval` flags (parsed by the real CLI parser)."""
    from eval import cli
    from eval.harness import Runtime

    args = cli.parse_args(["--checkpoint_path", str(checkpoint), *flags])
    model, tokenizer = cli.load_model(args.checkpoint_path, args.device, torch.float32)
    return Runtime(model, tokenizer, args, progress=True)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Tiny-model ops are latency-bound: with two OpenMP threads on a 2-core machine that other processes
    share, every op waits at a barrier (measured: a tiny fidelity run took 11.6 s, 0.16 s on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    with single_thread():
        yield


def finished(out_dir: Path) -> int:
    """Finished runs as the sweep counts them: pathlib's glob also matches a run still being written in its
    hidden temporary directory (metrics.json is written there last, then the directory is swapped in), which a
    SIGKILL at that moment leaves unfinished."""
    return sum(1 for m in out_dir.glob("*/*/*/metrics.json")
               if not m.parent.name.startswith(".") and is_finished(m.parent))


def read_results(path: Path) -> pd.DataFrame:
    """A results.csv with its hash columns read as text: pandas would read a run_id of digits as an integer
    (losing leading zeros), and an identity like 95e8404937768391 as a float (inf)."""
    return pd.read_csv(path, dtype={"run_id": str, "identity": str})
