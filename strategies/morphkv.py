"""`morphkv`: MorphKV (Ghadia et al. 2025, "Dialogue Without Limits: Constant-Sized KV Caches for Extended
Responses in LLMs", ICML 2025, arXiv 2503.00979).

A cache of constant size for long answers: the most recent tokens stay, and each older ("distant") token is
ranked by the attention the recent tokens' queries give it, recomputed at every step, so what is kept follows
what the answer is currently about (H2O's sum over every query ever made favours the early tokens; TOVA's
single latest query is noisy). The score of a distant token i is

    s_i = fuse over the last W queries j of  a_j(i) / Σ_{c distant} a_j(c),    fuse = sum or max,

each observer's attention renormalised over the distant tokens only (the authors' code takes the softmax of
the observers' logits over the distant keys), and the lowest is evicted. `--morphkv_fusion`: sum (the authors'
LongBench runs) or max (their long-response runs); `--morphkv_window` W: the observing queries, by default the
recent window's tokens before the one entering (`--recent_window` − 1), so that, as in the paper, the window
both observes and is kept: this cache at `--recent_window` R equals the authors' window R − 1.

- Decode: `window_attention` holds the last W queries' attention over the slots (their KV group's mean; a ring
  of W rows, the oldest overwritten at each step, zeroed at a slot when a token enters it, since the queries
  before it gave it nothing). Renormalising a stored row over the distant slots is exact: every distant token
  is older than every observer (with W ≤ R − 1), so it was held, and seen, when each observer attended, and a
  softmax restricted to a subset is the full one divided by the subset's mass. Cost: W rows of per-slot state.
- Prompt: the same score for the first token after the prompt: the last W prompt queries observe, the
  distant tokens are those a decode step at position T could evict, and those rows seed the decode ring.

Where this differs from the authors' code: with grouped-query attention the code sums the group's logits
before its softmax; here each observer's distribution over the distant tokens is its KV group's mean
attention restricted to them (one distribution per KV head, as `tova`). The first tokens are kept as sinks
(`--global_tokens`, 0 in the paper's runs: preset `morphkv`) and left out of the renormalisation. At the
prompt the code's observers are the W queries before the last prompt token; here the last W, the decode rule
at the first new token (each strategy's prompt rule is its decode rule). A W larger than R − 1 makes some
observers older than some distant tokens: they gave those tokens nothing (causal attention; the ring's entry
was zeroed when the token entered), and the score is still each observer's attention restricted to the
distant tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, Setting, grouped_mean, register_strategy
from kv_storage import scatter_slots
from prompt_compression import ScoredOnce, prompt_attention

FUSIONS = ("sum", "max")


def observer_count(cache: KVCache) -> int:
    """W: `--morphkv_window`, else the recent window's tokens before the one entering (at least 1)."""
    window = cache.setting(MorphKVCache.WINDOW)
    return int(window) if window is not None else max(cache.recent_window - 1, 1)


def fused_shares(rows: Tensor, distant: Tensor, fusion: str) -> Tensor:
    """Observers' attention rows [B, H, W, L] restricted to the `distant` tokens ([B, H, L] bool, or [T]) and
    renormalised there, fused over the W observers: [B, H, L] float32 (0 where nothing is distant)."""
    shares = rows.float() * distant.unsqueeze(-2)
    shares = shares / shares.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return shares.sum(-2) if fusion == "sum" else shares.amax(-2)


@register_strategy
class MorphKVCache(ScoredOnce, KVCache):
    name = "morphkv"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (
        WINDOW := Setting("morphkv_window", None, low=1,
                          help="the last W queries score the distant tokens (default: --recent_window − 1, "
                               "the recent window's tokens before the one entering, as the paper)"),
        FUSION := Setting("morphkv_fusion", FUSIONS[0], type=str, choices=FUSIONS,
                          help="fuse the observers' renormalised attention by sum (the authors' LongBench runs) "
                               "or max (their long-response runs)"),
    )
    head_specific = True
    needs_attention = True
    # The last W queries' attention over the slots, [B, n_kv, W, L] (registered in __init__; named here so a
    # pool's head view slices it by slot, its last dimension).
    slot_buffers = ("window_attention",)

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        self.observers = observer_count(self)
        self.fusion = str(self.setting(self.FUSION))
        B, H, L, kw = batch_size, n_kv_heads, self.pos.shape[-1], dict(device=self.pos.device)
        self.register_buffer("window_attention", torch.zeros(B, H, self.observers, L, **kw))
        self.register_buffer("step", torch.zeros(B, H, dtype=torch.long, **kw))  # the ring's next row

    def token_scores(self, input_pos: Tensor) -> Tensor:
        distant = self.mask[:, :, 0] & ~self.protected(input_pos)
        return fused_shares(self.window_attention, distant, self.fusion)

    @classmethod
    def scoring(cls, cache: KVCache, k: Tensor, q: Tensor) -> tuple[Tensor, dict[str, Tensor] | None]:
        """The prompt's scores, and the observers' rows [B, n_kv, W, T] that seed the ring (ScoredOnce: once); no
        rows where nothing is evicted after the prompt (the kvpress protocols), so none stay stashed with the prompt's
        keys for a ring that after_prefill leaves empty."""
        T = k.shape[2]
        rows = prompt_attention(q, k, min(observer_count(cache), T))
        index = torch.arange(T, device=k.device)
        # What a decode step at position T may evict: neither sinks nor the R − 1 newest prompt tokens.
        distant = (index >= cache.global_tokens) & (index <= T - cache.recent_window)
        scores = fused_shares(rows, distant, str(cache.setting(cls.FUSION)))
        return scores, {"rows": rows} if cache.evicts_after_prompt else None

    def update_state(self, probs: Tensor) -> None:
        if not self.evicts_after_prompt:
            return
        B, H, W, L = self.window_attention.shape
        row = self.step.view(B, H, 1, 1).expand(B, H, 1, L)
        scatter_slots(self.window_attention, 2, row, grouped_mean(probs)[:, :, None, :])
        self.step.copy_((self.step + 1) % W)

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        if not self.evicts_after_prompt:
            return
        # The last W prompt queries observe the first decode steps (rows 0..w−1; the next step writes row w).
        B, H, W, _ = self.window_attention.shape
        rows = self.scored_prompt(k, q)[1]["rows"]  # [B, n_kv, w, T], w = min(W, T)
        w, n = rows.shape[2], keep.shape[-1]
        self.window_attention.zero_()
        self.window_attention[:, :, :w, :n] = rows.gather(3, keep[:, :, None, :].expand(B, H, w, n))
        self.step.fill_(w % W)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        B, H, W, _ = self.window_attention.shape
        scatter_slots(self.window_attention, 3, slot.view(B, -1, 1, 1).expand(B, H, W, 1), 0.0)
