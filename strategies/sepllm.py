"""`sepllm`: SepLLM's cache without training (Chen et al., ICML 2025, "SepLLM: Accelerate Large Language Models by
Compressing One Segment into One Separator", arXiv 2412.12094; the authors' SepCache).

SepLLM observes that the attention to the tokens of a segment concentrates on the separator that ends it (".",
",", "\\n", ...), so the separators can stand for the segments: its cache holds the initial tokens (sinks), the
separators and a window of recent tokens. Here: the first `--global_tokens` and the `--recent_window` newest are
protected as in every cache, and among the rest a separator outranks any other token and a newer token an older
one. So the cache drops the oldest non-separator first and, only once everything unprotected is a separator,
the oldest separator (SepCache's `USE_MAX_SEP_CACHE`: at most the budget's room of separators, the newest kept).
A prompt longer than the budget is compressed by the same rule.

Where this differs from SepCache: SepCache drops a window's non-separators as soon as the window moves on and
holds the separators in a region of their own (`sep_cache_size`); this cache fills its whole budget and drops
non-separators only when it must, so it holds at least what SepCache holds at the same total size. The
separators are the tokens whose text is one of . , ? ! ; : with whitespace around it, or whitespace only
(strategies.token_ids.token_classes): SepCache's list of Llama 3 ids (the marks alone or after a space, a
newline, runs of spaces) written as a rule for any tokenizer, and wider: it also takes a mark with whitespace
after it and every whitespace-only token (".\n", "\n\n" where a vocabulary has them); the tokenizer's special
tokens are not separators (the first token is a sink anyway). The paper trains models to compress segments into their
separators; this is its training-free setting, on models never trained for it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, register_strategy
from errors import UserError
from kv_storage import scatter_slots
from strategies.token_ids import ReadsTokenIds


@register_strategy
class SepLLMCache(ReadsTokenIds, KVCache):
    name = "sepllm"
    hyperparameters = ("global_tokens", "recent_window")
    # A chunked prefill's held tokens' separator flags, carried into its next re-prefill (carry_over); eager.
    carried_separators: Tensor | None = None

    def __init__(self, batch_size: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, *args, **kwargs)
        L = self.pos.shape[-1]
        self.register_buffer("separator", torch.zeros(batch_size, 1, L, device=self.pos.device))  # 1.0: held separator

    def is_separator(self, ids: Tensor) -> Tensor:
        return self.token_class("separator", ids).float()

    @staticmethod
    def ranked(separator: Tensor, positions: Tensor, span: int) -> Tensor:
        """Separators above every other token (`span` exceeds every position), the newest first within each."""
        return separator * float(span) + positions.float()

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.ranked(self.separator, self.pos, self.capacity_needed)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        return cls.ranked(cls.prompt_separators(cache, k), cache.scored_positions(k), cache.scored_length(k))

    @classmethod
    def prompt_separators(cls, cache: KVCache, k: Tensor) -> Tensor:
        """[B, 1, T]: which of the prompt tokens `cache` is scoring are separators; in a chunked prefill's
        re-prefill, the held tokens' flags carried over, then the chunk's from its ids."""
        if not isinstance(cache, cls):
            raise UserError(f"prompt compression '{cls.name}' reads the prompt's token ids, which only a {cls.name} "
                            f"cache receives (got a {cache.name} cache)")
        held = cache.scored_held_tokens(k)
        ids = cache.prompt_ids
        if ids is None or ids.shape[1] != k.shape[2] - held:
            raise ValueError(f"a {cls.name} cache was asked to score a prompt whose token ids it was not given")
        flags = cache.is_separator(ids)[:, None, :]
        if held:
            flags = torch.cat([cache.carried_separators[:, :, :held], flags], dim=2)
        return flags

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        n = keep.shape[-1]
        self.separator[:, :, :n] = self.prompt_separators(self, k).gather(2, keep)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.separator, 2, slot[..., None], self.is_separator(self.current_token)[..., None])

    def carry_over(self, n: int) -> object:
        return self.separator[:, :, :n].clone()

    def take_over(self, carried: object) -> None:
        self.carried_separators = carried
