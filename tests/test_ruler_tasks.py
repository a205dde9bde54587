"""RULER's tasks by RULER's names (eval/tasks/ruler.py) against synthetic.yaml's definitions: haystack,
key and value types, numbers of keys, values and queries, the singular wording, the length; qa_1 over a
local SQuAD-shaped file; and ruler_file's rows in kvpress's split, read back by kvpress_dataset."""

from __future__ import annotations

import json
import re

import pytest

from errors import UserError
from eval import kvpress_runs
from eval.data import NOISE_SENTENCES
from eval.tasks import get_task
from eval.tasks.base import encode_example, use_chat
from eval.tasks.kvpress_datasets import parse_rows
from eval.tasks.ruler import GENERATORS, RULER_TASKS, ruler_file_main
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    tiny_runtime,
)

# synthetic.yaml (NVIDIA/RULER scripts/synthetic.yaml): haystack, key type, value type, keys, values, queries.
SYNTHETIC_YAML = {
    "niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
}
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
SHAPES = {"numbers": r"\d{7}", "uuids": UUID, "words": r"[a-z]+-[a-z]+"}
SQUAD = [{"question": f"What is item {i}?", "answers": [f"answer{i}"], "context": f"Item {i} is answer{i}. " * 3}
         for i in range(12)]


def examples(tiny_dir, name, seq_len=600, *more):
    rt = tiny_runtime(tiny_dir, "--tasks", name, "--seq_len", str(seq_len), "--limit", "3", "--haystack",
                      str(PYDOC_EXCERPT), *more)
    task = GENERATORS[name](rt.args)
    return rt, task.examples(rt)


@pytest.mark.parametrize("name", sorted(SYNTHETIC_YAML))
def test_niah_tasks_follow_synthetic_yaml(tiny_dir, name):
    kind, type_k, type_v, n_k, n_v, n_q = SYNTHETIC_YAML[name]
    rt, items = examples(tiny_dir, name, 1200)
    needle = re.compile(rf"One of the special magic {type_v} for ({SHAPES[type_k]}) is: ({SHAPES[type_v]})\.")
    for ex in items:
        assert len(encode_example(rt.tokenizer, ex, use_chat(rt))[0]) <= 1200
        found = needle.findall(ex.context)
        asked = re.search(r"for (.+) mentioned in the provided text\?", ex.question).group(1)
        asked_keys = re.split(r", and |, ", asked)
        assert len(asked_keys) == n_q
        real = [(k, v) for k, v in found if k in asked_keys or v in ex.answers]
        assert sorted(v for k, v in real if k in asked_keys) == sorted(ex.answers)
        assert len(ex.answers) == n_q * n_v and all(re.fullmatch(SHAPES[type_v], a) for a in ex.answers)
        keys = {k for k, _ in found}
        if kind == "needle":  # the haystack is distracting needles: many keys besides the one asked for
            assert len(keys) >= 4 and len(found) == len(ex.context.splitlines()) - 1
        else:
            assert len(keys) == max(n_k, n_q) and len(found) == max(n_k, n_q) * n_v
        if kind == "repeat":
            assert ex.context.count(NOISE_SENTENCES) == len(ex.context.splitlines()) - 1 - len(found)
        singular = n_q * n_v == 1
        assert ex.context.startswith("A special magic" if singular else "Some special magic")
        assert ex.answer_prefix.endswith(" is" if singular else " are")


def test_vt_cwe_fwe_are_the_existing_generators_scored_by_rulers_scorer(tiny_dir):
    for name, base in (("vt", "variable_tracking"), ("cwe", "common_words_extraction"),
                       ("fwe", "frequent_words_extraction")):
        assert issubclass(get_task(name), get_task(base))
    rt, (ex, *_) = examples(tiny_dir, "vt", 500)
    assert len(ex.answers) == 5  # one chain, four hops
    task = get_task("vt")(rt.args)
    assert task.score(" ".join(ex.answers[:2]), ex) == {"string_match": 0.4}  # all: 2 of 5 found


def test_qa_1_puts_the_gold_paragraph_among_distractors_and_takes_any_reference(tiny_dir, tmp_path):
    data = tmp_path / "squad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SQUAD))
    rt, items = examples(tiny_dir, "qa_1", 800, "--dataset", str(data))
    for ex in items:
        i = int(re.search(r"item (\d+)", ex.question).group(1))
        docs = re.findall(r"Document \d+:\n(.*?)(?:\n\n|$)", ex.context)
        assert SQUAD[i]["context"] in docs and len(docs) > 2 and ex.answers == [f"answer{i}"]
        assert len(encode_example(rt.tokenizer, ex, use_chat(rt))[0]) <= 800
    task = get_task("qa_1")(rt.args)
    assert task.score("Answer1 maybe", type(items[0])("", answers=["x", "answer1"])) == {"string_match": 1.0}


def test_ruler_file_writes_kvpress_split_rows_that_kvpress_dataset_reads(tiny_dir, tmp_path):
    out = tmp_path / "ruler.jsonl"
    kvpress_runs.main(["ruler_file", "--to", str(out), "--tasks", "niah_single_1", "niah_multiquery", "vt",
                       "--limit", "2", "--seq_len", "900", "--checkpoint_path", str(tiny_dir), "--haystack",
                       str(PYDOC_EXCERPT)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task"] for r in rows] == ["niah_single_1"] * 2 + ["niah_multiquery"] * 2 + ["vt"] * 2
    rt, originals = examples(tiny_dir, "niah_single_1", 900)
    assert rows[0]["context"] + rows[0]["question"] + rows[0]["answer_prefix"] == originals[0].prompt
    for r in rows:  # where kvpress's create_huggingface_dataset splits RULER's input
        assert r["question"].startswith(("What is", "What are all", "Question: Find all"))
        assert r["answer_prefix"].startswith(("The special magic", "Answer:"))
        assert r["max_new_tokens"] == (30 if r["task"] == "vt" else 128) and r["length"] <= 900
    assert [p.task for p in parse_rows(rows, str(out), None)] == [r["task"] for r in rows]
    assert set(RULER_TASKS) == set(kvpress_runs.scorers.RULER_METRICS)


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--math_format", "gsm8k"], "--math_format is read by none of the selected tasks (niah_single_1)"),
    (["--cache_strategy", "l2"], "--cache_strategy would be ignored: ruler_file writes the items and runs no cache"),
    (["--max_cache_length", "0.5"], "--max_cache_length would be ignored"),
    (["--out_dir", "results"], "--out_dir would be ignored"),
])
def test_ruler_file_refuses_flags_it_would_ignore(argv, fragment, tmp_path):
    """ruler_file only writes items: a cache or run flag, or a task flag its tasks do not read, is refused
    before the model loads, and no file is written."""
    out = tmp_path / "ruler.jsonl"
    with pytest.raises(UserError, match=re.escape(fragment)):
        ruler_file_main(["--to", str(out), "--tasks", "niah_single_1", "--checkpoint_path", "no-such-model", *argv])
    assert not out.exists()
