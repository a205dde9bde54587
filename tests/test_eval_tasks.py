"""Task generators and dataset tasks on the tiny model (byte-level tokenizer: one token per byte).

Generators are deterministic per seed, the answer is in the prompt, prompts fit --seq_len; dataset
tasks load local JSON/CSV/parquet files; option log-likelihoods match a single full forward pass.
"""

from __future__ import annotations

import collections
import json
import re

import pandas as pd
import pytest
import torch

from errors import UserError
from eval.harness import Timings, attach_caches, cache_specs, option_logliks
from eval.tasks import get_task
from eval.tasks.base import encode_example
from tests.eval_helpers import (
    PYDOC_EXCERPT,
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    tiny_runtime,
)

SYNTHETIC = ["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words_extraction",
             "frequent_words_extraction"]


def examples(tiny_dir, name: str, *flags: str) -> list:
    rt = tiny_runtime(tiny_dir, "--tasks", name, "--haystack", str(PYDOC_EXCERPT), "--limit", "3", *flags)
    return get_task(name)(rt.args).examples(rt), rt


@pytest.mark.parametrize("name", SYNTHETIC)
def test_generators_are_deterministic_and_the_answer_is_in_the_prompt(tiny_dir, name):
    seq_len = 900
    first, rt = examples(tiny_dir, name, "--seq_len", str(seq_len))
    again, _ = examples(tiny_dir, name, "--seq_len", str(seq_len))
    other, _ = examples(tiny_dir, name, "--seq_len", str(seq_len), "--seed", "1")
    assert first == again and first != other
    assert len({ex.prompt for ex in first}) == 3  # items differ from each other too
    for ex in first:
        assert ex.answers and all(answer in ex.context for answer in ex.answers)
        n_tokens = len(encode_example(rt.tokenizer, ex, chat=False)[0])
        assert 0.7 * seq_len <= n_tokens <= seq_len, n_tokens


def test_aggregation_tasks_have_a_unique_answer(tiny_dir):
    (cwe, *_), _ = examples(tiny_dir, "common_words_extraction", "--seq_len", "900")
    counts = collections.Counter(re.findall(r"\d+\. (\w+)", cwe.context))
    assert min(counts[w] for w in cwe.answers) > max(c for w, c in counts.items() if w not in cwe.answers)
    (fwe, *_), _ = examples(tiny_dir, "frequent_words_extraction", "--seq_len", "900")
    counts = collections.Counter(fwe.context.split("\n")[1].split())
    ranked = [c for _, c in counts.most_common()]
    assert [w for w, _ in counts.most_common(3)] == fwe.answers and ranked[2] > ranked[3]


def test_variable_chain_is_in_order(tiny_dir):
    (ex, *_), _ = examples(tiny_dir, "variable_tracking", "--seq_len", "900")
    positions = [ex.context.index(f"VAR {name} =") for name in ex.answers]
    assert positions == sorted(positions) and f"= {ex.meta['value']}." in ex.context


def test_seq_len_too_short_is_a_clear_error(tiny_dir):
    with pytest.raises(UserError, match="too short for niah_single"):
        examples(tiny_dir, "niah_single", "--seq_len", "50")


# ---- dataset tasks ------------------------------------------------------------------------------------


QA_ROWS = [{"doc": "The capital of France is Paris.", "q": "What is the capital of France?", "a": "Paris"},
           {"doc": "Water boils at 100 degrees.", "q": "At what temperature does water boil?", "a": ["100", "100 C"]}]


def test_qa_from_jsonl_query_agnostic_and_aware(tiny_dir, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in QA_ROWS))
    flags = ["--tasks", "qa", "--dataset", str(path), "--prompt_column", "q", "--context_column", "doc",
             "--answer_column", "a", "--max_new_tokens", "4"]
    rt = tiny_runtime(tiny_dir, *flags)
    with torch.inference_mode():
        agnostic = get_task("qa")(rt.args).run(rt)
    assert set(agnostic.metrics) == {"substring_match", "exact_match", "rouge_l"}
    assert [p["answers"] for p in agnostic.predictions] == [["Paris"], ["100", "100 C"]]
    for p, row in zip(agnostic.predictions, QA_ROWS, strict=True):  # the context alone is prefilled
        assert p["prefill_tokens"] == len(row["doc"]) + 2 < p["prompt_tokens"]
    rt = tiny_runtime(tiny_dir, *flags, "--query_aware")
    with torch.inference_mode():
        aware = get_task("qa")(rt.args).run(rt)
    assert all(p["prefill_tokens"] == p["prompt_tokens"] for p in aware.predictions)
    rt = tiny_runtime(tiny_dir, *flags, "--query_aware", "--decode_first_token", "--limit", "1")
    with torch.inference_mode():
        (first,) = get_task("qa")(rt.args).run(rt).predictions
    assert first["prefill_tokens"] == first["prompt_tokens"] - 1


@pytest.mark.parametrize("fmt", ["csv", "parquet", "json"])
def test_local_dataset_formats(tiny_dir, tmp_path, fmt):
    frame = pd.DataFrame([{"q": r["q"], "a": str(r["a"])} for r in QA_ROWS])
    path = tmp_path / f"rows.{fmt}"
    {"csv": frame.to_csv, "parquet": frame.to_parquet, "json": frame.to_json}[fmt](
        path, **({"index": False} if fmt != "json" else {"orient": "records"}))
    rt = tiny_runtime(tiny_dir, "--tasks", "qa", "--dataset", str(path), "--prompt_column", "q",
                      "--answer_column", "a", "--max_new_tokens", "2", "--limit", "1")
    with torch.inference_mode():
        out = get_task("qa")(rt.args).run(rt)
    assert len(out.predictions) == 1 and out.predictions[0]["answers"] == ["Paris"]


def test_option_logliks_match_one_full_forward_pass(tiny_dir):
    rt = tiny_runtime(tiny_dir)
    prompt, options = [5, 9, 14, 200, 3, 77, 31], [[40, 41, 42], [7], [100, 101]]
    with torch.inference_mode():
        attach_caches(rt, cache_specs(rt, rt.args, len(prompt), 3), len(prompt) + 3)
        ours = option_logliks(rt, prompt, 4, options, Timings())  # 4 prefilled, 3 fed, then the options
        rt.model.remove_caches()
        for option, got in zip(options, ours, strict=True):
            ids = torch.tensor([prompt + option])
            logp = torch.log_softmax(rt.model(ids, torch.arange(ids.shape[1]))[0].float(), dim=-1)
            want = sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(option))
            assert got == pytest.approx(want, abs=1e-4)


def test_multiple_choice_labels_by_index_letter_or_text(tiny_dir, tmp_path):
    rows = [{"q": "2+2?", "choices": ["3", "4", "5"], "label": 1},
            {"q": "Sky?", "choices": ["blue", "green"], "label": "A"},
            {"q": "Cat?", "choices": ["meow", "woof"], "label": "woof"}]
    path = tmp_path / "mc.json"
    path.write_text(json.dumps(rows))
    rt = tiny_runtime(tiny_dir, "--tasks", "multiple_choice", "--dataset", str(path), "--prompt_column", "q",
                      "--choices_column", "choices", "--answer_column", "label")
    with torch.inference_mode():
        out = get_task("multiple_choice")(rt.args).run(rt)
    assert [p["label"] for p in out.predictions] == [1, 0, 1]
    for p in out.predictions:
        assert p["accuracy"] == float(p["prediction"] == p["label"]) and len(p["logliks"]) in (2, 3)
    assert out.metrics["accuracy"] == pytest.approx(sum(p["accuracy"] for p in out.predictions) / 3)


BAD_DATASETS = {
    "unknown column": ('[{"q": "x", "a": "y"}]', ["--answer_column", "answer"], "unknown column 'answer'"),
    "empty list": ("[]", ["--answer_column", "a"], "empty"),
    "empty file": ("", ["--answer_column", "a"], "empty"),
}


@pytest.mark.parametrize("case", BAD_DATASETS, ids=list(BAD_DATASETS))
def test_bad_datasets_are_clear_errors(tiny_dir, tmp_path, case):
    content, flags, message = BAD_DATASETS[case]
    path = tmp_path / "rows.json"
    path.write_text(content)
    rt = tiny_runtime(tiny_dir, "--tasks", "qa", "--dataset", str(path), "--prompt_column", "q", *flags)
    with pytest.raises(UserError, match=message):
        get_task("qa")(rt.args).run(rt)


def test_hub_dataset_offline_is_a_clear_error(tiny_dir, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("eval.data.HUB_HOST", "hub.invalid")  # never reachable, online or not
    rt = tiny_runtime(tiny_dir, "--tasks", "qa", "--dataset", "squad", "--prompt_column", "q", "--answer_column", "a")
    with pytest.raises(UserError, match="cannot reach the Hugging Face hub"):
        get_task("qa")(rt.args).run(rt)
