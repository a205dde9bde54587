"""`kvzip`: KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", arXiv 2505.23416).

A KV pair matters if the model needs it to reproduce the context. KVzip feeds the model the context, a
"repeat the previous context" prompt and the context again, and scores each context KV pair by the
largest attention it receives from the queries of that repetition (the prompt's and the repeated context's,
as the paper's and kvpress's code: every row of the repeat input): the maximum over those queries and over
the query heads of its KV group. The scores do not depend on any later question, so one compressed cache
serves every query on the same context.

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
- Chunked scoring (`--kvzip_chunk` C > 0), the paper's chunking of long contexts as its code does it: the
  context is reconstructed C tokens at a time; the pass of chunk [s, e) reads the context, a prompt (the
  first chunk's `REPEAT_PROMPT`; a later one's `REPEAT_PART_PROMPT` followed by the previous chunk's last
  `PREVIOUS_TAIL` tokens), `REPEAT_SUFFIX` and the chunk, and scores the chunk's tokens only, each query's
  softmax taken over the first `SCORING_SINKS` tokens, the chunk and the repeat input (the rest of the
  context is left out of the scores, not of the pass). C = 0 reconstructs the whole context at once, which
  needs 2·T + |prompt| ≤ the model's context.
- Chunked prefill (--prefill_chunk N, `ChunkedReconstruction`): each prefill chunk is reconstructed over what
  the layers hold, its repeat input riding on the chunk's forward (in parts of --kvzip_chunk); the chunk's
  tokens are scored as a chunk above (the sinks those of the first SCORING_SINKS positions still held), the
  held tokens keep their own chunk's scores, and each layer keeps the budget's best of held + chunk. A pass
  holds 2·N + |prompt| tokens, whatever the prompt's length. With a pool (--budget_allocation adakv) each head
  holds its own tokens, so its chunk is scored over its own held sinks and its virtual prompt is its own held
  tokens + the chunk; the pool goes to the best (head, token) pairs of those.

Where this differs from the paper:
- The repeat prompt is plain text (tokenized without the chat template the paper wraps it in); without a
  tokenizer (set_repeat_prompt was not called) the context is repeated directly, every chunk right after it.
- The chunks' passes each re-run the context (the paper's reuse its KV): T/C context passes, the last of
  which also prefills.
- Under --prefill_chunk a chunk's passes read the held tokens, not the whole context (the paper prefills the
  whole context before reconstructing it): later chunks and evicted tokens are not in them.
- Each layer keeps its own budget (the paper and kvpress rank every layer's and head's scores together by
  default, so layers get different budgets; here caches are sized per layer before the prompt).
- Full causal attention is scored in every layer, sliding-window layers too (those keep the window
  policy anyway, model_policies.py); pooled caches (--budget_allocation adakv) pick (head, token) pairs
  from the same per-head scores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy
from cache_chunking import Rerotation
from errors import UserError
from kv_storage import scatter_slots
from prompt_compression import causal_attention_blocks

# The reconstruction's prompts, as the paper's code words them; the suffix stands where its chat template ends the
# user's turn. A later chunk's prompt ends with the previous chunk's last PREVIOUS_TAIL tokens: where to start.
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
REPEAT_PART_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
REPEAT_SUFFIX = "\n\n"
PREVIOUS_TAIL = 8
# The context's first tokens every chunk's scores are normalised over besides the chunk (kvpress's n_sink).
SCORING_SINKS = 4

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
                           max_elements: int | None = None, key_valid: Tensor | None = None) -> Tensor:
    """The largest causal attention each of the first `n_keys` keys receives from the queries at rows
    first_row.. (softmax over all keys up to the query), maximised over those queries and over the query
    heads of each KV group: [B, n_kv, n_keys] float32. q [B, n_head, S, D], k [B, n_kv, S, D]. In blocks of
    rows (prompt_compression.causal_attention_blocks, at most about `max_elements` probabilities each; None:
    the device's block size); `key_valid` [B, n_kv, S] False where a key is left out of the softmax."""
    best = torch.zeros(q.shape[0], k.shape[1], n_keys, dtype=torch.float32, device=q.device)
    for _, probs in causal_attention_blocks(q, k, first_row, max_elements, key_valid):
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

    def observe_tokens(self, token_ids: Tensor, chunk: bool = False) -> None:
        self.cache.observe_tokens(token_ids[:, : self.context], chunk)

    def observe_gates(self, log_gates: Tensor, chunk: bool = False) -> None:
        self.cache.observe_gates(log_gates[..., : self.context], chunk)

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        self.observe(self.layer, q, k)
        for user in self.users:
            user.reconstruction_scores = self.scores[self.layer]
        n = self.context
        stored = {} if k_store is None else {"k_store": k_store[:, :, :n]}
        self.cache.prefill(input_pos[:n], k[:, :, :n], v[:, :, :n], q[:, :, :n], **stored)


@dataclass(frozen=True)
class RepeatPrompts:
    """The token ids of the reconstruction's prompts (REPEAT_PROMPT, REPEAT_PART_PROMPT, REPEAT_SUFFIX; empty
    without a tokenizer: the context repeated directly)."""

    first: tuple[int, ...] = ()
    later: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def before_chunk(self, context: Tensor, start: int, step: int) -> Tensor:
        """[B, n]: what the pass reads between the context [B, T] and its chunk [start, start + step)."""
        B = context.shape[0]
        ids = partial(torch.tensor, dtype=context.dtype, device=context.device)
        if start == 0 or not self.later:  # without a prompt saying where to start, no tail either
            head = ids(list(self.first if start == 0 else ())).view(1, -1).expand(B, -1)
        else:
            tail = context[:, start - min(step, PREVIOUS_TAIL) : start]  # the previous chunk's last tokens
            head = torch.cat([ids(list(self.later)).view(1, -1).expand(B, -1), tail], dim=1)
        return torch.cat([head, ids(list(self.suffix)).view(1, -1).expand(B, -1)], dim=1)


def chunk_scores(q: Tensor, k: Tensor, chunk: int, part: tuple[int, int], start: int = 0,
                 sinks: Tensor | None = None, sink_valid: Tensor | None = None) -> Tensor:
    """[B, n_kv, b − a]: KVzip's scores of the rows part = (a, b) of `chunk` context rows at positions start..,
    from one pass over them (the first `chunk` rows of q [B, n_head, S, D], k [B, n_kv, S, D]) and the part's
    repeat input (the rows after): the largest attention each receives from a repeat-input query (and any query
    head of its KV group), each query's softmax over the tokens at positions below SCORING_SINKS (the context's
    own rows before the part, and under a chunked prefill the held `sinks` [B, n_kv, s, D], left out where not
    `sink_valid` [B, n_kv, s]), the part and the repeat input up to itself (kvpress's subsampled keys; the
    whole sequence when the part is the whole context)."""
    a, b = part
    lead = min(a, max(0, SCORING_SINKS - start))  # the context's own rows at positions < SCORING_SINKS
    if sinks is None and lead == a and b == chunk:  # nothing left out: the sequence as it is
        return max_attention_received(q, k, chunk, chunk)[..., a:]
    rows = torch.cat([torch.arange(lead), torch.arange(a, b), torch.arange(chunk, k.shape[2])]).to(k.device)
    q, k = q[:, :, rows], k[:, :, rows]
    valid = None
    if sinks is not None:
        B, H, _, D = q.shape
        s = sinks.shape[2]
        k = torch.cat([sinks.to(k.dtype), k], dim=2)
        q = torch.cat([q.new_zeros(B, H, s, D), q], dim=2)  # the sinks' own rows are never read
        valid = torch.cat([sink_valid, sink_valid.new_ones(B, k.shape[1], k.shape[2] - s)], dim=2)
        lead += s
    first = lead + b - a  # the repeat input's first row
    return max_attention_received(q, k, first, first, key_valid=valid)[..., lead:]


def reconstruction_scores(model, context: Tensor, prompts: RepeatPrompts = RepeatPrompts(),
                          chunk: int = 0) -> list[Tensor]:
    """KVzip's scores of every context token at every layer, [B, n_kv, T] each: for each chunk [s, e) of
    `chunk` tokens (0: one chunk of all T) the model reads context + the chunk's prompt + context[s:e], and
    the chunk's tokens are scored by `chunk_scores`. The model's caches are left as they were."""
    return reconstruction_passes(model, context, prompts, chunk)[0]


def reconstruction_passes(model, context: Tensor, prompts: RepeatPrompts = RepeatPrompts(), chunk: int = 0,
                          users: list[tuple[int, KVCache]] | None = None) -> tuple[list[Tensor], Tensor | None]:
    """The passes of `reconstruction_scores`: (the scores, None). With `users` ((layer, cache) pairs of the
    caches using the rule), the last pass also prefills the model's caches with the context, each user with its
    layer's scores (ScoringPrefillCache): the context is not run through the model once more, so KVzip's
    prefill costs the reconstruction alone (2·T + |prompt| tokens unchunked), as the paper's. Then (the scores,
    the logits of the context's last token [B, vocab])."""
    B, T = context.shape
    step = chunk or T
    starts = range(0, T, step)
    inputs = [torch.cat([prompts.before_chunk(context, s, step), context[:, s : s + step]], dim=1) for s in starts]
    longest = T + max(x.shape[1] for x in inputs)
    if longest > model.args.context_length:
        raise UserError(f"KVzip's reconstruction of a {T}-token context needs {longest} positions, more than the "
                        f"model's {model.args.context_length}: set --kvzip_chunk")
    scores: list[Tensor | None] = [None] * len(model.layers)
    span = [0, T]

    def observe(layer: int, q: Tensor, k: Tensor) -> None:
        if scores[layer] is None:
            scores[layer] = torch.zeros(B, k.shape[1], T, dtype=torch.float32, device=k.device)
        scores[layer][..., span[0] : span[1]] = chunk_scores(q, k, T, tuple(span))

    logits = None
    with torch.no_grad():
        for start, repeat_input in zip(starts, inputs, strict=True):
            span[:] = [start, min(start + step, T)]
            sequence = torch.cat([context, repeat_input], dim=1)
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
    """Give the kvzip caches (one per layer) the token ids of the reconstruction's prompts (`RepeatPrompts`)."""
    users = rule_users(caches)
    if not users:  # no encoding when no cache uses the rule
        return
    prompts = RepeatPrompts(*(tuple(tokenizer.encode(text)) for text in (REPEAT_PROMPT, REPEAT_PART_PROMPT,
                                                                          REPEAT_SUFFIX)))
    for _, cache in users:
        cache.kvzip_prompts = prompts


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


def pass_settings(users: list[tuple[int, KVCache]]) -> tuple[RepeatPrompts, int]:
    """(the repeat prompts, --kvzip_chunk) of the pass: one pass serves every layer, so the first user's."""
    first = users[0][1]
    return getattr(first, "kvzip_prompts", RepeatPrompts()), int(first.setting(CHUNK))


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


# ---- a chunked prefill (--prefill_chunk) ------------------------------------------------------------------


def held_runs(cache: KVCache) -> tuple[Tensor, Tensor]:
    """Where each head of `cache` holds its tokens, in position order: (first slot, count), [B, n_kv] each. A
    pool's heads from their own offsets (budget_allocation.PooledCache), every other cache's from slot 0."""
    start = cache.offset if cache.pooled else torch.zeros_like(cache.filled)
    return start, cache.filled


class ChunkPassCache(CaptureCache):
    """Stands in for a layer's cache during a pass of a chunked KVzip prefill (ChunkedReconstruction.chunk).
    The pass reads the chunk followed by a repeat input; model.Attention.attend_chunk reads the layer's held
    tokens through this stand-in, so every row attends over them, the chunk and the rows before it, as a later
    chunk's queries do. The layer's scores of the pass's part go to the reconstruction; the chunk's last pass
    also gives the rule's users on this layer their virtual prompt's scores and the layer's own cache the first
    `chunk` rows as the chunk (its tokens, gates, K/V and queries). Not a strategy (not registered)."""

    name = "capture_chunk"

    def __init__(self, layer: int, cache: KVCache, users: list[KVCache], reconstruction: ChunkedReconstruction,
                 chunk: int, part: tuple[int, int], start: int) -> None:
        super().__init__(layer, lambda *_: None, cache.n_kv_heads, cache.head_dim, cache.pos.device)
        self.cache, self.users, self.reconstruction = cache, users, reconstruction
        self.chunk, self.part, self.start = chunk, part, start
        self.prefills = part[1] == chunk
        # What the forward reads off a layer's cache during a chunk: the layer's own.
        self.chunk_queries, self.rerotate_positions = cache.chunk_queries, cache.rerotate_positions
        self.pooled = cache.pooled
        self.needs_gates, self.needs_token_ids = cache.needs_gates, cache.needs_token_ids
        self.pos, self.mask = cache.pos, cache.mask

    def chunk_held_keys(self) -> Tensor:
        return self.cache.chunk_held_keys()

    def chunk_held_values(self) -> Tensor:
        return self.cache.chunk_held_values()

    def observe_tokens(self, token_ids: Tensor, chunk: bool = False) -> None:
        if self.prefills:  # a prompt chunk's, even of one token
            self.cache.observe_tokens(token_ids[:, : self.chunk], True)

    def observe_gates(self, log_gates: Tensor, chunk: bool = False) -> None:
        if self.prefills:
            self.cache.observe_gates(log_gates[..., : self.chunk], True)

    def held_sinks(self, rerotation: Rerotation | None) -> tuple[Tensor, Tensor]:
        """Each head's first s held tokens, those at positions below SCORING_SINKS among them, as the pass attended
        over them: keys [B, n_kv, s, D] and which of them count [B, n_kv, s] (a head's held tokens are in position
        order from its first slot, `held_runs`; a pool's heads hold different ones)."""
        B, n_kv = self.pos.shape[0], self.n_kv_heads
        start, count = held_runs(self.cache)
        s = 0 if self.chunk_queries is None else min(SCORING_SINKS, int(count.max()))
        rank = torch.arange(s, device=self.pos.device)
        slots = (start[..., None] + rank).clamp(max=self.pos.shape[-1] - 1).expand(B, n_kv, s)
        held = self.chunk_held_keys()
        keys = held.expand(B, n_kv, -1, -1).gather(2, slots[..., None].expand(-1, -1, -1, held.shape[-1]))
        if rerotation is not None:  # stored before RoPE; a head's i-th held token is at rank i
            keys = rerotation.rope(keys, rank.view(1, 1, s))
        # A head holding fewer than s reads slots it does not hold (empty, or a pool's next head's): not masked in.
        pos, mask = (t.expand(B, n_kv, -1) for t in (self.pos, self.mask[:, :, 0]))
        return keys, (pos.gather(2, slots) < SCORING_SINKS) & mask.gather(2, slots)

    def prefill_chunk_tokens(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor,
                             rerotation: Rerotation | None = None) -> None:
        N = self.chunk
        if self.users:
            scores = chunk_scores(q, k, N, self.part, self.start, *self.held_sinks(rerotation))
            self.reconstruction.score(self.layer, scores, self.part, N)
        if not self.prefills:
            return
        self.reconstruction.give(self.layer, self.users)
        if rerotation is not None:
            rerotation = Rerotation(rerotation.k_plain[:, :, :N], rerotation.q_plain[:, :, :N], rerotation.rope)
        self.cache.prefill_chunk_tokens(input_pos[:N], k[:, :, :N], v[:, :, :N], q[:, :, :N], rerotation)
        self.reconstruction.keep(self.users, input_pos[:N])


class ChunkedReconstruction:
    """KVzip under --prefill_chunk N: each chunk is reconstructed over what every layer holds. A pass reads the
    chunk, then a repeat input (a part's prompt as `RepeatPrompts.before_chunk` gives it, and the part again):
    one pass for the whole chunk, or with --kvzip_chunk C one per C tokens of it, the last of which also
    prefills. The chunk's tokens are scored by the repeat rows (`chunk_scores`: the paper's chunked
    scoring, its softmax over the sinks, the part and the repeat input), the held tokens keep the scores their
    own chunk's pass gave them, and each layer's prompt rule keeps the budget's best of held + chunk. What
    differs from the paper's chunked scoring: a chunk's passes read the held tokens instead of the whole context
    (the later chunks, not yet read, and what was evicted are not in them), as every strategy's chunks do. A
    pool's heads hold different tokens: each head's sinks and held scores are its own (`held_runs`)."""

    def __init__(self, model, users: list[tuple[int, KVCache]], prompts: RepeatPrompts, part: int) -> None:
        self.model, self.users, self.prompts, self.part = model, users, prompts, part
        # The chunk's scores of each layer, filled part by part; per user, the scores of the tokens it holds (slot
        # order) and, before the chunk's prefill, its virtual prompt's scores and held positions.
        self.fresh: dict[int, Tensor] = {}
        self.held: dict[int, Tensor] = {}
        self.virtual: dict[int, tuple[Tensor, Tensor]] = {}

    @classmethod
    def for_prompt(cls, model, prompt: Tensor) -> ChunkedReconstruction | None:
        """The passes a chunked prefill of `prompt` [B, T] needs; None when no cache would compress it by the
        rule (users_to_score), as the one-shot prefill runs no pass then."""
        users = users_to_score(model, prompt)
        if not users:
            return None
        return cls(model, users, *pass_settings(users))

    def chunk(self, prompt: Tensor, start: int, end: int) -> Tensor:
        """The chunk prompt[:, start:end] through the model with its repeat inputs; each layer's cache takes the
        chunk, the users with its scores. Logits of the chunk's last token [B, vocab]."""
        N, step = end - start, self.part or end - start
        tokens = prompt[:, start:end]
        for a in range(0, N, step):
            b = min(a + step, N)
            repeat = [self.prompts.before_chunk(prompt, start + a, step), prompt[:, start + a : start + b]]
            logits = self.run_pass(torch.cat([tokens, *repeat], dim=1), start, N, (a, b))
        return logits

    def run_pass(self, sequence: Tensor, start: int, chunk: int, part: tuple[int, int]) -> Tensor:
        """One pass of `sequence` [B, S] (the chunk at positions start.., then a repeat input) with stand-ins;
        the logits of the chunk's last token [B, vocab]."""
        model = self.model
        caches = model.caches()
        rerotate = caches[0].rerotate_positions
        reach = (max(int(c.filled.max()) for c in caches) if rerotate and start else start) + sequence.shape[1]
        if reach > model.args.context_length:
            raise UserError(f"KVzip's pass over a {chunk}-token chunk and its repeat input needs {reach} positions, "
                            f"more than the model's {model.args.context_length}: use a smaller --prefill_chunk")
        positions = torch.arange(start, start + sequence.shape[1], device=sequence.device)
        saved = [layer.attention.kv_cache for layer in model.layers]
        try:
            for i, (layer, cache) in enumerate(zip(model.layers, saved, strict=True)):
                users = [user for j, user in self.users if j == i]
                layer.attention.kv_cache = ChunkPassCache(i, cache, users, self, chunk, part, start)
            return model(sequence, positions, chunk=True, logits_at=chunk - 1)[:, -1]
        finally:
            for layer, cache in zip(model.layers, saved, strict=True):
                layer.attention.kv_cache = cache

    def score(self, layer: int, scores: Tensor, part: tuple[int, int], chunk: int) -> None:
        """A pass's scores [B, n_kv, b − a] of the chunk's rows part = (a, b) at `layer`."""
        if part[0] == 0:
            self.fresh[layer] = scores.new_zeros(*scores.shape[:2], chunk)
        self.fresh[layer][..., part[0] : part[1]] = scores

    def give(self, layer: int, users: list[KVCache]) -> None:
        """Before the chunk's prefill: each user's scores of its virtual prompt, its held tokens' and the chunk's,
        [B, n_kv, longest]: head h's n_h + N first (a pool's heads hold different counts n_h; the rest padding,
        which `KvzipCache.scores_for` leaves out of each head's re-prefill)."""
        fresh = self.fresh.pop(layer, None)
        for user in users:
            B, H, N = fresh.shape
            # (copies: the prefill changes the buffers; a cache may keep one row of positions for all heads)
            start, count = (t.expand(B, H).clone() for t in held_runs(user))
            rank = torch.arange(int(count.max()) + N, device=count.device)
            in_held = rank < count[..., None]
            slots = (start[..., None] + rank).clamp(max=user.pos.shape[-1] - 1)
            in_chunk = (rank - count[..., None]).clamp(0, N - 1)
            chunk = fresh.gather(2, in_chunk)
            held = self.held.get(id(user))  # per slot; none before the first chunk (nothing is held)
            scores = chunk if held is None else torch.where(in_held, held.gather(2, slots), chunk)
            user.reconstruction_scores = scores
            held_pos = torch.where(in_held, user.pos.expand(B, H, -1).gather(2, slots), -1)
            self.virtual[id(user)] = (scores, held_pos, in_chunk, count)

    def keep(self, users: list[KVCache], chunk_pos: Tensor) -> None:
        """After the chunk's prefill: the score of the token each user's slot now holds [B, n_kv, slots], found
        by position in its head's virtual prompt."""
        for user in users:
            scores, held_pos, in_chunk, count = self.virtual.pop(id(user))
            rank = torch.arange(scores.shape[-1], device=count.device)
            # Past a head's virtual prompt the chunk's last position repeats: still sorted, found at its first.
            positions = torch.where(rank < count[..., None], held_pos, chunk_pos[in_chunk])
            kept = user.pos.clamp(min=0).expand(*count.shape, -1)
            index = torch.searchsorted(positions.contiguous(), kept.contiguous())
            self.held[id(user)] = scores.gather(2, index.clamp(max=scores.shape[-1] - 1))

    def end(self) -> None:
        """The prompt is in: the users keep no chunk's scores."""
        for _, user in self.users:
            user.__dict__.pop("reconstruction_scores", None)


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

    @staticmethod
    def scores_for(cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        """The supplied reconstruction scores when they are this prompt's, else the prompt's own. A pool's
        re-prefill after a chunk scores each head alone over its own virtual prompt, and the scores it is given
        are padded to the longest head's (ChunkedReconstruction.give)."""
        supplied = cache.__dict__.get("reconstruction_scores")
        B, H, T = k.shape[:3]
        if supplied is None or tuple(supplied.shape[:2]) != (B, H):
            return self_attention_max(q, k)
        if supplied.shape[2] == T:
            return supplied.to(k.device)
        in_reprefill = cache.scored_pos is not None and cache.scored_pos.shape[-1] == T
        if cache.pooled and in_reprefill and supplied.shape[2] > T:
            return supplied[..., :T].to(k.device)
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

    def carry_over(self, n: int) -> object:
        # A chunked prefill's re-prefill resets the cache: the virtual prompt's scores (ChunkedReconstruction.give)
        # outlive it.
        return self.__dict__.get("reconstruction_scores")

    def take_over(self, carried: object) -> None:
        if carried is not None:
            self.reconstruction_scores = carried

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
