"""Generate from one prompt, or a batch of them, under a (compressed) KV cache and report its statistics.

    python generate.py --prompt "What is a KV cache?" --max_new_tokens 64
    python generate.py --cache_strategy full --compile --stats_json stats.json --prompt prompt.txt
    python generate.py --prompt "Hi" --prompt notes.txt --prompt "Why?" --batch_size 3
    python generate.py --prompts_file questions.jsonl --batch_size 4   # one {"prompt": ...} per line
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from dataclasses import dataclass

import torch
from torch import Tensor

import cpu_bf16_kernels
from atomic_files import check_writable
from cache import KVCache, finite_float
from cache_chunking import end_chunked_prefill
from cache_setup import cache_specs, row_cache_specs, setup_caches, setup_row_caches
from cache_spec import LayerCacheSpec, add_cache_arguments, check_cache_flags, format_cache_spec, parse_args_with_preset
from checkpoint import add_model_arguments, load_checkpoint, parse_dtype, resolve_device
from compiled_step import compile_decode_step
from errors import CliParser, UserError, run_cli
from generation_stats import (
    batches_stats,
    print_stats_block,
    row_cache_statistics,
    row_stats,
    row_summary,
    write_stats_json,
)
from ignored_flags import check_typed_flags
from model import Transformer
from packed_prefill import packed_groups, prefill_packed, prefill_packed_chunks
from prompts import collect_prompts
from strategies.kvzip import ChunkedReconstruction, reconstruct_and_prefill, rule_users
from tokenizer import Tokenizer

# ---- the decode loop ------------------------------------------------------------------------------------


def prefill(model: Transformer, prompt: Tensor, prefill_length: int | None = None, decode_step=None) -> Tensor:
    """Run the prompt [B, T] through the model, filling the caches; logits of the last position [B, vocab].

    With `prefill_length` < T (--feed_long_prompts), only that many tokens are prefilled and the rest of
    the prompt goes through `decode_step` one token at a time, so every cache sees it as decoding. Caches
    configured with --prefill_chunk N get the prompt N tokens at a time (chunked_prefill); N = 1 is the
    token-by-token feed after a one-token prefill.
    """
    T = prompt.shape[1]
    n = T if prefill_length is None else min(prefill_length, T)
    step = decode_step or decode_one_token
    chunk = prefill_chunk_of(model)
    if chunk == 1:  # a one-token chunk is a decode step: the whole prompt is fed (--feed_long_prompts' path)
        n = 1
    if chunk and n > chunk:
        logits = chunked_prefill(model, prompt[:, :n], chunk, step)
    # KVzip's model-level scoring pass prefills the caches itself; without a cache that needs it, the forward.
    elif (logits := reconstruct_and_prefill(model, prompt[:, :n])) is None:
        logits = model(prompt[:, :n], torch.arange(n, device=prompt.device), last_logits_only=True)[:, -1]
    for p in range(n, T):
        logits = step(model, prompt[:, p : p + 1], torch.tensor([p], device=prompt.device))
    return logits


def prefill_chunk_of(model: Transformer) -> int:
    """The --prefill_chunk the attached caches were configured with (0: the prompt at once); every layer carries
    it, a sliding window's too (model_policies.py)."""
    return max((cache.prefill_chunk for cache in model.caches()), default=0)


def chunked_prefill(model: Transformer, prompt: Tensor, chunk: int, step) -> Tensor:
    """The prompt [B, T] through the model `chunk` tokens at a time; after each chunk every layer's cache
    holds at most its budget (KVCache.prefill_chunk_tokens). A last chunk of one token is the first decode step,
    after the prefill ends.
    Logits of the last position [B, vocab]."""
    T = prompt.shape[1]
    # KVzip's rule scores each chunk by a pass that also reads the chunk's repeat input (strategies/kvzip.py).
    reconstruction = ChunkedReconstruction.for_prompt(model, prompt)
    step_last = last_token_is_a_step(model)
    ended = False
    try:
        for start in range(0, T, chunk):
            end = min(start + chunk, T)
            if end - start == 1 and step_last:
                if end == T:  # the prompt's last token is the first decode step: the prefill ends before it
                    end_chunked_prefill(model.caches())
                    ended = True
                logits = step(model, prompt[:, start:end], torch.tensor([start], device=prompt.device))
            elif reconstruction is not None:
                logits = reconstruction.chunk(prompt, start, end)
            else:
                input_pos = torch.arange(start, end, device=prompt.device)
                logits = model(prompt[:, start:end], input_pos, last_logits_only=True, chunk=True)[:, -1]
    finally:
        if not ended:
            end_chunked_prefill(model.caches())
        if reconstruction is not None:
            reconstruction.end()
    return logits


def last_token_is_a_step(model: Transformer) -> bool:
    """Whether a prompt's last chunk of one token is a decode step (as transformers' chunked prefill feeds it),
    or a chunk like the others: under the kvpress protocol (a prompt budget set) decode steps never evict, so
    that token is compressed with the prompt by the prompt rule, to the prompt's budget."""
    return not any(c.prompt_budget for cache in model.caches() for c in cache.modules() if isinstance(c, KVCache))


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor) -> Tensor:
    """token [B, 1] at position input_pos [1] shared by the rows, or [B] one per row (device tensors) ->
    logits [B, vocab]. The eager step."""
    return model(token, input_pos)[:, -1]


def prefill_rows(model: Transformer, prompts: list[Tensor], prefill_lengths: list[int] | None = None,
                 rows: list[int] | None = None, prompt_budgets: list[int | None] | None = None,
                 pack: bool | None = None) -> Tensor:
    """Prefill prompts[i] [T_i] into cache row rows[i] (default: row i), each row storing and compressing only
    its own tokens at its own budget. Where the prefill can be shared (shares_prefill; `pack` forces it or not),
    consecutive prompts go through one forward pass packed (packed_prefill.py; with --prefill_chunk, one pass
    for the rows' j-th chunks); otherwise each is prefilled in its row context (Transformer.cache_row), where
    tokens past its prefill length (--feed_long_prompts) go through the eager step (a compiled one would
    recompile for a batch-1 model). `prompt_budgets`: each row's KVCache.prompt_budget (the kvpress protocol's
    per-item budget), None to keep the caches' own. Logits of each row's last position, [len(prompts), vocab]."""
    rows = list(range(len(prompts))) if rows is None else rows
    budgets = prompt_budgets or [None] * len(prompts)
    if not shares_prefill(model, prompts, prefill_lengths, pack):
        return torch.cat([prefill_row(model, b, prompt, None if prefill_lengths is None else prefill_lengths[i],
                                      budgets[i]) for i, (b, prompt) in enumerate(zip(rows, prompts, strict=True))])
    if chunk := prefill_chunk_of(model):
        return prefill_packed_chunks(model, prompts, rows, chunk, budgets)
    logits = []
    for group in packed_groups([len(p) for p in prompts]):
        if len(group) == 1:
            logits.append(prefill_row(model, rows[group[0]], prompts[group[0]], None, budgets[group[0]]))
        else:
            part, cache_rows = prompts[group.start:group.stop], rows[group.start:group.stop]
            logits.append(prefill_packed(model, part, cache_rows, budgets[group.start:group.stop]))
    return torch.cat(logits)


def shares_prefill(model: Transformer, prompts: list[Tensor], prefill_lengths: list[int] | None,
                   pack: bool | None = None) -> bool:
    """Whether the rows' prompts (their chunks, with --prefill_chunk) go through the model packed. They can
    where each is prefilled whole (not cut for --feed_long_prompts, not fed token by token by --prefill_chunk
    1) and no cache uses KVzip's rule (a reconstruction pass over each prompt's own sequence). They do if
    `pack`, or by default where the rows are not batch-invariant (Transformer.batch_invariant): where they are
    (the CPU kernels, up to 8 rows), packing would round a row's products over every row's tokens, while a row
    alone gets exactly its batch-1 caches (packing's gain on short CPU prompts is given up for that)."""
    whole = prefill_lengths is None or all(n >= len(p) for p, n in zip(prompts, prefill_lengths, strict=True))
    can = len(prompts) > 1 and whole and prefill_chunk_of(model) != 1 and not rule_users(model.caches())
    return can and (not model.batch_invariant() if pack is None else pack)


def prefill_row(model: Transformer, b: int, prompt: Tensor, prefill_length: int | None,
                prompt_budget: int | None = None) -> Tensor:
    """Row b's prompt [T] prefilled alone in its row context (see prefill), compressed to `prompt_budget` when
    given; its last logits [1, vocab]."""
    with model.cache_row(b):
        if prompt_budget is not None:
            for cache in model.caches():
                cache.configure(prompt_budget=prompt_budget)
        return prefill(model, prompt.view(1, -1), prefill_length)


def sample_rows(logits: Tensor, temperature: float, top_k: int | None,
                generators: list[torch.Generator] | None) -> Tensor:
    """Next token of each row [B, 1]; each row draws from its own generator, so a row's tokens are those it
    would sample alone with the same seed."""
    if temperature <= 0 or generators is None:
        return sample(logits, temperature, top_k, None)
    return torch.cat([sample(logits[b : b + 1], temperature, top_k, g) for b, g in enumerate(generators)])


def sample(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """Next token [B, 1]: greedy when temperature is 0, else softmax(logits / T) restricted to the top k."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    # The max subtracted first: (l - max) / T is ≤ 0, so a tiny T gives -inf (probability 0) or 0, never
    # inf - inf; the softmax is unchanged for every other T.
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


# On a GPU the loop never waits for a step to finish: tokens stay on the device and EOS is looked for once
# every EOS_CHECK_INTERVAL steps (one host synchronisation), so up to that many - 1 steps may run after an
# EOS; their tokens are dropped, but the caches have seen them (counted in the cache statistics).
EOS_CHECK_INTERVAL = 16


@dataclass
class GenerationResult:
    tokens: list[int]  # up to and including the first EOS
    prefill_seconds: float
    decode_seconds: float  # steady-state decode: after the prompt, compile and warm-up excluded
    decode_steps: int  # decode steps run (may exceed len(tokens) - 1 on a GPU: see EOS_CHECK_INTERVAL)
    stopped_at_eos: bool
    compile_seconds: float = 0.0  # compile and CUDA-graph capture before the prompt (CompiledDecodeStep.prepare)
    # A batch row's cache statistics, taken at the check where it stopped (generate_batch), before the tokens
    # the batch decodes after it reach its cache; None: read the caches as they are.
    cache_statistics: dict | None = None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    decode_step=decode_one_token,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    progress: bool = False,
    prefill_length: int | None = None,
) -> GenerationResult:
    """Prefill, then decode one token at a time until EOS or `max_new_tokens`. Caches must be set up."""
    from tqdm import tqdm

    device = model.tok_embeddings.weight.device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else 0)
    compile_seconds = prepare_step(decode_step, model)
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    eos = torch.tensor(eos_ids or [-1], dtype=torch.long, device=device)
    check_every = 1 if device.type == "cpu" else EOS_CHECK_INTERVAL
    model.reset_caches()
    with torch.inference_mode():
        t0 = time.perf_counter()
        token = sample(prefill(model, prompt, prefill_length, decode_step), temperature, top_k, generator)
        out = torch.empty(max_new_tokens, dtype=torch.long, device=device)
        out[:1] = token.view(1)
        stopped = bool(torch.isin(token, eos).any())  # one sync: the prefill time is real on a GPU too
        t1 = time.perf_counter()
        input_pos = torch.tensor([len(prompt_ids)], dtype=torch.long, device=device)
        n = 1
        bar = tqdm(total=max_new_tokens - 1, desc="decode", disable=not progress, leave=False)
        while not stopped and n < max_new_tokens:
            token = sample(decode_step(model, token.view(1, 1), input_pos), temperature, top_k, generator)
            out[n : n + 1] = token.view(1)
            input_pos += 1
            n += 1
            if n % check_every == 0 or n == max_new_tokens:
                stopped = bool(torch.isin(out[max(1, n - check_every) : n], eos).any())
                bar.update(n - 1 - bar.n)
        bar.close()
        _synchronize(device)
        t2 = time.perf_counter()
    tokens = out[:n].tolist()
    first_eos = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
    if first_eos is not None:
        tokens = tokens[: first_eos + 1]
    return GenerationResult(tokens, t1 - t0, t2 - t1, n - 1, first_eos is not None, compile_seconds)


def generate_batch(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: list[int],
    decode_step=decode_one_token,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    progress: bool = False,
    prefill_lengths: list[int] | None = None,
) -> list[GenerationResult]:
    """One row per prompt, of any lengths: the prompts prefilled into their rows (prefill_rows: packed), then
    every row decoded in one step per token, at its own position, until every row has its EOS or
    `max_new_tokens`. Row b's tokens are what `generate` gives for prompts[b] alone (greedy, or sampled
    with the same seed), on caches set up per row (cache_setup.setup_row_caches). A row that stopped keeps
    being decoded with the others (its tokens are dropped; its cache sees them), so its cache statistics are
    taken at the check where it stopped (every step on the CPU: exactly its batch-1 statistics). Per row: the
    batch's prefill time (the rows share forward passes), decode time and steps."""
    from tqdm import tqdm

    device = model.tok_embeddings.weight.device
    B = len(prompts)
    generators = None
    if temperature > 0:
        generators = [torch.Generator(device=device).manual_seed(seed if seed is not None else 0) for _ in prompts]
    compile_seconds = prepare_step(decode_step, model, B, per_row_positions=True)
    eos = torch.tensor(eos_ids or [-1], dtype=torch.long, device=device)
    check_every = 1 if device.type == "cpu" else EOS_CHECK_INTERVAL
    model.reset_caches()
    with torch.inference_mode():
        token, prefill_seconds = prefill_batch(model, prompts, prefill_lengths, temperature, top_k, generators)
        out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
        out[:, :1] = token
        done = torch.isin(token[:, 0], eos)
        snapshots: list[dict | None] = [None] * B
        take_snapshots(model, done, snapshots)
        stopped = all(x is not None for x in snapshots)
        t1 = time.perf_counter()
        input_pos = torch.tensor([len(ids) for ids in prompts], dtype=torch.long, device=device)  # one per row
        n = 1
        bar = tqdm(total=max_new_tokens - 1, desc="decode", disable=not progress, leave=False)
        while not stopped and n < max_new_tokens:
            token = sample_rows(decode_step(model, token, input_pos), temperature, top_k, generators)
            out[:, n : n + 1] = token
            done |= torch.isin(token[:, 0], eos)
            input_pos += 1
            n += 1
            if n % check_every == 0 or n == max_new_tokens:
                take_snapshots(model, done, snapshots)
                stopped = all(x is not None for x in snapshots)
                bar.update(n - 1 - bar.n)
        bar.close()
        _synchronize(device)
        decode_seconds = time.perf_counter() - t1
    return [row_result(row, eos_ids, prefill_seconds, decode_seconds, n - 1, compile_seconds, snapshots[b])
            for b, row in enumerate(out[:, :n].tolist())]


def prepare_step(decode_step, model: Transformer, batch_size: int = 1, per_row_positions: bool = False) -> float:
    """A compiled step compiled (and on CUDA captured) before the prompt (CompiledDecodeStep.prepare); its
    seconds (0 for the eager step, or one already prepared)."""
    if not hasattr(decode_step, "prepare"):
        return 0.0
    before = decode_step.compile_seconds
    decode_step.prepare(model, batch_size, per_row_positions)
    return decode_step.compile_seconds - before


def row_result(row: list[int], eos_ids: list[int], prefill_seconds: float, decode_seconds: float, steps: int,
               compile_seconds: float, cache_stats: dict | None) -> GenerationResult:
    """One row of a batch: its tokens up to and with its first EOS (the batch decoded past it)."""
    first_eos = next((i for i, t in enumerate(row) if t in eos_ids), None)
    tokens = row if first_eos is None else row[: first_eos + 1]
    return GenerationResult(tokens, prefill_seconds, decode_seconds, steps, first_eos is not None, compile_seconds,
                            cache_stats)


def prefill_batch(model: Transformer, prompts: list[list[int]], prefill_lengths: list[int] | None,
                  temperature: float, top_k: int | None, generators: list | None) -> tuple[Tensor, float]:
    """Every row's prompt prefilled (prefill_rows: in shared forward passes where it can): the first sampled
    token of every row [B, 1] and the prefill's seconds, after which every row has its first token."""
    device = model.tok_embeddings.weight.device
    started = time.perf_counter()
    logits = prefill_rows(model, [torch.tensor(ids, dtype=torch.long, device=device) for ids in prompts],
                          prefill_lengths)
    first = sample_rows(logits, temperature, top_k, generators)
    _synchronize(device)
    return first, time.perf_counter() - started


def take_snapshots(model: Transformer, done: Tensor, snapshots: list[dict | None]) -> None:
    """The cache statistics of every row that has stopped (`done` [B]) and has none yet, read in its row
    context (one host sync)."""
    for b in done.nonzero().flatten().tolist():
        if snapshots[b] is None:
            snapshots[b] = row_cache_statistics(model, b)


# ---- CLI ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="generate.py", description=__doc__)
    parser.add_argument("--prompt", action="append",
                        help="the prompt text, or the path of an existing text file; repeat it for several prompts, "
                             "decoded --batch_size at a time")
    parser.add_argument("--prompts_file", default=None,
                        help="more prompts, after any --prompt: one per line, or a .jsonl of {\"prompt\": ...} rows")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--ignore_eos", action="store_true",
                        help="decode --max_new_tokens tokens past any EOS (speed comparisons on equal token counts)")
    parser.add_argument("--temperature", type=finite_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the checkpoint's chat template (default: when it has one)")
    parser.add_argument("--stats_json", default=None, help="write the statistics and resolved config here")
    parser.add_argument("--overwrite", action="store_true", help="allow replacing an existing --stats_json")
    add_model_arguments(parser)
    add_cache_arguments(parser)
    return parser


def check_sampling(temperature: float, top_k: int | None) -> None:
    """Sampling flags, checked before anything is loaded (a negative temperature is not greedy decoding)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature must be a finite number ≥ 0 (0 = greedy), got {temperature:g}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top_k must be ≥ 1, got {top_k}")
    if top_k is not None and temperature == 0:
        raise UserError("--top_k restricts sampling, but --temperature 0 decodes greedily; give a temperature > 0")


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool | None) -> list[int]:
    if chat or (chat is None and tokenizer.chat_template):
        text = tokenizer.apply_chat_template(text)
    return tokenizer.encode(text)


def check_lengths(prompt_length: int, max_new_tokens: int, context_length: int,
                  rerotate_positions: bool = False, fed_in_pieces: bool = False) -> None:
    """The sequence must fit the model's context, unless positions are re-rotated: then only the prompt
    (prefilled at its own positions) must, and cache_setup.check_budgets checks every layer's budget. A
    prompt fed in pieces (`fed_in_pieces`: --prefill_chunk or --feed_long_prompts) with re-rotation is at
    ranks after its first piece, so it may exceed the context too."""
    if max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if prompt_length > context_length and not (rerotate_positions and fed_in_pieces):
        raise UserError(f"the prompt ({prompt_length} tokens) exceeds the model's context of {context_length} tokens"
                        + ("; --rerotate_positions with --prefill_chunk goes past it at a fixed budget"
                           if rerotate_positions else ""))
    if prompt_length + max_new_tokens > context_length and not rerotate_positions:
        raise UserError(
            f"the prompt ({prompt_length} tokens) plus --max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {context_length} tokens; --rerotate_positions goes past it with a cache whose "
            "budgets fit the context (e.g. --cache_strategy recent_global --max_cache_length 1024)"
        )


def eos_ids_for(args: argparse.Namespace, tokenizer: Tokenizer) -> list[int]:
    """The tokens that stop a row; none with --ignore_eos. A batch's tok/s counts the tokens its rows keep, and
    two caches whose texts differ stop their rows at different steps: their speeds compare on equal counts."""
    return [] if args.ignore_eos else tokenizer.eos_ids


def prefill_length_for(specs: list[LayerCacheSpec], prompt_length: int, feed_long_prompts: bool) -> int:
    """--feed_long_prompts prefills what fits the smallest layer budget; otherwise the whole prompt."""
    if not feed_long_prompts:
        return prompt_length
    return min(prompt_length, *(s.max_cache_length for s in specs))


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parse_args_with_preset(parser, argv)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    check_cache_flags(args)
    check_sampling(args.temperature, args.top_k)
    check_typed_flags(parser, args, argv)
    if args.max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be ≥ 1, got {args.max_new_tokens}")
    prompt_texts = collect_prompts(args.prompt, args.prompts_file)
    if args.stats_json is not None:  # '' too; before the model loads: a failed write would lose the statistics
        check_writable(args.stats_json, args.overwrite, "--stats_json")
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    model, tokenizer = load_checkpoint(args.checkpoint_path, device, dtype,
                                       allow_non_finite=args.allow_non_finite_weights)
    load_seconds = time.perf_counter() - t0
    prompts = [encode_prompt(tokenizer, text, args.chat) for text in prompt_texts]
    for ids in prompts:  # every prompt before any decoding: a bad one fails the run before it starts
        check_lengths(len(ids), args.max_new_tokens, model.args.context_length, args.rerotate_positions,
                      bool(args.prefill_chunk) or args.feed_long_prompts)
    if len(prompts) > 1:
        return main_rows(args, model, tokenizer, prompts, load_seconds)
    prompt_ids = prompts[0]
    specs = cache_specs(args, model.args, len(prompt_ids), args.max_new_tokens, quiet=False)
    if args.print_cache_spec:
        print(format_cache_spec(specs))
    setup_caches(model, specs, len(prompt_ids) + args.max_new_tokens, tokenizer)

    step = compile_decode_step(scope=args.compile_scope) if args.compile else decode_one_token
    result = generate(model, prompt_ids, args.max_new_tokens, eos_ids_for(args, tokenizer), step,
                      args.temperature, args.top_k, args.seed, progress=sys.stderr.isatty(),
                      prefill_length=prefill_length_for(specs, len(prompt_ids), args.feed_long_prompts))
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    print(text)
    stats = {"load_seconds": round(load_seconds, 3), **row_stats(len(prompt_ids), result, model, None),
             "compile_seconds": round(result.compile_seconds, 2) if args.compile else None}
    print_stats_block(stats)
    if args.stats_json:
        write_stats_json(args, model, {**stats, "text": text, "tokens": result.tokens},
                         [s.to_dict() for s in specs])
    return stats


# Where the last bit of a product flips which tokens a strategy keeps, so a batch's rows keep their batch-1
# tokens only where the rows are batch-invariant (Transformer.batch_invariant).
ROUNDING_SENSITIVE_DTYPES = (torch.bfloat16, torch.float16)


def note_if_rows_round_by_batch(model: Transformer, rows: int, suffix: str = "") -> None:
    """A note on stderr (once per setting) where `rows` rows in ROUNDING_SENSITIVE_DTYPES are not
    batch-invariant."""
    weight = model.tok_embeddings.weight
    if rows > 1 and weight.dtype in ROUNDING_SENSITIVE_DTYPES and not model.batch_invariant(rows):
        _note_rows(rows, str(weight.dtype).removeprefix("torch."), weight.device.type, suffix)


@functools.cache
def _note_rows(rows: int, dtype: str, device: str, suffix: str) -> None:
    print(f"note: {rows} rows in {dtype} on {device} round their products by the batch, so a row may keep other "
          f"tokens than in a batch-1 run{suffix}", file=sys.stderr)


def main_rows(args: argparse.Namespace, model: Transformer, tokenizer: Tokenizer, prompts: list[list[int]],
              load_seconds: float) -> dict:
    """Several prompts: decoded in batches of --batch_size rows (generate_batch), each row with the caches
    and budgets its own length resolves to; statistics per row (in the prompts' order) and the batches'
    decode throughput. Batches take the prompts longest first: a layer gives every row of a batch the slots
    of its largest budget, so a short prompt beside a long one would hold empty slots (a row's tokens do not
    depend on its batch). Each row prints when its batch finishes, under its prompt's index."""
    step = compile_decode_step(scope=args.compile_scope) if args.compile else decode_one_token
    eos_ids = eos_ids_for(args, tokenizer)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # stable: equal lengths keep their order
    batches = [order[first : first + args.batch_size] for first in range(0, len(order), args.batch_size)]
    # Every batch's caches resolved before any decoding: a prompt whose budget cannot hold its protected tokens
    # fails the run before it starts, not after the batches before it printed.
    batch_specs = [row_cache_specs(args, model.args, [len(prompts[i]) for i in indices], args.max_new_tokens,
                                   quiet=k > 0) for k, indices in enumerate(batches)]
    rows, specs_of = [None] * len(prompts), [None] * len(prompts)
    firsts, cache_bytes = [], 0  # each batch's first row (its timings are the batch's) and its largest caches
    for k, (indices, row_specs) in enumerate(zip(batches, batch_specs, strict=True)):
        batch = [prompts[i] for i in indices]
        setup_row_caches(model, row_specs, [len(ids) + args.max_new_tokens for ids in batch], tokenizer)
        if args.print_cache_spec and k == 0:
            print(format_cache_spec(row_specs[0]))
        note_if_rows_round_by_batch(model, len(batch),
                                    f" (up to {cpu_bf16_kernels.MAX_ROWS} rows on the CPU are bit for bit)")
        lengths = [prefill_length_for(s, len(ids), args.feed_long_prompts) for s, ids in zip(row_specs, batch,
                                                                                              strict=True)]
        results = generate_batch(model, batch, args.max_new_tokens, eos_ids, step, args.temperature, args.top_k,
                                 args.seed, progress=sys.stderr.isatty(), prefill_lengths=lengths)
        firsts.append(results[0])
        cache_bytes = max(cache_bytes, sum(c.nbytes() for c in model.caches()))
        for b in sorted(range(len(indices)), key=indices.__getitem__):  # within a batch, in the prompts' order
            i, result = indices[b], results[b]
            text = tokenizer.decode(result.tokens, skip_special_tokens=True)
            rows[i] = {**row_stats(len(batch[b]), result, model, b, sum(map(len, batch))), "text": text,
                       "tokens": result.tokens}
            print(f"---- row {i} ----\n{text}\n{row_summary(rows[i])}")
            specs_of[i] = row_specs[b]
    stats = {"load_seconds": round(load_seconds, 3), **batches_stats(args, rows, batches, firsts, cache_bytes)}
    print_stats_block(stats)
    if args.stats_json:
        write_stats_json(args, model, {**stats, "row_statistics": rows},
                         [[s.to_dict() for s in specs] for specs in specs_of])
    return stats


if __name__ == "__main__":
    run_cli(main)
