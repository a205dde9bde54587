"""Every strategy inside Hugging Face transformers: a `Cache` whose layers are this project's `KVCache`
modules and a registered attention function, so `model.generate(..., past_key_values=cache)` decodes
with eviction (docs/DESIGN.md §4 is the contract; the "Use from transformers" README section the usage).
transformers 5.24 names the argument `cache=` (`past_key_values=` still works, deprecated).

    cache = make_cache(model, ["--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25"],
                       prompt_length=ids.shape[1], max_new_tokens=32)
    out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False)  # past_key_values= before 5.x
    cache.statistics()  # compression, evictions, attention loss (debug_), as generate.py reports them

How the contract maps onto transformers (its models call `cache.update(k, v, layer_idx, kwargs=...)` with
keys after q/k norm and RoPE, then the attention function with the query):

- `update` of a decode step (one token) is `KVCache.update_kv`: it returns the slots' keys and values; the
  slots' mask stays with the layer. Of the prompt it only passes the keys through: `KVCache.prefill`
  needs the prompt's queries (prompt rules score with them), which only the attention function sees.
- `update` hands the layer to the attention function through the keyword dict the model passes to both
  (`kwargs=kwargs` to `update`, `**kwargs` to the attention function); without it (another cache, or none)
  the function is plain SDPA with transformers' own mask, so switching a model to it changes nothing else.
- the attention function: the prompt is causal SDPA (the sliding window where the layer has one), then
  `prefill`; a decode step is `model.grouped_attention` over the slots with their mask, and
  `update_state(probs [B, n_kv, rep, L])` for caches that need the probabilities: model.Attention's steps.
- a batch: `make_cache(..., prompt_length=[n_0, n_1, ...])` gives one row per prompt, each with the budgets
  its own length gives (cache_setup.build_row_caches, as generate.py's batches). transformers pads a batch on
  the left; the forward hook reads each row's length from the attention mask, and the prompt's attention
  prefills row by row in its row context without the padding (`KVCache.row`, as generate.prefill_rows), so
  each row is what it would be alone. Decode steps write each row at its own position (`inserted` per row,
  which is what transformers' position ids from the mask say too).
- a chunked prefill: a cache made with `--prefill_chunk N` takes the prompt from transformers' own chunked
  prefill (`generate(..., prefill_chunk_size=N)`): the first chunk a prefill, each later one attends over the
  held slots and itself (`chunk_attention`) and re-prefills the layer (cache_chunking.py), as
  model.Attention.forward_chunk; the first decode step ends it. One unpadded sequence, eager.
- `get_seq_length` is the positions fed (padding included, transformers' count), not the tokens held:
  positions and RoPE continue past evictions. `get_mask_sizes`: our function ignores transformers' masks
  (the slots carry their own), but generate still builds one: the prompt's own keys (each row's padding is
  read from it), then the slots. `reset` is `KVCache.reset`. Beam search, batch expansion, selecting rows
  and crop are refused (the eviction state is per sequence and not reorderable here yet).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor

from errors import UserError

try:
    from transformers import AttentionInterface, Cache
    from transformers.cache_utils import CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
except ImportError as e:  # transformers is optional for the tool: only this module needs it
    raise ImportError("transformers_adapter needs Hugging Face transformers (pip install transformers)") from e

from cache import KVCache, cache_statistics
from chunk_attention import chunk_attention
from model import ModelArgs, follows_window, grouped_attention, sliding_causal_mask
from strategies.debug import attention_loss_curve

ATTENTION_NAME = "kv_eviction"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
_LAYER_KEY = "kv_eviction_layer"  # the keyword through which `update` hands its layer to the attention function


# ---- building the caches (the one place that knows today's cache_spec functions) --------------------------


def _build_layer_caches(flags: argparse.Namespace, model_args: ModelArgs, prompt_lengths: list[int],
                        max_new_tokens: int, dtype: torch.dtype, device: torch.device,
                        token_classes: dict[str, Tensor] | None = None) -> list[KVCache]:
    """Flags -> one KVCache per layer with one row per prompt length, resolved as every entry point resolves
    them (cache_setup: the model's layer policies, the budget checks; each row the budgets its own length
    gives, as generate.py's batches), built for the transformers model rather than attached to ours."""
    from cache_setup import build_row_caches, cache_specs
    from cache_spec import build_caches

    def build(specs: list, rows: int, capacity: int) -> list[KVCache]:
        return build_caches(specs, rows, model_args.n_kv_head, model_args.head_dim, capacity, dtype, device,
                            token_classes)

    row_specs = [cache_specs(flags, model_args, n, max_new_tokens) for n in prompt_lengths]
    return build_row_caches(row_specs, [n + max_new_tokens for n in prompt_lengths], build)


def parse_cache_flags(flags: Sequence[str] | argparse.Namespace) -> argparse.Namespace:
    """The cache flags of generate.py / eval (a `--cache_config` preset included) as a namespace; refuses
    what the adapter cannot do yet, before anything is built."""
    from cache_setup import cache_config
    from cache_spec import check_cache_flags

    if isinstance(flags, argparse.Namespace):
        check_cache_flags(flags)
    else:
        flags = cache_config(list(flags))
    if flags.rerotate_positions:
        raise UserError("--rerotate_positions is not supported from transformers: its models apply RoPE before "
                        "the cache sees the keys, and re-rotation stores them before RoPE; use generate.py or eval")
    if flags.feed_long_prompts:
        raise UserError("--feed_long_prompts is not supported from transformers (generate prefills the whole "
                        "prompt); its token-by-token feed is --prefill_chunk 1 with generate(..., "
                        "prefill_chunk_size=1), or choose a --prompt_compression_strategy")
    if _needs(flags, "needs_gates"):
        gated = [s for s in flags.cache_strategy if "gated" in s]
        raise UserError(f"{', '.join(gated)}: learned gates are attached to this project's model only; use "
                        "generate.py / eval for gated caches, or another strategy here")
    return flags


def _needs(flags: argparse.Namespace, need: str) -> bool:
    """Whether a requested strategy declares `need`; a debug_ twin's needs are its shadow's (on the class
    they are properties, only read on instances)."""
    from strategies import get_strategy

    classes = [get_strategy(s) for s in flags.cache_strategy]
    return any(getattr(getattr(c, "shadow_class", c), need) for c in classes)


# ---- the model: architecture check, attention function, token ids -----------------------------------------


def model_args_of(model: torch.nn.Module) -> ModelArgs:
    """This project's ModelArgs of a transformers causal LM, or a UserError for what is not supported."""
    from checkpoint_hf import hf_model_args

    config = model.config
    model_type = getattr(config, "model_type", None)
    if hasattr(config, "text_config") or hasattr(config, "vision_config"):
        raise UserError(f"{model_type} is a multimodal model; load its text decoder alone (e.g. "
                        "Gemma3ForCausalLM for gemma3: model_type gemma3_text) or use a text model of: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"unsupported architecture {model_type!r} for the eviction cache; supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(config, "attn_logit_softcapping", None):
        raise UserError("attention logit soft-capping is not supported by the eviction attention")
    # The loaded config, less what only transformers' bookkeeping adds (private keys, token ids): hf_model_args
    # refuses any key it does not read, since in a config.json an unknown key may change the math.
    fields = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and not k.endswith("_token_id")}
    quant = fields.get("quantization_config") or {}
    if quant.get("quant_method") == "gguf":  # transformers dequantizes a GGUF file on load: plain weights
        fields.pop("quantization_config")
    return hf_model_args(fields)


def prepare_model(model: torch.nn.Module) -> ModelArgs:
    """Switch `model` to the eviction attention (plain SDPA for any other cache) and let caches that read token
    ids see them; idempotent. Returns the model's ModelArgs."""
    args = model_args_of(model)
    if model.config._attn_implementation != ATTENTION_NAME:
        can_set = getattr(model, "_can_set_attn_implementation", lambda: True)()
        if can_set:
            model.set_attn_implementation(ATTENTION_NAME)
        if not can_set or model.config._attn_implementation != ATTENTION_NAME:
            raise UserError(f"{type(model).__name__} cannot switch its attention implementation "
                            "(AttentionInterface); use a model of transformers' own classes for "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}, or generate.py")
    if not getattr(model, "_kv_eviction_hooked", False):
        model.register_forward_pre_hook(_observe_inputs, with_kwargs=True)
        model._kv_eviction_hooked = True
    return args


def _observe_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook, before any layer runs: checks the batch against the cache, reads each row's prompt
    length from the attention mask (left padding), checks the rows' room, and gives token ids to caches that
    read them (hybrid's policies), as model.Transformer.forward does."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, EvictionCache):
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    B, T = ids.shape[:2] if ids is not None else kwargs["inputs_embeds"].shape[:2]
    if B != cache.batch_size:
        raise UserError(f"the eviction cache was built for {cache.batch_size} sequence(s) (one per prompt length "
                        f"given to make_cache), got {B}; beam search and num_return_sequences > 1 are not supported")
    prompt = T > 1 and not cache.layers[0].prefilled  # static shapes under compile: decode never enters
    if T > 1 and cache.prefill_chunk and (torch.compiler.is_compiling() or
                                          hasattr(module.forward, "_torchdynamo_orig_callable")):
        # A chunk's prefill and re-prefill read the cache's counts on the host (cache_chunking.py): not traceable.
        # Under compile_config this hook is traced too; with `model.forward = torch.compile(...)` it runs eager.
        raise UserError("a chunked prefill (--prefill_chunk) runs eager: transformers compiles the prompt's chunks "
                        "under compile_config or a compiled forward; compile without chunks, or drop --prefill_chunk")
    if prompt:
        cache.begin_prompt(_prompt_lengths(kwargs.get("attention_mask"), B, T))
    elif T > 1 and (B > 1 or _prompt_lengths(kwargs.get("attention_mask"), B, T) != [T]):
        what = "a later prompt chunk" if cache.chunking else "a chunk after the prompt (the kvpress question)"
        raise UserError(f"{what} is supported for one unpadded sequence only; feed it row by row")
    elif T > 1 and cache.chunking:
        cache.next_chunk(T)
    elif T > 1 and not torch.compiler.is_compiling():  # the kvpress question: into empty slots, evicting nothing
        room = min(layer.cache.room() for layer in cache.layers)
        if room < T:
            raise UserError(f"a chunk of {T} tokens after the prompt goes into empty slots, and a layer has room "
                            f"for {room}; a prompt fed in chunks (transformers' prefill_chunk_size) needs a cache "
                            "made with --prefill_chunk of that size")
    elif T == 1 and cache.chunking:  # the first decode step (or a last chunk of one token, which is one)
        cache.end_chunks()
    if not torch.compiler.is_compiling():  # one host read per step in eager mode; a compiled step skips it
        cache.check_room(cache.prompt_rows if prompt else [T] * B)
    if cache.needs_token_ids:
        if ids is None:
            raise UserError("the hybrid cache reads token ids: call generate with input_ids, not inputs_embeds")
        for layer in cache.layers:
            if not layer.cache.needs_token_ids:
                continue
            if prompt and cache.prompt_rows != [T]:
                layer.prompt_ids = ids  # each row's own, in its row context just before its prefill (attend)
            else:
                layer.cache.observe_tokens(ids)


def _prompt_lengths(mask: Tensor | dict | None, B: int, T: int) -> list[int]:
    """Each row's tokens in a prompt of T positions, read from its attention mask: the 2D mask of a plain
    call, or the 4D masks generate prepares (per layer type in a dict; a causal or sliding query always sees
    its own token unless that token is padding, so the diagonal says it; get_mask_sizes gives the prompt's
    keys from 0). Padding must come first (left padding, as decoder-only generation wants): a row's tokens
    are its last n positions."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if not isinstance(mask, Tensor):
        return [T] * B  # None: transformers saw no padding (the causal kernel flag suffices)
    if mask.dim() == 2:
        real = mask[:, -T:].bool()
    else:
        diagonal = mask.diagonal(dim1=-2, dim2=-1)[..., -T:]  # [B, heads or 1, T]
        real = (diagonal if diagonal.dtype == torch.bool else diagonal == 0).any(dim=1)
    real = real.expand(B, T)
    lengths = real.sum(dim=1)
    positions = torch.arange(T, device=real.device)
    left_padded = real == (positions >= T - lengths[:, None])
    if not bool(left_padded.all()):
        raise UserError("padding after or inside a prompt is not supported by the eviction cache: pad on the left "
                        "(tokenizer.padding_side = 'left'), as decoder-only generation does")
    if not bool((lengths > 0).all()):
        raise UserError("a prompt of padding only (no token) cannot be prefilled")
    return lengths.tolist()


def eviction_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: object) -> tuple[Tensor, None]:
    """The registered attention function: over an EvictionLayer's slots when `update` handed one, else SDPA.
    query [B, n_head, T, D]; returns ([B, T, n_head, D], None) as transformers' attention functions do."""
    layer = kwargs.pop(_LAYER_KEY, None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    D = query.shape[-1]
    if scaling is not None and scaling != D**-0.5:
        # Our kernels and prompt rules scale logits by D ** -0.5; a model's own scale (Gemma 3's
        # query_pre_attn_scalar) is folded into q, as model.Attention does, so every rule sees it.
        query = query * (scaling * math.sqrt(D))
    return layer.attend(query, key, value).transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, eviction_attention)
# Masks as for SDPA, which the function falls back to for other caches; our layers ignore them.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


# ---- the cache --------------------------------------------------------------------------------------------


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

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to allocate: the KVCache was built with its buffers."""

    def seen(self) -> Tensor:
        """Tokens each row has seen, [B] (no host sync): the next token's position in its row. A copy: a view
        of `inserted` would advance inside update_kv, and after_insert would read the next position."""
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
        shared[_LAYER_KEY] = self
        T = key_states.shape[2]
        if T > 1:  # the prompt (or a chunk after it): the attention function stores it, with the queries
            return key_states, value_states
        keys, values, self._mask = self.cache.update_kv(self.seen(), key_states, value_states)
        return keys, values

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """model.Attention's three paths over this layer's cache; q, k, v as the model made them (after RoPE)."""
        cache, T = self.cache, q.shape[2]
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
        B, H = q.shape[:2]
        mask = self._mask
        if cache.pooled:  # one K/V pool for all heads (cache_allocation.py): every query head over it
            mask = mask.expand(-1, -1, H // cache.n_kv_heads, -1).reshape(B, 1, H, -1)
        y, probs = grouped_attention(q, k, v, mask)
        if cache.needs_attention:
            cache.update_state(probs.view(B, cache.n_kv_heads, -1, probs.shape[-1]))
        return y

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One row's prompt: causal SDPA (the sliding window where the layer has one), then the cache stores it."""
        T = q.shape[2]
        if self.sliding_window and T > self.sliding_window:
            window = sliding_causal_mask(T, self.sliding_window, q.device)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=window, enable_gqa=True)
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self.chunking:  # the first chunk: a prefill that keeps the queries the next chunk's re-prefill needs
            self.cache.prefill_chunk_tokens(torch.arange(T, device=q.device), k, v, q)
        else:
            self.cache.prefill(torch.arange(T, device=q.device), k, v, q)
        return y

    def _later_chunk(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """A later chunk of a chunked prefill, as model.Attention.forward_chunk: its queries attend over the held
        tokens and the chunk causally, then the cache re-prefills held + chunk (cache_chunking.py)."""
        cache, T = self.cache, q.shape[2]
        input_pos = torch.arange(T, device=q.device) + self.seen()[0]
        held, held_v = cache.keys(), cache.values()
        if cache.pooled:  # one K/V pool (budget_allocation.py): every head over it, masked to its own slots
            held, held_v = (t.expand(-1, k.shape[1], -1, -1) for t in (held, held_v))
        y = chunk_attention(q, held, held_v, k, v, cache.mask[:, :, 0], cache.pos, input_pos, self.sliding_window)
        cache.prefill_chunk_tokens(input_pos, k, v, q)
        return y

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

    def get_seq_length(self) -> Tensor:
        # Positions fed, padding included (transformers' count; each row's own tokens are `seen`).
        return self.seen()[0] + self.padding[0]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Our attention ignores transformers' masks (the slots carry their own); generate still builds one from
        # these sizes: the prompt's own keys (padding is refused from it), then the slots, as StaticLayer does.
        return (query_length if query_length > 1 else self.cache.keys().shape[2]), 0

    def get_max_length(self) -> int:
        return self.cache.capacity_needed  # prompt + new tokens the caches were sized for (full / debug_)

    def reset(self) -> None:
        self.cache.reset()
        self.prefilled = self.chunking = False
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
                 prefill_chunk: int = 0) -> None:
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

    def begin_prompt(self, lengths: list[int]) -> None:
        """A prompt comes whose row b has lengths[b] tokens after its padding (the forward hook reads them); with
        --prefill_chunk N, its first chunk."""
        T = max(lengths)
        if self.prefill_chunk:
            if lengths != [T]:
                raise UserError("a chunked prefill (--prefill_chunk) through transformers takes one unpadded "
                                "sequence; generate the prompts one at a time, or drop --prefill_chunk")
            self.short_chunk = False
            self.next_chunk(T)
            for layer in self.layers:
                layer.chunking = True
        padding = torch.tensor([T - n for n in lengths], dtype=torch.long)
        for layer in self.layers:
            layer.prompt_rows = list(lengths)
            layer.padding.copy_(padding)

    def next_chunk(self, T: int) -> None:
        """A chunk of T tokens of a chunked prefill: --prefill_chunk tokens, the last one maybe fewer."""
        N = self.prefill_chunk
        if T > N or self.short_chunk:
            raise UserError(f"the cache was configured with --prefill_chunk {N} and got "
                            f"{'a chunk after a shorter one' if T <= N else f'{T} prompt tokens at once'}: pass "
                            f"prefill_chunk_size={N} to generate, so the prompt comes {N} tokens at a time")
        self.short_chunk = T < N

    def end_chunks(self) -> None:
        """The chunked prompt is in (the first decode step comes): the held tokens' queries are dropped."""
        for layer in self.layers:
            layer.cache.end_chunked_prefill()
            layer.chunking = False
        self.short_chunk = False

    def check_room(self, new: list[int]) -> None:
        """A UserError when row b's tokens so far plus new[b] pass what the row was sized for (one host read)."""
        seen = self.layers[0].seen().tolist()
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
        had been decoded alone (its row context), and the attention-loss curve of debug_ caches."""
        if row is not None and not 0 <= row < self.batch_size:
            raise UserError(f"row {row}: the cache has rows 0 to {self.batch_size - 1}")
        with ExitStack() as stack:
            for cache in self.kv_caches if row is not None else ():
                stack.enter_context(cache.row(row))
            stats = cache_statistics(self.kv_caches)
            curve = attention_loss_curve(self.kv_caches)
        if curve:
            stats["attention_loss_cumulative_by_step"] = curve
        return stats


def make_cache(model: torch.nn.Module, flags: Sequence[str] | argparse.Namespace,
               prompt_length: int | Sequence[int], max_new_tokens: int, tokenizer: object | None = None,
               token_classes: dict[str, Tensor] | None = None) -> EvictionCache:
    """An EvictionCache for `model` from generate.py's cache flags (a list of words, or a parsed namespace),
    sized for `prompt_length` + `max_new_tokens` as generate.py sizes it; prepares the model (prepare_model).
    A list of prompt lengths gives one row per prompt of a batch (left-padded, as transformers batches
    decoder-only prompts), each row with the budgets its own length gives, as if decoded alone.
    `tokenizer` (this project's or a transformers one) or `token_classes` is needed by hybrid caches only."""
    flags = parse_cache_flags(flags)
    args = prepare_model(model)
    lengths = [prompt_length] if isinstance(prompt_length, int) else list(prompt_length)
    if not lengths or not all(isinstance(n, int) and n >= 1 for n in lengths):
        raise UserError(f"prompt lengths must be whole numbers ≥ 1 (one per sequence), got {prompt_length!r}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if max(lengths) + max_new_tokens > args.context_length:
        raise UserError(f"the prompt ({max(lengths)} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                        f"model's context of {args.context_length} tokens")
    weight = next(model.parameters())
    if token_classes is None and tokenizer is not None:
        token_classes = tokenizer_classes(tokenizer, args.vocab_size)
    if token_classes is None and _needs(flags, "needs_token_classes"):
        raise UserError("the hybrid cache needs the tokenizer's special and punctuation tokens: pass "
                        "make_cache(..., tokenizer=tokenizer) (or token_classes=)")
    caches = _build_layer_caches(flags, args, lengths, max_new_tokens, weight.dtype, weight.device, token_classes)
    # --prefill_chunk as typed: a layer whose cache a model policy replaced (a sliding window's) carries none, yet
    # takes the prompt's chunks like every layer (its window keeps the same tokens either way).
    return EvictionCache(caches, args, lengths, flags.prefill_chunk or 0)


def load_gguf_model(path: str | None = None, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, object]:
    """transformers' model (eval mode) and tokenizer of a GGUF file, the bundled SmolLM2 by default: what the
    benchmarks run through the adapter beside this project's own model of the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoint import bundled_checkpoint_path

    file = bundled_checkpoint_path() if path is None else Path(path)
    if file.suffix != ".gguf" or not file.is_file():
        raise UserError(f"{file}: not a GGUF file")
    folder, name = str(file.parent), file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def tokenizer_classes(tokenizer: object, vocab_size: int) -> dict[str, Tensor]:
    """strategies.hybrid.token_classes for this project's tokenizer or a transformers one (same rule)."""
    from strategies.hybrid import token_classes

    if not hasattr(tokenizer, "special_token_ids"):  # a transformers tokenizer: the same questions, its names
        hf = tokenizer

        class _View:
            vocab_size = len(hf)

            @staticmethod
            def special_token_ids() -> list[int]:
                return list(hf.all_special_ids)

            @staticmethod
            def decode(ids: list[int]) -> str:
                return hf.decode(ids)

        tokenizer = _View()
    return token_classes(tokenizer, vocab_size)
