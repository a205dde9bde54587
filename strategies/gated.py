"""`gated`: eviction by learned per-token forget gates (TRIM-KV's retention score, arXiv 2512.03324, with gates
trained here in the forget-gate form of gated and power attention: train_gates.py says how it differs).

Each token arrives with a log forget gate per KV head (log_gate ≤ 0, from the layer's learned gate in
gates.py, passed in by the model through `observe_gates` just before the token's K/V). Its retention
decays with age at its own rate, exp(log_gate × age); the token with the lowest log_gate × age
(age = current position − its position) is evicted, global tokens and the recent window protected.
With the same gate for every token this is StreamingLLM's order (the oldest goes first).

The cache holds a third tensor next to K/V, `log_gate` [B, n_kv, L] float32, written and moved exactly
like `pos`: at prefill (also after prompt compression) and into the slot each new token takes; reset
clears it. All of it is tensor ops on fixed-size buffers, so a compiled decode step never recompiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy, row_positions
from errors import UserError
from gates import GATES_DIR
from kv_storage import scatter_slots


@register_strategy
class GatedCache(KVCache):
    name = "gated"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (Setting("gates_path", None, type=str, shipped_files=GATES_DIR,
                        help="a gates file from train_gates.py (default: the shipped file matching the model)"),)
    head_specific = True
    needs_gates = True
    slot_buffers = ("log_gate",)

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        B, H = batch_size, n_kv_heads
        # The gate of the token the coming insert stores (observe_gates runs first, in the same step).
        self.register_buffer("incoming_log_gate", torch.zeros(B, H, 1, device=self.pos.device))
        # The prompt's gates [B, H, T] between observe_gates and prefill (eager only; cleared after use).
        self.prompt_log_gates: Tensor | None = None

    def observe_gates(self, log_gates: Tensor, chunk: bool = False) -> None:
        if log_gates.shape[-1] == 1 and not chunk:
            self.incoming_log_gate.copy_(log_gates)
        else:
            self.prompt_log_gates = log_gates

    def before_chunk_token(self, i: int) -> None:
        # A chunk's gates arrive together (observe_gates saw T tokens): token i's goes in with token i.
        self.incoming_log_gate.copy_(self.prompt_log_gates[..., i : i + 1])

    def token_scores(self, input_pos: Tensor) -> Tensor:
        # The most decayed token goes first.
        return self.log_retention(self.log_gate, row_positions(input_pos) - self.pos)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        log_gate = getattr(cache, "prompt_log_gates", None)  # [B, n_kv, T], set by observe_gates
        if log_gate is None:
            raise UserError(f"prompt compression 'gated' needs the learned gates, which only the gated cache "
                            f"receives (got a {cache.name} cache); use --cache_strategy gated or another compressor")
        # Ages as the next decode step sees them (the token at position T arriving): the same rule.
        return cls.log_retention(log_gate, cache.scored_length(k) - cache.scored_positions(k))

    @staticmethod
    def log_retention(log_gate: Tensor, age: Tensor) -> Tensor:
        """log of the retention exp(log_gate × age) a token has after `age` further tokens."""
        return log_gate * age.float()

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        if self.prompt_log_gates is None:
            raise ValueError("the gated cache got a prompt without its gates (the model calls observe_gates "
                             "when gates are attached)")
        n = keep.shape[-1]
        self.log_gate[:, :, :n] = self.prompt_log_gates.gather(2, keep)
        self.prompt_log_gates = None

    def carry_over(self, n: int) -> object:
        # A chunked prefill's virtual prompt: the held tokens' gates, then the chunk's (just observed).
        return torch.cat([self.log_gate[:, :, :n], self.prompt_log_gates], dim=-1)

    def take_over(self, carried: object) -> None:
        self.prompt_log_gates = carried

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        scatter_slots(self.log_gate, 2, slot[..., None], self.incoming_log_gate)

    def reset(self) -> None:
        super().reset()
        self.prompt_log_gates = None

    def extra_statistics(self) -> dict[str, Tensor]:
        """Mean log-gate of the tokens held at the end, per KV head (how much the kept tokens forget)."""
        held = self.mask[:, :, 0].float()
        mean = (self.log_gate * held).sum(-1) / held.sum(-1).clamp(min=1)
        return {"held_log_gate": mean.mean(dim=0)}
