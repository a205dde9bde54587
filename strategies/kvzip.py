"""`kvzip`: KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv 2505.23416).

A KV pair matters if the model needs it to reproduce the context. KVzip feeds the model the context, a
"repeat the previous context" prompt and the context again, and scores each context KV pair by the
largest attention it receives from the queries of that repetition: the maximum over those queries and
over the query heads of its KV group. The scores do not depend on any later question, so one compressed
cache serves every query on the same context.

The scores need a model-level pass (a layer's reconstruction queries come from the hidden states of the
reconstruction sequence at the layers below), so they cannot come from one layer's prompt rule:
`reconstruct_and_prefill` (the generate.prefill hook) runs the pass through the model with stand-in caches
that read each layer's queries and keys, and the pass also prefills: the context opens the sequence and
attention is causal, so its first T tokens' K/V are a prefill of the context, and each layer's cache takes
them with the layer's scores (which that layer has by then), as the paper reuses the context's KV instead of
running it again. A cache prefilled without the pass (a forward called directly, the transformers adapter)
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
  chunk passes reuse the context's KV; here each pass re-runs the context, so costs n/C context passes, the
  last of which also prefills).
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
def capture_queries(model, observe: Callable[[int, Tensor, Tensor], None],
                    prefill: tuple[int, list[tuple[int, KVCache]], list] | None = None) -> Iterator[None]:
    """Inside: every layer of `model` prefills into a CaptureCache calling `observe`; the model's own caches
    (in whatever row context they are) are put back on exit, untouched. With `prefill` = (T, users, scores),
    ScoringPrefillCache instead: each layer's own cache is prefilled with the first T tokens, its users given
    scores[layer] first."""
    saved = [layer.attention.kv_cache for layer in model.layers]
    device, args = model.tok_embeddings.weight.device, model.args
    try:
        for i, (layer, cache) in enumerate(zip(model.layers, saved, strict=True)):
            if prefill is None or cache is None:
                stand_in = CaptureCache(i, observe, args.n_kv_head, args.head_dim, device)
            else:
                context, users, scores = prefill
                layer_users = [user for j, user in users if j == i]
                stand_in = ScoringPrefillCache(i, observe, cache, context, layer_users, scores, args.n_kv_head,
                                               args.head_dim, device)
            layer.attention.kv_cache = stand_in
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


class ScoringPrefillCache(CaptureCache):
    """Stands in for a layer's cache during the last reconstruction pass (`reconstruct_and_prefill`): hands the
    queries and keys to `observe` like CaptureCache, gives the layer's finished scores to the caches of `users`
    (this layer's caches that use the kvzip rule), then prefills the layer's own `cache` with the first
    `context` tokens of the pass. The context comes first in the pass and attention is causal, so those are the
    K/V, queries, gates and token ids a prefill of the context alone gives it. Not a strategy (not
    registered)."""

    name = "capture_and_prefill"

    def __init__(self, layer: int, observe: Callable[[int, Tensor, Tensor], None], cache: KVCache, context: int,
                 users: list[KVCache], scores: list[Tensor | None], n_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:
        super().__init__(layer, observe, n_kv_heads, head_dim, device)
        self.cache, self.context, self.users, self.scores = cache, context, users, scores
        # What the model's forward reads off a cache before its prefill: the layer's own cache's answers.
        self.rerotate_positions = cache.rerotate_positions
        self.needs_gates, self.needs_token_ids = cache.needs_gates, cache.needs_token_ids

    def observe_tokens(self, token_ids: Tensor) -> None:
        self.cache.observe_tokens(token_ids[:, : self.context])

    def observe_gates(self, log_gates: Tensor) -> None:
        self.cache.observe_gates(log_gates[..., : self.context])

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        self.observe(self.layer, q, k)
        for user in self.users:
            user.reconstruction_scores = self.scores[self.layer]
        n = self.context
        stored = {} if k_store is None else {"k_store": k_store[:, :, :n]}
        self.cache.prefill(input_pos[:n], k[:, :, :n], v[:, :, :n], q[:, :, :n], **stored)


def reconstruction_scores(model, context: Tensor, repeat_ids: list[int] | tuple[int, ...] = (),
                          chunk: int = 0) -> list[Tensor]:
    """KVzip's scores of every context token at every layer, [B, n_kv, T] each: the model reads
    context + repeat_ids + context[s:e] for each chunk [s, e) of `chunk` tokens (0: one chunk of all T), and
    a context key's score is the largest attention any query of the repeated chunk (and any query head of
    its KV group) gives it, maximised over the chunks. The model's caches are left as they were."""
    return reconstruction_passes(model, context, repeat_ids, chunk)[0]


def reconstruction_passes(model, context: Tensor, repeat_ids: list[int] | tuple[int, ...] = (), chunk: int = 0,
                          users: list[tuple[int, KVCache]] | None = None) -> tuple[list[Tensor], Tensor | None]:
    """The passes of `reconstruction_scores`: (the scores, None). With `users` ((layer, cache) pairs of the
    caches using the rule), the last pass also prefills the model's caches with the context, each user with its
    layer's scores (ScoringPrefillCache): the context is not run through the model once more, so KVzip's
    prefill costs the reconstruction alone (2·T + |prompt| tokens unchunked), as the paper's. Then (the scores,
    the logits of the context's last token [B, vocab])."""
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

    starts = range(0, T, step)
    logits = None
    with torch.no_grad():
        for start in starts:
            piece = context[:, start : start + step]
            piece_length[0] = piece.shape[1]
            sequence = torch.cat([context, repeat, piece], dim=1)
            positions = torch.arange(sequence.shape[1], device=context.device)
            if users is None or start != starts[-1]:
                with capture_queries(model, observe):
                    model(sequence, positions, last_logits_only=True)
                continue
            with capture_queries(model, observe, prefill=(T, users, scores)):
                logits = model(sequence, positions, logits_at=T - 1)[:, -1]
    return scores, logits
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


def users_to_score(model, prompt: Tensor) -> list[tuple[int, KVCache]]:
    """(layer, cache) of the caches using the kvzip rule that need a reconstruction pass before `prompt` [B, T]
    is prefilled: none when no cache uses the rule or the prompt fits every such cache (nothing would be
    compressed); the users' scores of an earlier prompt are dropped then."""
    users = rule_users([layer.attention.kv_cache for layer in model.layers])
    if all(prompt.shape[1] <= c.prompt_target() for _, c in users):
        for _, cache in users:
            cache.__dict__.pop("reconstruction_scores", None)
        return []
    return users


def pass_settings(users: list[tuple[int, KVCache]]) -> tuple[tuple[int, ...], int]:
    """(the repeat prompt's ids, --kvzip_chunk) of the pass: one pass serves every layer, so the first user's."""
    first = users[0][1]
    return getattr(first, "kvzip_repeat_ids", ()), int(first.setting(CHUNK))


def reconstruct_and_prefill(model, prompt: Tensor) -> Tensor | None:
    """KVzip's prefill of `prompt` [B, T] (the generate.prefill hook): the reconstruction passes, the last of
    which prefills the model's caches, each user of the rule with its layer's scores (which stay on it until
    the next prompt or a kvzip cache's reset). The logits of the prompt's last token [B, vocab]; None, with
    nothing run, when no cache needs the pass (users_to_score): the caller prefills as usual."""
    users = users_to_score(model, prompt)
    if not users:
        return None
    return reconstruction_passes(model, prompt, *pass_settings(users), users)[1]


def supply_reconstruction_scores(model, prompt: Tensor) -> None:
    """The scores of reconstruct_and_prefill without its prefill: left on the users for a forward over `prompt`
    [B, T] that follows (a separate pass, as a reference for the fused one)."""
    users = users_to_score(model, prompt)
    if users:
        scores = reconstruction_scores(model, prompt, *pass_settings(users))
        for layer, cache in users:
            cache.reconstruction_scores = scores[layer]


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
