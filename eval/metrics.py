"""Scoring (docs/DESIGN.md §6): string metrics for generated answers and the per-token fidelity metrics of
teacher forcing. Pure functions, checked against hand-worked examples in tests/test_eval_metrics.py."""

from __future__ import annotations

import math
import re
import string

import numpy as np
import torch
from torch import Tensor

# ---- generated answers ----------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """SQuAD-style normalization: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, references: list[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(r) for r in references))


def substring_match(prediction: str, references: list[str]) -> float:
    """1 when a (normalized) reference occurs inside the (normalized) prediction."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(r) in pred for r in references if normalize_answer(r)))


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's score for one item: the fraction of references found in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's QA score for one item: 1 when any reference is found in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in references))


_ROUGE = None


def rouge_l(prediction: str, references: list[str]) -> float:
    """ROUGE-L F-measure (Google's `rouge-score` package, no stemming), best over the references."""
    global _ROUGE
    if _ROUGE is None:
        from rouge_score import rouge_scorer

        _ROUGE = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return max(_ROUGE.score(r, prediction)["rougeL"].fmeasure for r in references)


# ---- teacher forcing -------------------------------------------------------------------------------------


def step_fidelity(ref_logits: Tensor, logits: Tensor, target: int) -> tuple[float, bool, float, float]:
    """One position's (KL(ref ‖ compressed), top-1 agreement, NLL under ref, NLL under compressed).

    Both logits are [vocab] float32. Identical logits give exactly 0 and agreement True.
    """
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    logp = torch.log_softmax(logits.float(), dim=-1)
    kl = float((ref_logp.exp() * (ref_logp - logp)).sum())
    agree = bool(ref_logits.argmax() == logits.argmax())
    return kl, agree, -float(ref_logp[target]), -float(logp[target])


def rows_fidelity(ref_logits: Tensor, logits: Tensor, targets: Tensor) -> tuple[list[float], list[bool], list[float],
                                                                           list[float]]:
    """step_fidelity for B rows at once: ref_logits, logits [B, vocab], targets [B] -> its four values per
    row, as lists. A row whose two logits are identical gets exactly 0 and agreement True."""
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    logp = torch.log_softmax(logits.float(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)
    agree = ref_logits.argmax(dim=-1) == logits.argmax(dim=-1)
    index = targets.view(-1, 1)
    nll_ref, nll = -ref_logp.gather(1, index)[:, 0], -logp.gather(1, index)[:, 0]
    return kl.tolist(), agree.tolist(), nll_ref.tolist(), nll.tolist()


def summarize_fidelity(kl: list[float], agree: list[bool], nll_ref: list[float], nll: list[float]) -> dict:
    """Mean and p95 of the per-token KL, top-1 agreement, perplexity of both caches and its change."""
    kl_arr = np.asarray(kl, dtype=np.float64)
    ppl_ref = math.exp(float(np.mean(nll_ref)))
    ppl = math.exp(float(np.mean(nll)))
    return {
        "kl_mean": float(kl_arr.mean()),
        "kl_p95": float(np.percentile(kl_arr, 95)),
        "kl_max": float(kl_arr.max()),
        "top1_agreement": float(np.mean(agree)),
        "perplexity": ppl,
        "perplexity_full": ppl_ref,
        "perplexity_delta": ppl - ppl_ref,
        "perplexity_ratio": ppl / ppl_ref,
        "scored_tokens": int(kl_arr.size),
    }
