"""The KV cache contract (docs/DESIGN.md §4), `register_strategy`, the declaration of a strategy's own
settings (`Setting`) and the `full` cache; every other strategy is a file of strategies/, whose
`__init__` is the registry.

One `KVCache` per attention layer. Every tensor is a registered buffer of fixed shape, so a compiled
decode step never recompiles:

- `storage` (kv_storage.py): the K/V of L slots, L = this layer's budget: dense, quantized per token
  (`--cache_bits`) or KIVI's residual scheme; `keys()` / `values()` give [B, n_kv_heads, L, head_dim].
  Keys are stored after RoPE at their original position; eviction leaves gaps, nothing is re-rotated
  (with `rerotate_positions` they are stored before RoPE and rotated by rank: rerotation.py).
- `pos`: original position held in each slot, -1 when empty: [B, n_kv_heads or 1, L] (per head only
  for head-specific strategies, which evict different tokens in different heads).
- `mask`: which slots hold a token, [B, n_kv_heads, 1, L] (the shape attention broadcasts against).
- `inserted`: tokens that went through this cache, per head [B, n_kv_heads]; `filled`: slots in use, filled
  from slot 0 (the next empty slot) until the cache is full, [B, n_kv_heads or 1].
- With `--budget_allocation adakv` (budget_allocation.py) the heads share one pool: the storage has one head of
  n_kv·L slots and `pos` / `mask` / per-slot state are per head over the pool; `pooled` says so to the model.
- Rows (the batch, B): every buffer but the declared `row_shared_buffers` has the row first. Rows may hold
  different sequences: at decode `input_pos` is [1] (shared) or [B] (one position per row), and each row
  has its own budget (`row_budget` [B], `set_row_budgets`) within the L slots, which are the largest row's.
  `row(b)` is the row context: inside it the cache is row b alone, a batch-1 cache (prompts of different
  lengths are stored in it row by row, with no padding, even when packed into one forward pass).

A strategy is a small subclass with one scoring rule, used twice: `token_scores` scores the tokens the
cache holds (the lowest unprotected one is evicted at each decode step) and `prompt_scores` scores the
prompt's tokens when the prompt exceeds the budget (the best ones are kept; prompt_compression.py does
the shared top-k and protection). It names the shared settings it reads (global_tokens, recent_window,
seed: cache_spec.py) and declares its own (`settings`, each a `Setting`: flag, default, help, range).
Slots are chosen with tensor ops only (the next empty slot, else the argmin score), so the decode step
has no host syncs or data-dependent shapes.

Chunked prefill (`--prefill_chunk N`) is the `ChunkedPrefill` mixin of cache_chunking.py.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from cache_chunking import ChunkedPrefill
from errors import UserError
from kv_storage import DENSE, Storage, StorageSpec, make_storage, scatter_slots
from prompt_compression import compress_prompt


def finite_float(text: str) -> float:
    """argparse type: a float that is neither NaN nor infinite (float() accepts 'nan' and 'inf')."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


@dataclass(frozen=True)
class Setting:
    """A hyper-parameter a strategy owns, declared once in its class (`settings`): its flag `--name`, its
    YAML preset key, its range check, its column in --print_cache_spec and its place in the run identity
    are all derived from this (cache_spec loops over the registry)."""

    name: str
    default: object
    help: str
    type: Callable[[str], object] | None = int  # None: a switch (store_true)
    choices: tuple[str, ...] | None = None
    nargs: str | None = None  # "+": a list, each value checked
    low: float | None = None  # the valid range, inclusive unless low_open
    high: float | None = None
    low_open: bool = False
    odd: bool = False
    # Read by the strategy's prompt rule, so every cache that uses the rule (--prompt_compression_strategy)
    # gets it, through `prompt_settings`, rather than only caches of this strategy.
    prompt_rule: bool = False
    # Read only while another setting of the strategy has this value (SnapKV's window under the SnapKV prompt
    # rule): typed otherwise, the flag is refused as ignored (ignored_flags.py).
    read_if: tuple[str, object] | None = None
    check_value: Callable[[object], object] | None = None  # raises UserError (e.g. a parser of the value)
    # A calibration file's setting (gates, head roles, query filters): the folder of shipped files its default
    # comes from. The file given, else that folder, is an input of every run that reads the setting, hashed into
    # its identity (eval.results.input_fingerprints): a recalibrated file must not pass for the finished run's.
    shipped_files: Path | None = None

    def add_argument(self, group: argparse._ArgumentGroup, owner: str) -> None:
        text = f"{owner}: {self.help}"
        if self.type is None:
            group.add_argument(f"--{self.name}", action="store_true", help=text)
        else:
            default = list(self.default) if self.nargs else self.default
            group.add_argument(f"--{self.name}", type=self.type, choices=self.choices, nargs=self.nargs,
                               default=default, help=text)

    def check(self, value: object) -> None:
        """A UserError for a value outside the declared range."""
        if self.nargs:
            for item in value:
                Setting.check(replace(self, nargs=None), item)
            return
        if self.check_value is not None:
            self.check_value(value)
        if self.low is None or value is None:
            return
        below = value <= self.low if self.low_open else value < self.low
        if self.odd and (below or value % 2 == 0):
            raise UserError(f"--{self.name} must be a positive odd number, got {value:g}")
        if self.high is not None and (below or value > self.high):
            raise UserError(f"--{self.name} must be in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}], "
                            f"got {value:g}")
        if below:
            raise UserError(f"--{self.name} must be {'>' if self.low_open else '≥'} {self.low:g}, got {value:g}")


class KVCache(ChunkedPrefill, nn.Module):
    name: ClassVar[str] = ""
    registered: ClassVar[bool] = False  # set by @register_strategy
    # Names of the shared cache_spec flags this strategy reads (global_tokens, recent_window, seed); its own
    # `settings` are added to them by @register_strategy (all but prompt-rule ones, see Setting.prompt_rule).
    hyperparameters: ClassVar[tuple[str, ...]] = ()
    # The hyper-parameters this strategy owns (flags, presets, checks and identity come from them).
    settings: ClassVar[tuple[Setting, ...]] = ()
    # Evicts different tokens in different KV heads (then `pos` is per head).
    head_specific: ClassVar[bool] = False
    # Wants each decode step's attention probabilities through `update_state`.
    needs_attention: ClassVar[bool] = False
    # Wants the token ids (prompt and each decoded token) through `observe_tokens`.
    needs_token_ids: ClassVar[bool] = False
    # Wants the tokenizer's special/punctuation masks (strategies.token_ids.token_classes) through `configure`.
    needs_token_classes: ClassVar[bool] = False
    # Wants per-token log forget gates from the model's learned gates through `observe_gates`.
    needs_gates: ClassVar[bool] = False
    # Chooses the kept prompt tokens itself (its own `prefill`), so it pairs with no other prompt rule.
    profiles_prompt: ClassVar[bool] = False
    # Changes held tokens' values (merging an evicted token into them: `before_write` while decoding,
    # `merge_evicted_prompt` at a compressed prefill), so a held slot's V is no longer its token's; and its keys too.
    merges_values: ClassVar[bool] = False
    merges_keys: ClassVar[bool] = False
    # Per-slot float32 state [B, n_kv, L] (zeros; L: the slots, a pool's under adakv) the base registers
    # under these names: the strategy fills it in after_prefill / after_insert.
    slot_buffers: ClassVar[tuple[str, ...]] = ()
    # One K/V pool of n_kv·L slots shared by the heads (budget_allocation.py, --budget_allocation adakv):
    # keys()/values() are [B, 1, n_kv·L, D] and `mask` [B, n_kv, 1, n_kv·L] says which slots each head holds.
    pooled: ClassVar[bool] = False
    # The layer's index of this cache's first KV head: 0, but inside a pool's head view (PooledCache.head_view) the
    # viewed head's, so what is drawn per head (keyformer's noise) stays the head's own.
    first_kv_head: int = 0
    # Inside a pool's head view during a chunk's re-prefill: what the rule takes over the layer's heads together,
    # gathered from every head's virtual prompt (`head_statistics`; PooledCache.gather_layer_statistics), and under
    # "heads" each head's own.
    layer_statistics: dict | None = None
    # Buffers without a row dimension: the same for every row (the row context leaves them whole).
    row_shared_buffers: ClassVar[tuple[str, ...]] = ()
    # Buffers that are settings, not state (set when configured, the row budgets next to them): reset keeps them.
    setting_buffers: ClassVar[tuple[str, ...]] = ()
    # Why its prompt rule needs its own cache (lacache reads its ladder, d2o merges into what it keeps), so that it
    # compresses no other cache's prompt (cache_spec.check_prompt_compression); None: it may.
    prompt_rule_needs_own_cache: ClassVar[str | None] = None

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        max_cache_length: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        storage: StorageSpec = DENSE,
        capacity_needed: int | None = None,
        **hyperparameters: object,
    ) -> None:
        super().__init__()
        # prompt + new tokens: a budget at least this large never evicts (and skips scoring).
        self.capacity_needed = capacity_needed if capacity_needed is not None else 1 << 62
        unknown = set(hyperparameters) - set(self.hyperparameters)
        if unknown:
            raise TypeError(f"{self.name} does not read hyper-parameters {sorted(unknown)}")
        self.max_cache_length = max_cache_length
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.storage_spec = storage
        self.global_tokens = int(hyperparameters.get("global_tokens", 0))
        self.recent_window = int(hyperparameters.get("recent_window", 0))
        self.hparams = dict(hyperparameters)
        B, H, L, D = batch_size, n_kv_heads, max_cache_length, head_dim
        kw = dict(device=device)
        self.storage = make_storage(storage, B, 1 if self.pooled else H, L, D, dtype, device, self.capacity_needed)
        pos_heads = H if self.head_specific else 1
        self.register_buffer("pos", torch.full((B, pos_heads, L), -1, dtype=torch.long, **kw))
        self.register_buffer("mask", torch.zeros(B, H, 1, L, dtype=torch.bool, **kw))
        self.register_buffer("inserted", torch.zeros(B, H, dtype=torch.long, **kw))
        self.register_buffer("filled", torch.zeros(B, pos_heads, dtype=torch.long, **kw))
        for name in self.slot_buffers:
            self.register_buffer(name, torch.zeros(B, H, L, **kw))
        # Each row's budget within the L slots (a setting, kept by reset): rows of different lengths get
        # different budgets from a fractional --max_cache_length, as each would alone.
        self.register_buffer("row_budget", torch.full((B, 1), L, dtype=torch.long, **kw))  # [B, 1]: against [B, heads]
        self.row_budgets, self.row_capacities = [L] * B, [self.capacity_needed] * B
        self.never_full = self.rows_never_full()
        # chunk_queries, chunk_keys and chunk_values of each row, between its turns
        self.row_chunk_state: dict[int, tuple[Tensor | None, ...]] = {}

    # ---- rows ---------------------------------------------------------------------------------------------

    def set_row_budgets(self, budgets: list[int], capacities: list[int]) -> None:
        """Row b may hold `budgets[b]` ≤ L tokens and will see `capacities[b]` (its prompt + new tokens)."""
        if len(budgets) != len(self.row_budgets) or len(capacities) != len(budgets):
            raise ValueError(f"{len(budgets)} row budgets for {len(self.row_budgets)} rows")
        if max(budgets) > self.max_cache_length or max(capacities) > self.capacity_needed:
            raise ValueError(f"row budgets {budgets} exceed the cache's {self.max_cache_length} slots")
        self.row_budgets, self.row_capacities = list(budgets), list(capacities)
        self.never_full = self.rows_never_full()
        self.row_budget.copy_(torch.tensor(budgets, dtype=torch.long, device=self.row_budget.device)[:, None])

    def rows_never_full(self) -> bool:
        """No row's budget can fill (the full cache, budgets above the sequences, or slots sized for all that
        follows the prompt: `evicts_after_prompt` False): slots need no scores (read as `never_full`, kept with
        the budgets: decode steps ask at every layer)."""
        return not self.evicts_after_prompt or all(
            b >= c for b, c in zip(self.row_budgets, self.row_capacities, strict=True))

    @contextmanager
    def row(self, b: int) -> Iterator[KVCache]:
        """The row context: inside it this cache (its storage and shadow too) is row b alone, a batch-1
        cache with that row's budget. Buffers are replaced by views of row b, so whatever the cache does in
        place lands in the batched buffers; they are put back on exit."""
        swapped, limits = [], []
        for module in self.modules():
            shared = getattr(module, "row_shared_buffers", ())
            for name, buf in list(module._buffers.items()):
                if buf is not None and name not in shared:
                    swapped.append((module, name, buf))
                    module._buffers[name] = buf[b : b + 1]
            if isinstance(module, KVCache):
                limits.append((module, module.max_cache_length, module.capacity_needed, module.row_budgets,
                               module.row_capacities, module.chunk_state()))
                module.max_cache_length, module.capacity_needed = module.row_budgets[b], module.row_capacities[b]
                module.row_budgets, module.row_capacities = [module.row_budgets[b]], [module.row_capacities[b]]
                module.never_full = module.rows_never_full()
                # A chunked prefill's held queries are the row's own: rows prefilled chunk by chunk together
                # (packed_prefill.prefill_packed_chunks) take turns within each chunk.
                row_state = module.row_chunk_state.get(b, (None,) * 3)
                module.chunk_queries, module.chunk_keys, module.chunk_values = row_state
        try:
            yield self
        finally:
            for module, name, buf in swapped:
                module._buffers[name] = buf
            for module, *values, batch_state in limits:
                module.row_chunk_state[b] = module.chunk_state()
                module.max_cache_length, module.capacity_needed, module.row_budgets, module.row_capacities = values
                module.chunk_queries, module.chunk_keys, module.chunk_values = batch_state
                module.never_full = module.rows_never_full()  # a layer setting made inside the row holds after it

    # ---- storage (kv_storage.py, think_storage.py): dense, quantized per token, KIVI, ThinK -------------------

    def keys(self) -> Tensor:
        return self.storage.keys()

    def values(self) -> Tensor:
        return self.storage.values()

    # ---- the contract used by model.Attention ------------------------------------------------------------

    def prefill(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor, k_store: Tensor | None = None) -> None:
        """Store the prompt (positions `input_pos` from 0; k, v [B, n_kv, T, D] after RoPE) in the empty
        cache, compressing it when it exceeds the budget. q [B, n_head, T, D] is there for compressors
        and initial scores that need the prompt's attention. `k_store`: the keys to store when they are not
        the scored ones (before RoPE, under `rerotate_positions`)."""
        B, H, T, _ = k.shape
        self.observe_prompt_values(v)
        compress = T > self.prompt_target()
        if compress:
            keep = self.select_prompt_tokens(input_pos, k, v, q)  # [B, pos_heads, target], sorted
        else:
            keep = torch.arange(T, device=k.device).view(1, 1, T).expand(B, self.pos.shape[1], T)
        n = keep.shape[-1]
        stored = k if k_store is None else k_store
        if compress:  # a prompt that fits is stored as it is (no copy through the identity gather)
            gather = keep.expand(B, H, n)[..., None].expand(B, H, n, k.shape[-1])
            stored, v = self.merge_evicted_prompt(keep, stored, v, stored.gather(2, gather), v.gather(2, gather))
        # Into slots 0..n-1. The prompt's queries go with it: a storage may choose how to store by them
        # (ThinK's key channels).
        self.storage.write_prefix(stored, v, q)
        # input_pos [T], or a chunked prefill's held tokens + chunk at their true positions [B, pos_heads, T]
        positions = input_pos.view(1, 1, T) if input_pos.dim() == 1 else input_pos
        self.pos[:, :, :n] = positions.expand(B, keep.shape[1], T).gather(2, keep)
        self.mask[:, :, 0, :n] = True
        self.inserted.fill_(T)
        self.filled.fill_(n)
        self.after_prefill(keep, input_pos, k, q)

    def insert(self, input_pos: Tensor, k: Tensor, v: Tensor) -> None:
        """Insert one token (input_pos [1], or [B]: one per row; k, v [B, n_kv, 1, D]): its strategy chooses the
        slot, evicting when the cache is full."""
        self.observe_token_values(v)
        slot = self.choose_slot(input_pos)  # [B, pos_heads]
        k, v = self.before_write(slot, input_pos, k, v)
        B, H = k.shape[:2]
        head_slot = slot.expand(B, H)
        self.storage.write(head_slot[..., None], k, v)
        scatter_slots(self.pos, 2, slot[..., None], row_positions(input_pos).expand(B, slot.shape[1], 1))
        scatter_slots(self.mask, 3, head_slot[..., None, None], True)
        self.inserted += 1
        self.filled += (self.filled < self.row_budget).long()
        self.after_insert(slot, input_pos, k)

    def append(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Insert a chunk of T tokens after the prompt (input_pos [T]; k, v [B, n_kv, T, D]) into empty slots,
        evicting nothing: the question of the kvpress protocol, appended uncompressed in one forward step.
        Each token goes through `insert` so per-token state (scores, gates, KIVI flushes) is exactly a
        decode step's; attention statistics are not updated for a chunk. Returns (keys, values, mask)."""
        T = k.shape[2]
        if self.room() < T:
            raise ValueError(f"a {self.name} cache has room for {self.room()} tokens per head, not a chunk of {T}")
        for i in range(T):
            self.before_chunk_token(i)
            self.insert(input_pos[i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1])
        return self.keys(), self.values(), self.mask

    def room(self) -> int:
        """Empty slots left before this cache evicts (an eager read, for callers choosing how to feed)."""
        return int((self.row_budget - self.filled).min())

    def before_chunk_token(self, i: int) -> None:
        """Hook: token i of a chunk (`append`) is next; per-token inputs the model passed for the whole chunk
        (gates, token ids) are moved into place here."""

    def observe_prompt_values(self, v: Tensor) -> None:
        """Values [B, n_kv, T, D] of the prompt about to be scored (a chunked prefill's virtual prompt too, one
        head's under adakv): a prompt rule sees keys and queries only, so a strategy that weighs tokens by their
        values keeps what it needs here (strategies.critical_kv.PromptValueNorms)."""

    def observe_token_values(self, v: Tensor) -> None:
        """Values [B, n_kv, 1, D] of the token `insert` is about to store (this class's and adakv's pooled
        insert), before its slot is chosen and `after_insert` runs (which receives its key only)."""

    def update_state(self, probs: Tensor) -> None:
        """This step's attention probabilities over the slots, [B, n_kv, rep, L] (rep query heads per KV head)."""

    def observe_tokens(self, token_ids: Tensor, chunk: bool = False) -> None:
        """Token ids [B, T] entering the model (the prompt, then one per step), for needs_token_ids caches.
        `chunk`: a prompt chunk's, even of one token (the kvpress protocol's last chunk), not a decode step's."""

    def observe_gates(self, log_gates: Tensor, chunk: bool = False) -> None:
        """Log forget gates [B, n_kv, T] (float32, ≤ 0) of the tokens entering this layer, for needs_gates
        caches; called before `prefill` / `insert` with the same tokens. `chunk`: as observe_tokens'."""

    def reset(self) -> None:
        self.chunk_queries = self.chunk_keys = self.chunk_values = None
        for name, buf in self.named_buffers(recurse=False):
            if name != "row_budget" and name not in self.setting_buffers:
                buf.fill_(-1) if name == "pos" else buf.zero_()
        self.storage.reset()
        for child in self.children():
            if isinstance(child, KVCache):  # a debug cache's shadow
                child.reset()

    # ---- what a strategy overrides -------------------------------------------------------------------------

    def token_scores(self, input_pos: Tensor) -> Tensor:
        """Importance of every slot, [B, pos_heads, L]; the lowest unprotected one is evicted."""
        raise NotImplementedError

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor | None:
        """The same rule over the prompt when it exceeds `cache`'s budget: [B, 1 or n_kv, T], the best
        are kept. `cache` is the layer's cache (of this strategy, or of another that uses this one as its
        --prompt_compression_strategy): settings such as the seed are read from it. None: this strategy
        has no rule to choose prompt tokens by (the full cache keeps everything)."""
        return None

    @classmethod
    def head_statistics(cls, cache: KVCache, k: Tensor, q: Tensor) -> dict[str, Tensor] | None:
        """As a prompt rule, what of one head's prompt (k [B, 1, T, D], q [B, rep, T, D]) the rule takes over
        the layer's heads together, [B, 1, n] each (None: nothing; a pool's re-prefill, which scores its heads one
        at a time, gathers these from every head: budget_allocation.PooledCache.gather_layer_statistics)."""
        return None

    @classmethod
    def prompt_protected_window(cls, cache: KVCache) -> int:
        """Most recent prompt tokens this rule always keeps (the cache's recent window by default)."""
        return cache.recent_window

    def select_prompt_tokens(self, input_pos: Tensor, k: Tensor, v: Tensor, q: Tensor) -> Tensor:
        """Prompt tokens kept when the prompt exceeds the budget: sorted indices [B, pos_heads, L]."""
        return compress_prompt(self, input_pos, k, q)

    def after_prefill(self, keep: Tensor, input_pos: Tensor, k: Tensor, q: Tensor) -> None:
        """Hook: initialise per-token state of the kept prompt tokens (slots 0..n-1)."""

    def before_write(self, slot: Tensor, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Hook: the slot [B, pos_heads] chosen for the incoming token (k, v [B, n_kv, 1, D], as stored), before it
        is overwritten (the token it evicts still readable there); returns the key and value to store for the
        incoming token (`merges_values`, `merges_keys`)."""
        return k, v

    def merge_evicted_prompt(self, keep: Tensor, k: Tensor, v: Tensor, kept_k: Tensor,
                             kept_v: Tensor) -> tuple[Tensor, Tensor]:
        """Hook: a compressed prompt's K/V to store, kept_k / kept_v [B, n_kv, n, D] (the tokens `keep` [B,
        pos_heads, n] chooses out of the whole prompt's k, v [B, n_kv, T, D], as stored), before they are
        written: a strategy that merges what it evicts into what it keeps returns them changed."""
        return kept_k, kept_v

    def after_insert(self, slot: Tensor, input_pos: Tensor, k: Tensor) -> None:
        """Hook: initialise per-token state of the slot [B, pos_heads] that just received a token."""

    # Settings from cache_spec.build_caches (see `configure`).
    layer_idx: int = 0
    # The layers holding this layer's strategy (all of a model's but its sliding layers, unless --cache_strategy
    # gives a pattern): how many, and this one's place among them (lacache's ladder spreads its rungs over them).
    strategy_layers: int = 1
    strategy_layer_idx: int = 0
    # The strategy whose `prompt_scores` chooses the kept prompt tokens (--prompt_compression_strategy).
    prompt_compressor: type[KVCache] | None = None
    # The prompt-rule settings of the layer's --prompt_compression_strategy (Setting.prompt_rule), by name.
    prompt_settings: ClassVar[dict[str, object]] = {}
    # Compress a long prompt to this many tokens instead of the whole budget (None: the budget), leaving the
    # other slots for what follows: the kvpress protocol's per-item budget (eval --protocol kvpress).
    prompt_budget: int | None = None
    # False when nothing is evicted after the prompt (the kvpress protocols size the slots for the question and
    # answer): a strategy may then skip the statistics only decode eviction reads (heavy_hitter's H2O sums),
    # and slots are taken in order, unscored (`never_full`).
    evicts_after_prompt: bool = True
    # A sliding layer's window cache (model_policies.py; its window, 0 otherwise) is the model's own attention:
    # the two settings above, which the kvpress protocols give every cache, leave it alone (it keeps the prompt's
    # last `window` tokens and slides on after it, as the layer attends).
    sliding_window: int = 0
    # Keys are stored before RoPE and the layer rotates them by rank at each step (--rerotate_positions,
    # rerotation.py): the cache itself only stores what it is given.
    rerotate_positions: bool = False

    def configure(self, **settings: object) -> None:
        """Layer-level settings that are not strategy hyper-parameters (layer index, prompt compressor)."""
        if (classes := settings.get("token_classes")) is not None:
            # The vocabulary masks live on the cache's device: a host tensor read every decode step would be a
            # host-to-device copy per step (and cannot be captured in a CUDA graph).
            settings["token_classes"] = {name: mask.to(self.pos.device) for name, mask in classes.items()}
        for key, value in settings.items():
            if not hasattr(type(self), key):
                raise TypeError(f"unknown cache setting {key!r}")
            if not (self.sliding_window and key in ("prompt_budget", "evicts_after_prompt")):
                setattr(self, key, value)
        self.never_full = self.rows_never_full()

    def setting(self, setting: Setting) -> object:
        """The value of a declared setting for this cache: its own hyper-parameter, else what its prompt
        rule was given, else the declared default."""
        return self.hparams.get(setting.name, self.prompt_settings.get(setting.name, setting.default))

    def budget(self) -> int:
        """The token budget this layer was given (what statistics report)."""
        return self.max_cache_length

    def prompt_target(self) -> int:
        """Tokens a prompt is compressed to: `prompt_budget` when set (the rest of the slots stay empty for
        what follows the prompt), else the whole budget."""
        return min(self.prompt_budget, self.max_cache_length) if self.prompt_budget else self.max_cache_length

    def choose_slot(self, input_pos: Tensor) -> Tensor:
        """The next empty slot while there is one, else the lowest-scoring unprotected token."""
        filled = self.filled
        if self.never_full:
            # Never full (the full cache, or a budget above the sequence): skip scoring. A copy, since insert
            # advances `filled` in place before after_insert reads the slot.
            return filled.clone()
        # Slots past a row's budget are empty, and empty slots (pos −1) are always protected: never chosen.
        scores = self.token_scores(input_pos).masked_fill(self.protected(input_pos), float("inf"))
        return torch.where(filled < self.row_budget, filled, scores.argmin(dim=-1))

    def protected(self, input_pos: Tensor) -> Tensor:
        """Slots never evicted: global (sink) tokens and the recent window, [B, pos_heads, L].

        The window counts the token being inserted, so after the insert exactly the `recent_window`
        most recent positions are held.
        """
        return (self.pos < self.global_tokens) | (self.pos > row_positions(input_pos) - self.recent_window)

    # ---- statistics ----------------------------------------------------------------------------------------

    def held_tokens(self) -> Tensor:
        """Tokens held per head, [B, n_kv]."""
        return self.mask.sum(dim=(-1, -2))

    def compression_ratio_per_head(self) -> Tensor:
        """1 − (held × bits/16) / seen per head (docs/DESIGN.md §6), [B, n_kv]; 0 for a head that saw nothing.
        Tokens a KIVI residual keeps unquantized count at 16 bits; a ThinK token at the share of its kept key
        channels (the storage's `dense_equivalent`)."""
        seen = self.inserted.clamp(min=1).double()
        held = self.mask[:, :, 0]
        ratio = 1.0 - self.storage.dense_equivalent(held) / seen
        return torch.where(self.inserted > 0, ratio, torch.zeros_like(ratio))

    def nbytes(self) -> int:
        """Physical bytes of every buffer this cache holds (K/V or codes, scales, positions, masks, scores)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def kv_bytes(self) -> int:
        """Physical bytes of the K/V storage alone (codes, scales and residual included; a debug cache's
        full reference cache and its shadow's storage both count)."""
        return sum(b.numel() * b.element_size() for m in self.modules() if isinstance(m, Storage) for b in m.buffers())

    def head_budgets(self) -> Tensor:
        """Slots each KV head may hold, [B, n_kv]: the layer budget in every head, unless the heads share a
        pool (budget_allocation.py), where each head owns its own quota of it."""
        return torch.full_like(self.inserted, self.budget())

    def extra_statistics(self) -> dict[str, Tensor]:
        """Strategy-specific statistics (e.g. attention loss), each [n_kv] or a scalar tensor."""
        return {}

    def storage_statistics(self) -> dict[str, Tensor]:
        return self.storage.statistics(self.mask[:, :, 0])


def row_positions(input_pos: Tensor) -> Tensor:
    """A decode step's position, [1] (every row) or [B] (one per row), as [1 or B, 1, 1]: it broadcasts
    against [B, heads, slots]."""
    return input_pos.view(-1, 1, 1)


def grouped_mean(probs: Tensor) -> Tensor:
    """[B, n_kv, rep, L] -> [B, n_kv, L]: one attention distribution per KV head (GQA)."""
    return probs.mean(dim=2)


def register_strategy(cls: type[KVCache]) -> type[KVCache]:
    """Marks a class as a strategy (strategies/__init__.py lists the files it collects them from) and adds
    the names of its own settings to the hyper-parameters it reads."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no strategy name")
    own = tuple(s.name for s in cls.settings if not s.prompt_rule)
    cls.hyperparameters = tuple(dict.fromkeys((*cls.hyperparameters, *own)))
    cls.registered = True
    return cls


@register_strategy
class FullCache(KVCache):
    """Keeps everything: the cache is sized to the whole sequence (prompt + max_new_tokens)."""

    name = "full"



def cache_statistics(caches: list[KVCache]) -> dict:
    """Measured statistics over all layers (docs/DESIGN.md §6): compression per layer/head and averaged,
    physical bytes, tokens held and evicted, and any strategy-specific statistics."""
    if not caches:
        return {"cache_bytes": 0, "compression_ratio": 0.0}
    per_head = [c.compression_ratio_per_head().mean(dim=0) for c in caches]  # [n_kv] per layer
    held = [c.held_tokens().float().mean(dim=0) for c in caches]
    seen = [c.inserted.float().mean(dim=0) for c in caches]
    stats = {
        "cache_bytes": sum(c.nbytes() for c in caches),
        "compression_ratio": round(float(torch.stack(per_head).mean()), 4),
        "compression_ratio_per_layer": [round(float(r.mean()), 4) for r in per_head],
        "compression_ratio_per_head": [[round(float(x), 4) for x in r] for r in per_head],
        "tokens_held_per_head": [[round(float(x), 2) for x in h] for h in held],
        "evictions_per_layer": [round(float((s - h).sum()), 2) for s, h in zip(seen, held, strict=True)],
        "cache_budget_per_layer": [c.budget() for c in caches],
        # Slots each head may hold: the layer budget in every head, or each head's quota of a shared pool.
        "cache_budget_per_head": [[round(float(x), 2) for x in c.head_budgets().float().mean(dim=0)] for c in caches],
        "cache_kv_bytes": sum(c.kv_bytes() for c in caches),
    }
    extras = [c.extra_statistics() | c.storage_statistics() for c in caches]
    for key in sorted({k for e in extras for k in e}):
        per_layer = [e[key].double() for e in extras if key in e]
        stats[f"{key}_mean"] = round(float(torch.stack([x.mean() for x in per_layer]).mean()), 5)
        stats[f"{key}_per_layer"] = [round(float(x.mean()), 5) for x in per_layer]
        stats[f"{key}_per_head"] = [[round(float(v), 5) for v in x.flatten()] for x in per_layer]
    return stats


def row_statistics(caches: list[KVCache], b: int) -> dict:
    """`cache_statistics` of row b, as if it had been decoded alone (in its row context); the bytes are the
    row's share of the batch's buffers, whose slots are the largest row's."""
    with ExitStack() as stack:
        for cache in caches:
            stack.enter_context(cache.row(b))
        return cache_statistics(caches)
