"""RULER's and LongBench's scorers (eval/scorers.py) against hand-computed cases, the originals' quirks included."""

from __future__ import annotations

import pytest

from errors import UserError
from eval.scorers import (
    LONGBENCH_METRICS,
    RULER_METRICS,
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    longbench_e_scores,
    longbench_item_score,
    longbench_metric,
    longbench_score,
    qa_f1_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    ruler_item_score,
    ruler_metric,
    ruler_prediction,
    ruler_score,
)

# ---- RULER -------------------------------------------------------------------------------------------------


def test_ruler_task_names_map_to_their_family_metric():
    assert len(RULER_METRICS) == 13
    for name in ("niah_single_1", "niah_single_3", "niah_multikey_2", "niah_multivalue", "niah_multiquery", "vt",
                 "cwe", "fwe"):
        assert ruler_metric(name) == "string_match_all"
    assert ruler_metric("qa_1") == ruler_metric("qa_2") == "string_match_part"


def test_ruler_several_references_all_versus_part():
    refs = ["123", "456", "789"]
    assert ruler_item_score("niah_multivalue", "The numbers are 123 and 456.", refs) == pytest.approx(2 / 3)
    assert ruler_item_score("qa_1", "The numbers are 123 and 456.", refs) == 1.0  # any reference
    assert ruler_item_score("qa_2", "Paris", ["London", "Rome"]) == 0.0


def test_ruler_case_empty_prediction_and_control_characters():
    assert ruler_item_score("niah_single_3", "The uuid is ABC-def", ["abc-DEF"]) == 1.0
    assert ruler_item_score("vt", "", ["X1"]) == 0.0
    # evaluate.py turns a control character into a newline (not nothing): "12\t34" holds no "1234".
    assert ruler_prediction("  12\t34\x00 \n") == "12\n34"
    assert ruler_item_score("niah_single_1", "12\t34", ["1234"]) == 0.0


def test_ruler_task_score_is_the_mean_x100_rounded():
    # Item scores 1, 1/2, 0: mean 1/2 -> 50.0; items 1, 0, 0 -> 33.333... -> 33.33.
    assert ruler_score("cwe", ["a b", "a", "z"], [["a", "b"], ["a", "c"], ["q"]]) == 50.0
    assert ruler_score("fwe", ["a", "z", "z"], [["a"], ["a"], ["a"]]) == 33.33


@pytest.mark.parametrize("call", [
    lambda: ruler_metric("niah_single"),  # our task's name, not RULER's
    lambda: ruler_item_score("vt", "x", []),
    lambda: ruler_score("vt", ["x"], [["x"], ["y"]]),
    lambda: ruler_score("vt", [], []),
])
def test_ruler_bad_input_is_one_clear_error(call):
    with pytest.raises(UserError) as err:
        call()
    assert "\n" not in str(err.value)


def test_unknown_ruler_task_lists_the_names():
    with pytest.raises(UserError, match="unknown RULER task 'niah_single'.*niah_single_1, .*qa_2"):
        ruler_metric("niah_single")


# ---- LongBench metrics -------------------------------------------------------------------------------------


def test_qa_f1_by_hand():
    # "cat sat on mat" against "cat on mat": 3 tokens shared, P = 3/4, R = 1, F1 = 2 * 3/4 / (7/4) = 6/7.
    assert qa_f1_score("The cat sat on the mat.", "a cat on a mat") == pytest.approx(6 / 7)
    assert qa_f1_score("PARIS!", "paris") == 1.0
    assert qa_f1_score("", "paris") == 0.0
    assert qa_f1_score("a", "a") == 0.0  # an article: nothing is left to match
    # A repeated token counts as often as it occurs in both: "a a b" vs "a b b" share a, b: P = R = 2/3.
    assert qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)


def test_rouge_l_counts_distinct_words_of_the_union_lcs():
    # One sentence each. LCS = "the cat on the mat", whose distinct words are {the, cat, on, mat}: 4;
    # distinct words of each side: 5. P = R = 4/5, F = 0.8 (Google's rouge-score: 5/6 on tokens).
    assert rouge_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(0.8, abs=1e-8)
    # Sentences split on ".": LCS per sentence pair, so "a b. c" against "c. a b" finds all of a, b, c.
    assert rouge_score("a b. c", "c. a b") == pytest.approx(1.0, abs=1e-8)
    assert rouge_score("The cat", "the cat") == pytest.approx(0.5, abs=1e-8)  # case-sensitive: {cat} of 2
    assert rouge_score("", "the cat") == 0.0 and rouge_score("...", "the cat") == 0.0  # the package raises


def test_classification_by_hand():
    classes = ["Location", "Number", "Entity"]
    assert classification_score("Entity", "Entity", classes) == 1.0
    assert classification_score("Location or Number", "Number", classes) == 0.5  # two classes named
    assert classification_score("A person", "Number", classes) == 0.0
    # A class inside the reference ("cat" in "cat food") does not count against it.
    assert classification_score("cat food", "cat food", ["cat", "cat food", "dog"]) == 1.0
    # The original removes while iterating: after "a" goes, "ab" is skipped and stays, so 1/2, not 1.
    assert classification_score("abc", "abc", ["a", "ab", "abc"]) == 0.5
    with pytest.raises(UserError, match="all_classes"):
        classification_score("Entity", "Entity", None)


def test_retrieval_and_count_by_hand():
    assert retrieval_score("Paragraph 3, maybe paragraph 5", "Paragraph 3") == 0.5  # numbers 3, 5: one right
    assert retrieval_score("no idea", "Paragraph 3") == 0.0
    assert retrieval_zh_score("答案是段落2", "段落2") == 1.0
    assert count_score("There are 7 passages, not 8 or 9", "7") == pytest.approx(1 / 3)
    assert count_score("", "7") == 0.0
    with pytest.raises(UserError, match="names no paragraph"):
        retrieval_score("3", "the third")


def test_code_similarity_by_hand():
    # The first line without a comment or fence is compared: here it equals the reference.
    assert code_sim_score("\n# add one\n    return x + 1\nfoo", "    return x + 1") == 1.0
    # "return a" / "return b": difflib matches 7 of 16 characters twice: 2 * 7 / 16 = 0.875 -> 87.5 -> 88.
    assert code_sim_score("```python\nreturn a\n```", "return b") == 0.88
    # One character of 8 + 8 matches: 12.5, rounded half to even as Python's round: 12.
    assert fuzz_ratio("aXXXXXXX", "aYYYYYYY") == 12
    assert fuzz_ratio("", "") == 100 and fuzz_ratio("", "x") == 0
    assert code_sim_score("# only comments", "x = 1") == 0.0


# ---- LongBench datasets, post-processing, averaging ------------------------------------------------------


def test_longbench_dataset_map():
    assert len(LONGBENCH_METRICS) == 21
    assert longbench_metric("hotpotqa") == "qa_f1_score" and longbench_metric("gov_report") == "rouge_score"
    assert longbench_metric("trec") == "classification_score" and longbench_metric("lcc") == "code_sim_score"
    assert longbench_metric("passage_count") == "count_score"
    assert longbench_metric("qasper_e") == "qa_f1_score"  # a LongBench-E configuration: its base's metric
    assert longbench_metric("passage_retrieval_zh") == "retrieval_zh_score"  # a regex: no segmentation needed


@pytest.mark.parametrize("dataset", ["multifieldqa_zh", "dureader", "vcsum"])
def test_chinese_metrics_that_need_jieba_are_refused(dataset):
    with pytest.raises(UserError, match=f"LongBench {dataset} is scored with .*jieba"):
        longbench_metric(dataset)


def test_unknown_longbench_dataset_is_one_clear_error():
    with pytest.raises(UserError, match="unknown LongBench dataset 'hotpot'; LongBench's datasets: narrativeqa"):
        longbench_item_score("hotpot", "x", ["x"])


def test_best_reference_and_first_line_rule():
    # The best of several references: "paris france" against "paris" is P = 1/2, R = 1: 2/3; "london" 0.
    assert longbench_item_score("hotpotqa", "Paris France", ["London", "Paris"]) == pytest.approx(2 / 3)
    # triviaqa is scored on the first line (after leading newlines); hotpotqa on the whole answer.
    assert longbench_item_score("triviaqa", "\nParis\nQuestion: next", ["Paris"]) == 1.0
    assert longbench_item_score("hotpotqa", "\nParis\nQuestion: next", ["Paris"]) == pytest.approx(2 / 4)
    # trec: the first line names one class; the whole answer names two.
    classes = ["Location", "Number"]
    assert longbench_item_score("trec", "Location\nNumber", ["Location"], classes) == 1.0
    assert longbench_item_score("lsht", " Location\nNumber", ["Location"], classes) == 1.0  # spaces kept: a substring
    assert longbench_item_score("trec", "Location\nNumber", ["Number"], classes) == 0.0


def test_longbench_average_and_length_buckets():
    assert longbench_score("narrativeqa", ["Paris", "x"], [["Paris"], ["y"]]) == 50.0
    assert longbench_score("musique", ["p", "q", "r"], [["p"], ["z"], ["z"]]) == 33.33
    scores = longbench_e_scores("2wikimqa", ["p", "q", "p", "p"], [["p"], ["p"], ["z"], ["p"]],
                                [100, 3999, 4000, 9000])
    assert scores == {"0-4k": 50.0, "4-8k": 0.0, "8k+": 100.0}
    assert longbench_e_scores("hotpotqa", ["p"], [["p"]], [10]) == {"0-4k": 100.0, "4-8k": None, "8k+": None}
    with pytest.raises(UserError, match="2 lengths for 1 predictions"):
        longbench_e_scores("hotpotqa", ["a"], [["a"]], [10, 20])
    with pytest.raises(UserError, match="reference strings"):
        longbench_score("hotpotqa", ["a"], [[]])


# ---- kvpress's calculate_metrics (flavor "kvpress") --------------------------------------------------------
# The references below are kvpress's own code (evaluation/benchmarks/{ruler,longbench}/calculate_metrics.py),
# retyped: its postprocessing, its two string matches, and its LongBench scorer's whitespace handling.


def _kvpress_ruler_task(task: str, preds: list[str], refs: list[list[str]]) -> float:
    import re

    preds = [re.sub(r"[\x00-\x1f]", "", p.strip()).strip() for p in preds]
    if task.split("_")[0] == "qa":
        score = sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref)
                    for p, ref in zip(preds, refs, strict=True)) / len(preds) * 100
    else:
        score = sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
                    for p, ref in zip(preds, refs, strict=True)) / len(preds) * 100
    return round(score, 2)


RULER_CASES = [  # predictions with control characters inside and around references, and case changes
    ("niah_single_1", ["The number is 123\n4567.", " 7654321 ", "none"], [["1234567"], ["7654321"], ["1"]]),
    ("vt", ["AB, C\tD and EF", "ab cd"], [["AB", "CD", "EF"], ["AB", "CD", "XY"]]),
    ("qa_1", ["Will\x07iam Shakespeare", "paris"], [["William Shakespeare", "Shakespeare"], ["London", "Paris"]]),
]


@pytest.mark.parametrize("task, preds, refs", RULER_CASES)
def test_ruler_kvpress_flavor_gives_kvpress_numbers(task, preds, refs):
    assert ruler_score(task, preds, refs, flavor="kvpress") == _kvpress_ruler_task(task, preds, refs)


def test_ruler_flavors_differ_where_a_control_character_splits_a_reference():
    # RULER turns the newline into a newline (no match); kvpress deletes it (a match).
    assert ruler_item_score("niah_single_1", "123\n4567", ["1234567"]) == 0.0
    assert ruler_item_score("niah_single_1", "123\n4567", ["1234567"], flavor="kvpress") == 1.0
    assert ruler_prediction(" a\tb ", flavor="kvpress") == "ab" and ruler_prediction(" a\tb ") == "a\nb"


def test_longbench_kvpress_flavor_strips_leading_whitespace_first():
    # kvpress: prediction.lstrip().split("\n")[0] for the few-shot sets, prediction.lstrip() for the rest.
    # "  \nParis\nLondon" on triviaqa: LongBench takes the first line after newlines only: "  "; kvpress "Paris".
    assert longbench_item_score("triviaqa", "  \nParis\nLondon", ["Paris"]) == 0.0
    assert longbench_item_score("triviaqa", "  \nParis\nLondon", ["Paris"], flavor="kvpress") == 1.0
    # lcc: the first code line after leading newlines; a leading space changes fuzz.ratio only under LongBench.
    original = longbench_item_score("lcc", " x = 1", ["x = 1"])
    assert original < 1.0 and longbench_item_score("lcc", " x = 1", ["x = 1"], flavor="kvpress") == 1.0


def test_item_score_dispatches_on_the_task_name_and_refuses_unknown_ones():
    from eval.scorers import benchmark_of, item_score, task_metric, task_score

    assert benchmark_of("qa_2") == "ruler" and benchmark_of("hotpotqa") == "longbench"
    assert benchmark_of("qasper_e") == "longbench" and benchmark_of("squad") is None
    assert item_score("hotpotqa", "the Paris", ["Paris"]) == 1.0  # qa_f1 after normalisation
    assert task_metric("lcc") == "code_sim_score"
    assert task_score("hotpotqa", [1.0, 0.0, 0.5]) == 50.0 and task_score("qa_2", [1 / 3]) == 33.33
    # 23 of 160 at the rounding tie: RULER's sum / n x 100 (14.374999...) and LongBench's 100 x sum / n (14.375).
    hits = [1.0] * 23 + [0.0] * 137
    assert task_score("vt", hits) == 14.37 and task_score("passage_count", hits) == 14.38
    with pytest.raises(UserError, match="unknown task 'squad'"):
        task_metric("squad")
    with pytest.raises(ValueError, match="flavor"):
        ruler_prediction("x", flavor="ruler")
