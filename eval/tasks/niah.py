"""Needle in a haystack, RULER-style (arXiv 2404.06654): "special magic numbers" hidden in filler text.

- niah_single: one needle (a passkey); retrieve its 7-digit number.
- niah_multikey: four needles with different keys; retrieve the number of the one asked for.
- niah_multivalue: one key with four numbers; retrieve all of them.

Scored with RULER's string match: the fraction of the expected numbers found in the answer.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from eval.data import haystack, word_list
from eval.tasks.base import Example, SyntheticTask, insert_at_depths, register_task

INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
         "I will quiz you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."


class NeedleTask(SyntheticTask):
    n_keys = 1  # needles with different keys (one is asked for, the others distract)
    n_values = 1  # numbers per key

    def builder(self, rng: random.Random) -> Callable[[int], Example]:
        if not hasattr(self, "_haystack"):
            self._haystack = haystack(self.options["haystack"])
        units, joiner = self._haystack
        keys = rng.sample(word_list(), self.n_keys)
        values = {k: [str(rng.randrange(10**6, 10**7)) for _ in range(self.n_values)] for k in keys}
        needles = [(rng.random(), NEEDLE.format(key=k, value=v)) for k in keys for v in values[k]]
        start = rng.randrange(len(units))
        asked = keys[0]
        if self.n_values == 1:
            question = f"What is the special magic number for {asked} mentioned in the provided text?"
            prefix = f"\nThe special magic number for {asked} mentioned in the provided text is"
        else:
            question = f"What are all the special magic numbers for {asked} mentioned in the provided text?"
            prefix = f"\nThe special magic numbers for {asked} mentioned in the provided text are"

        def build(n: int) -> Example:
            filler = [units[(start + j) % len(units)] for j in range(n)]
            context = INTRO + joiner.join(insert_at_depths(filler, needles)) + "\n"
            return Example(context, question, prefix, answers=values[asked],
                           meta={"key": asked, "depths": [round(d, 3) for d, _ in needles]})

        return build


@register_task
class NiahSingle(NeedleTask):
    name = "niah_single"


@register_task
class NiahMultikey(NeedleTask):
    name = "niah_multikey"
    n_keys = 4


@register_task
class NiahMultivalue(NeedleTask):
    name = "niah_multivalue"
    n_values = 4
    defaults = {**SyntheticTask.defaults, "max_new_tokens": 64}
