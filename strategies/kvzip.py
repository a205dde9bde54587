"""`kvzip`: KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv 2505.23416).

A KV pair matters if the model needs it to reproduce the context. KVzip feeds the model the context, a
"repeat the previous context" prompt and the context again, and scores each context KV pair by the
largest attention it receives from the queries of that repetition: the maximum over those queries and
over the query heads of its KV group. The scores do not depend on any later question, so one compressed
cache serves every query on the same context.

The scores need a model-level pass (a layer's reconstruction queries come from the hidden states of the
reconstruction sequence at the layers below), so they cannot come from one layer's prompt rule:
`reconstruction_scores` runs the pass through the model with capture caches that only read each layer's
prefill queries and keys, and `supply_reconstruction_scores` hands each layer's scores to the caches that
use the `kvzip` rule, just before their prefill (the generate.prefill hook). A cache prefilled without them
scores the prompt with its own queries instead (`self_attention_max`: the same maximum over the prompt's
causal queries), so the strategy runs, and is tested, everywhere a prompt rule runs.

- Prompt: the best `budget` tokens by the supplied scores (sinks and the recent window protected).
- Decode: KVzip compresses the context once and keeps what follows. Here a held token's score keeps
  growing by the same definition, the maximum attention it receives, now from each decode query (the
  max over the step's query heads of its group), and the lowest is evicted when the cache is full. A
  budget of the compressed prompt + the new tokens (the kvpress protocol) never evicts at decode, which
  is the paper's setting; a smaller one continues the score rather than switching rules.

Where this differs from the paper:
- The repeat prompt is plain text (`REPEAT_PROMPT`, tokenized without the chat template the paper wraps
  it in); without a tokenizer (set_repeat_prompt was not called) the context is repeated directly.
- Chunked scoring (`--kvzip_chunk` C > 0): the context is reconstructed C tokens at a time, each chunk after
  the whole context + the prompt, a token's score its maximum over the chunks (the paper's chunking, whose
  chunk passes reuse the context's KV; here each pass re-runs the context, so costs n/C context passes).
  C = 0 reconstructs the whole context at once, which needs 2·T + |prompt| ≤ the model's context.
- Full causal attention is scored in every layer, sliding-window layers too (those keep the window
  policy anyway, model_policies.py); pooled caches (--budget_allocation adakv) pick (head, token) pairs
  from the same per-head scores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy
from errors import UserError
from kv_storage import scatter_slots
from prompt_compression import causal_attention_blocks

REPEAT_PROMPT = "\n\nRepeat the previous context exactly.\n\n"

CHUNK = Setting("kvzip_chunk", 0, low=0, prompt_rule=True,
                help="reconstruct the context this many tokens at a time when scoring it (0: all at once)")


# ---- the scoring pass -----------------------------------------------------------------------------------


class CaptureCache(KVCache):
    """Stands in for a layer's cache during a scoring pass: hands the prefill's queries and keys (after RoPE,
    as attention uses them) to `observe(layer, q, k)` and stores nothing. Not a strategy (not registered)."""

    name = "capture"

    def __init__(self, layer: int, observe: Callable[[int, Tensor, Tensor], None], n_kv_heads: int,
                 head_dim: int, device: torch.device) -> None:
        super().__init__(1, n_kv_heads, head_dim, 1, torch.float32, device)
        self.layer, self.observe = layer, observe

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        self.observe(self.layer, q, k)


@contextmanager
def capture_queries(model, observe: Callable[[int, Tensor, Tensor], None]) -> Iterator[None]:
    """Inside: every layer of `model` prefills into a CaptureCache calling `observe`; the model's own caches
    (in whatever row context they are) are put back on exit, untouched."""
    saved = [layer.attention.kv_cache for layer in model.layers]
    device = model.tok_embeddings.weight.device
    try:
        for i, layer in enumerate(model.layers):
            layer.attention.kv_cache = CaptureCache(i, observe, model.args.n_kv_head, model.args.head_dim, device)
        yield
    finally:
        for layer, cache in zip(model.layers, saved, strict=True):
            layer.attention.kv_cache = cache


def max_attention_received(q: Tensor, k: Tensor, first_row: int, n_keys: int,
                           max_elements: int | None = None) -> Tensor:
    """The largest causal attention each of the first `n_keys` keys receives from the queries at rows
    first_row.. (softmax over all keys up to the query), maximised over those queries and over the query
    heads of each KV group: [B, n_kv, n_keys] float32. q [B, n_head, S, D], k [B, n_kv, S, D]. In blocks of
    rows (prompt_compression.causal_attention_blocks, at most about `max_elements` probabilities each; None:
    the device's block size)."""
    best = torch.zeros(q.shape[0], k.shape[1], n_keys, dtype=torch.float32, device=q.device)
    for _, probs in causal_attention_blocks(q, k, first_row, max_elements):
        # [B, n_kv, min(end, n_keys)]: keys past the block's last row get nothing from it (causal), and the
        # prompt's own queries (first_row 0) reach them only in a later block.
        top = probs[..., :n_keys].amax(dim=(2, 3))
        seen = top.shape[-1]
        best[..., :seen] = torch.maximum(best[..., :seen], top)
    return best


def self_attention_max(q: Tensor, k: Tensor) -> Tensor:
    """The fallback without a reconstruction pass: KVzip's maximum over the prompt's own causal queries."""
    return max_attention_received(q, k, 0, k.shape[2])


def reconstruction_scores(model, context: Tensor, repeat_ids: list[int] | tuple[int, ...] = (),
                          chunk: int = 0) -> list[Tensor]:
    """KVzip's scores of every context token at every layer, [B, n_kv, T] each: the model reads
    context + repeat_ids + context[s:e] for each chunk [s, e) of `chunk` tokens (0: one chunk of all T), and
    a context key's score is the largest attention any query of the repeated chunk (and any query head of
    its KV group) gives it, maximised over the chunks."""
    B, T = context.shape
    step = chunk or T
    longest = T + len(repeat_ids) + min(step, T)
    if longest > model.args.context_length:
        raise UserError(f"KVzip's reconstruction of a {T}-token context needs {longest} positions, more than the "
                        f"model's {model.args.context_length}: set --kvzip_chunk")
    repeat = torch.tensor(list(repeat_ids), dtype=context.dtype, device=context.device).view(1, -1).expand(B, -1)
    scores: list[Tensor | None] = [None] * len(model.layers)
    piece_length = [0]

    def observe(layer: int, q: Tensor, k: Tensor) -> None:
        best = max_attention_received(q, k, q.shape[2] - piece_length[0], T)
        scores[layer] = best if scores[layer] is None else torch.maximum(scores[layer], best)

    with torch.no_grad(), capture_queries(model, observe):
        for start in range(0, T, step):
            piece = context[:, start : start + step]
            piece_length[0] = piece.shape[1]
            sequence = torch.cat([context, repeat, piece], dim=1)
            model(sequence, torch.arange(sequence.shape[1], device=context.device), last_logits_only=True)
    return scores


def rule_users(caches: list[KVCache | None]) -> list[tuple[int, KVCache]]:
    """(layer, cache) of every cache that scores its prompt by the kvzip rule, a debug cache's shadow
    included; `caches` one per layer."""
    users = []
    for i, top in enumerate(caches):
        for m in top.modules() if top is not None else ():
            if isinstance(m, KVCache) and (isinstance(m, KvzipCache) or m.prompt_compressor is KvzipCache):
                users.append((i, m))
    return users


def set_repeat_prompt(caches: list[KVCache], tokenizer) -> None:
    """Give the kvzip caches (one per layer) the token ids of REPEAT_PROMPT, for the reconstruction pass."""
    users = rule_users(caches)
    ids = tuple(tokenizer.encode(REPEAT_PROMPT)) if users else ()  # no encoding when no cache uses the rule
    for _, cache in users:
        cache.kvzip_repeat_ids = ids


def supply_reconstruction_scores(model, prompt: Tensor) -> None:
    """Before prefilling `prompt` [B, T]: run KVzip's reconstruction pass and leave each layer's scores on the
    caches that use the kvzip rule, where they stay until the next prompt (or a kvzip cache's reset). No pass
    when no cache uses the rule or the prompt fits every such cache (nothing would be compressed)."""
    users = rule_users([layer.attention.kv_cache for layer in model.layers])
    if not users or all(prompt.shape[1] <= c.prompt_target() for _, c in users):
        for _, cache in users:  # no pass for this prompt: no scores of an earlier one either
            cache.__dict__.pop("reconstruction_scores", None)
        return
    first = users[0][1]
    scores = reconstruction_scores(model, prompt, getattr(first, "kvzip_repeat_ids", ()), int(first.setting(CHUNK)))
    for layer, cache in users:
        cache.reconstruction_scores = scores[layer]


def reconstruction_scores_by_row(model, prompts: list[Tensor], cache_rows: list[int]) -> list[list[tuple]]:
    """supply_reconstruction_scores for each prompt [T_i] in its cache row's context, taken back off the caches:
    per row, (cache, its scores or None) for every cache using the rule. A packed prefill (packed_prefill.py)
    puts each row's back in that row's turn, since a cache holds one prompt's scores at a time."""
    users = rule_users([layer.attention.kv_cache for layer in model.layers])
    by_row = []
    for b, prompt in zip(cache_rows, prompts, strict=True):
        with model.cache_row(b):
            supply_reconstruction_scores(model, prompt[None])
        by_row.append([(cache, cache.__dict__.pop("reconstruction_scores", None)) for _, cache in users])
    return by_row


# ---- the strategy -----------------------------------------------------------------------------------------


@register_strategy
class KvzipCache(KVCache):
    name = "kvzip"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (CHUNK,)
    head_specific = True
    needs_attention = True
    # The largest attention each slot has received: from the reconstruction (or the prompt's own queries)
    # at prefill, then from every decode query.
    slot_buffers = ("max_attention",)
    # --prefill_chunk (where the contract has it): the scores come from one reconstruction pass over the
    # whole context, which a chunk-by-chunk prefill, re-scoring virtual prompts of held tokens, never has.
    chunked_prefill_refusal = ("its scores come from a reconstruction pass over the whole context, which a "
                               "chunk-by-chunk prefill (virtual prompts of the held tokens) does not have")

    @staticmethod
    def scores_for(cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        """The supplied reconstruction scores when they are this prompt's, else the prompt's own."""
        supplied = cache.__dict__.get("reconstruction_scores")
        if supplied is not None and tuple(supplied.shape) == (k.shape[0], k.shape[1], k.shape[2]):
            return supplied.to(k.device)
        return self_attention_max(q, k)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        scores = cls.scores_for(cache, k, q)
        if isinstance(cache, KvzipCache):  # its after_prefill seeds the slots with the same scores
            cache.__dict__["prompt_token_scores"] = scores
        return scores

    def reset(self) -> None:
        super().reset()
        self.__dict__.pop("reconstruction_scores", None)  # the next prompt gets its own pass

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.max_attention

    def update_state(self, probs: Tensor) -> None:
        torch.maximum(self.max_attention, probs.amax(dim=2), out=self.max_attention)

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        scores = self.__dict__.pop("prompt_token_scores", None)
        if scores is None:  # the prompt fitted, or another rule chose it: score it here
            scores = self.scores_for(self, k, q)
        n = keep.shape[-1]
        self.max_attention[:, :, :n] = scores.expand(-1, keep.shape[1], -1).gather(2, keep)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.max_attention, 2, slot[..., None], 0.0)  # this step's own query scores it next
