"""The math task: answer extraction and comparison (eval/answers.py) against hand-written cases, the three
file layouts, and the pipeline end to end (tiny model; the bundled model through `python -m eval`)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from errors import UserError
from eval import cli
from eval.answers import extract_answer, integer_equal, math_equal, normalize_math
from eval.tasks import get_task
from eval.tasks.base import Example
from eval.tasks.reasoning import detect_format, reference
from tests.eval_helpers import (
    one_thread,  # noqa: F401  (an autouse fixture: one torch thread)
    tiny_runtime,
)

# ---- extraction ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("so $\\boxed{\\frac{1}{2}}$.", ("\\frac{1}{2}", "boxed")),  # nested braces
    ("first \\boxed{5}, then \\boxed{(3, \\frac{\\pi}{2})}", ("(3, \\frac{\\pi}{2})", "boxed")),
    ("\\boxed{4} and at the end, cut off: \\boxed{\\frac{1", ("4", "boxed")),  # the last *closed* one
    ("\\fbox{7}", ("7", "boxed")),
    ("so it is $\\boxed 9$", ("9", "boxed")),
    ("Thus the final answer is $\\frac{3}{4}$. I hope it is correct.", ("\\frac{3}{4}", "statement")),
    ("The answer is: 12 apples.\nDone", ("12 apples", "statement")),
    ("She pays 3 * 4 = 12.\n#### 1,234", ("1,234", "statement")),
    ("We get 3 apples and 17 pears, so -2.5 left,", ("-2.5", "last_number")),
    ("I do not know.", (None, "none")),
    ("", (None, "none")),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ---- normalisation and comparison ---------------------------------------------------------------------


@pytest.mark.parametrize("prediction, ref", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("\\tfrac12", "\\frac{1}{2}"), ("1/2", "\\frac{1}{2}"),
    ("0.5", "\\frac12"), ("0.25", "\\frac{1}{4}"), ("-.5", "-\\frac{1}{2}"),  # numbers: exact values
    ("2.50", "2.5"), ("3.0", "3"), ("3.00", "\\frac{6}{2}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("\\!10", "10"),
    ("$5$", "5"), ("\\$18.00", "18"), ("10\\%", "10"), ("90^\\circ", "90"), ("90^{\\circ}", "90"),
    ("5 \\text{ cm}^2", "5"), ("12 square units", "12"), ("x = 5", "5"), ("1,000", "1000"),
    ("\\text{(C)}", "(C)"), ("\\sqrt 3", "\\sqrt{3}"), ("\\frac{\\sqrt{3}}{2}", "\\dfrac{\\sqrt3}{2}"),
])
def test_math_equal(prediction, ref):
    assert math_equal(prediction, ref)


@pytest.mark.parametrize("prediction, ref", [
    ("0.33", "\\frac{1}{3}"), ("2", "3"), ("(3,2)", "(2,3)"), ("\\frac{1}{2}", "\\frac{2}{1}"), ("x", "y"),
    ("\\text{Monday}", "\\text{Tuesday}"), (None, "1"),
])
def test_math_not_equal(prediction, ref):
    assert not math_equal(prediction, ref)


def test_normalize_math_by_hand():
    assert normalize_math(" \\left( 1, \\dfrac 12 \\right) ") == "(1,\\frac{1}{2})"
    assert normalize_math("k = \\$1,234.50") == "1234.5"
    assert normalize_math("\\text{Monday}") == "Monday"  # a text answer keeps its words


def test_integer_answers():
    assert integer_equal("$1,000.00", 1000) and integer_equal("033", 33) and integer_equal("18 dollars", 18)
    assert integer_equal("-4", -4) and integer_equal("\\frac{6}{2}", 3)
    assert not integer_equal("33.5", 33) and not integer_equal("(3, 4)", 3) and not integer_equal(None, 0)


# ---- layouts --------------------------------------------------------------------------------------------

MATH500 = [{"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}",
            "solution": "We add: $\\boxed{\\frac{3}{4}}$."},
           {"problem": "Compute $2^3$.", "answer": "8", "solution": "$2^3 = \\boxed{8}$."}]
AIME = [{"Problem": "Find the remainder when $7^{2}$ is divided by 10.", "Answer": 9},
        {"Problem": "How many positive divisors does 12 have?", "Answer": "006"}]
GSM8K = [{"question": "Tom has 3 boxes of 4 pens. How many pens?", "answer": "3 * 4 = <<3*4=12>>12\n#### 12"},
         {"question": "A car costs $1,200 and a bike $300. Total?", "answer": "1200 + 300 = 1500\n#### 1,500"}]


def test_layouts_are_detected_from_the_columns():
    assert detect_format(MATH500, "f") == "math500"
    assert detect_format(AIME, "f") == "aime"  # integer answers, no solution; columns in any case
    assert detect_format(GSM8K, "f") == "gsm8k"
    assert detect_format([{"problem": "p", "answer": "\\frac12"}], "f") == "math500"
    with pytest.raises(UserError, match="cannot tell the layout of f from its columns \\(text, label\\)"):
        detect_format([{"text": "p", "label": 1}], "f")


def test_references_per_layout():
    assert reference(MATH500[0], "math500", "row 0") == "\\frac{3}{4}"
    assert reference({"problem": "p", "solution": "so \\boxed{\\frac{1}{2}}."}, "math500", "row 0") == "\\frac{1}{2}"
    assert reference(AIME[1], "aime", "row 1") == "6"
    assert reference(GSM8K[1], "gsm8k", "row 1") == "1500"
    with pytest.raises(UserError, match="row 3: a GSM8K answer ends with '#### <integer>'"):
        reference({"question": "q", "answer": "12"}, "gsm8k", "row 3")
    with pytest.raises(UserError, match="row 2: the aime answer must be an integer, got '1/2'"):
        reference({"problem": "p", "answer": "1/2"}, "aime", "row 2")
    with pytest.raises(UserError, match="row 0: no reference answer"):
        reference({"problem": "p", "solution": "no box"}, "math500", "row 0")


def test_score_of_a_long_generation():
    task = get_task("math")(argparse.Namespace(dataset="f.jsonl"))
    example = Example("p", answers=["\\frac{1}{2}"], meta={"math_format": "math500"})
    assert task.score("... so the answer is $\\boxed{\\dfrac12}$.", example) == {"accuracy": 1.0, "answered": 1.0}
    assert task.score("... 3 then 0.5", example) == {"accuracy": 1.0, "answered": 0.0}  # the last number
    integer = Example("p", answers=["1500"], meta={"math_format": "gsm8k"})
    assert task.score("The answer is $1,500.", integer) == {"accuracy": 1.0, "answered": 1.0}


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("rows, fmt", [(MATH500, "math500"), (AIME, "aime"), (GSM8K, "gsm8k")])
def test_each_layout_runs_under_eviction(tiny_dir, tmp_path, rows, fmt):
    path = write_rows(tmp_path / "problems.jsonl", rows)
    rt = tiny_runtime(tiny_dir, "--tasks", "math", "--dataset", path, "--max_new_tokens", "6",
                      "--cache_strategy", "recent_global", "--max_cache_length", "0.5")
    with torch.inference_mode():
        out = get_task("math")(rt.args).run(rt)
    assert set(out.metrics) == {"accuracy", "answered", "finished"}
    assert [p["math_format"] for p in out.predictions] == [fmt, fmt]
    assert [p["answers"] for p in out.predictions] == [[reference(r, fmt, "")] for r in rows]
    for p, item in zip(out.predictions, out.items, strict=True):
        assert p["output_tokens"] == len(item["output_ids"]) <= 6 and "extracted_by" in p
        assert set(item["metrics"]) >= {"accuracy", "answered", "finished", "compression_ratio"}
    assert 0 < out.stats["compression_ratio"] < 1  # measured over the whole generation


def test_math_format_overrides_detection_and_bad_options_are_errors(tiny_dir, tmp_path):
    path = write_rows(tmp_path / "problems.jsonl", [{"problem": "1+1?", "answer": "2", "solution": "\\boxed{2}"}])
    rt = tiny_runtime(tiny_dir, "--tasks", "math", "--dataset", path, "--max_new_tokens", "2")
    rt.args.math_format = "aime"  # as `--math_format aime` sets it
    with torch.inference_mode():
        (p,) = get_task("math")(rt.args).run(rt).predictions
    assert p["math_format"] == "aime" and p["answers"] == ["2"]
    rt.args.math_format = "gsm8k"
    with pytest.raises(UserError, match="the gsm8k layout needs columns question and answer; found problem"):
        get_task("math")(rt.args).run(rt)
    with pytest.raises(UserError, match="--math_format must be one of math500, aime, gsm8k"):
        get_task("math")(argparse.Namespace(dataset=path, math_format="amc"))
    with pytest.raises(UserError, match="math: the problem is the whole prompt"):
        get_task("math")(argparse.Namespace(dataset=path, protocol="kvpress"))
    with pytest.raises(UserError, match="^math needs --dataset$"):  # when the runs are planned, before any runs
        get_task("math")(argparse.Namespace())


@pytest.mark.slow
def test_bundled_model_end_to_end(tmp_path):
    """`python -m eval --tasks math` on the bundled model: two problems, a short budget, eviction at decode."""
    path = write_rows(tmp_path / "problems.jsonl", GSM8K)
    full, ours = cli.main(["--tasks", "math", "--dataset", path, "--max_new_tokens", "12",
                           "--cache_strategy", "recent_global", "--max_cache_length", "0.5",
                           "--out_dir", str(tmp_path / "runs")])
    assert full["strategy"] == "full" and ours["strategy"] == "recent_global"
    assert {"accuracy", "answered", "finished"} <= set(ours) and ours["compression_ratio"] > 0
    (run,) = [d for d in (tmp_path / "runs").glob("*/math/*") if json.loads((d / "metrics.json").read_text())
              ["strategy"] == "recent_global"]
    items = [json.loads(line) for line in (run / "items.jsonl").read_text().splitlines()]
    predictions = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert len(items) == len(predictions) == 2 and all(len(i["output_ids"]) <= 12 for i in items)
    assert [p["answers"] for p in predictions] == [["12"], ["1500"]]
    assert all("extracted_answer" in p for p in predictions)
