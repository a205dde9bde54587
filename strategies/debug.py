"""`debug_<strategy>`: decode with the full cache while a shadow cache of <strategy> sees exactly what a
real one would (the same K/V, prompt compression at prefill, its own attention), and measure the
attention loss each step: 1 − attention mass (under the full cache) on the tokens the shadow holds.

The generation is the full cache's, so losses at different steps are measured on the same text and
compare strategies on equal footing; the loss is per layer, per KV head (averaged over its query heads).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from cache import KVCache
from errors import UserError
from kv_storage import scatter_slots

_DEBUG_CLASSES: dict[type[KVCache], type[KVCache]] = {}


class DebugCache(KVCache):
    shadow_class: ClassVar[type[KVCache]]
    needs_attention = True

    def __init__(self, *args: object, capacity_needed: int | None = None, **kwargs: object) -> None:
        if capacity_needed is None:
            raise ValueError("a debug cache needs capacity_needed: its full cache holds the whole sequence")
        # The shadow takes KVCache's arguments as given, exactly as the strategy would run alone.
        shadow = self.shadow_class(*args, capacity_needed=capacity_needed, **kwargs)
        batch_size, n_kv_heads, device = shadow.pos.shape[0], shadow.n_kv_heads, shadow.pos.device
        # The full cache is never quantized: it is the reference the shadow is measured against.
        super().__init__(batch_size, n_kv_heads, shadow.head_dim, capacity_needed, shadow.dtype, device,
                         capacity_needed=capacity_needed)
        self.shadow = shadow
        # Per row: rows decode at their own positions.
        self.register_buffer("current_pos", torch.zeros(batch_size, dtype=torch.long, device=device))
        # Loss per step and head, indexed by absolute position (empty before the first decode step).
        self.register_buffer("loss_history", torch.zeros(batch_size, n_kv_heads, capacity_needed, device=device))
        self.register_buffer("loss_recorded", torch.zeros(batch_size, capacity_needed, dtype=torch.bool,
                                                          device=device))

    def set_row_budgets(self, budgets: list[int], capacities: list[int]) -> None:
        super().set_row_budgets(capacities, capacities)  # the reference holds each row's whole sequence
        self.shadow.set_row_budgets(budgets, capacities)

    def configure(self, **settings: object) -> None:
        self.shadow.configure(**settings)
        # The reference keeps the whole sequence: a prompt budget (kvpress protocol) is the shadow's alone.
        super().configure(**{k: v for k, v in settings.items() if hasattr(KVCache, k) and k != "prompt_budget"})

    @property
    def needs_token_ids(self) -> bool:  # type: ignore[override]
        return self.shadow.needs_token_ids

    @property
    def needs_gates(self) -> bool:  # type: ignore[override]
        return self.shadow.needs_gates

    def budget(self) -> int:
        return self.shadow.budget()

    def head_budgets(self) -> Tensor:
        return self.shadow.head_budgets()

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        super().prefill(input_pos, k, v, q, k_store)
        self.shadow.prefill(input_pos, k, v, q, k_store)

    def insert(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        self.shadow.insert(input_pos, k, v)
        self.current_pos.copy_(input_pos)
        super().insert(input_pos, k, v)

    def append(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.shadow.room() < k.shape[2]:  # the full cache always has room; the shadow must too
            raise ValueError(f"a {self.shadow.name} cache has no room for a chunk of {k.shape[2]}")
        return super().append(input_pos, k, v)

    def before_chunk_token(self, i: int) -> None:
        self.shadow.before_chunk_token(i)

    def room(self) -> int:
        return min(super().room(), self.shadow.room())

    def observe_tokens(self, token_ids: Tensor, chunk: bool = False) -> None:
        self.shadow.observe_tokens(token_ids, chunk)

    def observe_gates(self, log_gates: Tensor, chunk: bool = False) -> None:
        self.shadow.observe_gates(log_gates, chunk)

    def update_state(self, probs: Tensor) -> None:
        # The full cache fills slots in order, so slot i holds position i: gather by the shadow's positions.
        B, H, rep, _ = probs.shape
        shadow_pos = self.shadow.pos.expand(B, H, -1)
        held = self.shadow.mask[:, :, 0]  # [B, H, Ls]
        index = shadow_pos.clamp(min=0)[:, :, None, :].expand(B, H, rep, -1)
        held_probs = probs.gather(3, index) * held[:, :, None, :]
        mass = held_probs.sum(dim=-1)  # [B, H, rep]
        loss = (1.0 - mass).clamp(min=0.0).mean(dim=2)
        scatter_slots(self.loss_history, 2, self.current_pos.view(B, 1, 1).expand(B, H, 1), loss[..., None])
        scatter_slots(self.loss_recorded, 1, self.current_pos.view(B, 1), True)
        if self.shadow.needs_attention:
            # What the shadow would have seen as the only cache: softmax over its own tokens, i.e. the
            # full probabilities restricted to them and renormalised, per query head.
            self.shadow.update_state(held_probs / mass[..., None].clamp(min=1e-30))

    def held_tokens(self) -> Tensor:
        return self.shadow.held_tokens()

    def compression_ratio_per_head(self) -> Tensor:
        return self.shadow.compression_ratio_per_head()

    def attention_loss_per_step(self) -> Tensor:
        """[steps, n_kv]: the loss of each decode step, in order, averaged over the rows. Rows that recorded
        more steps (a longer prompt fed with --feed_long_prompts) count their last ones: the generation's."""
        rows = [history[:, recorded].T for history, recorded in zip(self.loss_history, self.loss_recorded,
                                                                      strict=True)]
        steps = min(len(r) for r in rows)
        return torch.stack([r[len(r) - steps :] for r in rows]).mean(dim=0)

    def extra_statistics(self) -> dict[str, Tensor]:
        steps = self.attention_loss_per_step()
        if steps.shape[0] == 0:
            return {}
        return {"attention_loss": steps.mean(dim=0)}

    def storage_statistics(self) -> dict[str, Tensor]:
        return self.shadow.storage_statistics()  # the strategy's storage, not the full reference cache


def debug_strategy(inner: type[KVCache]) -> type[KVCache]:
    """The class of `debug_<inner.name>`, made once: it reads exactly the hyper-parameters and pairs with
    exactly the prompt rules `inner` does (its own full cache is only the reference it measures against)."""
    if issubclass(inner, DebugCache):
        raise UserError(f"debug_{inner.name}: a debug cache cannot shadow another debug cache")
    if inner not in _DEBUG_CLASSES:
        _DEBUG_CLASSES[inner] = type(
            f"Debug{inner.__name__}",
            (DebugCache,),
            {"name": f"debug_{inner.name}", "shadow_class": inner, "hyperparameters": inner.hyperparameters,
             "head_specific": False, "needs_token_classes": inner.needs_token_classes,
             "profiles_prompt": inner.profiles_prompt,
             "__doc__": f"Full cache with a shadow `{inner.name}` cache measuring attention loss."},
        )
    return _DEBUG_CLASSES[inner]


def attention_loss_curve(caches: list[KVCache], checkpoints: int = 8) -> dict[str, float]:
    """Cumulative mean attention loss (over layers and heads) at about `checkpoints` steps, log-spaced."""
    per_step = [c.attention_loss_per_step().mean(dim=1) for c in caches if isinstance(c, DebugCache)]
    if not per_step or per_step[0].numel() == 0:
        return {}
    losses = torch.stack(per_step).mean(dim=0).double()
    cumulative = losses.cumsum(0) / torch.arange(1, len(losses) + 1, dtype=torch.float64)
    marks = sorted({min(len(losses), 2**i) for i in range(64) if 2**i <= 2 * len(losses)})[:checkpoints - 1]
    marks = sorted(set(marks) | {len(losses)})
    return {str(m): round(float(cumulative[m - 1]), 5) for m in marks}
