"""`python -m eval.replay RUN_DIR --item N`: run one stored item again from its recorded token ids, and say
whether the answer, the score and the positions kept after prefill are the ones the run recorded.

Nothing is regenerated from the task's generator or dataset: the prompt is items.jsonl's `context_ids`
+ `question_ids`, the flags are config.json's, the caches are sized as the run sized them (from the
longest prompt of its set, `prompt_tokens_max`). Generation tasks only (RULER tasks, qa): fidelity and
multiple_choice store their items too, but replaying them is not implemented.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from errors import CliParser, UserError, run_cli
from eval import results
from eval.harness import Runtime, Timings, attach_caches, cache_specs, greedy_answer
from eval.tasks import get_task
from eval.tasks.base import Example, GenerationTask, is_kvpress, kvpress_budgets, kvpress_prompt_budget
from flag_types import count


def stored_run(run_dir: Path) -> tuple[dict, dict[int, dict]]:
    """(config.json, items by index) of a finished run; a UserError when it is damaged (as eval would find it:
    not counted, run again) or has no items."""
    results.check_not_damaged(run_dir)
    try:
        config = json.loads((run_dir / "config.json").read_text())
        items = results.read_items(run_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read run {run_dir}: {e}") from None
    if items is None:
        raise UserError(f"run {run_dir} has no {results.ITEMS_FILE} (written before items were recorded)")
    if not items:
        raise UserError(f"run {run_dir}: {results.ITEMS_FILE} holds no item")
    if not isinstance(config, dict) or not {"flags", "identity"} <= config.keys():
        raise UserError(f"run {run_dir}: config.json is not a run's configuration (no flags or identity)")
    return config, {it["index"]: it for it in items}


def replayable(run_dir: Path, index: int) -> tuple[dict, dict, GenerationTask]:
    """(config.json, the item, its task) of item `index` of a finished run of a generation task; checked
    before a model loads."""
    config, items = stored_run(Path(run_dir))
    if index not in items:
        raise UserError(f"run {run_dir} has no item {index} (items: {min(items)}..{max(items)})")
    task = get_task(config["identity"]["task"])(argparse.Namespace(**config["flags"]))
    if not isinstance(task, GenerationTask):
        raise UserError(f"replay supports generation tasks, not {task.name}")
    return config, items[index], task


def protocol_slots(stored: list[dict]) -> int:
    """The slots a kvpress-protocol run gave its layers (every layer alike), read from its recorded spec: a
    layer's that is not a sliding window's cache (model_policies.py), whose budget is the window. A model whose
    every layer slides keeps its windows whatever the slots."""
    return next((s["max_cache_length"] for s in stored if not s.get("sliding_window")), stored[0]["max_cache_length"])


def replay_item(run_dir: Path, index: int, model: torch.nn.Module, tokenizer: object) -> dict:
    """Greedy answer, scores and kept positions of item `index` of `run_dir`, computed again with `model`
    (the run's model: config.json's inputs say which)."""
    config, item, task = replayable(run_dir, index)
    args = argparse.Namespace(**config["flags"])
    max_new = task.options["max_new_tokens"]
    ids = item["context_ids"] + item["question_ids"]
    kvpress = is_kvpress(task.options.get("protocol"))
    if kvpress:  # this item's context budget, in caches of the run's slots (sized from all its items)
        n_context = len(item["context_ids"])
        budget = kvpress_prompt_budget(kvpress_budgets(args, [(ids, n_context)])[0], len(ids), item["n_prefill"],
                                       n_context)
        slots = float(protocol_slots(config["cache_spec"]))
        args = argparse.Namespace(**{**vars(args), "max_cache_length": [slots], "cache_length_pattern": "tile"})
    rt = Runtime(model, tokenizer, args, progress=True)
    specs = cache_specs(rt, args, config["prompt_tokens_max"], max_new)
    resolved = json.loads(json.dumps([s.to_dict() for s in specs], default=str))
    # A field added to the spec since the run was recorded (prompt_settings) is not in it: compare the rest.
    stored = config["cache_spec"]
    if len(resolved) != len(stored) or [{k: v for k, v in now.items() if k in then}
                                        for now, then in zip(resolved, stored, strict=True)] != stored:
        raise UserError("the flags resolve to another cache spec than the run's (other code or model?)")
    with torch.inference_mode():
        caches = attach_caches(rt, specs, config["prompt_tokens_max"] + max_new)
        if kvpress:
            for cache in caches:
                cache.configure(prompt_budget=budget)
        try:
            tokens = greedy_answer(rt, ids, item["n_prefill"], max_new, Timings(), chunk=kvpress)
        finally:
            model.remove_caches()
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    scores = task.score(text, Example(context="", answers=item["answers"]))
    return {"output_ids": tokens, "metrics": scores, "kept_positions": rt.kept, "stored": item}


def same_kept(a: list, b: list) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def build_parser() -> CliParser:
    parser = CliParser(prog="python -m eval.replay", description=__doc__, allow_abbrev=False)
    parser.add_argument("run_dir", help="a finished run directory (with items.jsonl)")
    parser.add_argument("--item", type=count(0), default=0, help="the item's index")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    from checkpoint import parse_dtype
    from eval.cli import load_model

    config, _, _ = replayable(Path(args.run_dir), args.item)  # a bad run or item is refused before the model loads
    flags = config["flags"]
    dtype = parse_dtype(flags["dtype"], flags["device"])
    model, tokenizer = load_model(flags["checkpoint_path"], flags["device"], dtype)
    out = replay_item(Path(args.run_dir), args.item, model, tokenizer)
    stored = out["stored"]
    checks = {"answer tokens": out["output_ids"] == stored.get("output_ids"),
              "scores": all(stored["metrics"].get(k) == v for k, v in out["metrics"].items()),
              "kept positions": same_kept(out["kept_positions"], stored.get("kept_positions", []))}
    for name, ok in checks.items():
        print(f"{name}: {'same' if ok else 'DIFFERENT'}")
    print(f"scores: {out['metrics']}")
    return out


if __name__ == "__main__":
    run_cli(main)
