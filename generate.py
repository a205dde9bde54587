"""Generate from one prompt under a (compressed) KV cache and report its statistics.

    python generate.py --prompt "What is a KV cache?" --max_new_tokens 64
    python generate.py --cache_strategy full --compile --stats_json stats.json --prompt prompt.txt
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from cache import cache_statistics, get_strategy
from cache_hybrid import token_classes
from cache_spec import (
    LayerCacheSpec,
    add_cache_arguments,
    build_caches,
    check_cache_flags,
    format_cache_spec,
    parse_args_with_preset,
    resolve_cache_spec,
)
from checkpoint import DTYPES, load_checkpoint, parse_dtype
from debug_cache import attention_loss_curve
from errors import CliParser, UserError, run_cli
from model import Transformer
from model_policies import apply_model_layer_policies
from tokenizer import Tokenizer

# ---- the decode loop ------------------------------------------------------------------------------------


def prefill(model: Transformer, prompt: Tensor, prefill_length: int | None = None, decode_step=None) -> Tensor:  # noqa: ANN001
    """Run the prompt [B, T] through the model, filling the caches; logits of the last position [B, vocab].

    With `prefill_length` < T (--feed_long_prompts), only that many tokens are prefilled and the rest of
    the prompt goes through `decode_step` one token at a time, so every cache sees it as decoding.
    """
    T = prompt.shape[1]
    n = T if prefill_length is None else min(prefill_length, T)
    input_pos = torch.arange(n, device=prompt.device)
    logits = model(prompt[:, :n], input_pos, last_logits_only=True)[:, -1]
    step = decode_step or decode_one_token
    for p in range(n, T):
        logits = step(model, prompt[:, p : p + 1], torch.tensor([p], device=prompt.device))
    return logits


def decode_one_token(model: Transformer, token: Tensor, input_pos: Tensor) -> Tensor:
    """token [B, 1] at position input_pos [1] -> logits [B, vocab]. The function `--compile` compiles."""
    return model(token, input_pos)[:, -1]


def sample(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """Next token [B, 1]: greedy when temperature is 0, else softmax(logits / T) restricted to the top k."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


def compile_decode_step(fn=decode_one_token):  # noqa: ANN001, ANN201
    # Static shapes (one token, fixed-size cache buffers, positions as a tensor) let dynamo trace once.
    return torch.compile(fn, fullgraph=True, dynamic=False)


@dataclass
class GenerationResult:
    tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    stopped_at_eos: bool
    step_seconds: list[float] = field(default_factory=list)


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: list[int],
    decode_step=decode_one_token,  # noqa: ANN001
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    progress: bool = False,
    prefill_length: int | None = None,
) -> GenerationResult:
    """Prefill, then decode one token at a time until EOS or `max_new_tokens`. Caches must be set up."""
    device = model.tok_embeddings.weight.device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else 0)
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    model.reset_caches()
    with torch.inference_mode():
        t0 = time.perf_counter()
        token = sample(prefill(model, prompt, prefill_length, decode_step), temperature, top_k, generator)
        tokens = [int(token)]
        t1 = time.perf_counter()
        steps: list[float] = []
        stopped = tokens[0] in eos_ids
        from tqdm import tqdm

        bar = tqdm(total=max_new_tokens - 1, desc="decode", disable=not progress, leave=False)
        pos = len(prompt_ids)
        while not stopped and len(tokens) < max_new_tokens:
            s = time.perf_counter()
            input_pos = torch.tensor([pos], device=device)
            token = sample(decode_step(model, token.view(1, 1), input_pos), temperature, top_k, generator)
            tokens.append(int(token))  # int() syncs, so the step time is real on a GPU too
            steps.append(time.perf_counter() - s)
            stopped = tokens[-1] in eos_ids
            pos += 1
            bar.update()
        bar.close()
        t2 = time.perf_counter()
    return GenerationResult(tokens, t1 - t0, t2 - t1, len(steps), stopped, steps)


# ---- CLI ---------------------------------------------------------------------------------------------


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and runtime flags shared by generate.py and eval."""
    g = parser.add_argument_group("model")
    g.add_argument("--checkpoint_path", default=None,
                   help="a .gguf file or a Hugging Face directory (default: the bundled SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto",
                   help=f"auto (float32 on cpu, bfloat16 on cuda) or one of {', '.join(DTYPES)}")
    g.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile")
    g.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="generate.py", description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", required=True, help="the prompt text, or a path to a .txt file")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="apply the checkpoint's chat template (default: when it has one)")
    parser.add_argument("--stats_json", default=None, help="write the statistics and resolved config here")
    parser.add_argument("--overwrite", action="store_true", help="allow replacing an existing --stats_json")
    add_model_arguments(parser)
    add_cache_arguments(parser)
    return parser


def read_prompt(prompt: str) -> str:
    if prompt.endswith(".txt"):
        path = Path(prompt)
        if not path.is_file():
            raise UserError(f"prompt file not found: {prompt}")
        prompt = path.read_text()
    if not prompt.strip():
        raise UserError("the prompt is empty")
    return prompt


def resolve_device(name: str) -> str:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} requested but CUDA is not available")
    if not (name == "cpu" or name.startswith("cuda")):
        raise UserError(f"unknown device {name!r}; use cpu, cuda or cuda:N")
    return name


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool | None) -> list[int]:
    if chat or (chat is None and tokenizer.chat_template):
        text = tokenizer.apply_chat_template(text)
    return tokenizer.encode(text)


def check_lengths(prompt_length: int, max_new_tokens: int, context_length: int) -> None:
    if max_new_tokens < 1:
        raise UserError(f"--max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if prompt_length + max_new_tokens > context_length:
        raise UserError(
            f"the prompt ({prompt_length} tokens) plus --max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {context_length} tokens"
        )


def setup_caches(
    model: Transformer,
    specs: list[LayerCacheSpec],
    capacity_needed: int,
    tokenizer: Tokenizer | None = None,
    snapkv_window: int = 32,
    snapkv_kernel: int = 7,
) -> None:
    """Build and attach one cache per layer; the tokenizer is needed by hybrid caches only. Gated caches
    get the model's learned gates: --gates_path, else those already attached, else the shipped file."""
    a = model.args
    w = model.tok_embeddings.weight
    classes = None
    if tokenizer is not None and any(getattr(get_strategy(s.strategy), "needs_token_classes", False) for s in specs):
        classes = token_classes(tokenizer, a.vocab_size)
    caches = build_caches(specs, 1, a.n_kv_head, a.head_dim, capacity_needed, w.dtype, w.device,
                          snapkv_window, snapkv_kernel, classes)
    if any(c.needs_gates for c in caches):
        from gates import prepare_gates

        paths = {s.hyperparameters.get("gates_path") for s in specs if "gates_path" in s.hyperparameters}
        prepare_gates(model, next(iter(paths), None))  # one --gates_path flag: one value
    model.setup_caches(caches)


def prefill_length_for(specs: list[LayerCacheSpec], prompt_length: int, feed_long_prompts: bool) -> int:
    """--feed_long_prompts prefills what fits the smallest layer budget; otherwise the whole prompt."""
    if not feed_long_prompts:
        return prompt_length
    return min(prompt_length, *(s.max_cache_length for s in specs))


def write_json_atomic(path: str | Path, payload: dict, overwrite: bool) -> None:
    path = Path(path)
    if path.exists() and not overwrite:
        raise UserError(f"{path} exists; pass --overwrite to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parse_args_with_preset(parser, argv)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    check_cache_flags(args)
    prompt_text = read_prompt(args.prompt)
    if args.stats_json and Path(args.stats_json).exists() and not args.overwrite:
        raise UserError(f"{args.stats_json} exists; pass --overwrite to replace it")
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    model, tokenizer = load_checkpoint(args.checkpoint_path, device, dtype)
    load_seconds = time.perf_counter() - t0
    prompt_ids = encode_prompt(tokenizer, prompt_text, args.chat)
    check_lengths(len(prompt_ids), args.max_new_tokens, model.args.context_length)
    specs = resolve_cache_spec(args, model.args.n_layer, len(prompt_ids), args.max_new_tokens)
    specs = apply_model_layer_policies(specs, model.args, len(prompt_ids), args.max_new_tokens)
    if args.print_cache_spec:
        print(format_cache_spec(specs))
    setup_caches(model, specs, len(prompt_ids) + args.max_new_tokens, tokenizer, args.snapkv_window,
                 args.snapkv_kernel)

    step = compile_decode_step() if args.compile else decode_one_token
    result = generate(model, prompt_ids, args.max_new_tokens, tokenizer.eos_ids, step,
                      args.temperature, args.top_k, args.seed, progress=sys.stderr.isatty(),
                      prefill_length=prefill_length_for(specs, len(prompt_ids), args.feed_long_prompts))
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    print(text)

    stats = {
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": len(result.tokens),
        "load_seconds": round(load_seconds, 3),
        "prefill_seconds": round(result.prefill_seconds, 4),
        "prefill_tokens_per_second": round(len(prompt_ids) / result.prefill_seconds, 2),
        "decode_tokens_per_second": round(result.decode_steps / result.decode_seconds, 2)
        if result.decode_steps else None,
        "total_seconds": round(result.prefill_seconds + result.decode_seconds, 3),
        **cache_statistics(model.caches()),
    }
    curve = attention_loss_curve(model.caches())
    if curve:
        stats["attention_loss_cumulative_by_step"] = curve
    print_stats_block(stats)
    if args.stats_json:
        config = {k: v for k, v in vars(args).items() if k not in ("prompt",)}
        payload = {**stats, "text": text, "tokens": result.tokens, "config": config,
                   "model": model.args.to_dict(), "cache_spec": [s.to_dict() for s in specs]}
        write_json_atomic(args.stats_json, payload, overwrite=args.overwrite)
    return stats


def print_stats_block(stats: dict) -> None:
    keys = ["prompt_tokens", "generated_tokens", "prefill_tokens_per_second", "decode_tokens_per_second",
            "total_seconds", "cache_bytes", "compression_ratio", "attention_loss_mean"]
    print("\n---- statistics ----")
    for key in keys:
        if key in stats:
            print(f"{key:<30} {stats[key]}")
    for key in ("compression_ratio_per_layer", "attention_loss_per_layer", "evictions_per_layer"):
        if key in stats:
            print(f"{key:<30} {' '.join(f'{x:g}' for x in stats[key])}")


if __name__ == "__main__":
    run_cli(main)
