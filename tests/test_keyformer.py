"""Naive Keyformer: a whole run re-played here from the paper's definition with plain loops over layer 0 (float64;
the layer-0 keys and queries of a full-cache run, which depend on the token ids only). Every query adds, to each
token it sees, softmax((x + ζ) / τ) of its query head (x the logits q·k/√d, ζ = −log(−log u) a Gumbel draw),
averaged over the KV group's query heads; τ is τ_init over the prompt and τ_init + s·τ_delta at the s-th decode
step; the prompt keeps the sinks, the recent window and the top sums; each step evicts the lowest sum outside
the sinks and the recent window. The uniforms u are the cache's hashed ones (the random source both share,
itself checked against the int64 hash and for its Gumbel moments); `--keyformer_noise none` is replayed with
ζ = 0. Compared at every step: the held positions
and their sums (rtol 1e-4; budget 16 of a 24-token prompt + 16 new tokens, 2 sinks, a 4-token recent window)."""

from __future__ import annotations

import math

import pytest
import torch

import strategies.keyformer as keyformer
from generate import chunked_prefill, decode_one_token, prefill
from prompt_compression import hashed_bits, hashed_uniform
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids
from tests.test_chunked_prefill import layer0_qkv
from tests.test_h2o_prompt_rule import naive_top
from tests.test_strategies import layer0_queries, reference_kv

BUDGET = 16


def test_the_32_bit_hash_gives_the_int64_hashs_top_bits():
    """hashed_uniform's int32 arithmetic wraps to the int64 finaliser's bits, for any seed, positions, steps."""
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(-1, 1 << 20, (4096,), generator=gen)
    step = torch.randint(0, 1 << 20, (4096,), generator=gen)
    for seed in (0, 5, 1_000_003 * 7 + 3, 0xFFFFFFFF, torch.tensor(123_456_789_012), torch.arange(4096) * 0x632BE5AB):
        want = ((hashed_bits(pos, step, seed) >> 9) * 2 + 1).double() / (1 << 24)
        assert torch.equal(hashed_uniform(pos, step, seed).double(), want)


def test_the_noise_has_gumbels_moments():
    """One million draws over positions and steps: mean γ (Euler's constant) and variance π²/6, P(g < 0) = 1/e.
    Tolerances are ~5 standard errors."""
    pos = torch.arange(1000).view(-1, 1)
    step = torch.arange(1000).view(1, -1)
    g = -torch.log(-torch.log(hashed_uniform(pos, step, 17).double()))
    assert abs(g.mean().item() - 0.5772156649) < 0.007
    assert abs(g.var().item() - math.pi**2 / 6) < 0.015
    assert abs((g < 0).double().mean().item() - math.exp(-1)) < 0.003


def naive_weights(q_head: torch.Tensor, keys: torch.Tensor, positions: list[int], query: int, head: int,
                  tau: float, noise: bool = True) -> dict[int, float]:
    """softmax((x + ζ) / τ) of one query head over `positions` (float64), ζ from the cache's hashed uniforms
    (ζ = 0 without `noise`: the ablation)."""
    x = torch.stack([q_head @ keys[p] for p in positions]) / math.sqrt(q_head.shape[-1])
    u = hashed_uniform(torch.tensor(positions), torch.tensor(query), head * keyformer.HEAD_STRIDE).double()
    w = torch.softmax((x - noise * torch.log(-torch.log(u))) / tau, dim=0)
    return dict(zip(positions, w.tolist(), strict=True))


def naive_keyformer(model, ids, tau_init: float, tau_delta: float,
                    noise: bool = True) -> list[tuple[list[set[int]], list[dict]]]:
    """Per KV head, the held positions and their sums after the prefill and after each decode step."""
    ref_k, _ = reference_kv(model, ids)
    ref_k = ref_k.double()
    q = layer0_queries(model, ids).double()
    n_kv, rep = ref_k.shape[0], q.shape[0] // ref_k.shape[0]

    def add(score: dict[int, float], h: int, query: int, positions: list[int], tau: float) -> None:
        for j in range(h * rep, (h + 1) * rep):
            for p, w in naive_weights(q[j, query], ref_k[h], positions, query, j, tau, noise).items():
                score[p] = score.get(p, 0.0) + w / rep

    held, scores = [], []
    for h in range(n_kv):
        score: dict[int, float] = {}
        for t in range(PROMPT):
            add(score, h, t, list(range(t + 1)), tau_init)
        protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
        others = sorted(set(range(PROMPT)) - protected, key=lambda x: -score[x])
        held.append(protected | set(others[: BUDGET - len(protected)]))
        scores.append({x: score[x] for x in held[h]})
    trace = [([set(x) for x in held], [dict(s) for s in scores])]
    for step, p in enumerate(range(PROMPT, TOTAL), start=1):
        for h in range(n_kv):
            if len(held[h]) == BUDGET:
                evicted = min((x for x in held[h] if GLOBAL <= x <= p - RECENT), key=lambda x: scores[h][x])
                held[h].remove(evicted)
                del scores[h][evicted]
            held[h].add(p)
            add(scores[h], h, p, sorted(held[h]), tau_init + step * tau_delta)
        trace.append(([set(x) for x in held], [dict(s) for s in scores]))
    return trace


# The code's defaults; τ ≠ 1 at prefill; without the noise, at τ = 1 (H2O's summed attention) and τ ≠ 1.
@pytest.mark.parametrize(("tau_init", "tau_delta", "noise"),
                         [(1.0, 0.01, "gumbel"), (0.5, 0.25, "gumbel"), (1.0, 0.0, "none"), (0.5, 0.25, "none")])
def test_keyformer_keeps_and_scores_as_the_naive_rule(tau_init, tau_delta, noise):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("keyformer", str(BUDGET), "dense", "--keyformer_tau_init", str(tau_init),
                                      "--keyformer_tau_delta", str(tau_delta), "--keyformer_noise", noise))
    ours = []

    def record(p: int) -> None:
        c = caches[0]
        ours.append((held_positions(c), [{int(x): float(c.score[0, h, s]) for s, x in enumerate(c.pos[0, h])
                                          if x >= 0} for h in range(c.n_kv_heads)]))

    with torch.inference_mode():
        run(model, ids, decode_one_token, record)
    expected = naive_keyformer(model, ids, tau_init, tau_delta, noise == "gumbel")
    for step, ((held, scores), (want_held, want_scores)) in enumerate(zip(ours, expected, strict=True)):
        assert held == want_held, f"step {step}"
        for h, head_scores in enumerate(scores):
            for x, s in head_scores.items():
                assert s == pytest.approx(want_scores[h][x], rel=1e-4, abs=1e-6), f"step {step} head {h} pos {x}"


def test_one_pass_over_the_prompts_attention_scores_and_seeds(monkeypatch):
    calls = []
    original = keyformer.causal_attention_blocks

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(keyformer, "causal_attention_blocks", counting)
    model = make_tiny_model()
    caches = attach(model, cache_args("keyformer", str(BUDGET)))
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, token_ids()[:, :PROMPT])
    assert len(calls) == len(caches)


def naive_chunked(q, k, chunk: int, budget: int) -> list[list[set[int]]]:
    """Layer 0's kept positions per KV head after every chunk: each held token's sum goes on from the queries it
    met in earlier chunks (over what was held then); the chunk's queries add theirs over held + the chunk."""
    n_kv, rep = k.shape[0], q.shape[0] // k.shape[0]
    held: list[list[int]] = [[] for _ in range(n_kv)]
    sums: list[dict[int, float]] = [{} for _ in range(n_kv)]
    history = []
    for start in range(0, PROMPT, chunk):
        new = list(range(start, min(start + chunk, PROMPT)))
        for h in range(n_kv):
            cand = held[h] + new
            for i, query in enumerate(new):
                seen = cand[: len(held[h]) + i + 1]
                for j in range(h * rep, (h + 1) * rep):
                    for p, w in naive_weights(q[j, query].double(), k[h].double(), seen, query, j, 1.0).items():
                        sums[h][p] = sums[h].get(p, 0.0) + w / rep
            held[h] = cand if len(cand) <= budget else naive_top(sums[h], cand, budget)
            sums[h] = {p: sums[h][p] for p in held[h]}
        history.append([set(x) for x in held])
    return history


@pytest.mark.parametrize("chunk", [5, 9])
def test_a_chunked_prefill_carries_the_sums_on(chunk):
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("keyformer", "10", "dense", "--prefill_chunk", str(chunk)))
    with torch.inference_mode():
        q, k, _ = layer0_qkv(model, ids[:, :PROMPT])
        expected = naive_chunked(q, k, chunk, 10)
        got = []
        for n in range(chunk, PROMPT + chunk, chunk):  # the same prompt cut after each chunk
            model.reset_caches()
            chunked_prefill(model, ids[:, : min(n, PROMPT)], chunk, decode_one_token)
            got.append(held_positions(caches[0]))
    assert got == expected
