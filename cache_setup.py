"""The one way from cache flags to caches attached to a model, used by generate.py, eval, the bench, the
benchmarks and the tests:

    config = cache_config(["--cache_strategy", "heavy_hitter", "--max_cache_length", "0.25"])
    specs = attach_caches(model, config, prompt_length, max_new_tokens, tokenizer)

`cache_config` takes command-line words, a mapping of flags (as a YAML preset spells them) or a preset's
name, and returns the validated flags; `cache_specs` resolves them for a model (per-layer budgets, the
model's own layer policies such as sliding windows, the budget checks); `attach_caches` does that and
builds and attaches the caches. Every step a caller could forget is inside.

Rows of one batch: `batch_size=B` gives B rows of one shape (equal prompt lengths, shared positions);
`attach_row_caches(model, config, prompt_lengths, max_new_tokens)` gives one row per prompt length, each
with the budgets its own length resolves to (prefill them with generate.prefill_rows).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from torch import Tensor

from cache import KVCache
from cache_spec import (
    LayerCacheSpec,
    add_cache_arguments,
    build_caches,
    cache_flag_names,
    check_cache_flags,
    mapping_to_argv,
    parse_args_with_preset,
    resolve_cache_spec,
)
from errors import CliParser, UserError
from model import ModelArgs, Transformer
from model_policies import apply_model_layer_policies
from strategies import get_strategy
from strategies.kvzip import set_repeat_prompt
from strategies.token_ids import token_classes
from tokenizer import Tokenizer

__all__ = ["attach_caches", "attach_row_caches", "build_row_caches", "cache_config", "cache_specs", "check_budgets",
           "setup_caches", "setup_row_caches"]


def cache_config(flags: Sequence[str] | Mapping[str, object] | str | None = None,
                 **values: object) -> argparse.Namespace:
    """The validated cache flags from command-line words, a mapping of flag names to values (typed and
    checked as a YAML preset is) or a preset's name or path; `values` override them, as typed flags
    override a preset."""
    parser = CliParser(prog="cache_config", add_help=False)
    add_cache_arguments(parser)
    if isinstance(flags, str):
        argv = ["--cache_config", flags]
    elif isinstance(flags, Mapping):
        argv = mapping_to_argv(dict(flags), parser, cache_flag_names(), "cache settings", "cache flag")
    else:
        argv = list(flags or [])
    argv += mapping_to_argv(values, parser, cache_flag_names(), "cache settings", "cache flag")
    args = parse_args_with_preset(parser, argv)
    check_cache_flags(args)
    return args


def check_budgets(specs: list[LayerCacheSpec], context_length: int, sequence_length: int) -> None:
    """With --rerotate_positions, ranks index the RoPE tables: every layer's cache must hold at most the
    context. A full cache and a debug_ cache (a full cache with a shadow) hold the whole sequence."""
    for spec in specs:
        whole = spec.strategy.startswith("debug_") or spec.strategy == "full"
        held = sequence_length if whole else spec.max_cache_length
        if spec.rerotate_positions and held > context_length:
            what = f"holds the whole sequence ({held} tokens)" if whole else f"has a budget of {held} tokens"
            raise UserError(
                f"layer {spec.layer}: the {spec.strategy} cache {what}, more than the model's context of "
                f"{context_length}; with --rerotate_positions every layer's cache must fit the context (its "
                "positions are ranks below its size)"
            )


def cache_specs(config: argparse.Namespace, model_args: ModelArgs, prompt_length: int, max_new_tokens: int,
                quiet: bool = True) -> list[LayerCacheSpec]:
    """One spec per layer of the model: the flags resolved, the model's layer policies applied (a sliding
    layer gets its window cache; unless `quiet`, a note says so) and the budgets checked."""
    specs = resolve_cache_spec(config, model_args.n_layer, prompt_length, max_new_tokens)
    chunk = getattr(config, "prefill_chunk", None)
    if chunk and chunk > model_args.context_length:
        raise UserError(f"--prefill_chunk {chunk} is larger than the model's context of {model_args.context_length} "
                        "tokens (a chunk goes through the model at once)")
    specs = apply_model_layer_policies(specs, model_args, prompt_length, max_new_tokens, quiet=quiet)
    check_budgets(specs, model_args.context_length, prompt_length + max_new_tokens)
    for spec in specs:  # a chunk's queries sit at ranks up to the budget + the chunk (a full cache: positions)
        ranks = spec.max_cache_length + (chunk or 0)
        compresses = spec.strategy.removeprefix("debug_") != "full"
        if chunk and spec.rerotate_positions and compresses and ranks > model_args.context_length:
            raise UserError(f"layer {spec.layer}: with --rerotate_positions a chunk's queries sit at ranks up to the "
                            f"budget plus the chunk, {spec.max_cache_length} + {chunk}, more than the model's context "
                            f"of {model_args.context_length}; use a smaller --prefill_chunk or budget")
    return specs


def setup_caches(model: Transformer, specs: list[LayerCacheSpec], capacity_needed: int,
                 tokenizer: Tokenizer | None = None, classes: dict[str, Tensor] | None = None,
                 batch_size: int = 1) -> None:
    """Build and attach one cache per layer from resolved specs, for `batch_size` rows of one shape (equal
    prompt lengths); the tokenizer (or its `classes`, strategies.token_ids.token_classes) is needed by hybrid
    caches only. Gated caches get the model's learned gates: --gates_path, else those already attached, else
    the shipped file."""
    model.setup_caches(_build(model, specs, batch_size, capacity_needed, tokenizer, classes))


def setup_row_caches(model: Transformer, row_specs: list[list[LayerCacheSpec]], capacities: list[int],
                     tokenizer: Tokenizer | None = None, classes: dict[str, Tensor] | None = None) -> None:
    """Caches for rows that each have their own sequence: row b's specs (resolved for its prompt length) and
    the tokens it will see, `capacities[b]`. A layer's cache has the largest row's slots and every row its
    own budget within them (KVCache.set_row_budgets), so a row behaves as it would alone. The rows' specs
    must agree on everything but the budget (one cache class and storage per layer)."""
    model.setup_caches(build_row_caches(
        row_specs, capacities, lambda specs, rows, capacity: _build(model, specs, rows, capacity, tokenizer, classes)))


def build_row_caches(row_specs: list[list[LayerCacheSpec]], capacities: list[int],
                     build: Callable[[list[LayerCacheSpec], int, int], list[KVCache]]) -> list[KVCache]:
    """One cache per layer for rows of their own lengths (see setup_row_caches): `build(specs, rows, capacity)`
    builds the widest row's caches, and each row gets its own budget within them. The transformers adapter
    builds its batches here too."""
    if len(row_specs) != len(capacities) or not row_specs:
        raise ValueError(f"{len(row_specs)} rows of specs for {len(capacities)} capacities")
    check_rows_agree(row_specs)
    widest = [max(specs, key=lambda s: s.max_cache_length) for specs in zip(*row_specs, strict=True)]
    caches = build(widest, len(capacities), max(capacities))
    for layer, cache in enumerate(caches):
        cache.set_row_budgets([specs[layer].max_cache_length for specs in row_specs], list(capacities))
    return caches


def check_rows_agree(row_specs: list[list[LayerCacheSpec]]) -> None:
    """Rows batched into one cache per layer must resolve to the same cache but for the budget."""
    for layer, specs in enumerate(zip(*row_specs, strict=True)):
        if any(replace(s, max_cache_length=0) != replace(specs[0], max_cache_length=0) for s in specs):
            raise UserError(f"layer {layer}: the rows' prompts resolve to different caches (strategy, storage or "
                            "layer policy); batch prompts whose lengths resolve alike, or decode them apart")


def row_cache_specs(config: argparse.Namespace, model_args: ModelArgs, prompt_lengths: list[int],
                    max_new_tokens: int, quiet: bool = True) -> list[list[LayerCacheSpec]]:
    """Each row's specs, resolved for its own prompt length (notes printed for the first row unless `quiet`),
    checked to batch together (check_rows_agree)."""
    row_specs = [cache_specs(config, model_args, n, max_new_tokens, quiet=quiet or b > 0)
                 for b, n in enumerate(prompt_lengths)]
    check_rows_agree(row_specs)
    return row_specs


def _build(model: Transformer, specs: list[LayerCacheSpec], batch_size: int, capacity_needed: int,
           tokenizer: Tokenizer | None, classes: dict[str, Tensor] | None) -> list[KVCache]:
    a = model.args
    w = model.tok_embeddings.weight
    if classes is None and tokenizer is not None and any(get_strategy(s.strategy).needs_token_classes for s in specs):
        classes = token_classes(tokenizer, a.vocab_size)
    caches = build_caches(specs, batch_size, a.n_kv_head, a.head_dim, capacity_needed, w.dtype, w.device, classes)
    if tokenizer is not None:
        set_repeat_prompt(caches, tokenizer)  # KVzip's reconstruction prompt (a no-op for other caches)
    if any(c.needs_gates for c in caches):
        from gates import prepare_gates

        paths = {s.hyperparameters.get("gates_path") for s in specs if "gates_path" in s.hyperparameters}
        prepare_gates(model, next(iter(paths), None))  # one --gates_path flag: one value
    return caches


def attach_caches(model: Transformer, config: argparse.Namespace, prompt_length: int, max_new_tokens: int,
                  tokenizer: Tokenizer | None = None, classes: dict[str, Tensor] | None = None,
                  quiet: bool = True, capacity_needed: int | None = None, batch_size: int = 1) -> list[LayerCacheSpec]:
    """Caches for a prompt of `prompt_length` tokens followed by `max_new_tokens` (in each of `batch_size`
    rows), attached to `model`; the resolved specs. `capacity_needed` (default: prompt + new tokens) is what
    a full cache holds."""
    specs = cache_specs(config, model.args, prompt_length, max_new_tokens, quiet=quiet)
    setup_caches(model, specs, capacity_needed or prompt_length + max_new_tokens, tokenizer, classes, batch_size)
    return specs


def attach_row_caches(model: Transformer, config: argparse.Namespace, prompt_lengths: list[int],
                      max_new_tokens: int, tokenizer: Tokenizer | None = None,
                      classes: dict[str, Tensor] | None = None, quiet: bool = True) -> list[list[LayerCacheSpec]]:
    """Caches for one row per prompt length (each followed by `max_new_tokens`), each row with the budgets
    its own length resolves to (setup_row_caches); the specs of every row."""
    row_specs = row_cache_specs(config, model.args, prompt_lengths, max_new_tokens, quiet)
    setup_row_caches(model, row_specs, [n + max_new_tokens for n in prompt_lengths], tokenizer, classes)
    return row_specs
