"""`duo_attention`: DuoAttention (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM Inference with
Retrieval and Streaming Heads", arXiv 2410.10819).

Only some heads retrieve from the whole context; the others ("streaming heads") attend to the attention
sinks and the recent tokens. DuoAttention keeps the full cache for retrieval heads and only sinks + a
window for streaming heads, with the roles fixed per (layer, KV head) by an offline calibration.

Here, per KV head (head-specific):
- a streaming head holds the first `global_tokens` (sinks) and the `recent_window` newest tokens, never
  more: as each token arrives (decoded or appended), every other token it holds is released (slot emptied,
  masked: strategies/variable_occupancy.py), so from the first decode step on it uses global_tokens +
  recent_window of its slots, whatever the budget; the prompt is stored as the budget allows and its
  tokens outside the pattern go when the first token arrives, before any decode query attends;
- a retrieval head holds everything up to the layer's budget L (the paper's full cache when L covers the
  sequence); a budget below it makes it StreamingLLM with a window of L − global_tokens (the oldest
  unprotected token goes first), so the one rule of both roles is recency: `token_scores` is the position.
- roles: the `--duo_retrieval_fraction` of the model's KV heads that a streaming pattern would hurt most
  are retrieval heads, ranked over all layers together as the paper thresholds one gate per head over the
  whole model. The ranking score is the calibration file's (`--duo_heads_path`, default the shipped file
  duo/<model>.json when its head count and size match the layer): per head, the attention mass the
  sinks + window pattern misses, measured on the bundled model by calibrate_duo.py.

Where this differs from the paper: DuoAttention learns a gate per head by optimisation (the model's
output under a mix of full and streaming attention on synthetic passkey retrieval, with an L1 penalty on
the gates); the calibration here ranks heads by the measured attention loss of the streaming pattern on
text (the profiling baseline the paper compares its optimisation with). A layer the file does not cover
(another model) ranks its own heads by the same loss on its prompt, within the layer. The prefill itself
is full causal attention in every head (the paper's streaming heads prefill with streaming attention:
a cache does not change the prompt's attention); releasing the prompt at prefill instead of at the first
insert would change nothing a decode query sees. With a chunk after the prompt (`append`) a streaming
head keeps only the window of it, as it does for decoded tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor

from cache import KVCache, Setting, finite_float, register_strategy
from errors import UserError
from prompt_compression import causal_attention_blocks
from strategies.variable_occupancy import VariableOccupancy

DUO_DIR = Path(__file__).resolve().parent.parent / "duo"
SHIPPED = DUO_DIR / "SmolLM2-135M-Instruct.json"


def streaming_loss(q: Tensor, k: Tensor, sinks: int, window: int) -> Tensor:
    """Per KV head, the mean over prompt queries of the attention mass outside the sinks and the query's
    own window (keys j < sinks or i − window < j ≤ i, the pattern a streaming head keeps; of the mean over
    the KV group's query heads): [B, n_kv]."""
    B, T = k.shape[0], k.shape[2]
    missed = torch.zeros(B, k.shape[1], dtype=torch.float32, device=k.device)
    for rows, probs in causal_attention_blocks(q, k):
        keys = torch.arange(probs.shape[-1], device=k.device)
        kept = (keys < sinks) | ((keys <= rows[:, None]) & (keys > rows[:, None] - window))
        missed += (probs.mean(dim=2) * ~kept).sum(dim=(-1, -2))  # the group mean first: one pass over the heads
    return missed / T


def retrieval_heads(scores: list[list[float]], fraction: float) -> list[list[bool]]:
    """The `fraction` of all heads (rounded) with the highest scores, over every layer at once; ties go
    to the earlier (layer, head)."""
    flat = [(-s, i) for i, s in enumerate(x for layer in scores for x in layer)]
    chosen = {i for _, i in sorted(flat)[: round(fraction * len(flat))]}
    n = len(scores[0])
    return [[layer * n + h in chosen for h in range(n)] for layer in range(len(scores))]


def load_head_scores(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        scores = data["scores"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"--duo_heads_path {path}: not a head-role file of calibrate_duo.py ({e})") from None
    rows = isinstance(scores, list) and scores and all(isinstance(layer, list) for layer in scores)
    if not rows or any(len(layer) != len(scores[0]) for layer in scores):
        raise UserError(f"--duo_heads_path {path}: the scores are not one row of KV heads per layer")
    if data.get("n_layer", len(scores)) != len(scores):
        raise UserError(f"--duo_heads_path {path}: {len(scores)} rows of scores for {data['n_layer']} layers (a file "
                        "calibrated past a sliding window left those layers out): calibrate it again")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for layer in scores for x in layer):
        raise UserError(f"--duo_heads_path {path}: non-finite head scores")
    return data


class StreamingHeads(VariableOccupancy, KVCache):
    """Heads in one of two roles, per row (`retrieval` [B, n_kv]: 1.0 retrieval, 0.0 streaming): a retrieval head
    keeps every token up to the budget (then the oldest unprotected goes first), a streaming head only the sinks
    and the recent window. What sets the roles is the subclass's (DuoAttention: per head, calibrated; SimLayerKV:
    per layer, from the prompt's attention)."""

    hyperparameters = ("global_tokens", "recent_window")
    head_specific = True
    # A streaming head holds the sinks and the window and nothing else, not even the token it decodes (the
    # window counts it): with neither, its attention has no key (NaN). cache_spec refuses that.
    holds_only_protected = True

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        self.register_buffer("retrieval", torch.zeros(batch_size, n_kv_heads, device=self.pos.device))

    def token_scores(self, input_pos: Tensor) -> Tensor:
        return self.pos.float()  # the oldest unprotected token goes first (both roles)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        # One row per KV head (the same in each), so Ada-KV's allocation can read it as head-specific.
        return cache.scored_positions(k).float().expand(-1, k.shape[1], -1)

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        self.release_streaming(input_pos)

    def release_streaming(self, newest: Tensor) -> None:
        """Streaming heads keep only their sinks and window: release every other token they hold."""
        streaming = self.retrieval[..., None] == 0
        self.release(self.evictable(newest) & streaming)

    def extra_statistics(self) -> dict[str, Tensor]:
        """1 for a retrieval head, 0 for a streaming one, per KV head."""
        return {"retrieval_head": self.retrieval.mean(dim=0)}


@register_strategy
class DuoAttentionCache(StreamingHeads):
    name = "duo_attention"
    settings = (
        FRACTION := Setting("duo_retrieval_fraction", 0.5, type=finite_float, low=0.0, high=1.0,
                            help="fraction of the model's KV heads that keep everything (retrieval heads); "
                                 "the others keep the sinks and the recent window"),
        PATH := Setting("duo_heads_path", None, type=str, shipped_files=DUO_DIR,
                        help="head scores from calibrate_duo.py (default: the shipped file when it fits)"),
    )

    def __init__(self, batch_size: int, n_kv_heads: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, *args, **kwargs)
        self.fraction = float(self.setting(self.FRACTION))
        path = self.setting(self.PATH)
        self.head_file = load_head_scores(Path(path)) if path else None
        if self.head_file is None and SHIPPED.exists():
            shipped = load_head_scores(SHIPPED)
            if shipped.get("n_kv_head") == n_kv_heads and shipped.get("head_dim") == self.head_dim:
                self.head_file = shipped
        # The roles (`retrieval`) are set from the file (configure) or the prompt (after_prefill).
        self.roles_from_file = False

    def configure(self, **settings: object) -> None:
        super().configure(**settings)
        if self.head_file is None:
            return
        scores = self.head_file["scores"]
        if len(scores[0]) != self.n_kv_heads or self.layer_idx >= len(scores):
            raise UserError(f"the DuoAttention head file has {len(scores)} layers of {len(scores[0])} KV heads; "
                            f"layer {self.layer_idx} has {self.n_kv_heads}: calibrate with calibrate_duo.py")
        self.file_roles = retrieval_heads(scores, self.fraction)[self.layer_idx]
        self.roles_from_file = True
        self.apply_file_roles()

    def apply_file_roles(self) -> None:
        roles = torch.tensor(self.file_roles, dtype=torch.float32, device=self.pos.device)
        self.retrieval.copy_(roles.expand_as(self.retrieval))

    def reset(self) -> None:
        super().reset()  # zeroes every buffer, the roles too: the calibrated ones are a setting, not state
        if self.roles_from_file:
            self.apply_file_roles()

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        if not self.roles_from_file:
            loss = streaming_loss(q, k, self.global_tokens, self.recent_window)  # [B, n_kv]
            n = round(self.fraction * self.n_kv_heads)
            top = loss.topk(n, dim=-1).indices
            self.retrieval.copy_(torch.zeros_like(loss).scatter(1, top, 1.0))
