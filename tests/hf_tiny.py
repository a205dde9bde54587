"""Tiny random Hugging Face checkpoints written with transformers' own config and model classes
(`save_pretrained`, safetensors), plus a byte-level tokenizer.json, for parity tests against
transformers on the same directory. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


def save_tiny_model(directory: Path, model_type: str = "llama", seed: int = 0, **overrides: object) -> Path:
    """A random `model_type` model (transformers' classes) saved in `directory` with a tokenizer."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY_CONFIG, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.2)  # sharp attention, so cache and parity differences show in logits
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory
