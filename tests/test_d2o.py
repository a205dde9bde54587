"""Naive D2O: a whole run re-played here from the authors' definition with plain loops over layer 0 (float64; the
layer-0 keys, values and queries depend on the token ids only, and the run is teacher-forced): per KV head, the
attention each held token has received in all (its group's mean, over the keys the cache holds: merged ones
included), the eviction of the lowest sum outside the sinks and the recent window, and the merge of the evicted
key and value into the nearest kept key by cosine similarity, where the similarity averaged over the heads reaches
the moving threshold. Compared at every step with what the cache holds: positions, keys and values (1e-5)."""

from __future__ import annotations

import math

import pytest
import torch

import generate
from errors import run_cli
from generate import decode_one_token
from tests.conftest import make_tiny_model
from tests.strategy_matrix import GLOBAL, PROMPT, RECENT, TOTAL, attach, cache_args, held_positions, run, token_ids
from tests.test_strategies import layer0_queries, reference_kv


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm().clamp(min=1e-6) * b.norm().clamp(min=1e-6)))


def head_probs(q: torch.Tensor, keys: dict[int, torch.Tensor], positions: list[int], head: int, rep: int) -> dict:
    """Softmax of KV head `head`'s query heads over `positions` (keys by position), averaged over the group."""
    out = dict.fromkeys(positions, 0.0)
    for g in range(head * rep, (head + 1) * rep):
        scores = torch.stack([q[g] @ keys[p] / math.sqrt(q.shape[-1]) for p in positions])
        for p, a in zip(positions, torch.softmax(scores, 0).tolist(), strict=True):
            out[p] += a / rep
    return out


class NaiveD2O:
    """The rule over per-head dicts: held positions, keys and values by position, attention sums, the threshold."""

    def __init__(self, model, ids, budget: int, ema: float, merge: bool = True) -> None:
        self.k, self.v = (x.double() for x in reference_kv(model, ids))
        self.q = layer0_queries(model, ids).double()
        self.n_kv = self.k.shape[0]
        self.rep = self.q.shape[0] // self.n_kv
        self.budget, self.ema, self.merge = budget, ema, merge
        self.keys = [{p: self.k[h, p] for p in range(TOTAL)} for h in range(self.n_kv)]
        self.values = [{p: self.v[h, p] for p in range(TOTAL)} for h in range(self.n_kv)]
        self.tau: float | None = None
        self.merges = 0

    def gate(self, sims: list[list[float]]) -> list[bool]:
        """sims[h][i]: evicted token i's nearest similarity in head h; the threshold moves, then gates."""
        means = [sum(s[i] for s in sims) / len(sims) for i in range(len(sims[0]))]
        mean = sum(means) / len(means)
        self.tau = mean if self.tau is None else self.ema * self.tau + (1 - self.ema) * mean
        return [m >= self.tau for m in means]

    def prefill(self) -> None:
        prompt = list(range(PROMPT))
        self.attn = [dict.fromkeys(prompt, 0.0) for _ in range(self.n_kv)]
        for t in prompt:  # the prompt's causal attention over its own (unmerged) keys
            for h in range(self.n_kv):
                for p, a in head_probs(self.q[:, t], self.keys[h], prompt[: t + 1], h, self.rep).items():
                    self.attn[h][p] += a
        self.held = []
        if PROMPT <= self.budget:
            self.held = [set(prompt) for _ in range(self.n_kv)]
            return
        protected = set(range(GLOBAL)) | set(range(PROMPT - RECENT, PROMPT))
        for h in range(self.n_kv):
            others = sorted(set(prompt) - protected, key=lambda x, h=h: (-self.attn[h][x], x))
            self.held.append(protected | set(others[: self.budget - len(protected)]))
        if not self.merge:
            return
        evicted = [sorted(set(prompt) - held) for held in self.held]
        nearest = [[max(sorted(self.held[h]), key=lambda t, e=e, h=h: cos(self.keys[h][e], self.keys[h][t]))
                    for e in evicted[h]] for h in range(self.n_kv)]
        sims = [[cos(self.keys[h][e], self.keys[h][t]) for e, t in zip(evicted[h], nearest[h], strict=True)]
                for h in range(self.n_kv)]
        gates = self.gate(sims)
        for h in range(self.n_kv):
            added = {t: (torch.zeros_like(self.k[0, 0]), torch.zeros_like(self.v[0, 0]), 0) for t in self.held[h]}
            for i, (e, t) in enumerate(zip(evicted[h], nearest[h], strict=True)):
                if gates[i]:
                    dk, dv, n = added[t]
                    added[t] = (dk + sims[h][i] * self.keys[h][e], dv + sims[h][i] * self.values[h][e], n + 1)
                    self.merges += 1
            for t, (dk, dv, n) in added.items():
                self.keys[h][t] = (self.keys[h][t] + dk) / (1 + n)
                self.values[h][t] = (self.values[h][t] + dv) / (1 + n)

    def step(self, p: int) -> None:
        """Token p comes in: evict and merge if full, then its query attends over what each head holds."""
        if len(self.held[0]) == self.budget:
            evicted, targets, sims = [], [], []
            for h in range(self.n_kv):
                candidates = [x for x in self.held[h] if GLOBAL <= x <= p - RECENT]
                e = min(candidates, key=lambda x, h=h: (self.attn[h][x], x))
                others = sorted(self.held[h] - {e}) + [p]
                t = max(others, key=lambda x, h=h, e=e: cos(self.keys[h][e], self.keys[h][x]))
                evicted.append(e), targets.append(t), sims.append([cos(self.keys[h][e], self.keys[h][t])])
            gate = self.gate(sims)[0] and self.merge
            for h, (e, t) in enumerate(zip(evicted, targets, strict=True)):
                self.held[h].remove(e)
                if gate:
                    self.merges += 1
                    self.keys[h][t] = (self.keys[h][t] + sims[h][0] * self.keys[h][e]) / 2
                    self.values[h][t] = (self.values[h][t] + sims[h][0] * self.values[h][e]) / 2
        for h in range(self.n_kv):
            self.held[h].add(p)
            self.attn[h][p] = 0.0
            for x, a in head_probs(self.q[:, p], self.keys[h], sorted(self.held[h]), h, self.rep).items():
                self.attn[h][x] += a

    def trace(self) -> list:
        self.prefill()
        out = [self.snapshot()]
        for p in range(PROMPT, TOTAL):
            self.step(p)
            out.append(self.snapshot())
        return out

    def snapshot(self) -> tuple:
        return ([set(h) for h in self.held], [{x: self.keys[h][x] for x in held} for h, held in enumerate(self.held)],
                [{x: self.values[h][x] for x in held} for h, held in enumerate(self.held)])


def cache_trace(budget: int, *extra: str, storage: str = "dense") -> tuple[object, torch.Tensor, list]:
    """The d2o cache's held positions, keys and values by position (layer 0) after the prefill and each step."""
    model = make_tiny_model()
    ids = token_ids()
    caches = attach(model, cache_args("d2o", str(budget), storage, *extra))
    trace = []

    def record(p: int) -> None:
        c = caches[0]
        pos, keys, vals = c.pos[0].tolist(), c.keys()[0].double(), c.values()[0].double()
        trace.append((held_positions(c), [{x: keys[h, s] for s, x in enumerate(pos[h]) if x >= 0}
                                          for h in range(c.n_kv_heads)],
                      [{x: vals[h, s] for s, x in enumerate(pos[h]) if x >= 0} for h in range(c.n_kv_heads)]))

    with torch.inference_mode():
        run(model, ids, decode_one_token, record)
    return model, ids, trace


def assert_traces_equal(ours: list, expected: list) -> None:
    assert len(ours) == len(expected)
    for step, (got, want) in enumerate(zip(ours, expected, strict=True)):
        assert got[0] == want[0], f"step {step}: held positions"
        for part, name in ((1, "key"), (2, "value")):
            for h, by_pos in enumerate(want[part]):
                for x, expected_row in by_pos.items():
                    torch.testing.assert_close(got[part][h][x], expected_row, atol=1e-5, rtol=0,
                                               msg=lambda m, s=step, h=h, x=x, n=name: f"step {s} head {h} {n} {x}: "
                                                                                       f"{m}")


@pytest.mark.parametrize(("budget", "ema"), [(16, 0.5), (16, 0.9), (12, 0.0), (28, 0.5)],
                         ids=["prompt-compressed", "slow-threshold", "threshold-is-the-last-mean", "prompt-fits"])
def test_d2o_keeps_and_merges_as_the_naive_rule(budget, ema):
    """Prompt compression with merging (16 and 12 of 24), then one eviction and merge decision a step; a prompt that
    fits (28) leaves the threshold to the first decode eviction."""
    model, ids, ours = cache_trace(budget, "--d2o_ema", str(ema))
    naive = NaiveD2O(model, ids, budget, ema)
    assert_traces_equal(ours, naive.trace())
    decisions = (PROMPT - min(budget, PROMPT)) * naive.n_kv + (TOTAL - max(budget, PROMPT)) * naive.n_kv
    assert 0 < naive.merges < decisions, "some evictions merge and some do not"


def test_without_merging_every_held_token_keeps_its_own_key_and_value():
    """--d2o_no_merge: H2O's plain sums evict, the held keys and values are the tokens' own."""
    model, ids, ours = cache_trace(16, "--d2o_no_merge")
    naive = NaiveD2O(model, ids, 16, 0.5, merge=False)
    assert_traces_equal(ours, naive.trace())
    assert naive.merges == 0


@pytest.mark.parametrize("storage", ["dense", "4bit", "8bit", "kivi4", "think", "think_ring"])
def test_every_storage_rewrites_held_keys(storage):
    """Storage.write_keys: the targeted slots' keys become the new ones (KIVI: a slot in its residual exactly, a
    quantized slot within one step of its group's per-channel range; ThinK: the kept channels, the pruned ones
    staying zero, and with a ring of whole keys (the last 4 tokens: slot 14 among them) the whole key there), every
    other slot untouched."""
    model = make_tiny_model(n_layer=1)
    ring = ["--think_recent", "4"] if storage == "think_ring" else []
    caches = attach(model, cache_args("d2o", "16", storage.removesuffix("_ring"), *ring))
    with torch.inference_mode():
        model.reset_caches()
        model(token_ids()[:, :PROMPT], torch.arange(PROMPT))
        store = caches[0].storage
        before = store.keys().clone()
        H = before.shape[1]
        slots = torch.tensor([1, 9, 14]).view(1, 1, 3).expand(1, H, 3).contiguous()  # KIVI: 1 quantized, 9, 14 residual
        # Slot 1's new key the mean of its KIVI group's (slots 0-3) slots 0 and 2: within the group's per-channel
        # range (a key outside it is clamped to it).
        new = (before[:, :, [0, 3, 4]] + before[:, :, [2, 6, 7]]) / 2
        store.write_keys(slots, new)
        after = store.keys()
    expected = before.clone()
    expected[:, :, [1, 9, 14]] = new
    if storage.startswith("think"):  # only the kept channels are stored, but in the ring's slots (12-15)
        kept = (before[:, :, :12].abs().sum(2, keepdim=True) > 0)
        whole = torch.zeros(16, dtype=torch.bool).view(1, 1, 16, 1)
        whole[:, :, 12:] = storage == "think_ring"
        expected = torch.where(whole, expected, expected * kept)
    bits = {"4bit": 4, "8bit": 8, "kivi4": 4}.get(storage)
    step = 0.0 if bits is None else float((before.amax(2) - before.amin(2)).max()) / (2**bits - 1)
    per_token = storage in ("4bit", "8bit")
    if per_token:  # re-quantized per token: within a step of the new key's own range
        step = float((new.amax(-1) - new.amin(-1)).max()) / (2**bits - 1)
    torch.testing.assert_close(after, expected, atol=step + 1e-5, rtol=0)
    untouched = [s for s in range(16) if s not in (1, 9, 14)]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched]), "a slot outside the targets changed"


@pytest.mark.parametrize("flags,message", [
    (["--budget_allocation", "adakv"], "merges what it evicts into the tokens it keeps"),
    (["--cache_strategy", "heavy_hitter", "--prompt_compression_strategy", "d2o"],
     "into the tokens only a d2o cache keeps"),
])
def test_where_its_merge_cannot_run_d2o_gets_one_error_line_and_exit_2(flags, message, tiny_dir, capsys, tmp_path):
    stats = tmp_path / "stats.json"
    with pytest.raises(SystemExit) as exit_:
        run_cli(generate.main, ["--checkpoint_path", str(tiny_dir), "--prompt", "hello there", "--max_new_tokens",
                                "2", "--stats_json", str(stats), "--cache_strategy", "d2o", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not stats.exists()
