"""The strategy test matrix's shared pieces: every registered strategy and its debug_ twin, the storages,
the budgets, and how a matrix case builds its caches and runs a short prompt + decode on the tiny model.

Lists come from the registry, so a strategy is in every matrix the moment it is registered.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cache import KVCache
from cache_setup import cache_config, cache_specs
from cache_spec import build_caches
from gates import attach_random_gates
from generate import decode_one_token, prefill
from strategies import CACHE_STRATEGIES
from strategies.debug import DebugCache

PROMPT, NEW = 24, 16
TOTAL = PROMPT + NEW
GLOBAL, RECENT = 2, 4
BUDGETS = {"fraction": "0.5", "absolute": "16"}  # 20 and 16 tokens of 40
VOCAB = 256
TOKEN_CLASSES = {"special": torch.arange(VOCAB) < 4, "punct": (torch.arange(VOCAB) >= 4) & (torch.arange(VOCAB) < 40),
                 # about one token in four of the random test ids: enough separators for both of sepllm's ranks
                 "separator": (torch.arange(VOCAB) >= 4) & (torch.arange(VOCAB) % 4 == 1)}
# K/V storages; KIVI with small groups and residual so flushes, and evictions from both stores, happen.
STORAGES = {"dense": [], "2bit": ["--cache_bits", "2"], "4bit": ["--cache_bits", "4"], "8bit": ["--cache_bits", "8"],
            "kivi4": ["--cache_bits", "4", "--cache_quantization", "kivi", "--q_group_size", "4",
                      "--residual_length", "8"],
            # ThinK's thin keys: half the channels of every key, chosen by the prompt's last 8 queries.
            "think": ["--think_ratio", "0.5", "--think_window", "8"]}
STORAGE_BUDGETS = [("dense", "fraction"), ("dense", "absolute"), ("4bit", "fraction"), ("kivi4", "absolute")]
# Compiled, each case a compile (seconds): the two ends, dense and KIVI (its flush is the most static-shape
# work), and per-token codes, whose CPU step attends from the codes through its own op.
COMPILED_STORAGE_BUDGETS = [("dense", "fraction"), ("kivi4", "absolute"), ("4bit", "fraction")]
STRATEGIES = sorted(CACHE_STRATEGIES)
ALL = STRATEGIES + [f"debug_{s}" for s in STRATEGIES]
# The traits by which the code around a strategy's own update differs: the debug_ twin's wrapper (it hands
# the shadow attention only if it reads it), the layer (per-head slots, empty slots, token ids, gates), the
# prompt's profile. Code that wraps every strategy alike (a twin's wrapper, the whole step's embedding,
# layer loop and head, re-rotation by rank) is compiled for one strategy per set of traits (the first evicting
# one in name order), while each strategy's own update is compiled on its own (COMPILED_CASES): a new
# strategy joins these lists when it brings a new set of traits.
GRAPH_TRAITS = ("head_specific", "needs_attention", "needs_token_ids", "needs_token_classes", "needs_gates",
                "profiles_prompt", "variable_occupancy")


def one_per_trait_set(names: list[str]) -> list[str]:
    """The first of `names` (not `full`) for each set of GRAPH_TRAITS among them."""
    chosen: dict[tuple, str] = {}
    for name in names:
        traits = tuple(bool(getattr(CACHE_STRATEGIES[name], t, False)) for t in GRAPH_TRAITS)
        if name != "full":
            chosen.setdefault(traits, name)
    return list(chosen.values())


TRAIT_REPRESENTATIVES = one_per_trait_set(STRATEGIES)
# The compiled matrix's cases: every strategy on dense storage, KIVI and 4-bit codes, and the twins of
# TRAIT_REPRESENTATIVES on dense storage (a twin's graph is its wrapper around the strategy's own cache,
# whose graph the strategy's case compiles; every twin runs eager in the matrix). Each case names its backend.
# Inductor lowers every strategy on dense storage, and TRAIT_REPRESENTATIVES on the codes; the other strategies
# on the codes are traced by dynamo and AOT autograd and run eagerly (aot_eager): the same one graph, guards and
# guard-free steps, so a strategy whose update breaks the graph, recompiles or changes what a guard reads on a
# storage still fails, while what inductor would lower beyond the dense case is the storage's own code
# (dequantizing, KIVI's flush), the same around every strategy. A cold inductor compile is ~3-10 s here (KIVI's
# the most), a trace ~1-2 s.
COMPILED_TWINS = [f"debug_{s}" for s in TRAIT_REPRESENTATIVES]


def compile_backend(strategy: str, storage: str, lowered: list[str]) -> str:
    """Inductor on dense storage and for the strategies in `lowered`; elsewhere aot_eager (see above)."""
    return "inductor" if storage == "dense" or strategy in lowered else "aot_eager"


COMPILED_CASES = ([(s, *COMPILED_STORAGE_BUDGETS[0], "inductor") for s in STRATEGIES + COMPILED_TWINS]
                  + [(s, *sb, compile_backend(s, sb[0], TRAIT_REPRESENTATIVES))
                     for sb in COMPILED_STORAGE_BUDGETS[1:] for s in STRATEGIES])
# The budget-allocation axis (--budget_allocation adakv, budget_allocation.py): every head-specific strategy that
# can pool its heads (hybrid sizes them itself) and its debug_ twin, on dense and per-token-quantized storage
# (KIVI is refused). A short SnapKV window, so heavy_hitter's prompt rule protects less than the budget and
# heads really receive different quotas.
# Caches that hold a variable number of tokens per head (threshold, duo_attention): released slots stay empty.
VARIABLE = {s for s, c in CACHE_STRATEGIES.items() if getattr(c, "variable_occupancy", False)}
# The strategies adakv pools (budget_allocation.check_budget_allocation refuses the others, a merging cache too).
ADAKV_STRATEGIES = [s for s, c in sorted(CACHE_STRATEGIES.items())
                    if c.head_specific and not c.profiles_prompt and s not in VARIABLE and not c.merges_keys]
ADAKV = ADAKV_STRATEGIES + [f"debug_{s}" for s in ADAKV_STRATEGIES]
ADAKV_STORAGES = ["dense", "4bit"]
# Compiled: every strategy on dense and per-token-quantized storage, and on dense storage the twins of one
# strategy per set of traits. Inductor lowers those strategies and twins, on both storages; the others are
# traced (aot_eager, as in COMPILED_CASES): each strategy's own update is lowered by inductor in COMPILED_CASES'
# dense case, and what pooling adds (budget_allocation.py's quotas and per-head selection) is the same code
# around every strategy of a set of traits.
ADAKV_REPRESENTATIVES = one_per_trait_set(ADAKV_STRATEGIES)
ADAKV_COMPILED_TWINS = [f"debug_{s}" for s in ADAKV_REPRESENTATIVES]
ADAKV_COMPILED_CASES = ([(s, "dense", "inductor") for s in ADAKV_COMPILED_TWINS]
                        + [(s, storage, "inductor" if s in ADAKV_REPRESENTATIVES else "aot_eager")
                           for storage in ADAKV_STORAGES for s in ADAKV_STRATEGIES])
ALLOCATIONS = {"uniform": [], "adakv": ["--budget_allocation", "adakv", "--snapkv_window", "4"]}
# --prefill_chunk (KVCache.prefill_chunk_tokens): every strategy and twin but those that declare why they
# cannot compress a prompt chunk by chunk (cache_spec refuses the flag for them).
CHUNK_REFUSED = [s for s in ALL if CACHE_STRATEGIES[s.removeprefix("debug_")].chunked_prefill_refusal]
CHUNKABLE = [s for s in ALL if s not in CHUNK_REFUSED]
# Those that take chunks, but not with a head-adaptive pool (cache_spec refuses the pair).
CHUNK_POOL_REFUSED = [s for s in CHUNKABLE if CACHE_STRATEGIES[s.removeprefix("debug_")].chunked_prefill_conflict(
    SimpleNamespace(budget_allocation="adakv"))]


# Settings that make a strategy's rule act on the matrix's 24-token prompt (LagKV's default partition of
# 128 tokens would score none of it: every head would keep the newest tokens, the same in every head), and
# within the matrices' short contexts (KVzip's reconstruction pass reads the context twice unless chunked:
# context + 4 tokens; the unchunked pass is checked against its oracle in test_strategies_more), and CurDKV's
# windows tiling it (with its default of 16 the last 8 tokens share a window of their own and outrank the rest
# in every head alike, so Ada-KV's heads all get the same quota; the default is checked against its oracle in
# test_curdkv).
CURDKV_WINDOW = 6
MATRIX_FLAGS = {"lagkv": ["--lag_size", "4"], "kvzip": ["--kvzip_chunk", "4"],
                "curdkv": ["--curdkv_window", str(CURDKV_WINDOW)]}


def cache_args(strategy: str, budget: str, storage: str = "dense", *extra: str):
    own = MATRIX_FLAGS.get(strategy.removeprefix("debug_"), [])  # before `extra`, which may override it
    return cache_config(["--cache_strategy", strategy, "--max_cache_length", budget, "--global_tokens",
                         str(GLOBAL), "--recent_window", str(RECENT), *STORAGES[storage], *own, *extra])


def attach(model, args, device: str = "cpu", dtype: torch.dtype = torch.float32, new: int = NEW) -> list[KVCache]:
    specs = cache_specs(args, model.args, PROMPT, new)
    if model.layers[0].attention.gate is None:  # only caches that need gates (gated) make the model use them
        attach_random_gates(model, seed=0)
    a = model.args
    caches = build_caches(specs, 1, a.n_kv_head, a.head_dim, PROMPT + new, dtype, device, token_classes=TOKEN_CLASSES)
    model.setup_caches(caches)
    return caches


def inner(cache: KVCache) -> KVCache:
    return cache.shadow if isinstance(cache, DebugCache) else cache


def held_positions(cache: KVCache) -> list[set[int]]:
    """Positions held per KV head (batch 0)."""
    c = inner(cache)
    pos = c.pos[0].expand(c.n_kv_heads, -1)
    return [set(pos[h][c.mask[0, h, 0]].tolist()) for h in range(c.n_kv_heads)]


def token_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, TOTAL), generator=torch.Generator().manual_seed(seed))


def run(model, ids, step_fn, check) -> None:
    model.reset_caches()
    prefill(model, ids[:, :PROMPT])
    check(PROMPT - 1)
    for p in range(PROMPT, TOTAL):
        step_fn(model, ids[:, p : p + 1], torch.tensor([p], device=ids.device))
        check(p)


def prompt_then_rest(model, ids: torch.Tensor, chunk: bool, prompt: int = 16) -> torch.Tensor:
    """Prefill the first `prompt` tokens of `ids` on reset caches, then feed positions prompt..PROMPT-1 as one
    appended chunk (KVCache.append) or one decode step each; the last position's logits."""
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :prompt])
        if chunk:
            return model(ids[:, prompt:PROMPT], torch.arange(prompt, PROMPT), append=True)[:, -1]
        for p in range(prompt, PROMPT):
            out = decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]))
        return out
