"""Every strategy inside Hugging Face transformers: a `Cache` whose layers are this project's `KVCache`
modules (transformers_cache.py) and a registered attention function, so `model.generate(..., cache=cache)`
decodes with eviction (docs/DESIGN.md §4 is the contract; the "Use from transformers" README section the usage).
transformers 5.24 names the argument `cache=` (`past_key_values=` still works, deprecated).

    cache = make_cache(model, ["--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25"],
                       prompt_length=ids.shape[1], max_new_tokens=32)
    out = model.generate(ids, cache=cache, max_new_tokens=32, do_sample=False)  # past_key_values= before 5.x
    cache.statistics()  # compression, evictions, attention loss (debug_), as generate.py reports them

How the contract maps onto transformers (its models call `cache.update(k, v, layer_idx, kwargs=...)` with
keys after q/k norm and RoPE, then the attention function with the query):

- `update` of a decode step (one token) is `KVCache.insert`; it hands back the token's own keys and values,
  since the attention function reads the slots itself (from quantized codes without rebuilding K and V on the
  CPU), and the slots' mask stays with the layer. Of the prompt it only passes the keys through:
  `KVCache.prefill` needs the prompt's queries (prompt rules score with them), which only the attention
  function sees.
- `update` hands the layer to the attention function through the keyword dict the model passes to both
  (`kwargs=kwargs` to `update`, `**kwargs` to the attention function); without it (another cache, or none)
  the function is plain SDPA with transformers' own mask, so switching a model to it changes nothing else.
- the attention function: the prompt is causal SDPA (the sliding window where the layer has one), then
  `prefill`; a decode step is `attention.attend_slots` over the slots with their mask, and
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
  model.Attention.forward_chunk; the first decode step ends it. Eager. A left-padded batch: transformers cuts it
  every N padded positions, not where a shorter row's own chunks end, so each row's tokens are cut again at its
  own boundaries (from make_cache's prompt lengths) and go through its cache part by part in its row context
  (EvictionLayer._row_chunks), each row as alone.
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
from pathlib import Path

import torch
from torch import Tensor

from errors import UserError

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
except ImportError as e:  # transformers is optional for the tool: only this module needs it
    raise ImportError("transformers_adapter needs Hugging Face transformers (pip install transformers)") from e

from cache import KVCache
from model import ModelArgs
from strategies.token_ids import TOKEN_CLASSES_NEEDED
from transformers_cache import LAYER_KEY, SUPPORTED_MODEL_TYPES, EvictionCache

ATTENTION_NAME = "kv_eviction"


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
    if gated := _needing(flags, "needs_gates"):
        raise UserError(f"{', '.join(gated)}: learned gates are attached to this project's model only; use "
                        "generate.py / eval for gated caches, or another strategy here")
    return flags


def _needing(flags: argparse.Namespace, need: str) -> list[str]:
    """The requested strategies that declare `need`, once each; a debug_ twin's needs are its shadow's (on the
    class they are properties, only read on instances)."""
    from strategies import get_strategy

    classes = {name: get_strategy(name) for name in flags.cache_strategy}
    return [name for name, cls in classes.items() if getattr(getattr(cls, "shadow_class", cls), need)]


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
    _refuse_unsupported_feeds(module, cache, B, T)
    prompt = T > 1 and not cache.layers[0].prefilled  # static shapes under compile: decode never enters
    row_chunk = cache.row_chunking and not cache.prompt_fed()  # a padded batch's chunk, which may be one token
    if prompt:
        cache.begin_prompt(_prompt_lengths(kwargs.get("attention_mask"), B, T, empty_rows=bool(cache.prefill_chunk)), T)
    elif row_chunk:
        cache.next_chunk(T)
        lengths = _prompt_lengths(kwargs.get("attention_mask"), B, T, empty_rows=True)
        if cache.plan_row_chunks(T) != lengths:
            raise UserError(f"a chunk's attention mask gives rows {lengths} tokens where the padded batch's rows "
                            "(make_cache's prompt lengths, left-padded) have others; pad on the left")
    elif T > 1 and (B > 1 or _prompt_lengths(kwargs.get("attention_mask"), B, T) != [T]):
        what = "a later prompt chunk" if cache.chunking else "a chunk after the prompt (the kvpress question)"
        raise UserError(f"{what} is supported for one unpadded sequence only; feed it row by row (for a new "
                        "prompt, cache.reset() first)")
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
    if not torch.compiler.is_compiling() and not cache.row_chunking:  # one host read per step in eager mode; a
        # compiled step skips it (a padded batch's chunks are its make_cache lengths, which fit, checked above)
        seen = cache.layers[0].seen().tolist()
        cache.check_room(cache.prompt_rows if prompt else [T] * B, seen)
        if T == 1 and ids is not None:
            cache.note_stopped_rows(ids[:, 0], seen)
    if cache.needs_token_ids:
        _give_token_ids(cache, ids, prompt or row_chunk)


def _refuse_unsupported_feeds(module: torch.nn.Module, cache: EvictionCache, B: int, T: int) -> None:
    """A batch other than the cache's rows, a padded batch fed token by token, a chunked prefill under compile."""
    if B != cache.batch_size:
        raise UserError(f"the eviction cache was built for {cache.batch_size} sequence(s) (one per prompt length "
                        f"given to make_cache), got {B}; beam search and num_return_sequences > 1 are not supported")
    if T == 1 and cache.prefill_chunk == 1 and len(set(cache.prompt_lengths)) > 1:
        # Fed token by token (prefill_chunk_size=1), a padded batch's padding would enter its rows as tokens.
        raise UserError("a padded batch fed token by token (--prefill_chunk 1) is not supported: feed its prompts "
                        "one at a time, or use chunks of 2 tokens or more (prefill_chunk_size)")
    if T > 1 and cache.prefill_chunk and (torch.compiler.is_compiling() or
                                          hasattr(module.forward, "_torchdynamo_orig_callable")):
        # A chunk's prefill and re-prefill read the cache's counts on the host (cache_chunking.py): not traceable.
        # Under compile_config this hook is traced too; with `model.forward = torch.compile(...)` it runs eager.
        raise UserError("a chunked prefill (--prefill_chunk) runs eager: transformers compiles the prompt's chunks "
                        "under compile_config or a compiled forward; compile without chunks, or drop --prefill_chunk")


def _give_token_ids(cache: EvictionCache, ids: Tensor | None, prompt: bool) -> None:
    """The token ids to the caches that read them (hybrid's policies, sepllm's separators), as
    model.Transformer.forward gives them; `prompt`: a prompt or a padded batch's chunk, cut per row in `attend`."""
    if ids is None:
        raise UserError("this cache reads token ids (hybrid, sepllm): call generate with input_ids, not inputs_embeds")
    for layer in cache.layers:
        if not layer.cache.needs_token_ids:
            continue
        if prompt and cache.prompt_rows != [ids.shape[1]]:
            # each row's own, in its row context just before its prefill or its chunk's part (attend)
            layer.prompt_ids = ids
        else:
            layer.cache.observe_tokens(ids)


def _prompt_lengths(mask: Tensor | dict | None, B: int, T: int, empty_rows: bool = False) -> list[int]:
    """Each row's tokens in a prompt of T positions, read from its attention mask: the 2D mask of a plain
    call, or the 4D masks generate prepares (per layer type in a dict; a causal or sliding query always sees
    its own token unless that token is padding, so the diagonal says it; get_mask_sizes gives the prompt's
    keys from 0). Padding must come first (left padding, as decoder-only generation wants): a row's tokens
    are its last n positions. `empty_rows`: a row may have none (a chunk of a padded batch's prefill)."""
    if isinstance(mask, dict):
        mask = mask.get("full_attention", next(iter(mask.values()), None))
    if not isinstance(mask, Tensor):
        return [T] * B  # None: transformers saw no padding (the causal kernel flag suffices)
    if mask.dim() == 2:
        real = mask[:, -T:].bool()
    else:
        # The last T keys are the T queries' own tokens (a later chunk's mask has the earlier keys first).
        diagonal = mask[..., -T:].diagonal(dim1=-2, dim2=-1)  # [B, heads or 1, T]
        real = (diagonal if diagonal.dtype == torch.bool else diagonal == 0).any(dim=1)
    real = real.expand(B, T)
    lengths = real.sum(dim=1)
    positions = torch.arange(T, device=real.device)
    left_padded = real == (positions >= T - lengths[:, None])
    if not bool(left_padded.all()):
        raise UserError("padding after or inside a prompt is not supported by the eviction cache: pad on the left "
                        "(tokenizer.padding_side = 'left'), as decoder-only generation does")
    if not empty_rows and not bool((lengths > 0).all()):
        raise UserError("a prompt of padding only (no token) cannot be prefilled")
    return lengths.tolist()


def eviction_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       **kwargs: object) -> tuple[Tensor, None]:
    """The registered attention function: over an EvictionLayer's slots when `update` handed one, else SDPA.
    query [B, n_head, T, D]; returns ([B, T, n_head, D], None) as transformers' attention functions do."""
    layer = kwargs.pop(LAYER_KEY, None)
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


# ---- the cache (transformers_cache.py) and its construction -------------------------------------------------


def make_cache(model: torch.nn.Module, flags: Sequence[str] | argparse.Namespace,
               prompt_length: int | Sequence[int], max_new_tokens: int, tokenizer: object | None = None,
               token_classes: dict[str, Tensor] | None = None,
               eos_token_id: int | Sequence[int] | None = None) -> EvictionCache:
    """An EvictionCache for `model` from generate.py's cache flags (a list of words, or a parsed namespace),
    sized for `prompt_length` + `max_new_tokens` as generate.py sizes it; prepares the model (prepare_model).
    A list of prompt lengths gives one row per prompt of a batch (left-padded, as transformers batches
    decoder-only prompts), each row with the budgets its own length gives, as if decoded alone. With
    `eos_token_id` (generate's), a row's statistics are taken where it is fed its EOS, as generate.py's (under
    `compile_config` with `stopping_criteria=cache.stopping_criteria()` too); without it they count what
    transformers feeds a stopped row (its padding) until the batch ends.
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
    if token_classes is None and (needing := _needing(flags, "needs_token_classes")):
        raise UserError(f"the {needing[0]} cache {TOKEN_CLASSES_NEEDED}: pass "
                        "make_cache(..., tokenizer=tokenizer) (or token_classes=)")
    caches = _build_layer_caches(flags, args, lengths, max_new_tokens, weight.dtype, weight.device, token_classes)
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return EvictionCache(caches, args, lengths, flags.prefill_chunk or 0, eos)


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """(input ids [B, T], attention mask [B, T]) of prompts of any lengths, padded on the left as transformers
    batches decoder-only prompts (what make_cache's rows expect)."""
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = torch.tensor(list(p), dtype=torch.long), 1
    return ids, mask


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
    """strategies.token_ids.token_classes for this project's tokenizer or a transformers one (same rule)."""
    from strategies.token_ids import token_classes

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
