"""The GGUF-built tokenizer: round trips, and agreement with transformers' tokenizer for the same GGUF."""

from __future__ import annotations

import pytest

from checkpoint import bundled_checkpoint_path

TEXTS = [
    "Hello, world!",
    "In 2024, 12345 apples cost $3.50 — or 3,50 €.",
    "Ünïcödé, 日本語のテキスト, emoji 🤖🚀 and Ελληνικά.",
    "def f(x):\n\treturn x ** 2  # trailing spaces   \n\n\n",
    "  leading spaces and <|im_start|>special<|im_end|> tokens",
    "URLs like https://example.com/a?b=c&d=e and e-mail a.b@c.org",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(bundled, text):
    _, tokenizer = bundled
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_agrees_with_transformers_tokenizer(bundled):
    import transformers  # a test dependency (requirements-dev.txt), never used by the tool

    path = bundled_checkpoint_path()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _, tokenizer = bundled
    import pydoc_data.topics

    for text in [*TEXTS, pydoc_data.topics.topics["for"][:3000]]:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text


def test_digits_are_split_one_by_one(bundled):
    _, tokenizer = bundled
    ids = tokenizer.encode("12345")
    assert [tokenizer.decode([i]) for i in ids] == list("12345")


def test_chat_template_renders_chatml(bundled):
    _, tokenizer = bundled
    text = tokenizer.apply_chat_template("Hi there")
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(text)
    assert tokenizer.id_to_token(ids[0]) == "<|im_start|>"  # one special token, not split into pieces
    assert tokenizer.eos_ids == [2]
