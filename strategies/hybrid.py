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

Static shapes for compile: every head's decision is a tensor op over all heads at once. A head whose
policy rejects the new token writes it to a scratch slot (index L, never marked as held), so every
step writes exactly one slot per head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cache import KVCache, Setting, finite_float, grouped_mean, register_strategy, row_positions
from errors import UserError
from kv_storage import scatter_slots
from prompt_compression import causal_attention_blocks
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
    chunked_prefill_refusal = ("its prefill profiles the whole prompt's attention per head and may hold fewer "
                               "tokens than its budget, so held + chunk is no prompt it can profile")

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

    def _profile_attention(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """(received, in_window), [B, n_kv, T] each: the attention every prompt key receives from all
        prompt queries (averaged over a KV group's query heads), and the part of it from the queries whose
        own local window holds the key (i − j < ceil(r_l·(i + 1))). In blocks of queries over the keys each
        block can see, so memory stays O(block × T) (docs/DESIGN.md §7)."""
        B, T = q.shape[0], q.shape[2]
        received = torch.zeros(B, k.shape[1], T, dtype=torch.float32, device=q.device)
        in_window = torch.zeros_like(received)
        for rows, probs in causal_attention_blocks(q, k):
            end = probs.shape[-1]
            window = torch.ceil(self.recent_frac * (rows + 1).float()).long()
            held = rows[:, None] - torch.arange(end, device=q.device) < window[:, None]
            group = probs.mean(dim=2)  # [B, n_kv, rows, end]: the one pass over every head's probabilities
            received[:, :, :end] += group.sum(dim=2)
            in_window[:, :, :end] += (group * held).sum(dim=2)  # causal: probs are 0 past each row
        return received, in_window

    def _choose_policies(self, parts: dict[str, Tensor], received: Tensor, in_window: Tensor) -> tuple[Tensor, Tensor]:
        """(policy index [B, H], prompt tokens the policy keeps [B, H, T]): the first policy recovering
        `min_recovery` of the head's attention map. A policy's kept entries are its token components'
        columns plus, with `local`, each query's window; the last policy takes every head still undecided."""
        B, H, T = received.shape
        total = received.sum(-1)
        chosen = torch.full((B, H), len(self.policies) - 1, dtype=torch.long, device=received.device)
        keep = torch.zeros(B, H, T, dtype=torch.bool, device=received.device)
        decided = torch.zeros(B, H, dtype=torch.bool, device=received.device)
        for index, policy in enumerate(self.policies):
            tokens = [parts[c] for c in policy if c != "local"] or [torch.zeros_like(keep)]
            columns = torch.stack(tokens).any(dim=0)
            recovered = (received * columns).sum(-1)
            if "local" in policy:  # window entries of the columns the other components did not already take
                recovered = recovered + (in_window * ~columns).sum(-1)
            take = (recovered >= self.min_recovery * total) if index < len(self.policies) - 1 else True
            take = take & ~decided
            kept = columns | parts["local"] if "local" in policy else columns
            chosen = torch.where(take, index, chosen)
            keep = torch.where(take[..., None], kept, keep)
            decided |= take
        return chosen, keep

    # ---- prefill: profile each head, keep what its policy keeps -------------------------------------------

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        if self.prompt_ids is None:
            raise UserError("the hybrid cache did not see the prompt's token ids")
        B, H, T, D = k.shape
        received, in_window = self._profile_attention(q, k)
        is_special, is_punct = (c[:, None, :].expand(B, H, T) for c in self._classes(self.prompt_ids))
        parts = self._component_keep(T, input_pos.view(1, 1, T).expand(B, H, T), is_special, is_punct, received)
        chosen, keep = self._choose_policies(parts, received, in_window)
        self.policy.copy_(chosen)
        for c_index, component in enumerate(COMPONENTS):
            has = torch.tensor([component in p for p in self.policies], device=k.device)
            self.uses[..., c_index] = has[chosen]
        # At most L tokens per head: special/punct first, then by attention (ties: the newest).
        L = self.prompt_target()
        priority = received + input_pos.float() * 1e-9 + (is_special | is_punct) * 1e6
        priority = priority.masked_fill(~keep, float("-inf"))
        top = priority.topk(min(L, T), dim=-1)
        valid = top.values > float("-inf")
        idx = top.indices
        n = idx.shape[-1]
        gather = idx[..., None].expand(B, H, n, D)
        stored = (k if k_store is None else k_store).gather(2, gather)
        self.storage.write(torch.arange(n, device=k.device).expand(B, H, n), stored, v.gather(2, gather), q)
        self.pos[:, :, :n] = torch.where(valid, input_pos[idx], -1)
        self.mask[:, :, 0, :n] = valid
        self.slot_special[:, :, :n] = ((is_special & self._use("special")[..., None])
                                       | (is_punct & self._use("punct")[..., None])).gather(2, idx) & valid
        self.attn_sum[:, :, :n] = received.gather(2, idx) * valid
        self.inserted.fill_(T)
        self.prompt_ids = None

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
        self.mask[..., L] = False  # the scratch slot is never held
        self.pos[..., L] = -1
        self.inserted += 1

    def update_state(self, probs: Tensor) -> None:
        self.attn_sum += grouped_mean(probs)

    def extra_statistics(self) -> dict[str, Tensor]:
        return {"hybrid_policy_index": self.policy.float().mean(dim=0)}
