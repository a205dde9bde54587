"""KIVI residual quantized storage (kv_storage.ResidualQuantizedStorage) against a naive re-implementation:
a Python list of tokens, a residual flushed in groups, per-channel key / per-token value quantization
written element by element. The storage under test works on packed codes, group ids and masked flushes."""

from __future__ import annotations

import random

import pytest
import torch

from eval import cli
from eval.harness import Runtime
from eval.tasks import get_task
from kv_storage import StorageSpec, make_storage
from tests.eval_helpers import PYDOC_EXCERPT, one_thread  # noqa: F401  (autouse: one torch thread)

B, H, D = 1, 2, 8


def naive_quantize(values: list[float], bits: int) -> list[float]:
    """Asymmetric min/max quantization of one group of numbers, returned dequantized (float64 maths on
    float32 inputs; the scale floor only matters for constant groups, which reconstruct exactly anyway)."""
    lo, hi = min(values), max(values)
    scale = (hi - lo) / (2**bits - 1)
    if scale == 0:
        return list(values)
    return [round((x - lo) / scale) * scale + lo for x in values]


class NaiveKivi:
    """slot -> token; tokens enter a residual list; a full residual is quantized in chunks of G entries."""

    def __init__(self, bits: int, G: int, R: int) -> None:
        self.bits, self.G, self.R = bits, G, R
        self.k: dict[int, torch.Tensor] = {}  # slot -> reconstructed key [H, D] (float64)
        self.v: dict[int, torch.Tensor] = {}
        self.residual: list[int | None] = []  # slots in insertion order; None once evicted
        self.exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _quantize(self, entries: list[int | None], keys: dict, values: dict) -> None:
        for start in range(0, len(entries), self.G):
            members = [s for s in entries[start : start + self.G] if s is not None]
            if not members:  # every token of the group was evicted before the flush: nothing to quantize
                continue
            for s in members:
                self.k[s] = torch.zeros(H, D, dtype=torch.float64)
                self.v[s] = torch.zeros(H, D, dtype=torch.float64)
            for h in range(H):
                for c in range(D):  # keys: one range per channel over the group's live tokens
                    q = naive_quantize([float(keys[s][h, c]) for s in members], self.bits)
                    for s, x in zip(members, q, strict=True):
                        self.k[s][h, c] = x
                for s in members:  # values: one range per token and group of G channels
                    g = min(self.G, D)
                    for c0 in range(0, D, g):
                        self.v[s][h, c0 : c0 + g] = torch.tensor(
                            naive_quantize([float(x) for x in values[s][h, c0 : c0 + g]], self.bits))

    def prompt(self, k: torch.Tensor, v: torch.Tensor) -> None:  # k [H, n, D], slots 0..n-1
        n = k.shape[1]
        q = self.G * max(0, -(-(n - self.R) // self.G))
        self._quantize(list(range(q)), {s: k[:, s] for s in range(q)}, {s: v[:, s] for s in range(q)})
        self.residual = list(range(q, n))
        for s in range(q, n):
            self.exact[s] = (k[:, s], v[:, s])

    def insert(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:  # k [H, D]
        if len(self.residual) == self.R:
            live = [s for s in self.residual if s is not None]
            self._quantize(self.residual, {s: self.exact[s][0] for s in live}, {s: self.exact[s][1] for s in live})
            for s in live:
                del self.exact[s]
            self.residual = []
        self.residual = [None if s == slot else s for s in self.residual]
        self.exact.pop(slot, None)
        self.residual.append(slot)
        self.exact[slot] = (k, v)

    def keys_values(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.stack([self.exact[s][0].double() if s in self.exact else self.k[s] for s in slots], 1)
        v = torch.stack([self.exact[s][1].double() if s in self.exact else self.v[s] for s in slots], 1)
        return k, v


def through_flushes_and_evictions(bits: int, G: int, R: int, prompt: int, L: int = 24, steps: int = 48,
                                  seed: int = 0):
    """A KIVI storage and the naive KIVI fed the same prompt, then the same decode tokens into the same slots
    (new slots until L are used, then a random slot: evicting from the residual or the quantized store);
    yields (storage, naive, slots in use) after every step."""
    rng = random.Random(seed)
    torch.manual_seed(bits)
    storage = make_storage(StorageSpec(bits, "kivi", G, R), B, H, L, D, torch.float32, "cpu", prompt + steps)
    naive = NaiveKivi(bits, G, R)
    k = torch.randn(H, prompt, D) * torch.linspace(0.5, 6, D)  # channels of different ranges, as keys have
    v = torch.randn(H, prompt, D)
    storage.write(torch.arange(prompt).expand(B, H, prompt), k[None], v[None])
    naive.prompt(k, v)
    used = prompt
    for _ in range(steps):
        slot = used if used < L else rng.randrange(L)
        used = min(L, used + 1)
        kt, vt = torch.randn(H, D) * torch.linspace(0.5, 6, D), torch.randn(H, D)
        storage.write(torch.full((B, H, 1), slot), kt[None, :, None], vt[None, :, None])
        naive.insert(slot, kt, vt)
        yield storage, naive, used


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("G", "R", "prompt"), [(4, 8, 13), (2, 4, 3), (4, 4, 20)])
def test_matches_naive_kivi_through_flushes_and_evictions_from_both_stores(bits, G, R, prompt):
    for storage, naive, used in through_flushes_and_evictions(bits, G, R, prompt, seed=bits * 100 + G * 10 + R):
        slots = list(range(used))
        want_k, want_v = naive.keys_values(slots)
        torch.testing.assert_close(storage.keys()[0, :, :used].double(), want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(storage.values()[0, :, :used].double(), want_v, atol=1e-5, rtol=1e-5)
        exact = storage.full_precision_slots()[0, 0, :used].tolist()
        assert exact == [s in naive.exact for s in slots]


def test_flush_happens_every_residual_length_insertions_and_drops_evicted_entries():
    G, R, L = 2, 4, 8
    storage = make_storage(StorageSpec(4, "kivi", G, R), B, H, L, D, torch.float32, "cpu", 64)
    storage.write(torch.arange(4).expand(B, H, 4), torch.randn(1, H, 4, D), torch.randn(1, H, 4, D))
    assert storage.full_precision_slots()[0, 0].tolist() == [True] * 4 + [False] * 4  # prompt ≤ R: all residual
    storage.write(torch.full((B, H, 1), 1), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))  # flush, then 1
    fp = storage.full_precision_slots()[0, 0].tolist()
    assert fp[:4] == [False, True, False, False] and int(storage.next_group) == R // G
    # Slot 1's old token was quantized by the flush and is overwritten: its new token sits in the residual.
    for slot in (4, 1, 5):  # slot 1 again: its residual entry is dropped, never quantized
        storage.write(torch.full((B, H, 1), slot), torch.randn(1, H, 1, D), torch.randn(1, H, 1, D))
    assert storage.res_slot[0, 0].tolist() == [-1, 4, 1, 5] and int(storage.res_fill) == 4


def outlier_keys(n: int) -> torch.Tensor:
    """Keys whose channels have very different scales and offsets (as post-RoPE LLM keys do)."""
    torch.manual_seed(0)
    offsets = torch.zeros(64)
    offsets[[3, 17, 40]] = torch.tensor([12.0, -9.0, 15.0])
    return (torch.randn(1, 2, n, 64) + offsets)


def reconstruction_error(scheme: str, bits: int, k: torch.Tensor) -> float:
    n = k.shape[2]
    spec = StorageSpec(bits, scheme, 32, 32) if scheme == "kivi" else StorageSpec(bits)
    storage = make_storage(spec, 1, 2, n, 64, torch.float32, "cpu", n)
    storage.write(torch.arange(n).expand(1, 2, n), k, torch.randn_like(k))
    if scheme == "kivi":
        assert not storage.full_precision_slots()[..., : n - 32].any()
    return float((storage.keys() - k)[..., : n - 32, :].norm() / k[..., : n - 32, :].norm())


@pytest.mark.parametrize("bits", [2, 4])
def test_per_channel_keys_beat_per_token_keys_on_outlier_channels(bits):
    """KIVI's reason for per-channel keys: an outlier channel widens every per-token range."""
    k = outlier_keys(160)
    assert reconstruction_error("kivi", bits, k) < 0.5 * reconstruction_error("per_token", bits, k)


def storage_bytes(spec: StorageSpec, L: int, capacity: int) -> int:
    return sum(b.numel() * b.element_size() for b in make_storage(spec, 1, 3, L, 64, torch.bfloat16, "cpu",
                                                                  capacity).buffers())


def test_bytes_reflect_packed_codes_and_scales():
    L = 2048
    dense = storage_bytes(StorageSpec(), L, L)
    sizes = {bits: storage_bytes(StorageSpec(bits, "kivi"), L, L) for bits in (2, 4, 8)}
    for bits, size in sizes.items():
        s = make_storage(StorageSpec(bits, "kivi"), 1, 3, L, 64, torch.bfloat16, "cpu", L)
        assert s.k_codes.dtype == torch.uint8 and s.k_codes.shape[-1] == 64 * bits // 8
        # codes (bits/16 of dense) + residual (128 of 2048 tokens dense) + per-slot ids, value scales
        # and key group scales: a bounded overhead, not a dense copy in disguise.
        assert bits / 16 * dense < size < (bits / 16 + 0.25) * dense
    assert sizes[2] < sizes[4] < sizes[8] < dense


def test_residual_tokens_count_as_16_bits_in_the_compression_ratio():
    from strategies import get_strategy

    spec = StorageSpec(4, "kivi", 4, 8)
    cache = get_strategy("full")(1, 2, 16, 24, torch.float32, "cpu", spec, capacity_needed=24)
    cache.prefill(torch.arange(20), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 4, 20, 16))
    # 20 tokens: 12 quantized (3 groups of 4), 8 in the residual.
    want = 1 - (8 + 12 * 4 / 16) / 20
    assert cache.compression_ratio_per_head()[0].tolist() == pytest.approx([want, want])


def fidelity(bundled, *flags: str) -> dict:
    model, tokenizer = bundled
    args = cli.parse_args(["--text_file", str(PYDOC_EXCERPT), "--seq_len", "192", "--prefill_tokens", "64",
                           *flags])
    with torch.inference_mode():
        return get_task("fidelity")(args).run(Runtime(model, tokenizer, args, progress=False)).metrics


def test_bundled_model_8bit_kivi_stays_close_to_the_full_cache(bundled):
    """128 teacher-forced tokens of pydoc text; residual 32 in groups of 16, so most of the cache is
    quantized and four flushes happen. 2-bit must visibly hurt, or nothing was quantized."""
    kivi = ["--cache_quantization", "kivi", "--q_group_size", "16", "--residual_length", "32"]
    eight = fidelity(bundled, "--cache_bits", "8", *kivi)
    two = fidelity(bundled, "--cache_bits", "2", *kivi)
    assert 0 < eight["kl_mean"] < 0.01 and eight["top1_agreement"] > 0.95
    assert two["kl_mean"] > 10 * eight["kl_mean"]


def test_tokens_per_key_group_counts_fragmentation_from_evictions():
    from cache import cache_statistics
    from strategies import get_strategy

    spec = StorageSpec(4, "kivi", 4, 4)
    cache = get_strategy("full")(1, 2, 16, 24, torch.float32, "cpu", spec, capacity_needed=24)
    cache.prefill(torch.arange(20), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 4, 20, 16))
    stats = cache_statistics([cache])  # 16 quantized tokens in 4 whole groups, 4 in the residual
    assert stats["kivi_tokens_per_key_group_mean"] == 4.0 and stats["kivi_residual_tokens_mean"] == 4.0
    cache.mask[:, :, 0, [0, 1, 2, 5]] = False  # group 0 keeps one token, group 1 three
    assert cache.storage_statistics()["kivi_tokens_per_key_group"].tolist() == [3.0, 3.0]  # 12 held / 4 groups
