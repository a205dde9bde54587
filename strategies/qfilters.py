"""`qfilters`: Q-Filters (Godey et al. 2025, "Q-Filters: Leveraging QK Geometry for Efficient KV Cache
Compression", arXiv 2503.02812). Attention-free: it reads the keys only.

Queries and keys of a head are anisotropic: they share a principal direction u, and along it the mean
query has a fixed sign. Then ⟨q, k⟩ ≈ ⟨q, u⟩⟨k, u⟩ + the rest, and averaged over queries the attention
logit a key gets grows with ⟨k, u⟩ when u is oriented so that the queries' mean projection is positive.
Q-Filters computes u once per (layer, KV head) offline, as the first right singular vector of each query
head's queries on some text, averaged over the query heads of the KV group (not renormalised: the authors'
make_filters), and keeps the keys with the largest projection ⟨k, u⟩ — no attention needed, so it runs with
the fused kernels. The average, not one vector of the group's stacked queries, whose top direction would be
the group's most energetic head's alone.

- Decode: the held key with the lowest ⟨k, u⟩ is evicted (keys as stored: dequantized on quantized
  storage). Prompt: the best `budget` prompt keys by the same projection.
- u: the calibration file's (`--qfilters_path`, default the shipped qfilters/<model>.json when its head
  count and size match the layer), made by calibrate_qfilters.py on the bundled model; a layer the file
  does not cover (another model) takes u from its own prompt's queries at prefill (the same SVD), and so
  does another cache using `qfilters` as its --prompt_compression_strategy.

Where this differs from the paper: its filters are computed on a few thousand samples of a pretraining
corpus per model (and published for large models only); the shipped ones come from a few windows of the
project's calibration text (see calibrate_qfilters.py) with queries after RoPE and the model's query scale,
as attention uses them. The sign convention: each head's vector is oriented so that its queries' mean
projection is positive (the authors' code takes the sign most projections have; the calibration sums
moments over windows, which keep the mean and not the signs), and the score is +⟨k, u⟩ (kvpress's
QFilterPress stores the opposite orientation and negates). With --rerotate_positions the keys
are stored before RoPE, so they are projected without the rotation the direction was measured with.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor

from cache import KVCache, Setting, register_strategy
from errors import UserError

QFILTERS_DIR = Path(__file__).resolve().parent.parent / "qfilters"
SHIPPED = QFILTERS_DIR / "SmolLM2-135M-Instruct.json"

PATH = Setting("qfilters_path", None, type=str, shipped_files=QFILTERS_DIR,
               help="per-layer, per-KV-head query directions from calibrate_qfilters.py (default: the shipped "
                    "file when it fits the model)")


def query_moments(q: Tensor) -> tuple[Tensor, Tensor]:
    """The Gram matrix Σ q qᵀ [B, n_head, D, D] and the sum Σ q [B, n_head, D] of each query head's queries:
    what its principal direction needs, summable over windows (calibrate_qfilters.py)."""
    samples = q.float()
    return samples.transpose(-1, -2) @ samples, samples.sum(dim=2)


def group_directions(gram: Tensor, total: Tensor, n_kv: int) -> Tensor:
    """The filter of each KV head [..., n_kv, D] from its query heads' moments [..., n_head, D, D] and
    [..., n_head, D] (query heads grouped in order): their principal directions, averaged."""
    return principal_directions(gram, total).unflatten(-2, (n_kv, -1)).mean(-2)


def principal_directions(gram: Tensor, total: Tensor) -> Tensor:
    """The first right singular vector of a head's queries (the top eigenvector of their Gram matrix),
    oriented so that the queries' mean projection on it is ≥ 0: [..., D] unit vectors."""
    gram = gram.double()
    # Off the CPU, no eigensolver: a GPU's solver runs the few D × D problems one small launch sequence at a
    # time (qfilters' uncalibrated 4k prefill read 0.11 of the full cache's on the H200 with it), and a solve
    # on the host waits for the GPU and costs ~9 ms a layer at the 8B shape (8 heads of 128, one thread of an
    # AMD EPYC; the squaring below takes 16 ms on that thread, so the CPU keeps LAPACK).
    u = torch.linalg.eigh(gram)[1][..., -1] if gram.device.type == "cpu" else top_eigenvectors(gram)
    u = u.float()
    sign = torch.where((total * u).sum(-1, keepdim=True) < 0, -1.0, 1.0)
    return u * sign


def top_eigenvectors(gram: Tensor, squarings: int = 16) -> Tensor:
    """The unit eigenvector of the largest eigenvalue of each symmetric positive semi-definite matrix
    [..., D, D], by repeated squaring: G^(2^s) = Σ λᵢ^(2^s) uᵢ uᵢᵀ, so every other direction shrinks by
    (λᵢ/λ₁)^(2^s) (an eigengap of 0.01% leaves e^-6.5 of it after 16 squarings). Each square is rescaled to
    trace 1; the column of the largest diagonal entry (u₁ times its largest component) is then multiplied by G
    once more and normalised. A few batched matrix products: one launch each on a GPU, where an eigensolver
    takes a sequence per matrix. Float64 in, float64 out; a zero matrix gives the first basis vector."""
    def unit_trace(m: Tensor) -> Tensor:
        trace = m.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
        return m / torch.where(trace > 0, trace, 1.0)

    m = unit_trace(gram)
    for _ in range(squarings):
        m = unit_trace(m @ m)
    j = m.diagonal(dim1=-2, dim2=-1).argmax(-1)
    column = m.gather(-1, j[..., None, None].expand(*m.shape[:-1], 1))  # [..., D, 1]
    v = (gram @ column).squeeze(-1)
    norm = v.norm(dim=-1, keepdim=True)
    first = torch.zeros_like(v)
    first[..., 0] = 1.0
    return torch.where(norm > 0, v / torch.where(norm > 0, norm, 1.0), first)


def load_filters(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        filters = data["filters"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--qfilters_path {path}: not a Q-Filters file of calibrate_qfilters.py ({e})") from None
    shape_ok = isinstance(filters, list) and filters and all(
        isinstance(layer, list) and len(layer) == len(filters[0]) and all(
            isinstance(head, list) and len(head) == len(filters[0][0]) for head in layer) for layer in filters)
    if not shape_ok or not filters[0] or not filters[0][0]:
        raise UserError(f"--qfilters_path {path}: the filters are not layers × KV heads × head_dim")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for layer in filters for head in layer for x in head):
        raise UserError(f"--qfilters_path {path}: non-finite filter values")
    return data


@register_strategy
class QFiltersCache(KVCache):
    name = "qfilters"
    hyperparameters = ("global_tokens", "recent_window")
    settings = (PATH,)
    head_specific = True

    def __init__(self, batch_size: int, n_kv_heads: int, head_dim: int, *args: object, **kwargs: object) -> None:
        super().__init__(batch_size, n_kv_heads, head_dim, *args, **kwargs)
        path = self.setting(PATH)
        self.filter_file = load_filters(Path(path)) if path else None
        if self.filter_file is None and SHIPPED.exists():
            shipped = load_filters(SHIPPED)
            if shipped.get("n_kv_head") == n_kv_heads and shipped.get("head_dim") == head_dim:
                self.filter_file = shipped
        # u per row and KV head: the file's (configure) or the prompt's (after_prefill).
        self.register_buffer("direction", torch.zeros(batch_size, n_kv_heads, head_dim, device=self.pos.device))
        self.from_file = False

    def configure(self, **settings: object) -> None:
        super().configure(**settings)
        if self.filter_file is None:
            return
        filters = self.filter_file["filters"]
        if len(filters[0]) != self.n_kv_heads or len(filters[0][0]) != self.head_dim or self.layer_idx >= len(filters):
            raise UserError(f"the Q-Filters file has {len(filters)} layers of {len(filters[0])} KV heads × "
                            f"{len(filters[0][0])}; layer {self.layer_idx} has {self.n_kv_heads} × {self.head_dim}: "
                            "calibrate with calibrate_qfilters.py")
        self.file_direction = torch.tensor(filters[self.layer_idx], dtype=torch.float32)
        self.from_file = True
        self.apply_file_direction()

    def apply_file_direction(self) -> None:
        self.direction.copy_(self.file_direction.to(self.direction.device).expand_as(self.direction))

    def reset(self) -> None:
        super().reset()  # zeroes every buffer: the file's directions are a setting, not state
        self.__dict__.pop("prompt_direction", None)
        if self.from_file:
            self.apply_file_direction()

    @staticmethod
    def layer_direction(cache: KVCache, q: Tensor, n_kv: int) -> Tensor:
        """u of the layer, [B, n_kv, D]: the calibrated one, else the prompt queries' own."""
        if isinstance(cache, QFiltersCache) and cache.from_file:
            return cache.direction
        return group_directions(*query_moments(q), n_kv)

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        u = cls.layer_direction(cache, q, k.shape[1])
        if isinstance(cache, QFiltersCache) and not cache.from_file:
            # after_prefill stores the same queries' direction: one solve a layer, not two
            cache.__dict__["prompt_direction"] = u
        return (k.float() * u[:, :, None]).sum(-1)

    def token_scores(self, input_pos: Tensor) -> Tensor:
        keys = self.keys().float()
        if keys.shape[1] != self.n_kv_heads:  # a pooled cache: one K/V head of pool slots, scored per head
            keys = keys.expand(-1, self.n_kv_heads, -1, -1)
        return (keys * self.direction[:, :, None]).sum(-1)

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        u = self.__dict__.pop("prompt_direction", None)
        if not self.from_file:
            self.direction.copy_(group_directions(*query_moments(q), k.shape[1]) if u is None else u)
