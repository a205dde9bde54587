"""The field's scorers, re-implemented to give the originals' numbers (docs/DESIGN.md §6, task scores).

RULER (arXiv 2404.06654; NVIDIA/RULER `scripts/eval/synthetic/constants.py`, `scripts/synthetic.yaml`,
`scripts/eval/evaluate.py`): every task is scored with `string_match_all` except QA, `string_match_part`.
LongBench (arXiv 2308.14508; THUDM/LongBench `LongBench/eval.py`, `LongBench/metrics.py`): one metric per
dataset, the best over an item's references, averaged over items, x100. Each function cites the
definition it follows; where the original leans on a package (`rouge`, `fuzzywuzzy`) the package's own
definition is followed, so no new dependency is needed. Only `jieba`'s word segmentation is not
re-implemented: the Chinese QA and summarisation datasets are refused rather than scored differently.

kvpress (NVIDIA/kvpress `evaluation/benchmarks/{ruler,longbench}/calculate_metrics.py`) differs in two
places: it deletes control characters from RULER predictions (RULER turns them into newlines, so a
reference split by one matches only under kvpress), and its LongBench scorer strips all leading whitespace
from every prediction (LongBench strips newlines, before taking the first line of the datasets it cuts so;
its LongBench-E scorer does the same as LongBench's).
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from errors import UserError
from eval.metrics import normalize_answer, string_match_all, string_match_part

# ---- RULER --------------------------------------------------------------------------------------------

# synthetic.yaml maps each task to a family (niah, variable_tracking, common_words_extraction,
# freq_words_extraction, qa); constants.py gives every family string_match_all except qa.
RULER_METRICS: dict[str, str] = {
    **{name: "string_match_all" for name in (
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")},
    "qa_1": "string_match_part",
    "qa_2": "string_match_part",
}
_RULER_FNS: dict[str, Callable[[str, list[str]], float]] = {
    "string_match_all": string_match_all, "string_match_part": string_match_part}
_CONTROL_CHARS = re.compile(r"[\x00-\x1f]")


SCORER_FLAVORS = ("original", "kvpress")


def ruler_prediction(text: str, flavor: str = "original") -> str:
    """evaluate.py's postprocess_pred: strip, every control character (\\x00-\\x1f) to a newline, strip.
    kvpress's calculate_metrics deletes them instead (`np_pattern.sub("", x.strip()).strip()`)."""
    return _CONTROL_CHARS.sub("" if _flavor(flavor) == "kvpress" else "\n", text.strip()).strip()


def ruler_metric(task: str) -> str:
    if task not in RULER_METRICS:
        raise UserError(f"unknown RULER task {task!r}; RULER's tasks: {', '.join(RULER_METRICS)}")
    return RULER_METRICS[task]


def ruler_item_score(task: str, prediction: str, references: Sequence[str], flavor: str = "original") -> float:
    """One item's score in [0, 1]: the task's string match on the post-processed prediction."""
    fn = _RULER_FNS[ruler_metric(task)]
    return fn(ruler_prediction(prediction, flavor), list(_references(references, task)))


def ruler_score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]],
                flavor: str = "original") -> float:
    """A task's score as RULER reports it: the mean item score x100, rounded to 2 decimals."""
    items = _paired(predictions, references, task)
    return task_score(task, [ruler_item_score(task, p, r, flavor) for p, r in items])


# ---- LongBench: the per-dataset metrics (LongBench/metrics.py) ----------------------------------------


def _token_f1(prediction: list[str], reference: list[str]) -> float:
    """metrics.py f1_score: bag-of-tokens F1 (a token counts as often as it occurs in both)."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str) -> float:
    """metrics.py qa_f1_score: token F1 after SQuAD normalisation (lowercase, no punctuation, no articles);
    eval.metrics.normalize_answer is that normalisation."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _rouge_sentences(text: str) -> list[str]:
    # rouge 1.0.1 (pltrdy) Rouge._get_avg_scores: sentences are split on "." (kept when non-empty before
    # whitespace is collapsed, so a sentence of spaces stays as ""), words on single spaces.
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def _lcs_words(x: list[str], y: list[str]) -> list[str]:
    """rouge_score._recon_lcs: the words of one longest common subsequence of x (reference) and y, traced back
    with the package's tie rule (diagonal on a match, else up only when strictly longer, else left): which
    LCS is found matters, since ROUGE-L here counts the distinct words of the union of LCSs."""
    table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if x[i - 1] == y[j - 1] else max(table[i - 1][j], table[i][j - 1])
    # Iterative where the package recurses: it hits Python's recursion limit past ~1000 words in a sentence
    # pair (LongBench then scores 0 through its bare except); here such a pair is scored.
    words, i, j = [], len(x), len(y)
    while i > 0 and j > 0:
        if x[i - 1] == y[j - 1]:
            words.append(x[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_score(prediction: str, reference: str) -> float:
    """metrics.py rouge_score: `Rouge().get_scores(...)["rouge-l"]["f"]` of the `rouge` package (1.0.1,
    rouge_l_summary_level with exclusive=True), 0 when it raises (an empty prediction or reference).

    Not Google's rouge-score (eval.metrics.rouge_l): no lowercasing or punctuation removal, sentences split
    on ".", and with exclusive=True the counts are of *distinct* words: the union of the LCSs of every
    (reference sentence, predicted sentence) pair over the distinct words of each side."""
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(reference)
    if not hyp or not ref:
        return 0.0
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union.update(_lcs_words(r.split(" "), h.split(" ")))
    n_hyp = len({w for s in hyp for w in s.split(" ")})
    n_ref = len({w for s in ref for w in s.split(" ")})
    p, r = len(union) / n_hyp, len(union) / n_ref
    return 2.0 * ((p * r) / (p + r + 1e-8))  # the package's F, 1e-8 included


def classification_score(prediction: str, reference: str, all_classes: Sequence[str] | None) -> float:
    """metrics.py classification_score: the classes named (as substrings) in the prediction, less those that
    are a proper substring of the reference; 1/len(matched) when the reference is among them, else 0."""
    if not all_classes:
        raise UserError("LongBench classification (trec, lsht) needs the dataset's all_classes")
    matched = [c for c in all_classes if c in prediction]
    # The original removes from the list while iterating over it, so the class after a removed one is never
    # checked (and may stay); kept, since it changes scores.
    i = 0
    while i < len(matched):
        if matched[i] in reference and matched[i] != reference:
            del matched[i]
        i += 1
    return 1.0 / len(matched) if reference in matched else 0.0


def _count_of(prediction: str, target: str) -> float:
    # metrics.py count_score / retrieval_score: the share of the numbers in the prediction that equal the target.
    numbers = re.findall(r"\d+", prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, reference: str) -> float:
    return _count_of(prediction, str(reference))


def _paragraph_id(reference: str, pattern: str) -> str:
    found = re.findall(pattern, reference)
    if not found:
        raise UserError(f"LongBench retrieval reference {reference!r:.60} names no paragraph ({pattern})")
    return found[0]


def retrieval_score(prediction: str, reference: str) -> float:
    """metrics.py retrieval_score: the reference "Paragraph N"; the share of numbers in the prediction = N."""
    return _count_of(prediction, _paragraph_id(reference, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, reference: str) -> float:
    return _count_of(prediction, _paragraph_id(reference, r"段落(\d+)"))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18 fuzz.ratio as LongBench installs it (requirements.txt: fuzzywuzzy without
    python-Levenshtein, so difflib's SequenceMatcher): 100 when equal, 0 when either is empty, else
    int(round(100 * ratio)) (round half to even)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, reference: str) -> float:
    """metrics.py code_sim_score: the first line of the prediction (after leading newlines) with no "`",
    "#" or "//" (a comment or a fence is not code), fuzz.ratio against the reference / 100."""
    lines = prediction.lstrip("\n").split("\n")
    first = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz_ratio(first, reference) / 100


# ---- LongBench: datasets, post-processing and averaging (LongBench/eval.py) ---------------------------

_QA, _ROUGE, _CLS = "qa_f1_score", "rouge_score", "classification_score"
LONGBENCH_METRICS: dict[str, str] = {
    "narrativeqa": _QA, "qasper": _QA, "multifieldqa_en": _QA, "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": _QA, "2wikimqa": _QA, "musique": _QA, "dureader": "rouge_zh_score", "gov_report": _ROUGE,
    "qmsum": _ROUGE, "multi_news": _ROUGE, "vcsum": "rouge_zh_score", "trec": _CLS, "triviaqa": _QA,
    "samsum": _ROUGE, "lsht": _CLS, "passage_retrieval_en": "retrieval_score", "passage_count": "count_score",
    "passage_retrieval_zh": "retrieval_zh_score", "lcc": "code_sim_score", "repobench-p": "code_sim_score",
}
_LONGBENCH_FNS: dict[str, Callable[[str, str], float]] = {
    _QA: qa_f1_score, _ROUGE: rouge_score, "retrieval_score": retrieval_score,
    "retrieval_zh_score": retrieval_zh_score, "count_score": count_score, "code_sim_score": code_sim_score}
# Scored on the first line only: few-shot tasks, where a greedy answer runs on into the next example.
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")
LONGBENCH_E_BUCKETS = ("0-4k", "4-8k", "8k+")


def longbench_metric(dataset: str) -> str:
    """The metric of a LongBench dataset (LongBench-E's `<name>_e` configurations take their base's)."""
    name = dataset.removesuffix("_e") if dataset.removesuffix("_e") in LONGBENCH_METRICS else dataset
    if name not in LONGBENCH_METRICS:
        raise UserError(f"unknown LongBench dataset {dataset!r}; LongBench's datasets: {', '.join(LONGBENCH_METRICS)}")
    metric = LONGBENCH_METRICS[name]
    if metric.endswith("_zh_score") and metric != "retrieval_zh_score":
        raise UserError(f"LongBench {name} is scored with {metric}, which segments Chinese with jieba (not a "
                        "dependency here); it is not scored rather than scored differently")
    return metric


def longbench_item_score(dataset: str, prediction: str, references: Sequence[str],
                         all_classes: Sequence[str] | None = None, flavor: str = "original") -> float:
    """eval.py scorer, one item: first line for the few-shot datasets, then the best score over references.
    kvpress's scorer strips all leading whitespace, of every prediction, before anything else."""
    metric = longbench_metric(dataset)
    if _flavor(flavor) == "kvpress":
        prediction = prediction.lstrip()
    if dataset.removesuffix("_e") in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    refs = _references(references, dataset)
    if metric == _CLS:
        return max(classification_score(prediction, r, all_classes) for r in refs)
    fn = _LONGBENCH_FNS[metric]
    return max(fn(prediction, r) for r in refs)


def longbench_score(dataset: str, predictions: Sequence[str], references: Sequence[Sequence[str]],
                    all_classes: Sequence[str] | None = None, flavor: str = "original") -> float:
    """A dataset's score as LongBench reports it: the mean item score x100, rounded to 2 decimals."""
    items = _paired(predictions, references, dataset)
    total = sum(longbench_item_score(dataset, p, r, all_classes, flavor) for p, r in items)
    return round(100 * total / len(items), 2)


def longbench_e_scores(dataset: str, predictions: Sequence[str], references: Sequence[Sequence[str]],
                       lengths: Sequence[int], all_classes: Sequence[str] | None = None) -> dict[str, float | None]:
    """eval.py scorer_e: the score per length bucket (the item's `length` field, in words: < 4000, < 8000,
    else). An empty bucket is None where the original reports NaN (the mean of nothing)."""
    items = _paired(predictions, references, dataset)
    if len(lengths) != len(items):
        raise UserError(f"LongBench-E {dataset}: {len(lengths)} lengths for {len(items)} predictions")
    buckets: dict[str, list[float]] = {b: [] for b in LONGBENCH_E_BUCKETS}
    for (p, r), length in zip(items, lengths, strict=True):
        bucket = LONGBENCH_E_BUCKETS[0] if length < 4000 else LONGBENCH_E_BUCKETS[1] if length < 8000 else "8k+"
        buckets[bucket].append(longbench_item_score(dataset, p, r, all_classes))
    return {b: round(100 * float(np.mean(s)), 2) if s else None for b, s in buckets.items()}


# ---- one entry point per benchmark task -------------------------------------------------------------------


def benchmark_of(task: str) -> str | None:
    """`ruler` or `longbench` for a task name either benchmark defines (LongBench-E's `_e` names
    included), None for any other name."""
    if task in RULER_METRICS:
        return "ruler"
    if task in LONGBENCH_METRICS or task.removesuffix("_e") in LONGBENCH_METRICS:
        return "longbench"
    return None


def task_metric(task: str) -> str:
    """The metric the original benchmark scores `task` with (string_match_all, qa_f1_score, ...)."""
    benchmark = benchmark_of(task)
    if benchmark is None:
        raise UserError(f"unknown task {task!r}: neither RULER's ({', '.join(RULER_METRICS)}) nor LongBench's "
                        f"({', '.join(LONGBENCH_METRICS)})")
    return ruler_metric(task) if benchmark == "ruler" else longbench_metric(task)


def item_score(task: str, prediction: str, references: Sequence[str], all_classes: Sequence[str] | None = None,
               flavor: str = "original") -> float:
    """One item's score in [0, 1] under its benchmark's scorer (task_metric)."""
    task_metric(task)
    if benchmark_of(task) == "ruler":
        return ruler_item_score(task, prediction, references, flavor)
    return longbench_item_score(task, prediction, references, all_classes, flavor)


def task_score(task: str, item_scores: Sequence[float]) -> float:
    """A task's reported score from its item scores in [0, 1], rounded to 2 decimals, in its benchmark's order
    of operations (they differ in the last digit at exact ties): RULER and kvpress's RULER sum / count x 100,
    LongBench's eval.py 100 x sum / count."""
    if not item_scores:
        raise UserError("no items to score")
    total, n = sum(item_scores), len(item_scores)
    return round(100 * total / n if benchmark_of(task) == "longbench" else total / n * 100, 2)


# ---- shared checks --------------------------------------------------------------------------------------


def _flavor(flavor: str) -> str:
    if flavor not in SCORER_FLAVORS:
        raise ValueError(f"scorer flavor {flavor!r} is not one of {SCORER_FLAVORS}")
    return flavor



def _references(references: Sequence[str] | str, task: str) -> list[str]:
    """An item's references as a list of strings; none at all is an error (RULER would divide by zero,
    LongBench silently score 0)."""
    refs = [references] if isinstance(references, str) else list(references)
    if not refs or any(not isinstance(r, str) for r in refs):
        raise UserError(f"{task}: every item needs a list of reference strings, got {references!r:.60}")
    return refs


def _paired(predictions: Sequence[str], references: Sequence[Sequence[str]], task: str) -> list[tuple]:
    if len(predictions) != len(references):
        raise UserError(f"{task}: {len(predictions)} predictions for {len(references)} reference lists")
    if not predictions:
        raise UserError(f"{task}: no predictions to score")
    return list(zip(predictions, references, strict=True))
