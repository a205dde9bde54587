"""math: math word problems with a final answer, generated at length under decode-time eviction.

The setting where eviction while decoding matters most: a reasoning model writes thousands of tokens, and
the cache fills with its own chain of thought, not with the prompt. Each problem is the whole prompt;
greedy answers of up to --max_new_tokens (2048 by default), the answer extracted from the end of the
generation and compared with the reference (eval/answers.py). The cache statistics are measured after
the whole generation, as for every generation task.

Rows of a local file (or a hub dataset) in one of three layouts, `--math_format` or detected from the columns:

    math500   problem, answer (LaTeX; or, without it, the last \\boxed{} of `solution`)
    aime      problem, answer (an integer)
    gsm8k     question, answer (a worked solution ending in "#### <integer>")

Scores per item: accuracy (the extracted answer equals the reference), answered (an explicit final answer:
a \\boxed{} or an answer statement, not the fallback last number) and finished (EOS within the budget).
"""

from __future__ import annotations

import argparse

from errors import UserError
from eval.answers import extract_answer, integer_equal, last_boxed, math_equal
from eval.harness import Runtime
from eval.tasks.base import Example, GenerationTask, TaskResult, register_task, use_chat
from eval.tasks.dataset import dataset_rows

FORMATS = ("math500", "aime", "gsm8k")
# The instruction DeepSeek-R1 and Qwen2.5-Math recommend for math problems.
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_COLUMNS = {"math500": ("problem", "answer"), "aime": ("problem", "answer"), "gsm8k": ("question", "answer")}


def _column_names(row: dict) -> dict[str, str]:
    """Lowercase column name -> the file's own (AIME files often spell them Problem / Answer)."""
    return {str(name).lower(): name for name in row}


def detect_format(rows: list[dict], source: str) -> str:
    columns = _column_names(rows[0])
    if "question" in columns and "answer" in columns and "problem" not in columns:
        return "gsm8k"
    if "problem" in columns and ("answer" in columns or "solution" in columns):
        answers = [row.get(columns.get("answer", "")) for row in rows]
        integers = all((isinstance(a, int) and not isinstance(a, bool)) or (isinstance(a, str) and a.strip().isdigit())
                       for a in answers)
        return "aime" if integers and "solution" not in columns else "math500"
    raise UserError(f"math: cannot tell the layout of {source} from its columns ({', '.join(map(str, rows[0]))}); "
                    "expected problem/answer (math500, aime) or question/answer (gsm8k)")


def reference(row: dict, fmt: str, where: str) -> str:
    """The row's reference answer as text: LaTeX (math500) or an integer's digits (aime, gsm8k)."""
    columns = _column_names(row)
    value = row.get(columns.get("answer", ""))
    if fmt == "math500":
        if (value is None or not str(value).strip()) and "solution" in columns:
            value = last_boxed(str(row[columns["solution"]] or ""))
        if value is None or isinstance(value, bool | dict | list) or not str(value).strip():
            raise UserError(f"{where}: no reference answer (column answer, or a \\boxed{{}} in solution)")
        return str(value).strip()
    text = str(value).split("####")[-1] if fmt == "gsm8k" else str(value)
    if fmt == "gsm8k" and (not isinstance(value, str) or "####" not in value):
        raise UserError(f"{where}: a GSM8K answer ends with '#### <integer>', got {str(value)[-60:]!r}")
    digits = text.strip().replace(",", "")
    try:
        return str(int(digits))
    except ValueError:
        raise UserError(f"{where}: the {fmt} answer must be an integer, got {text.strip()!r:.40}") from None


@register_task
class Math(GenerationTask):
    name = "math"
    metrics = ("accuracy", "answered", "finished")
    reads = GenerationTask.reads + ("dataset", "dataset_config", "split", "math_format")
    defaults = {"max_new_tokens": 2048, "split": "train"}
    required = ("dataset",)

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        if self.options["protocol"] not in (None, "decode"):
            raise UserError("math: the problem is the whole prompt, there is no context to compress before a "
                            "question; use --protocol decode (eviction while the answer is generated)")
        fmt = self.options["math_format"]
        if fmt is not None and fmt not in FORMATS:
            raise UserError(f"--math_format must be one of {', '.join(FORMATS)}, got {fmt!r}")

    def examples(self, rt: Runtime) -> list[Example]:
        rows = dataset_rows(self)
        source = self.options["dataset"]
        fmt = self.options["math_format"] or detect_format(rows, source)
        # No chat template: the continuation is cued the way MATH's few-shot prompts end.
        prefix = "" if use_chat(rt) else "\nSolution:"
        examples = []
        for index, row in enumerate(rows):
            where = f"row {index} of {source}"
            columns = _column_names(row)
            problem_column, _ = _COLUMNS[fmt]
            if problem_column not in columns or ("answer" not in columns and fmt != "math500"):
                raise UserError(f"{where}: the {fmt} layout needs columns {' and '.join(_COLUMNS[fmt])}; "
                                f"found {', '.join(map(str, row))}")
            problem = row[columns[problem_column]]
            if not isinstance(problem, str) or not problem.strip():
                raise UserError(f"{where}: column {columns[problem_column]!r} has no problem text "
                                f"(got {problem!r:.40})")
            examples.append(Example(f"{problem.strip()}\n\n{INSTRUCTION}", "", prefix,
                                    answers=[reference(row, fmt, where)], meta={"math_format": fmt}))
        return examples

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        answer, how = extract_answer(prediction)
        ref = example.answers[0]
        right = math_equal(answer, ref) if example.meta["math_format"] == "math500" else integer_equal(answer, int(ref))
        return {"accuracy": float(right), "answered": float(how in ("boxed", "statement"))}

    def run(self, rt: Runtime) -> TaskResult:
        result = super().run(rt)
        eos = set(rt.tokenizer.eos_ids)
        for p, item in zip(result.predictions, result.items, strict=True):
            output = item["output_ids"]
            # Finished: the model closed its answer (EOS) before the budget ran out.
            finished = float(bool(output) and output[-1] in eos)
            p["extracted_answer"], p["extracted_by"] = extract_answer(p["prediction"])
            p["output_tokens"], p["finished"] = len(output), finished
            item["metrics"]["finished"] = finished
        result.metrics["finished"] = sum(p["finished"] for p in result.predictions) / len(result.predictions)
        return result
