"""The transformers `Cache` over this project's caches (transformers_adapter.py puts it to use): one
`EvictionLayer` per layer around that layer's `KVCache`, and `EvictionCache`, the batch's rows, the prompt's
chunks and the statistics. How the contract maps onto transformers: transformers_adapter.py's docstring and
docs/DESIGN.md §4."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch
from torch import Tensor
from transformers import Cache, StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import CacheLayerMixin

from attention import attend_slots, follows_window, grouped_attention, prompt_attention
from cache import KVCache, cache_statistics
from chunk_attention import chunk_attention
from errors import UserError
from model import ModelArgs
from strategies.debug import attention_loss_curve

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
LAYER_KEY = "kv_eviction_layer"  # the keyword through which `update` hands its layer to the attention function


class EvictionLayer(CacheLayerMixin):
    """One transformers cache layer around one KVCache (static buffers: compileable)."""

    is_compileable = True
    is_croppable = False

    def __init__(self, cache: KVCache, sliding_window: int = 0) -> None:
        super().__init__()
        self.cache = cache
        self.sliding_window = sliding_window  # tokens a sliding layer's prompt queries see (0: all)
        self.is_sliding = bool(sliding_window)
        self.is_initialized = True  # the KVCache's buffers exist from the start
        self.batch_size = cache.inserted.shape[0]
        self.device = cache.pos.device
        self._mask: Tensor | None = None
        self.prompt_rows: list[int] | None = None  # each row's prompt tokens (begin_prompt); None: all unpadded
        self.prompt_ids: Tensor | None = None  # a padded or batched prompt's ids, for caches that read them
        # Padding positions before each row's tokens (tokens fed per row = seen + padding, the same for every row).
        self.padding = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        # Whether the prompt is in: a Python flag rather than a read of `seen`, so a compiled forward (transformers'
        # model.forward recipe) branches on a guard instead of breaking its graph on a host read.
        self.prefilled = False
        self.chunking = False  # a prompt fed in chunks (--prefill_chunk) until the first decode step
        # A padded batch's chunked prefill (EvictionCache.plan_row_chunks): per row, (its tokens before this
        # forward, its tokens in it); None otherwise. Each row's own chunks are cut every `prefill_chunk` of its
        # tokens, and a chunk that spans two forwards keeps its first part's (q, k, v) in `pending` until it is
        # complete (its rows' prompt lengths: `prompt_rows`); `positions_fed`: the padded positions fed so far.
        self.row_chunk_plan: list[tuple[int, int]] | None = None
        self.prefill_chunk, self.positions_fed = 0, 0
        self.pending: list[tuple[Tensor, Tensor, Tensor, Tensor | None] | None] = []  # q, k, v, token ids

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to allocate: the KVCache was built with its buffers."""

    def seen(self) -> Tensor:
        """Tokens each row has seen, [B] (no host sync): the next token's position in its row. A copy: a view
        of `inserted` would advance inside insert, and after_insert would read the next position."""
        return self.cache.inserted[:, 0].clone()

    def update(self, key_states: Tensor, value_states: Tensor, *args: object,
               **kwargs: object) -> tuple[Tensor, Tensor]:
        if key_states.shape[0] != self.batch_size:
            raise UserError(f"the eviction cache was built for {self.batch_size} sequence(s), got "
                            f"{key_states.shape[0]} (beam search and num_return_sequences > 1 are not supported)")
        shared = kwargs.get("kwargs")
        if not isinstance(shared, dict):
            raise UserError("this model does not pass its attention keywords to the cache (transformers' own "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)} classes do)")
        shared[LAYER_KEY] = self
        if key_states.shape[2] == 1 and self.row_chunk_plan is None:  # a decode step: into the slots, which the
            # attention function reads itself (a padded batch's one-token prompt chunk goes to attend)
            self.cache.insert(self.seen(), key_states, value_states)
            self._mask = self.cache.mask
        # The prompt (or a chunk after it) goes to the attention function, which stores it with the queries; a
        # decode step's attention reads the slots (attend_slots: from quantized codes without rebuilding K and V
        # on the CPU), so the new token's own K/V are all transformers needs back.
        return key_states, value_states

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """model.Attention's three paths over this layer's cache; q, k, v as the model made them (after RoPE)."""
        cache, T = self.cache, q.shape[2]
        if self.row_chunk_plan is not None:  # a padded batch's prompt chunk
            return self._row_chunks(q, k, v)
        if T > 1 and self.prefilled:  # a later prompt chunk, or a chunk after the prompt (the kvpress question)
            return self._later_chunk(q, k, v) if self.chunking else self._append(q, k, v)
        if T > 1:
            self.prefilled = True
            rows = self.prompt_rows or [T] * q.shape[0]
            if rows == [T]:  # one unpadded row: no row context (a compiled prefill traces this)
                return self._prefill(q, k, v)
            # Each row alone in its row context, without its padding (as generate.prefill_rows): the padding's
            # outputs are zeros, which no later position reads (every row's attention is over its own tokens).
            y = torch.zeros_like(q)
            for b, n in enumerate(rows):
                with cache.row(b):
                    if self.prompt_ids is not None:  # observed per row: a cache keeps the latest prompt's ids
                        cache.observe_tokens(self.prompt_ids[b : b + 1, T - n :])
                    y[b : b + 1, :, T - n :] = self._prefill(q[b : b + 1, :, T - n :], k[b : b + 1, :, T - n :],
                                                             v[b : b + 1, :, T - n :])
            self.prompt_ids = None
            return y
        return self._attend_slots(q, self._mask)

    def _attend_slots(self, q: Tensor, mask: Tensor) -> Tensor:
        """A decode step's attention over the slots (their `mask`), and the probabilities to caches that need them."""
        cache, (B, H) = self.cache, q.shape[:2]
        if cache.pooled:  # one K/V pool for all heads (budget_allocation.py): every query head over it
            mask = mask.expand(-1, -1, H // cache.n_kv_heads, -1).reshape(B, 1, H, -1)
        y, probs = attend_slots(cache, q, mask)
        if cache.needs_attention:
            cache.update_state(probs.view(B, cache.n_kv_heads, -1, probs.shape[-1]))
        return y

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One row's prompt: causal SDPA (the sliding window where the layer has one), then the cache stores it."""
        T = q.shape[2]
        y = prompt_attention(q, k, v, self.sliding_window)
        if self.chunking:  # the first chunk: a prefill that keeps the queries the next chunk's re-prefill needs
            self.cache.prefill_chunk_tokens(torch.arange(T, device=q.device), k, v, q)
        else:
            self.cache.prefill(torch.arange(T, device=q.device), k, v, q)
        return y

    def _later_chunk(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """A later chunk of a chunked prefill, as model.Attention.forward_chunk: its queries attend over the held
        tokens and the chunk causally, then the cache re-prefills held + chunk (cache_chunking.py)."""
        input_pos = torch.arange(q.shape[2], device=q.device) + self.seen()[0]
        y = self._attend_held(q, k, v, input_pos)
        self.cache.prefill_chunk_tokens(input_pos, k, v, q)
        return y

    def _attend_held(self, q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor) -> Tensor:
        """A chunk's queries (at input_pos) over the held tokens and the chunk itself, causally."""
        cache = self.cache
        held, held_v = cache.chunk_held_keys(), cache.chunk_held_values()
        if cache.pooled:  # one K/V pool (budget_allocation.py): every head over it, masked to its own slots
            held, held_v = (t.expand(-1, k.shape[1], -1, -1) for t in (held, held_v))
        return chunk_attention(q, held, held_v, k, v, cache.mask[:, :, 0], cache.pos, input_pos, self.sliding_window)

    def _row_chunks(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """A forward of a padded batch's chunked prefill. transformers cuts the padded batch every
        `prefill_chunk` positions, which is not where a row's own chunks end (its padding shifts them), so each
        row's tokens in this forward are cut at its own chunk boundaries and go through its cache in its row
        context, part by part (`_own_chunk_part`): each row holds and computes what its chunks give it alone."""
        self.prefilled = True
        T = q.shape[2]
        y = torch.zeros_like(q)  # padding's outputs: zeros, which no row's attention reads
        for b, (fed, new) in enumerate(self.row_chunk_plan):
            parts, start = [], T - new
            with self.cache.row(b):
                while start < T:
                    n = min(self.prefill_chunk - fed % self.prefill_chunk, T - start)
                    part = slice(start, start + n)
                    ids = None if self.prompt_ids is None else self.prompt_ids[b : b + 1, part]
                    parts.append(self._own_chunk_part(b, fed, q[b : b + 1, :, part], k[b : b + 1, :, part],
                                                      v[b : b + 1, :, part], ids))
                    fed, start = fed + n, start + n
            if parts:
                y[b : b + 1, :, T - new :] = torch.cat(parts, dim=2)
        self.prompt_ids = None
        return y

    def _own_chunk_part(self, b: int, fed: int, q: Tensor, k: Tensor, v: Tensor, ids: Tensor | None = None) -> Tensor:
        """Row b's tokens fed .. fed + n, all of one of its own chunks (in its row context): their attention
        over the held tokens and the chunk so far (its earlier part, `pending`, was answered in an earlier
        forward; causal, so the same outputs), and, once the chunk is complete, the chunk into the cache. A
        chunk of one token that ends the row's prompt is a decode step, as it is alone. `ids`: the part's token
        ids, for caches that read them (observed with the whole chunk, as generate.py's loop gives them)."""
        n, end = q.shape[2], fed + q.shape[2]
        if n == 1 and fed % self.prefill_chunk == 0 and end == self.prompt_rows[b]:
            if ids is not None:
                self.cache.observe_tokens(ids)
            self.cache.end_chunked_prefill()
            self.cache.insert(self.seen(), k, v)
            return self._attend_slots(q, self.cache.mask)
        if self.pending[b] is not None:
            *earlier_qkv, earlier_ids = self.pending[b]
            q, k, v = (torch.cat([earlier, x], dim=2) for earlier, x in zip(earlier_qkv, (q, k, v), strict=True))
            ids = None if ids is None else torch.cat([earlier_ids, ids], dim=1)
        start = end - q.shape[2]
        input_pos = torch.arange(start, end, device=q.device)
        if start == 0:  # the row's first chunk: a prefill
            y = prompt_attention(q, k, v, self.sliding_window)
        else:
            y = self._attend_held(q, k, v, input_pos)
        complete = end % self.prefill_chunk == 0 or end == self.prompt_rows[b]
        if complete:
            if ids is not None:
                self.cache.observe_tokens(ids)
            self.cache.prefill_chunk_tokens(input_pos, k, v, q)
        self.pending[b] = None if complete else (q, k, v, ids)
        return y[:, :, -n:]

    def _append(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache, (B, H, T, _) = self.cache, q.shape
        input_pos = torch.arange(T, device=q.device) + self.seen()[0]  # one row (the hook refuses more)
        k_all, v_all, mask = cache.append(input_pos, k, v)
        n_kv = cache.n_kv_heads
        pos = cache.pos.expand(B, n_kv, -1)
        visible = mask[:, :, 0, None, :] & (pos[:, :, None, :] <= input_pos.view(1, 1, T, 1))
        visible = visible.repeat(1, 1, H // n_kv, 1)
        if cache.pooled:
            visible = visible.reshape(B, 1, -1, visible.shape[-1])
        y, _ = grouped_attention(q, k_all, v_all, visible)
        return y

    def get_seq_length(self) -> Tensor | int:
        # Positions fed, padding included (transformers' count; each row's own tokens are `seen`, which a padded
        # batch's chunked prefill counts only for the chunks complete).
        if self.row_chunk_plan is not None:
            return self.positions_fed
        return self.seen()[0] + self.padding[0]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Our attention ignores transformers' masks (the slots carry their own); generate still builds one from
        # these sizes: the prompt's own keys (padding is refused from it), then the slots, as StaticLayer does. A
        # later chunk (a prompt's in --prefill_chunk, the kvpress question): its own positions' keys, from which the
        # forward hook reads each row's tokens (the mask's diagonal), as for a padded batch's chunk; keys from 0
        # would leave a chunk past a sliding window (Mistral's) outside its own mask, read as padding only.
        if self.row_chunk_plan is not None:
            return query_length, self.positions_fed
        if query_length > 1:
            return query_length, int(self.get_seq_length()) if self.prefilled else 0
        return self.cache.mask.shape[-1], 0

    def get_max_length(self) -> int:
        return self.cache.capacity_needed  # prompt + new tokens the caches were sized for (full / debug_)

    def reset(self) -> None:
        self.cache.reset()
        for cache in self.cache.modules():  # a chunked prefill cut short leaves no row's held queries behind
            if isinstance(cache, KVCache):
                cache.row_chunk_state.clear()
        self.prefilled = self.chunking = False
        self.row_chunk_plan, self.pending = None, []
        self.padding.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UserError("beam search is not supported by the eviction cache (its per-token scores are per "
                        "sequence); use num_beams=1: greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UserError("the eviction cache holds one row per prompt: use num_beams=1 and num_return_sequences=1")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise UserError("the eviction cache cannot select sequences of a batch (its rows are built together)")

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("the eviction cache cannot be cropped (evicted tokens are gone): assisted and "
                        "speculative decoding are not supported")


class EvictionCache(Cache):
    """A transformers Cache whose layer i is this project's KVCache for layer i (`kv_caches`)."""

    def __init__(self, caches: Sequence[KVCache], model_args: ModelArgs, prompt_lengths: list[int],
                 prefill_chunk: int = 0, eos_token_ids: Sequence[int] = ()) -> None:
        if len(caches) != model_args.n_layer:
            raise ValueError(f"got {len(caches)} caches for {model_args.n_layer} layers")
        for i, cache in enumerate(caches):
            window = model_args.layer_window(i)
            if window and not follows_window(cache, window):
                raise UserError(f"layer {i} attends to its last {window} tokens only, but its {cache.name} cache can "
                                "hold older ones; sliding layers need the window policy (make_cache applies it)")
            if cache.rerotate_positions:
                raise UserError("re-rotating caches are not supported from transformers (RoPE precedes the cache)")
            if cache.needs_gates:
                raise UserError(f"the {cache.name} cache needs this project's learned gates; use generate.py")
        super().__init__(layers=[EvictionLayer(c, model_args.layer_window(i)) for i, c in enumerate(caches)])
        self.prompt_lengths = list(prompt_lengths)  # per row, as make_cache sized the rows
        self.capacities = list(caches[0].row_capacities)  # per row: its prompt + the new tokens
        self.prefill_chunk = prefill_chunk  # --prefill_chunk: the prompt comes this many tokens at a time (0: at once)
        self.short_chunk = False  # a chunk shorter than prefill_chunk came: it must be the last
        self.eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=caches[0].pos.device)
        # Per row: its statistics when it stopped (note_stopped_rows), as generate.py's batches take them.
        self.row_snapshots: list[dict | None] = [None] * len(self.prompt_lengths)

    @property
    def batch_size(self) -> int:
        return len(self.prompt_lengths)

    @property
    def prompt_rows(self) -> list[int]:
        """Each row's tokens in the prompt being prefilled (its attention mask's, without padding)."""
        return self.layers[0].prompt_rows

    @property
    def chunking(self) -> bool:
        return self.layers[0].chunking

    @property
    def row_chunking(self) -> bool:
        """Whether a padded batch's chunked prefill is under way (EvictionLayer._row_chunks)."""
        return self.layers[0].row_chunk_plan is not None

    def begin_prompt(self, lengths: list[int], T: int) -> None:
        """A prompt of T positions comes whose row b has lengths[b] tokens after its padding (the forward hook
        reads them); with --prefill_chunk N, its first chunk (of a padded batch: begin_row_chunks)."""
        if self.prefill_chunk:
            self.short_chunk = False
            self.next_chunk(T)
            for layer in self.layers:
                layer.chunking = True
            if lengths != [T]:
                self.begin_row_chunks(lengths, T)
                return
        padding = torch.tensor([T - n for n in lengths], dtype=torch.long)
        for layer in self.layers:
            layer.prompt_rows = list(lengths)
            layer.padding.copy_(padding)

    def begin_row_chunks(self, first: list[int], T: int) -> None:
        """A padded batch's chunked prefill starts with a chunk of T positions where row b has first[b] tokens.
        Its rows' own chunks are cut from their prompt lengths, which must be make_cache's: every row ends at the
        last padded position, so those lengths say where each row starts and which chunk is its last."""
        rows = list(zip(first, self.prompt_lengths, strict=True))
        ends = {T - m + n for m, n in rows if m}  # where each row with tokens in this chunk ends, padded
        padded = min(ends, default=0)
        # One end for all; a row with tokens here has no more than its length, one without starts past T.
        if len(ends) != 1 or any(m > n if m else padded - n < T for m, n in rows):
            raise UserError("a chunked prefill of a padded batch cuts each row's chunks from the prompt lengths "
                            f"given to make_cache ({self.prompt_lengths}), and the prompts' own differ; make the "
                            "cache with each prompt's length")
        for layer in self.layers:
            layer.prompt_rows = list(self.prompt_lengths)
            layer.prefill_chunk, layer.positions_fed = self.prefill_chunk, 0
            layer.pending = [None] * self.batch_size
            layer.padding.copy_(torch.tensor([padded - n for n in self.prompt_lengths], dtype=torch.long))
        self.padded_length = padded
        self.plan_row_chunks(T)

    def plan_row_chunks(self, T: int) -> list[int]:
        """The next T padded positions of a padded batch's chunked prefill: each layer told each row's tokens
        before them and in them; those counts (the chunk's attention mask must say the same)."""
        past = self.layers[0].positions_fed
        starts = [self.padded_length - n for n in self.prompt_lengths]
        plan = [(max(past - p, 0), max(past + T - max(past, p), 0)) for p in starts]
        for layer in self.layers:
            layer.row_chunk_plan, layer.positions_fed = plan, past + T
        return [new for _, new in plan]

    def prompt_fed(self) -> bool:
        """Whether a padded batch's chunked prefill has fed its last prompt position."""
        return self.layers[0].positions_fed >= self.padded_length

    def next_chunk(self, T: int) -> None:
        """A chunk of T tokens of a chunked prefill: --prefill_chunk tokens, the last one maybe fewer."""
        N = self.prefill_chunk
        if T > N or self.short_chunk:
            raise UserError(f"the cache was configured with --prefill_chunk {N} and got "
                            f"{'a chunk after a shorter one' if T <= N else f'{T} prompt tokens at once'}: pass "
                            f"prefill_chunk_size={N} to generate, so the prompt comes {N} tokens at a time")
        self.short_chunk = T < N

    def end_chunks(self) -> None:
        """The chunked prompt is in (the first decode step comes): the held tokens' queries are dropped (each
        row's, which its row context keeps between its turns)."""
        for layer in self.layers:
            for b in range(self.batch_size):
                with layer.cache.row(b):
                    layer.cache.end_chunked_prefill()
            layer.cache.end_chunked_prefill()
            layer.chunking = False
            layer.row_chunk_plan, layer.pending = None, []
        self.short_chunk = False

    def note_stopped_rows(self, tokens: Tensor, seen: list[int]) -> None:
        """A step's tokens [B] and each row's tokens so far (from the forward hook, eager, or from
        stopping_criteria between steps): a row whose token is its EOS has stopped (transformers then feeds it
        padding until the batch ends), so its statistics are taken now, before the EOS enters, as generate.py
        takes a stopped row's; `statistics(row=b)` returns them."""
        if not self.eos.numel():
            return
        for b, stopped in enumerate(torch.isin(tokens, self.eos).tolist()):
            if stopped and self.row_snapshots[b] is None and seen[b] >= self.prompt_lengths[b]:
                self.row_snapshots[b] = self.statistics(row=b)

    def stopping_criteria(self) -> StoppingCriteriaList:
        """For `generate(..., stopping_criteria=cache.stopping_criteria())`: takes a stopped row's statistics
        between steps, on the host, where under `compile_config` the forward hook that takes them in eager
        mode is traced and cannot (the same snapshot: the EOS is made, not fed yet). Stops nothing itself."""
        if not self.eos.numel():
            raise UserError("a stopped row's statistics need its EOS: make the cache with "
                            "make_cache(..., eos_token_id=...) as given to generate")
        return StoppingCriteriaList([StoppedRowSnapshots(self)])

    def reset(self) -> None:
        super().reset()
        self.short_chunk = False
        self.row_snapshots = [None] * self.batch_size

    def check_room(self, new: list[int], seen: list[int]) -> None:
        """A UserError when row b's tokens so far, seen[b], plus new[b] pass what the row was sized for."""
        for b, (n, s, capacity) in enumerate(zip(new, seen, self.capacities, strict=True)):
            if s + n > capacity:
                row = f"row {b} of the eviction cache was" if self.batch_size > 1 else "the eviction cache was"
                raise UserError(f"{row} sized for {self.prompt_lengths[b]} prompt tokens + "
                                f"{capacity - self.prompt_lengths[b]} new ones ({capacity} in all), and {s + n} "
                                "were asked for; make_cache with the prompt lengths and max_new_tokens of this "
                                "generate call (or cache.reset() before a new prompt)")

    @property
    def kv_caches(self) -> list[KVCache]:
        return [layer.cache for layer in self.layers]

    @property
    def needs_token_ids(self) -> bool:
        return any(c.needs_token_ids for c in self.kv_caches)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.layers[0].reorder_cache(beam_idx)

    def statistics(self, row: int | None = None) -> dict:
        """generate.py's cache statistics (docs/DESIGN.md §6) of every row together, or of one `row` as if it
        had been decoded alone (its row context; a row that stopped, as it was when it met its EOS), and the
        attention-loss curve of debug_ caches."""
        if row is not None and not 0 <= row < self.batch_size:
            raise UserError(f"row {row}: the cache has rows 0 to {self.batch_size - 1}")
        if row is not None and self.row_snapshots[row] is not None:
            return dict(self.row_snapshots[row])
        with ExitStack() as stack:
            for cache in self.kv_caches if row is not None else ():
                stack.enter_context(cache.row(row))
            stats = cache_statistics(self.kv_caches)
            curve = attention_loss_curve(self.kv_caches)
        if curve:
            stats["attention_loss_cumulative_by_step"] = curve
        return stats


class StoppedRowSnapshots(StoppingCriteria):
    """EvictionCache.stopping_criteria's criterion: after each step, the rows whose new token is an EOS."""

    def __init__(self, cache: EvictionCache) -> None:
        self.cache = cache

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: object) -> Tensor:
        self.cache.note_stopped_rows(input_ids[:, -1].to(self.cache.eos.device), self.cache.layers[0].seen().tolist())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

