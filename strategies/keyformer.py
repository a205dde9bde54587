"""`keyformer`: Keyformer (Adnan et al., MLSys 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection
for Efficient Generative Inference", arXiv 2403.09054).

H2O's accumulated attention favours the tokens attended early and keeps favouring them once others are evicted
(the softmax renormalises over what is left). Keyformer scores a token by an accumulated Gumbel softmax instead:
each query adds softmax((x + ζ) / τ) over the held tokens, x its unnormalised logits, ζ ~ Gumbel(0, 1) drawn
afresh for every (query head, token, query), τ growing with the decode steps (τ_init + step × τ_delta, the
reference code's 1.0 and 0.01). The noise spreads the score over tokens a slightly different distribution would
also attend, and the rising temperature flattens it as generation goes on. The lowest accumulated score is
evicted; the recent window is protected (Keyformer's `recent`, 30% of the cache in its code: the preset's
`--recent_window 0.3`). The scores are summed, not averaged, as the reference code sums them.

`--keyformer_noise none` drops the noise (an ablation, not Keyformer): the temperature's softmax of the
attention alone, and with `--keyformer_tau_delta 0` H2O's accumulated attention as its paper sums it, where
heavy_hitter averages it since each token's entry; so the noise and the sum can be measured apart.

One rule, used twice, per KV head (the query heads of a group averaged, as heavy_hitter does; Keyformer's models
are multi-head):
- prompt: the same sum over every prompt query at τ_init (the reference scores the prompt's causal attention so,
  then keeps the recent window and the top scores); the kept tokens carry it into decoding;
- decode: `update_state` adds the step's Gumbel softmax, from the step's probabilities (log p differs from the
  logits by a constant per query, which the softmax removes).

The noise is a hash of (seed, layer, query head, token position, query position), not torch's generator: a run
is reproducible for a `--seed`, eager or compiled, and a row of a batch draws what it draws alone. In a chunked
prefill a held token's sum goes on from the earlier chunks, as H2O's does. A probability that underflows to zero
in float32 (a logit ~104 below the query's largest) adds nothing, where the reference's softmax of the raw logits
at τ ≥ 1 adds at most e^-52. The prompt draws one number per (query head, query, key): T²·H/2 of them, the cost
of this rule on long prompts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, Setting, finite_float, register_strategy, row_positions
from kv_storage import scatter_slots
from prompt_compression import LayerSeed, ScoredOnce, causal_attention_blocks, hashed_uniform, random_seed

HEAD_STRIDE = 0x632BE5AB  # spreads the query heads' seeds apart in the hash
NOISES = ("gumbel", "none")


def head_seeds(seed: Tensor | int, heads: Tensor) -> Tensor:
    return seed + heads * HEAD_STRIDE


def gumbel_softmax(probs: Tensor, u: Tensor | None, tau: float | Tensor) -> Tensor:
    """softmax((log p + g) / τ) over the last dimension, g = −log(−log u) ~ Gumbel(0, 1), or g = 0 without u (the
    ablation `--keyformer_noise none`). At τ = 1 the weights are p·e^g = p / E with E = −log u ~ Exp(1): one
    logarithm an element instead of four (the prompt's T² draws)."""
    if isinstance(tau, float) and tau == 1.0:
        w = probs if u is None else probs / -torch.log(u)
        return w / w.sum(dim=-1, keepdim=True)
    logits = probs.log() if u is None else probs.log() - torch.log(-torch.log(u))
    return torch.softmax(logits / tau, dim=-1)


@register_strategy
class KeyformerCache(ScoredOnce, LayerSeed, KVCache):
    name = "keyformer"
    hyperparameters = ("global_tokens", "recent_window", "seed")
    settings = (
        TAU_INIT := Setting("keyformer_tau_init", 1.0, type=finite_float, low=0, low_open=True, prompt_rule=True,
                            help="the Gumbel softmax's temperature over the prompt (Keyformer's code: 1.0)"),
        TAU_DELTA := Setting("keyformer_tau_delta", 0.01, type=finite_float, low=0,
                             help="the temperature's growth per decode step (Keyformer's code: 0.01)"),
        NOISE := Setting("keyformer_noise", NOISES[0], type=str, choices=NOISES, prompt_rule=True,
                         help="'none' drops the Gumbel noise, an ablation (with --keyformer_tau_delta 0: H2O's "
                              "attention summed rather than averaged)"),
    )
    head_specific = True
    needs_attention = True
    slot_buffers = ("score",)  # the accumulated Gumbel softmax (0 for empty slots)
    # A chunked prefill's held tokens' sums from the earlier chunks (carry_over), added to the chunk's.
    carried_score: Tensor | None = None

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        kw = dict(device=self.pos.device)
        self.register_buffer("step", torch.zeros(batch_size, **kw))  # decode steps since the prompt, per row
        self.register_buffer("query_pos", torch.zeros(batch_size, dtype=torch.long, **kw))  # the step's position

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.score

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict]:
        """The Gumbel softmax at τ_init summed over the prompt's queries, the group's mean: [B, n_kv, T], both the
        scores and the sums after_prefill seeds (ScoredOnce: one pass). For its own cache's chunked re-prefill,
        the chunk's queries' on top of the held tokens' earlier sums; as another cache's rule, the held tokens
        and the chunk scored as one prompt by their own queries."""
        own = isinstance(cache, cls)
        first = cache.scored_held_tokens(k) if own else 0
        B, n_kv, T = k.shape[:3]
        rep = q.shape[1] // n_kv
        positions = cache.scored_positions(k)[:, :, None, None, :]  # [B, 1 or n_kv, 1, 1, T]
        heads = torch.arange(q.shape[1], device=k.device) + cache.first_kv_head * rep  # the layer's query heads
        seeds = head_seeds(cache.seed if own else random_seed(cache), heads.view(1, n_kv, rep, 1, 1))
        tau = float(cache.setting(cls.TAU_INIT))
        noise = cache.setting(cls.NOISE) == "gumbel"
        total = torch.zeros(B, n_kv, T, device=k.device)
        for rows, probs in causal_attention_blocks(q, k, first):
            end = probs.shape[-1]
            u = hashed_uniform(positions[..., :end], positions[..., rows].transpose(-1, -2), seeds) if noise else None
            total[:, :, :end] += gumbel_softmax(probs, u, tau).sum(dim=3).mean(dim=2)
        if first and cache.carried_score is not None:
            total[:, :, :first] += cache.carried_score
        return total, {}

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        total = self.scored_prompt(k, q)[0]
        n = keep.shape[-1]
        self.score[:, :, :n] = total.gather(2, keep)
        self.step.zero_()

    def carry_over(self, n: int) -> object:
        return self.score[:, :, :n].clone()

    def take_over(self, carried: object) -> None:
        self.carried_score = carried

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.score, 2, slot[..., None], 0.0)
        self.query_pos.copy_(row_positions(input_pos).view(-1).expand_as(self.query_pos))

    def update_state(self, probs: Tensor) -> None:
        if not self.evicts_after_prompt:
            return
        self.step += 1
        _, n_kv, rep, _ = probs.shape
        tau = self.setting(self.TAU_INIT) + self.step.view(-1, 1, 1, 1) * self.setting(self.TAU_DELTA)
        u = None
        if self.setting(self.NOISE) == "gumbel":
            seeds = head_seeds(self.seed, torch.arange(n_kv * rep, device=probs.device).view(1, n_kv, rep, 1))
            u = hashed_uniform(self.pos[:, :, None, :], self.query_pos.view(-1, 1, 1, 1), seeds)
        self.score += gumbel_softmax(probs.float(), u, tau).mean(dim=2)
