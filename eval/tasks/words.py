"""Aggregation tasks, RULER-style (arXiv 2404.06654): count words over the whole context, so every
evicted token can cost. Scored with RULER's string match (fraction of the expected words found).

- common_words_extraction: a numbered list of words where ten appear more often than the rest; name
  the ten. Common words appear 30 times and the others 3 times from 4k tokens on (RULER's setting);
  shorter prompts use 4 and 1 so that the ten still fit.
- frequent_words_extraction: a text of made-up "coded" words whose counts follow Zipf's law (exponent
  2); name the three most frequent.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from eval.data import word_list
from eval.tasks.base import Example, SyntheticTask, register_task

N_COMMON = 10
ZIPF_EXPONENT = 2.0
N_FREQUENT = 3
# The smallest top count at which floor(top / rank**2) keeps ranks 1-4 apart (so the top 3 is unique).
MIN_TOP_COUNT = 18


@register_task
class CommonWordsExtraction(SyntheticTask):
    name = "common_words_extraction"
    reads = tuple(r for r in SyntheticTask.reads if r != "haystack")
    defaults = {**SyntheticTask.defaults, "max_new_tokens": 96}

    def builder(self, rng: random.Random) -> Callable[[int], Example]:
        long = self.options["seq_len"] >= 4096
        freq_common, freq_other = (30, 3) if long else (4, 1)
        words = rng.sample(word_list(), len(word_list()))
        common, others = words[:N_COMMON], words[N_COMMON:]
        shuffle_seed = rng.random()
        intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.\n")
        question = f"Question: What are the {N_COMMON} most common words in the list above?"
        prefix = f"\nAnswer: The top {N_COMMON} words that appear most often in the list are:"

        def build(n: int) -> Example:
            items = common * freq_common + others[:n] * freq_other
            random.Random(shuffle_seed).shuffle(items)
            listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
            return Example(intro + listing + "\n", question, prefix, answers=common)

        return build


@register_task
class FrequentWordsExtraction(SyntheticTask):
    name = "frequent_words_extraction"
    reads = tuple(r for r in SyntheticTask.reads if r != "haystack")
    defaults = {**SyntheticTask.defaults, "max_new_tokens": 48}

    def builder(self, rng: random.Random) -> Callable[[int], Example]:
        shuffle_seed = rng.random()
        intro = ("Read the following coded text and track the frequency of each coded word. "
                 "Find the three most frequently appeared coded words.\n")
        question = "Question: What are the three most frequently appeared words in the coded text above?"
        prefix = "\nAnswer: According to the coded text above, the three most frequently appeared words are:"
        vocab: list[str] = []

        def coded_words(k: int) -> list[str]:  # drawn once, in order, so build(n) is deterministic
            while len(vocab) < k:
                word = "".join(rng.choices(string.ascii_lowercase, k=5))
                if word not in vocab:
                    vocab.append(word)
            return vocab[:k]

        def build(n: int) -> Example:
            top = MIN_TOP_COUNT + n
            words = coded_words(2 * top)  # the long tail: words seen once
            counts = [max(1, int(top / (r + 1) ** ZIPF_EXPONENT)) for r in range(len(words))]
            items = [w for w, c in zip(words, counts, strict=True) for _ in range(c)]
            random.Random(shuffle_seed).shuffle(items)
            return Example(intro + " ".join(items) + "\n", question, prefix, answers=words[:N_FREQUENT])

        return build
