"""What a strategy reads from the token ids the model is given (`hybrid`'s policies, `sepllm`'s separators): the
tokenizer's classes of tokens, as boolean masks over the vocabulary, and the mixin that keeps the ids a cache is given.
"""

from __future__ import annotations

import string

import torch
from torch import Tensor

from errors import UserError

# SepLLM's separators (arXiv 2412.12094; its cache's list for Llama 3): the marks that end a clause, alone or
# with whitespace around them, and whitespace-only tokens (spaces, newlines).
SEPARATOR_MARKS = frozenset(".,?!;:")


def token_classes(tokenizer, vocab_size: int) -> dict[str, Tensor]:
    """Boolean masks over the vocabulary: special tokens (from the tokenizer), punctuation tokens (tokens whose
    text is only punctuation and whitespace, with at least one punctuation mark; FastGen's) and separators
    (one of SEPARATOR_MARKS with optional whitespace around it, or whitespace only; SepLLM's)."""
    special = torch.zeros(vocab_size, dtype=torch.bool)
    for i in tokenizer.special_token_ids():
        if i < vocab_size:
            special[i] = True
    punct = torch.zeros(vocab_size, dtype=torch.bool)
    separator = torch.zeros(vocab_size, dtype=torch.bool)
    marks = set(string.punctuation)
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        text = tokenizer.decode([i])
        if text.strip() and all(c in marks or c.isspace() for c in text):
            punct[i] = True
        if text and (text.isspace() or text.strip() in SEPARATOR_MARKS):
            separator[i] = True
    return {"special": special, "punct": punct & ~special, "separator": separator & ~special}


# What a strategy reading token_classes lacks without them (hybrid: special and punctuation tokens; sepllm: separators).
TOKEN_CLASSES_NEEDED = "needs the tokenizer's token classes (its special, punctuation and separator tokens)"


class ReadsTokenIds:
    """Mixed in before KVCache by a strategy that reads the token ids the model is given and the tokenizer's
    classes of them (`token_classes`): the last prompt or chunk given at once (`prompt_ids`, eager) and the token
    a decode step, or a chunk appended token by token, inserts next (`current_token` [B, 1], a buffer, so a
    compiled step reads it)."""

    needs_token_ids = True
    needs_token_classes = True
    token_classes: dict[str, Tensor] | None = None  # set through configure(); moved to the cache's device
    prompt_ids: Tensor | None = None

    def __init__(self, batch_size: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, *args, **kwargs)
        self.register_buffer("current_token", torch.zeros(batch_size, 1, dtype=torch.long, device=self.pos.device))

    def observe_tokens(self, token_ids: Tensor, chunk: bool = False) -> None:
        if token_ids.shape[1] > 1 or chunk:
            self.prompt_ids = token_ids
        else:
            self.current_token.copy_(token_ids)

    def before_chunk_token(self, i: int) -> None:
        # A chunk's ids arrive together (observe_tokens saw T tokens): token i is inserted next.
        self.current_token.copy_(self.prompt_ids[:, i : i + 1])

    def token_class(self, name: str, ids: Tensor) -> Tensor:
        """Whether each of `ids` is in the tokenizer's class `name` (token_classes), as bools of ids' shape."""
        if self.token_classes is None:
            raise UserError(f"the {self.name} cache {TOKEN_CLASSES_NEEDED} (cache_spec.build_caches)")
        return self.token_classes[name][ids]
