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
- `get_seq_length` is the tokens seen (`KVCache.inserted`), not held: positions and RoPE continue past
  evictions. `get_mask_sizes`: our function ignores transformers' masks (the slots carry their own), but
  generate still builds one: the prompt's own keys (padding is detected from it and refused), then the slots.
  `reset` is `KVCache.reset`. Beam search, batch expansion and crop are refused (the eviction state is per
  sequence and not reorderable here yet).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

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
from model import ModelArgs, follows_window, grouped_attention, sliding_causal_mask
from strategies.debug import attention_loss_curve

ATTENTION_NAME = "kv_eviction"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3")
_LAYER_KEY = "kv_eviction_layer"  # the keyword through which `update` hands its layer to the attention function


# ---- building the caches (the one place that knows today's cache_spec functions) --------------------------


def _build_layer_caches(flags: argparse.Namespace, model_args: ModelArgs, prompt_length: int, max_new_tokens: int,
                        dtype: torch.dtype, device: torch.device,
                        token_classes: dict[str, Tensor] | None = None) -> list[KVCache]:
    """Flags -> one KVCache per layer, resolved as every entry point resolves them (cache_setup: the model's
    layer policies, the budget checks), built for the transformers model rather than attached to ours."""
    from cache_setup import cache_specs
    from cache_spec import build_caches

    specs = cache_specs(flags, model_args, prompt_length, max_new_tokens)
    return build_caches(specs, 1, model_args.n_kv_head, model_args.head_dim, prompt_length + max_new_tokens, dtype,
                        device, token_classes)


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
                        "prompt); choose a --prompt_compression_strategy instead")
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
    """Forward pre-hook: checks the batch of a prompt and gives token ids to caches that read them
    (hybrid's policies), before any layer runs, as model.Transformer.forward does."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, EvictionCache):
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None and ids.shape[1] > 1:  # a prompt (static shapes under compile: decode never enters)
        if ids.shape[0] != 1:
            raise UserError(f"the eviction cache decodes one sequence at a time (batch 1), got a batch of "
                            f"{ids.shape[0]}; loop over the prompts")
        if _has_padding(kwargs.get("attention_mask")):
            raise UserError("padded prompts are not supported by the eviction cache (batch 1, no padding)")
    n = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
    if not torch.compiler.is_compiling():  # one host read per step in eager mode; a compiled step skips it
        seen = int(cache.layers[0].seen())
        if seen + n > cache.capacity:
            raise UserError(f"the eviction cache was sized for {cache.prompt_length} prompt tokens + "
                            f"{cache.capacity - cache.prompt_length} new ones ({cache.capacity} in all), and "
                            f"{seen + n} were asked for; make_cache with the prompt length and max_new_tokens "
                            "of this generate call (or cache.reset() before a new prompt)")
    if cache.needs_token_ids:
        if ids is None:
            raise UserError("the hybrid cache reads token ids: call generate with input_ids, not inputs_embeds")
        for layer in cache.layers:
            if layer.cache.needs_token_ids:
                layer.cache.observe_tokens(ids)


def _has_padding(mask: Tensor | dict | None) -> bool:
    """Whether a prompt's attention mask hides some of its tokens: the 2D mask of a plain call, or the 4D masks
    generate prepares (per layer type in a dict): a causal or sliding query always sees its own token, unless
    that token is padding, so the diagonal says it (get_mask_sizes gives the prompt's keys from 0)."""
    if isinstance(mask, dict):
        return any(_has_padding(m) for m in mask.values())
    if not isinstance(mask, Tensor):
        return False  # None: transformers saw no padding (the causal kernel flag suffices)
    if mask.dim() == 2:
        return not bool(mask.bool().all())
    diagonal = mask.diagonal(dim1=-2, dim2=-1)
    return not bool(diagonal.all()) if diagonal.dtype == torch.bool else bool((diagonal != 0).any())


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
        # Whether the prompt is in: a Python flag rather than a read of `seen`, so a compiled forward (transformers'
        # model.forward recipe) branches on a guard instead of breaking its graph on a host read.
        self.prefilled = False

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to allocate: the KVCache was built with its buffers."""

    def seen(self) -> Tensor:
        """Tokens this layer has seen, a 0-dim tensor (no host sync, as StaticLayer's cumulative_length). A copy:
        a view of `inserted` would advance inside update_kv, and after_insert would read the next position."""
        return self.cache.inserted[0, 0].clone()

    def update(self, key_states: Tensor, value_states: Tensor, *args: object,
               **kwargs: object) -> tuple[Tensor, Tensor]:
        if key_states.shape[0] != self.batch_size:
            raise UserError(f"the eviction cache was built for batch {self.batch_size}, got {key_states.shape[0]} "
                            "sequences (beam search and num_return_sequences > 1 are not supported; use one "
                            "sequence per generate call)")
        shared = kwargs.get("kwargs")
        if not isinstance(shared, dict):
            raise UserError("this model does not pass its attention keywords to the cache (transformers' own "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)} classes do)")
        shared[_LAYER_KEY] = self
        T = key_states.shape[2]
        if T > 1:  # the prompt (or a chunk after it): the attention function stores it, with the queries
            return key_states, value_states
        keys, values, self._mask = self.cache.update_kv(self.seen().view(1), key_states, value_states)
        return keys, values

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """model.Attention's three paths over this layer's cache; q, k, v as the model made them (after RoPE)."""
        cache, T = self.cache, q.shape[2]
        if T > 1 and self.prefilled:  # a chunk after the prompt (KVCache.append, the kvpress question)
            return self._append(q, k, v)
        if T > 1:
            input_pos = torch.arange(T, device=q.device)
            if self.sliding_window and T > self.sliding_window:
                window = sliding_causal_mask(T, self.sliding_window, q.device)
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=window, enable_gqa=True)
            else:
                y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            cache.prefill(input_pos, k, v, q)
            self.prefilled = True
            return y
        B, H = q.shape[:2]
        mask = self._mask
        if cache.pooled:  # one K/V pool for all heads (cache_allocation.py): every query head over it
            mask = mask.expand(-1, -1, H // cache.n_kv_heads, -1).reshape(B, 1, H, -1)
        y, probs = grouped_attention(q, k, v, mask)
        if cache.needs_attention:
            cache.update_state(probs.view(B, cache.n_kv_heads, -1, probs.shape[-1]))
        return y

    def _append(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        cache, (B, H, T, _) = self.cache, q.shape
        input_pos = torch.arange(T, device=q.device) + self.seen()
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
        return self.seen()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Our attention ignores transformers' masks (the slots carry their own); generate still builds one from
        # these sizes: the prompt's own keys (padding is refused from it), then the slots, as StaticLayer does.
        return (query_length if query_length > 1 else self.cache.keys().shape[2]), 0

    def get_max_length(self) -> int:
        return self.cache.capacity_needed  # prompt + new tokens the caches were sized for (full / debug_)

    def reset(self) -> None:
        self.cache.reset()
        self.prefilled = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UserError("beam search is not supported by the eviction cache (its per-token scores are per "
                        "sequence); use num_beams=1: greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UserError("the eviction cache decodes one sequence: use num_beams=1 and num_return_sequences=1")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise UserError("the eviction cache cannot select sequences of a batch (batch 1 only)")

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("the eviction cache cannot be cropped (evicted tokens are gone): assisted and "
                        "speculative decoding are not supported")


class EvictionCache(Cache):
    """A transformers Cache whose layer i is this project's KVCache for layer i (`kv_caches`)."""

    def __init__(self, caches: Sequence[KVCache], model_args: ModelArgs, prompt_length: int) -> None:
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
        self.capacity = caches[0].capacity_needed  # prompt + new tokens the caches were built for
        self.prompt_length = prompt_length

    @property
    def kv_caches(self) -> list[KVCache]:
        return [layer.cache for layer in self.layers]

    @property
    def needs_token_ids(self) -> bool:
        return any(c.needs_token_ids for c in self.kv_caches)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.layers[0].reorder_cache(beam_idx)

    def statistics(self) -> dict:
        """generate.py's cache statistics (docs/DESIGN.md §6), and the attention-loss curve of debug_ caches."""
        stats = cache_statistics(self.kv_caches)
        curve = attention_loss_curve(self.kv_caches)
        if curve:
            stats["attention_loss_cumulative_by_step"] = curve
        return stats


def make_cache(model: torch.nn.Module, flags: Sequence[str] | argparse.Namespace, prompt_length: int,
               max_new_tokens: int, tokenizer: object | None = None,
               token_classes: dict[str, Tensor] | None = None) -> EvictionCache:
    """An EvictionCache for `model` from generate.py's cache flags (a list of words, or a parsed namespace),
    sized for `prompt_length` + `max_new_tokens` as generate.py sizes it; prepares the model (prepare_model).
    `tokenizer` (this project's or a transformers one) or `token_classes` is needed by hybrid caches only."""
    flags = parse_cache_flags(flags)
    args = prepare_model(model)
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if prompt_length + max_new_tokens > args.context_length:
        raise UserError(f"the prompt ({prompt_length} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                        f"model's context of {args.context_length} tokens")
    weight = next(model.parameters())
    if token_classes is None and tokenizer is not None:
        token_classes = tokenizer_classes(tokenizer, args.vocab_size)
    if token_classes is None and _needs(flags, "needs_token_classes"):
        raise UserError("the hybrid cache needs the tokenizer's special and punctuation tokens: pass "
                        "make_cache(..., tokenizer=tokenizer) (or token_classes=)")
    caches = _build_layer_caches(flags, args, prompt_length, max_new_tokens, weight.dtype, weight.device,
                                 token_classes)
    return EvictionCache(caches, args, prompt_length)


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
