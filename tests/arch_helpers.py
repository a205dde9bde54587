"""Tiny random checkpoints of each supported architecture, written by transformers itself.

Each model comes from transformers' own config class and `save_pretrained` (safetensors), with weights
redrawn large enough that attention is sharp and the logits spread (the default init of std 0.02 would
make every architecture's logits nearly uniform and hide layout bugs). A word-level tokenizer over the
same vocabulary is saved next to it, so `load_checkpoint` reads the directory as it would a real one.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 160
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
WINDOW = 12  # sliding layers: shorter than the test sequences, so the window binds in prefill and decode


def arch_configs() -> dict[str, object]:
    import transformers as T

    # Llama 3.1's scaling; an original context of 64 puts the head's 8 frequencies in all three of its bands
    # (wavelengths 6.3 kept, 32.5 on the ramp, the rest divided by the factor).
    llama3_rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64, rope_theta=500000.0)
    return {
        "llama": T.LlamaConfig(**SMALL, rope_parameters=llama3_rope),
        "llama_tied_linear": T.LlamaConfig(**SMALL, tie_word_embeddings=True,
                                           rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=10000.0)),
        "mistral": T.MistralConfig(**SMALL, sliding_window=WINDOW, head_dim=16),
        "qwen2": T.Qwen2Config(**SMALL, tie_word_embeddings=True),
        "qwen3": T.Qwen3Config(**SMALL, head_dim=32),
        # Sliding window on the layers from max_window_layers on (layers 2 and 3 here).
        "qwen2_window": T.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
        "gemma3": T.Gemma3TextConfig(
            **SMALL, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            final_logit_softcapping=30.0),
        "llama_plain": T.LlamaConfig(**SMALL),
        # transformers' GGUF loader leaves Qwen3's head_dim at the class default, 128.
        "qwen3_gguf": T.Qwen3Config(**SMALL, head_dim=128),
        "phi3_full": T.Phi3Config(**SMALL, pad_token_id=0, eos_token_id=2, bos_token_id=1),
        "phi3": T.Phi3Config(**SMALL, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75)),
    }


def write_tokenizer(directory: Path, chat_template: str | None = None, **special: str) -> None:
    """A word-level tokenizer: <unk>, <s>, </s>, then 'w3' … 'w{VOCAB-1}' (ids = the numbers), saved by
    transformers. Special tokens do not look like words, or they would match inside them ('w1' in 'w10')."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(directory))


def save_tiny_model(arch: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """Write a random model of `arch` to `directory`; return the transformers model (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    config = arch_configs()[arch]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            else:  # norms (Gemma's are stored as weight − 1) and biases: away from their neutral value
                p.normal_(0.0 if "norm" not in name or arch == "gemma3" else 1.0, 0.2)
    model.save_pretrained(str(directory))
    write_tokenizer(directory, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return model.eval()


def add_gguf_shape(writer, config, head_dim: int) -> None:
    """The hyper-parameter keys every GGUF architecture needs, from a transformers config."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
