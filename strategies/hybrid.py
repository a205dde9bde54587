"""`hybrid`: FastGen (Ge et al., "Model Tells You What to Discard", arXiv 2310.01801).

At prefill each KV head is profiled: its prompt attention map is scored against an ordered list of
candidate policies, cheapest first, and the head takes the first policy whose kept entries recover at
least `min_recovery_frac` (the paper's T) of its attention. A policy is a union of components:
`special` (special tokens), `punct` (punctuation), `local` (each query's `hybrid_recent_frac` most
recent tokens), `frequent` (the top `hybrid_heavy_frac` of tokens by accumulated attention), or `full`.
Then each head grows and evicts under its own policy, so heads really hold different numbers of tokens
(the statistics report them per head).

The profile follows the paper's compression policies as the decode step applies them:

- Locality is relative to the current token: a context token is evicted once its distance to the
  current token exceeds a window that is a ratio r_l of the sequence length. So in the profile the query
  at position i is credited with the keys j ≤ i with i − j < ceil(r_l·(i + 1)), its own window, which is
  the window the decode step keeps when that query is the newest token (seen = i + 1). One set of keys
  for all queries (the last r_l of the prompt) would credit the early queries with keys they cannot see
  and send heads that attend locally to `full`. After the prompt the cache keeps the last query's window.
  This is our reading: the paper states r_l as a ratio of the input sequence's length, and cold-compress's
  FastGen gives every profiled query a window of r_l·T (and r_l × the budget while decoding).
- Frequency is the cumulative sum of the attention each token has received (the paper's "token
  frequency", H2O's accumulated attention), one rank everywhere: the profile and the prefill rank the
  prompt's tokens by the attention summed over the prompt's queries, decode continues that sum with each
  step's attention. The sum, not the mean over the steps a token was held, because it is the paper's
  rank; a mean would rank a token attended once, just admitted, above one attended at every step.

Chunked prefill (--prefill_chunk N, `reprefill`): the profile reads the map's column sums (the attention each
token received from every query, and the part of it from queries whose own window held it), sums over every
query, so they accumulate as H2O's do: each later chunk's queries attend over what each head holds plus the chunk
(as the model's do) and add to the held tokens' sums carried from the earlier chunks. After each chunk every head's
policy is chosen again by the one-shot rule over its held tokens + the chunk, and the head holds the budget's best
of them, its policy's tokens first; the policy's own cut (releasing the tokens it does not keep) waits for the
whole prompt (`finish_chunked_prefill`), as FastGen decides on the whole prompt's profile. So while the budget
holds every token the profile is the one-shot one, and a prompt whose chunks before the last fit the budget is
compressed exactly as one shot. Where tokens were evicted for the budget, their attention is out of every
policy's reach and leaves the map the policies are judged on. Cutting at every chunk instead (and under KIVI or
ThinK storage, whose stored form depends on every token written, it does) evicts by a policy profiled on part of
the prompt: on fidelity at half the budget, KL +0.108 over one shot against +0.064 deferred (docs/performance.md).
The prompt rule over held + chunk rather than the decode rule (a policy fixed after the first chunk, each later
token admitted one by one), because a policy profiled on the first N tokens would ignore the rest of the prompt's
attention, which is what FastGen's profile is. A head may change policy between chunks.
A head never profiled (a one-token prompt goes straight to decoding) holds every token (`full`; its policy index
reads as the last policy's), where an empty profile would choose the cheapest policy and reject every token.

Static shapes for compile: every head's decision is a tensor op over all heads at once. A head whose
policy rejects the new token writes it to a scratch slot (index L, never marked as held), so every
step writes exactly one slot per head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cache import KVCache, Setting, finite_float, grouped_mean, register_strategy, row_positions
from cache_chunking import Rerotation
from errors import UserError
from kv_storage import scatter_slots
from prompt_compression import causal_attention_blocks
from rerotation import slot_ranks
from strategies.token_ids import ReadsTokenIds

COMPONENTS = ("special", "punct", "frequent", "local", "full")
DEFAULT_HYBRID_POLICIES = ("special", "special+punct", "special+punct+frequent",
                           "special+punct+frequent+local", "full")


def parse_policy(policy: str) -> tuple[str, ...]:
    parts = tuple(policy.split("+"))
    unknown = [p for p in parts if p not in COMPONENTS]
    if unknown or not policy:
        raise UserError(f"unknown hybrid policy component(s) {unknown or [policy]} in {policy!r}; "
                        f"components: {', '.join(COMPONENTS)}")
    return parts


@register_strategy
class HybridCache(ReadsTokenIds, KVCache):
    name = "hybrid"
    settings = (
        MIN_RECOVERY := Setting("min_recovery_frac", 0.95, type=finite_float, low=0, low_open=True, high=1,
                                help="a head takes the first policy recovering this much of its attention "
                                     "(FastGen's threshold T, which the paper varies; cold-compress's default "
                                     "is 0.9)"),
        POLICIES := Setting("hybrid_policies", DEFAULT_HYBRID_POLICIES, type=str, nargs="+", check_value=parse_policy,
                            help="candidate policies, cheapest first (components joined by +: special, punct, "
                                 "frequent, local, full)"),
        RECENT_FRAC := Setting("hybrid_recent_frac", 0.3, type=finite_float, low=0, low_open=True, high=1,
                               help="local window, fraction of tokens"),
        HEAVY_FRAC := Setting("hybrid_heavy_frac", 0.3, type=finite_float, low=0, low_open=True, high=1,
                              help="heavy hitters, fraction of tokens (0.3 as cold-compress's FastGen)"),
    )
    head_specific = True
    needs_attention = True
    profiles_prompt = True
    cut_at_end = False  # True inside a chunked prefill's chunk: the policies' cut waits (prefill_chunk_tokens)

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, max_cache_length: int,
                 *args: object, **kwargs: object) -> None:
        # One extra slot (index L) where heads that reject a token write it; it is never held.
        super().__init__(batch_size, n_kv_heads, head_dim, max_cache_length + 1, *args, **kwargs)
        self.max_cache_length = self.scratch = max_cache_length  # the scratch slot stays the last one in a row context
        self.set_row_budgets([max_cache_length] * batch_size, self.row_capacities)
        B, H, L1 = batch_size, n_kv_heads, max_cache_length + 1
        kw = dict(device=self.pos.device)
        self.policies = [parse_policy(p) for p in self.setting(self.POLICIES)]
        self.min_recovery = float(self.setting(self.MIN_RECOVERY))
        self.recent_frac = float(self.setting(self.RECENT_FRAC))
        self.heavy_frac = float(self.setting(self.HEAVY_FRAC))
        self.register_buffer("policy", torch.zeros(B, H, dtype=torch.long, **kw))  # chosen index per head
        self.register_buffer("uses", torch.zeros(B, H, len(COMPONENTS), dtype=torch.bool, **kw))  # its components
        self.register_buffer("slot_special", torch.zeros(B, H, L1, dtype=torch.bool, **kw))  # special or punct
        self.register_buffer("attn_sum", torch.zeros(B, H, L1, **kw))  # the frequency rank (module docstring)
        # For a chunked prefill's next chunk (written by prefills only: decoding never reads them): each held
        # prompt token's id, and the part of its summed attention from queries whose own window held it.
        self.register_buffer("slot_token", torch.zeros(B, H, L1, dtype=torch.int32, **kw))
        self.register_buffer("window_sum", torch.zeros(B, H, L1, **kw))
        # Which held slots the head's policy keeps: a chunked prefill holds others too while the budget has room,
        # until the prompt is in (finish_chunked_prefill). Decoding admits only what the policy keeps.
        self.register_buffer("policy_keep", torch.zeros(B, H, L1, dtype=torch.bool, **kw))
        self.reset()

    def reset(self) -> None:
        super().reset()
        # A head never profiled has no map to choose by: it holds every token (module docstring).
        self.policy.fill_(len(self.policies) - 1)
        self.uses[..., COMPONENTS.index("full")] = True

    def room(self) -> int:
        held = self.mask[:, :, 0, : self.scratch].sum(-1)  # its heads grow by their own policy
        return int((self.row_budget - held).min())

    def _use(self, component: str) -> Tensor:
        return self.uses[..., COMPONENTS.index(component)]

    def _classes(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.token_class("special", ids), self.token_class("punct", ids)

    def _component_keep(self, seen: int, pos: Tensor, is_special: Tensor, is_punct: Tensor,
                        attn: Tensor) -> dict[str, Tensor]:
        """Which tokens each component keeps, [B, H, n] each, after `seen` tokens: `local` is the window
        of the newest token (position seen − 1), the keys the cache holds for what comes next."""
        frequent_k = math.ceil(self.heavy_frac * seen)
        kth = attn.topk(min(frequent_k, attn.shape[-1]), dim=-1).values[..., -1:]
        return {
            "special": is_special,
            "punct": is_punct,
            "local": pos >= seen - math.ceil(self.recent_frac * seen),
            "frequent": attn >= kth,
            "full": torch.ones_like(is_special),
        }

    def _profile_attention(self, q: Tensor, k: Tensor, key_pos: Tensor | None = None,
                           key_valid: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(received, in_window), [B, n_kv, S] each: the attention every key receives from the queries q
        [B, n_head, T, D] (the last T of the S keys k; averaged over a KV group's query heads), and the part of
        it from the queries whose own local window holds the key (i − j < ceil(r_l·(i + 1)) in positions).
        `key_pos` [B, n_kv, S] and `key_valid` (None: a prompt, 0..S−1): a chunk's queries over the held
        tokens (slots a head does not hold masked) and the chunk. In blocks of queries over the keys each
        block can see, so memory stays O(block × S) (docs/DESIGN.md §7)."""
        B, H, T, D = q.shape
        S = k.shape[2]
        first = S - T  # the queries are the keys' last T; the held tokens' rows are never computed
        if first:
            q = torch.cat([q.new_zeros(B, H, first, D), q], dim=2)
        positions = torch.arange(S, device=q.device).view(1, 1, S) if key_pos is None else key_pos
        received = torch.zeros(B, k.shape[1], S, dtype=torch.float32, device=q.device)
        in_window = torch.zeros_like(received)
        for rows, probs in causal_attention_blocks(q, k, first_query=first, key_valid=key_valid):
            end = probs.shape[-1]
            at = positions[..., rows, None]  # the queries' positions
            window = torch.ceil(self.recent_frac * (at + 1).float()).long()
            held = at - positions[..., None, :end] < window
            group = probs.mean(dim=2)  # [B, n_kv, rows, end]: the one pass over every head's probabilities
            received[:, :, :end] += group.sum(dim=2)
            in_window[:, :, :end] += (group * held).sum(dim=2)  # causal: probs are 0 past each row
        return received, in_window

    def _policy_recovery(self, parts: dict[str, Tensor], received: Tensor, in_window: Tensor) -> Tensor:
        """[B, H, P]: the attention each policy recovers of the map whose column sums are `received` and whose
        entries within each query's window sum to `in_window` ([B, H, S] each). A policy's kept entries are its
        token components' columns plus, with `local`, each query's window."""
        recovered = []
        for policy in self.policies:
            columns = self._columns(parts, policy)
            mass = (received * columns).sum(-1)
            if "local" in policy:  # window entries of the columns the other components did not already take
                mass = mass + (in_window * ~columns).sum(-1)
            recovered.append(mass)
        return torch.stack(recovered, dim=-1)

    @staticmethod
    def _columns(parts: dict[str, Tensor], policy: tuple[str, ...]) -> Tensor:
        tokens = [parts[c] for c in policy if c != "local"]
        return torch.stack(tokens).any(dim=0) if tokens else torch.zeros_like(parts["full"])

    def _choose_policies(self, parts: dict[str, Tensor], recovered: Tensor, total: Tensor) -> tuple[Tensor, Tensor]:
        """(policy index [B, H], tokens the policy keeps [B, H, S]): the first policy whose `recovered` attention
        [B, H, P] is `min_recovery` of the map's `total` [B, H]; the last policy takes every head still
        undecided."""
        enough = recovered >= self.min_recovery * total[..., None]
        enough[..., -1] = True
        chosen = enough.long().argmax(dim=-1)  # the first True
        keeps = [self._columns(parts, p) | parts["local"] if "local" in p else self._columns(parts, p)
                 for p in self.policies]
        keep = torch.stack(keeps, dim=-1).gather(-1, chosen[..., None, None].expand(*keeps[0].shape, 1))[..., 0]
        return chosen, keep

    # ---- prefill: profile each head, keep what its policy keeps -------------------------------------------

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        B, H, T, _ = k.shape
        ids = self._take_prompt_ids()[:, None, :].expand(B, H, T)
        received, in_window = self._profile_attention(q, k)
        positions = input_pos.view(1, 1, T).expand(B, H, T)
        valid = torch.ones(B, H, T, dtype=torch.bool, device=k.device)
        keep = self._compress(positions, ids, valid, received, in_window, T)
        self._store(keep, positions, ids, valid, received, in_window, k if k_store is None else k_store, v, q)
        self.inserted.fill_(T)

    def _take_prompt_ids(self) -> Tensor:
        """The ids of the prompt (or chunk) being prefilled, [B, T]; read once (a later prefill gets its own)."""
        if self.prompt_ids is None:
            raise UserError("the hybrid cache did not see the prompt's token ids")
        ids, self.prompt_ids = self.prompt_ids, None
        return ids

    def _compress(self, positions: Tensor, ids: Tensor, valid: Tensor, received: Tensor, in_window: Tensor,
                  seen: int) -> Tensor:
        """Profile and choose over the tokens `positions`, `ids`, `valid` [B, H, S] (a prompt, or a head's held
        tokens + a chunk): `received` [B, H, S] is the attention each has received from every query so far and
        `in_window` the part of it from queries whose own window held it, the column sums of the map that the
        policies' recovered attention is read from. Sets each head's policy; returns the tokens it keeps after
        `seen` tokens, [B, H, S]."""
        is_special, is_punct = (c & valid for c in self._classes(ids))
        rank = received.masked_fill(~valid, float("-inf"))
        parts = {name: part & valid for name, part in
                 self._component_keep(seen, positions, is_special, is_punct, rank).items()}
        recovered = self._policy_recovery(parts, received, in_window)
        chosen, keep = self._choose_policies(parts, recovered, received.sum(-1))
        self.policy.copy_(chosen)
        for c_index, component in enumerate(COMPONENTS):
            has = torch.tensor([component in p for p in self.policies], device=chosen.device)
            self.uses[..., c_index] = has[chosen]
        return keep

    def _store(self, keep: Tensor, positions: Tensor, ids: Tensor, valid: Tensor, received: Tensor,
               in_window: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        """The tokens `keep` [B, H, S] (at most the prompt budget per head: special/punct first, then by
        attention, ties to the newest) into slots 0..n−1 in position order, the slots a head leaves empty after
        them; during a chunked prefill (`cut_at_end`) the other valid tokens too while the budget has room,
        after the policy's. k, v [B, H, S, D] as stored, q the queries a storage may choose by. Returns the kept
        indices [B, H, n] into the S tokens, in slot order (empty slots' entries index a token not kept)."""
        B, H, S, D = k.shape
        is_special, is_punct = (c & valid for c in self._classes(ids))
        priority = received + positions.float() * 1e-9 + (is_special | is_punct) * 1e6
        # The policy's tokens by priority, then (deferring its cut) the other valid ones by priority: two stable
        # sorts, as an offset added to the priority would swamp it in float32.
        rank = keep.long() * 2 + (valid & ~keep).long() * self.cut_at_end  # 0: not held
        by_priority = priority.argsort(dim=-1, descending=True, stable=True)
        by_rank = rank.gather(2, by_priority).argsort(dim=-1, descending=True, stable=True)
        top = by_priority.gather(2, by_rank)[..., : min(self.prompt_target(), S)]
        held = rank.gather(2, top) > 0
        at = positions.gather(2, top)
        order = at.masked_fill(~held, torch.iinfo(at.dtype).max).argsort(dim=-1)
        idx, held = top.gather(2, order), held.gather(2, order)
        n = idx.shape[-1]
        gather = idx[..., None].expand(B, H, n, D)
        slots = torch.arange(n, device=k.device).expand(B, H, n)
        self.storage.write(slots, k.gather(2, gather), v.gather(2, gather), q)
        self.pos[:, :, :n] = torch.where(held, positions.gather(2, idx), -1)
        self.mask[:, :, 0, :n] = held
        self.slot_token[:, :, :n] = ids.gather(2, idx).to(self.slot_token.dtype)
        counted = (is_special & self._use("special")[..., None]) | (is_punct & self._use("punct")[..., None])
        self.slot_special[:, :, :n] = counted.gather(2, idx) & held
        self.attn_sum[:, :, :n] = received.gather(2, idx) * held
        self.window_sum[:, :, :n] = in_window.gather(2, idx) * held
        self.policy_keep[:, :, :n] = keep.gather(2, idx) & held
        self.filled.fill_(n)
        return idx

    # ---- chunked prefill (--prefill_chunk): the profile accumulates, the policies are chosen again -----------

    def prefill_chunk_tokens(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor,
                             rerotation: Rerotation | None = None) -> None:
        # The policies' own cut waits for the whole prompt (finish_chunked_prefill), but where the stored form
        # depends on every token written (ThinK's channels, KIVI's groups), which releasing a slot cannot undo.
        self.cut_at_end = not self.storage.exact_in_chunks
        try:
            super().prefill_chunk_tokens(input_pos, k, v, q, rerotation)
        finally:
            self.cut_at_end = False

    def finish_chunked_prefill(self) -> None:
        """The prompt is in: each head releases the held tokens its policy, chosen over the whole prompt's
        profile at the last chunk, does not keep."""
        drop = self.mask[:, :, 0] & ~self.policy_keep
        self.mask[:, :, 0].masked_fill_(drop, False)
        self.pos.masked_fill_(drop, -1)
        self.slot_special.masked_fill_(drop, False)
        self.attn_sum.masked_fill_(drop, 0.0)

    def reprefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, rerotation: Rerotation | None) -> None:
        """After a later chunk: each head's tokens are its own held ones (a head may hold fewer than the slots
        written, `filled`) followed by the chunk. The chunk's queries attend over them (as the model's did) and add
        to the held tokens' sums; the one-shot rule then chooses each head's policy from those sums, and the head
        holds the budget's best, its policy's tokens first (module docstring)."""
        B, H, T, D = k.shape
        n = int(self.filled.max())
        held, held_pos = self.mask[:, :, 0, :n], self.pos[:, :, :n]
        held_k, held_v = self.chunk_held_keys()[:, :, :n], self.chunk_held_values()[:, :, :n]
        scored_k = held_k if rerotation is None else rerotation.rope(held_k, slot_ranks(held_pos))
        positions = torch.cat([held_pos, input_pos.view(1, 1, T).expand(B, H, T)], dim=2)
        valid = torch.cat([held, held.new_ones(B, H, T)], dim=2)
        ids = torch.cat([self.slot_token[:, :, :n].long(), self._take_prompt_ids()[:, None, :].expand(B, H, T)], 2)
        received, in_window = self._profile_attention(q, torch.cat([scored_k, k], 2), positions, valid)
        received[..., :n] += self.attn_sum[:, :, :n] * held  # the earlier chunks' queries' sums (H2O's, carried)
        in_window[..., :n] += self.window_sum[:, :, :n] * held
        stored = torch.cat([held_k, k if rerotation is None else rerotation.k_plain], 2)
        values = torch.cat([held_v, v], 2)
        rep = q.shape[1] // H
        held_q = self.chunk_queries * held.repeat_interleave(rep, dim=1)[..., None]  # a slot not held has none
        queries = torch.cat([held_q, q if rerotation is None else rerotation.q_plain], 2)
        seen = self.inserted + T
        self.reset()
        keep = self._compress(positions, ids, valid, received, in_window, int(input_pos[-1]) + 1)
        idx = self._store(keep, positions, ids, valid, received, in_window, stored, values, queries)
        self.inserted.copy_(seen)
        self.chunk_queries = queries.gather(2, idx.repeat_interleave(rep, dim=1)[..., None].expand(B, H * rep, -1, D))
        exact = self.storage.exact_in_chunks
        at = idx[..., None].expand(B, H, idx.shape[-1], D)
        self.chunk_keys = stored.gather(2, at) if "keys" in exact else None
        self.chunk_values = values.gather(2, at) if "values" in exact else None

    # ---- decode: admit or reject the new token per head, evict by the head's own priorities -------------------

    def insert(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        B, H = k.shape[:2]
        L, limit = self.scratch, self.row_budget  # the slots, and each row's budget within them
        seen = self.inserted + 1  # [B, H], including this token
        is_special, is_punct = (c[:, None].expand(B, H) for c in self._classes(self.current_token[:, 0]))
        new_is_special = (is_special & self._use("special")) | (is_punct & self._use("punct"))
        admitted = new_is_special | self._use("local") | self._use("frequent") | self._use("full")

        held = self.mask[:, :, 0, :L]
        local_len = torch.ceil(self.recent_frac * seen.float())
        allowance = (self.slot_special[..., :L] & held).sum(-1) + new_is_special.long()
        allowance = allowance + self._use("local") * local_len + self._use("frequent") * torch.ceil(
            self.heavy_frac * seen.float())
        allowance = torch.where(self._use("full"), limit, torch.minimum(allowance, limit))
        # Held slots are below the row's budget, so while it has room the first empty slot is one of its own.
        can_grow = (held.sum(-1) < allowance) & (held.sum(-1) < limit)
        first_empty = (~held).float().argmax(dim=-1)

        pos = self.pos[..., :L]
        in_window = self._use("local")[..., None] & (pos >= seen[..., None] - local_len[..., None])
        scores = torch.where(self._use("frequent")[..., None] | self._use("full")[..., None], self.attn_sum[..., :L],
                             pos.float() * 1e-6 - 1.0)  # no attention component: oldest out-of-window first
        scores = scores + in_window * 1e6 + self.slot_special[..., :L] * 1e9
        evict = scores.masked_fill(~held, float("inf")).argmin(dim=-1)
        slot = torch.where(admitted, torch.where(can_grow, first_empty, evict), L)  # [B, H]

        self.storage.write(slot[..., None], k, v)
        scatter_slots(self.pos, 2, slot[..., None], row_positions(input_pos).expand(B, H, 1))
        scatter_slots(self.mask, 3, slot[..., None, None], True)
        scatter_slots(self.slot_special, 2, slot[..., None], new_is_special[..., None])
        scatter_slots(self.attn_sum, 2, slot[..., None], 0.0)
        scatter_slots(self.policy_keep, 2, slot[..., None], True)
        self.mask[..., L] = False  # the scratch slot is never held
        self.pos[..., L] = -1
        self.inserted += 1

    def update_state(self, probs: Tensor) -> None:
        self.attn_sum += grouped_mean(probs)

    def extra_statistics(self) -> dict[str, Tensor]:
        return {"hybrid_policy_index": self.policy.float().mean(dim=0)}
