"""`python -m eval`: run tasks under one cache configuration, next to the full cache on the same items.

    python -m eval --tasks fidelity --cache_strategy recent_global --max_cache_length 0.25
    python -m eval --tasks niah_single --seq_len 1024 --limit 20 --cache_config my_preset.yaml
    python -m eval --tasks qa --dataset data.jsonl --prompt_column question --answer_column answer

`--batch_size N` decodes N fidelity windows together (one length, shared positions), or N items of any
other task (a row each, refilled as items finish; records as at batch 1). Every cache flag is shared
with generate.py (defined once in cache_spec.py). A flag typed that the run would ignore is refused: a task
flag none of the selected tasks reads (Task.reads), a strategy flag no cache of the configuration reads
(ignored_flags.check_typed_flags). Results land in `--out_dir` (see eval/results.py); a
finished run is skipped unless --overwrite, and run again when the model file, data files or code it was
computed with have changed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

from cache_spec import add_cache_arguments, check_cache_flags, parse_args_with_preset, storage_spec
from checkpoint import add_model_arguments, load_checkpoint, parse_dtype, resolve_device
from compiled_step import compile_decode_step
from errors import CliParser, UserError, run_cli
from eval import results
from eval.harness import Runtime, full_cache_args, peak_memory_mb
from eval.tasks import TASKS, Task, get_task
from eval.tasks.base import KVPRESS_PROTOCOLS
from eval.uncertainty import LEVEL, RESAMPLES, SEED, item_intervals
from flag_types import count, explicit_dests
from generate import decode_one_token
from ignored_flags import check_typed_flags
from model import Transformer
from tokenizer import Tokenizer


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """Task flags; a task reads only some of them (Task.reads), and unset ones take the task's default."""
    g = parser.add_argument_group("tasks")
    g.add_argument("--limit", type=count(), default=None,
                   help="items per task: examples (RULER: 50), dataset rows (all), fidelity windows (1)")
    g.add_argument("--seq_len", type=count(), default=None,
                   help="prompt length in tokens: RULER target (1024), fidelity window (2048)")
    g.add_argument("--max_new_tokens", type=count(), default=None, help="answer length (task default)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template to prompts (default: when the checkpoint has one)")
    g.add_argument("--query_aware", action=argparse.BooleanOptionalAction, default=False,
                   help="prefill context and question together, so prompt compression sees the question "
                        "(default: query-agnostic, the context is compressed before the question)")
    g.add_argument("--protocol", choices=["decode", *KVPRESS_PROTOCOLS], default="decode",
                   help="decode: the cache is sized from the longest prompt + answer and evicts while the question "
                        "and answer go through it (query-agnostic unless --query_aware); kvpress: as kvpress and "
                        "RULER's tables: each item's context is compressed once to the budget (a fraction of that "
                        "context, or tokens), the question is appended uncompressed in one forward step, and "
                        "nothing is evicted while answering (generation tasks); with --query_aware, the SnapKV "
                        "paper's setting: context and question are compressed together to the context's budget + "
                        "the question's length (the same slots), then nothing is evicted while answering; "
                        "kvpress_compress_questions: kvpress's compress_questions (query-aware as kvpress means it): "
                        "context and question are compressed together to int((context + question) x budget) "
                        "tokens (the question can be evicted), then the chat template's end of turn and the answer "
                        "prefix are appended, so the first answer token is computed over the compressed cache")
    g.add_argument("--decode_first_token", action="store_true",
                   help="feed the last prompt token through the decode path, so the first answer token "
                        "is computed over the compressed cache")
    g.add_argument("--haystack", default=None, help="RULER filler: pydoc (default), noise, or a text file")
    g.add_argument("--prefill_tokens", type=count(), default=None, help="fidelity: tokens prefilled (128)")
    g.add_argument("--text_file", default=None, help="fidelity: a text file instead of pydoc_data.topics")
    g.add_argument("--text_offset", type=count(0), default=None, help="fidelity: tokens skipped at the start (0)")
    g.add_argument("--dataset", default=None, help="a .json/.jsonl/.csv/.parquet file, or a hub name (online)")
    g.add_argument("--dataset_config", default=None, help="hub dataset configuration")
    g.add_argument("--split", default=None, help="hub dataset split (train)")
    g.add_argument("--text_column", default=None, help="fidelity: the text column of --dataset")
    g.add_argument("--prompt_column", default=None, help="qa / multiple_choice: the question")
    g.add_argument("--context_column", default=None, help="qa / multiple_choice: a document before the question")
    g.add_argument("--answer_column", default=None, help="reference answer(s), or the right choice")
    g.add_argument("--choices_column", default=None, help="multiple_choice: the list of options")
    g.add_argument("--math_format", choices=["math500", "aime", "gsm8k"], default=None,
                   help="math: the layout of --dataset (default: detected from its columns)")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m eval", description=__doc__, allow_abbrev=False)
    parser.add_argument("--tasks", nargs="+", default=["fidelity"], help=f"any of: {', '.join(TASKS)}")
    parser.add_argument("--out_dir", default="results", help="where run directories and results.csv go")
    parser.add_argument("--overwrite", action="store_true", help="re-run finished runs")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the full cache on the same items (skipped when already finished)")
    add_task_arguments(parser)
    add_model_arguments(parser)
    add_cache_arguments(parser)
    return parser


TASK_GROUP = "tasks"


def task_flags(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.Action]:
    """The task flags (add_task_arguments) by destination: each is read by some tasks only (Task.reads)."""
    parser = parser or build_parser()
    group = next(g for g in parser._action_groups if g.title == TASK_GROUP)
    return {a.dest: a for a in group._group_actions}


def check_task_flags_read(tasks: list[str], explicit: set[str], parser: argparse.ArgumentParser | None = None) -> None:
    """A task flag typed explicitly that none of `tasks` reads would be ignored without a word: refuse it."""
    for dest, action in task_flags(parser).items():
        if dest in explicit and not any(dest in get_task(name).reads for name in tasks):
            readers = [name for name, cls in TASKS.items() if dest in cls.reads]
            others = [name for name in TASKS if name not in readers]
            which = f"every task but {', '.join(others)}" if len(others) < len(readers) else ", ".join(readers)
            raise UserError(f"{action.option_strings[0]} is read by none of the selected tasks ({', '.join(tasks)}): "
                            f"it would be ignored; it applies to {which or 'no task'}")


def without_flags(argv: list[str], dests: set[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """`argv` without the flags whose destination is in `dests`, and their values."""
    parser = parser or build_parser()
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    out: list[str] = []
    skip: int | None = 0  # value words still to drop (None: all up to the next flag)
    for word in argv:
        option = word.split("=", 1)[0]
        if option in by_option:
            action = by_option[option]
            if action.dest not in dests:
                skip = 0
                out.append(word)
                continue
            nargs = action.nargs
            skip = 0 if nargs == 0 or "=" in word else None if nargs in ("+", "*") else 1 if nargs is None else nargs
        elif skip is None or skip > 0:
            skip = None if skip is None else skip - 1
        else:
            out.append(word)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags (with --cache_config merged in), checked before anything is loaded."""
    args = parse_args_with_preset(build_parser(), argv)
    check_cache_flags(args)
    args.device = resolve_device(args.device)
    for name in args.tasks:
        get_task(name)(args)  # unknown task or bad task option: fail now
    return args


@functools.lru_cache(maxsize=1)
def load_model(checkpoint_path: str | None, device: str, dtype: torch.dtype,
               allow_non_finite: bool = False, files: str = "") -> tuple[Transformer, Tokenizer]:
    """`files`: the checkpoint's fingerprint, part of the cache's key only (see model_of)."""
    return load_checkpoint(checkpoint_path, device, dtype, allow_non_finite=allow_non_finite)


def model_of(args: argparse.Namespace) -> tuple[Transformer, Tokenizer]:
    """The model and tokenizer a configuration runs on: loaded once for the runs of one command (a sweep's
    worker), and again when the checkpoint's files changed since, whose new hash the next runs record."""
    files = json.dumps(results.path_fingerprint(results.checkpoint_location(args.checkpoint_path)), sort_keys=True)
    return load_model(args.checkpoint_path, args.device, parse_dtype(args.dtype, args.device),
                      args.allow_non_finite_weights, files)


def plan(args: argparse.Namespace) -> list[tuple[Task, argparse.Namespace, Path]]:
    """(task, cache configuration, run directory) for every run asked for; the full cache first."""
    dtype = str(parse_dtype(args.dtype, args.device)).removeprefix("torch.")
    configs = [args]
    if args.baseline and args.cache_strategy != ["full"]:
        configs.insert(0, full_cache_args(args))
    out_dir = Path(args.out_dir)
    runs = []
    for name in args.tasks:
        for config in configs:
            task = get_task(name)(config)
            identity = results.run_identity(config, name, task.options, dtype)
            runs.append((task, config, results.run_dir(out_dir, config, identity)))
    return runs


def check_inputs(runs: list[tuple[Task, argparse.Namespace]]) -> None:
    """Each run about to start builds and checks its inputs first (Task.check_inputs: its examples or text
    against the model's context, its dataset rows, the caches it resolves), so that bad input (a --seq_len too
    short for a task's smallest prompt, a budget its prompts cannot hold) is refused before the first run
    starts rather than after the runs before it."""
    for task, config in runs:
        task.check_inputs(Runtime(*model_of(config), config))


def execute(task: Task, args: argparse.Namespace, path: Path, progress: bool | None = None) -> dict:
    """Run one task under one configuration and write its directory; returns metrics.json's content.

    The run is written beside `path` and swapped in when complete: until then a previous result (an
    --overwrite, or one whose inputs changed) stays as it was, also when the run is interrupted."""
    dtype = parse_dtype(args.dtype, args.device)
    dtype_name = str(dtype).removeprefix("torch.")
    identity = results.run_identity(args, task.name, task.options, dtype_name)
    inputs = results.input_fingerprints(args, task.options)  # before the run: what it is about to read
    model, tokenizer = model_of(args)
    step = decode_one_token
    if args.compile:
        torch._dynamo.reset()  # each run brings new cache modules; start from a clean compile cache
        # No CUDA graph: eval attaches new caches for each batch of windows or items (a captured graph replays on
        # the buffers it was captured with), and the kvpress protocol re-configures caches item by item.
        step = compile_decode_step(cuda_graph=False, scope=args.compile_scope)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(args.device)
    torch.manual_seed(args.seed)
    tmp = results.start_run(path)
    try:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = task.run(Runtime(model, tokenizer, args, step, progress))
        seconds = time.perf_counter() - t0
        if out.timings.compiling_steps:  # compiled again after the prepared compile: counted, and said
            n = out.timings.compiling_steps
            print(f"note: {n} decode step{'s' * (n != 1)} compiled during the run (a shape or setting the step was "
                  "not prepared for); that time is in compile_seconds, not in the decode speed", file=sys.stderr)
        scalars = {k: v for k, v in out.stats.items() if not isinstance(v, list)}
        budgets = out.stats.get("cache_budget_per_layer") or []
        metrics = {
            "model": identity["model"], "task": task.name, "strategy": results.strategy_label(args),
            "budget": results.budget_value(args), "storage": storage_spec(args).describe(),
            "query_aware": task.options.get("query_aware"),
            "seed": args.seed, "n_items": len({p.get("window", p.get("index")) for p in out.predictions}),
            **scalars, "budget_tokens_mean": sum(budgets) / len(budgets) if budgets else None,
            **out.metrics, **out.timings.to_dict(), "seconds": seconds,
            "peak_memory_mb": peak_memory_mb(torch.device(args.device)), "run_id": results.run_id(identity),
            "identity": results.content_id(identity, inputs),
            "per_layer": {k: v for k, v in out.stats.items() if isinstance(v, list)},
        }
        metrics.update(interval_columns(metrics, out.items, task.derived_intervals(out.items)))
        config = {
            "run_id": metrics["run_id"], "identity": identity, "inputs": inputs, "flags": vars(args),
            "task_options": task.options, **out.config, "model_args": model.args.to_dict(),
            "versions": results.package_versions(), "git_commit": results.git_commit(), "command": sys.argv,
        }
        results.finish_run(tmp, path, json.loads(json.dumps(config, default=str)), out.predictions, metrics,
                           out.items)
    finally:
        results.abandon_run(tmp)  # a no-op after finish_run; on any failure or Ctrl-C, no leftovers
    return metrics


def interval_columns(metrics: dict, items: list[dict], derived: dict | None = None) -> dict:
    """The bootstrap interval of every aggregate that is the mean of the items' values, or a function of
    such means (`derived`, from the task): `<m>_ci_low`, `<m>_ci_high` (None with a single item), and `ci`
    (each interval with its n, the level, resamples and seed). Other aggregates (KL p95 and max over
    pooled positions) get none."""
    intervals = {**item_intervals([it["metrics"] for it in items], RESAMPLES, SEED, LEVEL), **(derived or {})}
    out: dict = {}
    ci = {}
    for name, interval in intervals.items():
        value = metrics.get(name)
        if not isinstance(value, int | float) or abs(value - interval.estimate) > 1e-9 * max(1.0, abs(value)):
            continue  # not the mean of these items: an interval would describe another number
        d = interval.to_dict()
        out[f"{name}_ci_low"], out[f"{name}_ci_high"] = d["low"], d["high"]
        ci[name] = d
    out["ci"] = {"level": LEVEL, "method": "percentile bootstrap over items", "resamples": RESAMPLES,
                 "seed": SEED, "metrics": ci}
    return out


def current_state(task: Task, args: argparse.Namespace, path: Path) -> tuple[dict | None, str]:
    """(finished metrics, None when there are none or they are for other inputs; why it must run)."""
    metrics = results.read_metrics(path)
    if metrics is None:
        return None, "run"
    problem = results.damage(path, metrics)
    if problem is not None:  # never counted as finished: run again, replacing it
        return None, f"rerun (damaged run: {problem})"
    dtype = str(parse_dtype(args.dtype, args.device)).removeprefix("torch.")
    inputs = results.input_fingerprints(args, task.options)
    identity = results.run_identity(args, task.name, task.options, dtype)
    if metrics.get("identity") == results.content_id(identity, inputs):
        return metrics, "skip (finished)"
    return None, f"rerun (changed since the finished run: {', '.join(results.changed_inputs(path, inputs))})"


def job_state(job: list[str]) -> tuple[bool, str]:
    """(whether the eval run of `job`, one task and one configuration, is finished with today's inputs and
    complete; the state line: skip, run, rerun and why)."""
    ((task, config, path),) = plan(parse_args(job))
    metrics, state = current_state(task, config, path)
    return metrics is not None, state


def job_is_current(job: list[str]) -> bool:
    return job_state(job)[0]


def headline(task: Task, metrics: dict) -> str:
    name = task.metrics[0]
    return f"{name}={metrics[name]:.4g}" if name in metrics else ""


def main(argv: list[str] | None = None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # Typed flags this command would ignore: refused here, not in parse_args, which also reads the runs of a
    # sweep or an experiment, whose shared flags reach runs that ignore some (the sweep checks them whole).
    parser = build_parser()
    check_task_flags_read(args.tasks, explicit_dests(parser, argv), parser)
    check_typed_flags(parser, args, argv)
    out_dir = results.check_out_dir(args.out_dir)
    runs = [(task, config, path, *current_state(task, config, path)) for task, config, path in plan(args)]
    check_inputs([(task, config) for task, config, _, metrics, _ in runs if metrics is None or args.overwrite])
    done = []
    for task, config, path, metrics, state in runs:
        label = f"{task.name} {results.strategy_label(config)} budget={results.budget_value(config)}"
        if metrics is not None and not args.overwrite:
            print(f"{state}: {label} -> {path}", file=sys.stderr)
        else:
            print(f"{'run' if metrics is not None else state}: {label}", file=sys.stderr)
            metrics = execute(task, config, path)
        done.append(metrics)
        ratio = metrics.get("compression_ratio")
        print(f"{label}: {headline(task, metrics)} compression_ratio={'n/a' if ratio is None else f'{ratio:.4g}'} "
              f"-> {path}")
    table = results.write_results_table(out_dir)
    print(f"results table: {table}")
    return done


def run_job(job: list[str], device: str | None, progress: bool | None) -> None:
    """One run of a sweep (a local worker or a Ray actor): flags with a single configuration, on `device`."""
    args = parse_args(job + (["--device", device] if device else []))
    ((task, config, path),) = plan(args)
    execute(task, config, path, progress)


if __name__ == "__main__":
    run_cli(main)
