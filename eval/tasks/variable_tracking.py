"""variable_tracking, RULER-style (arXiv 2404.06654): a chain of assignments `VAR B = VAR A` hidden in
filler text; name every variable that ends up holding the value. It needs multi-hop retrieval, which
token eviction can break anywhere along the chain. Scored with RULER's string match (fraction found).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from eval.data import haystack
from eval.tasks.base import Example, SyntheticTask, insert_at_depths, register_task

HOPS = 4  # assignments after the first: five variables share the value


@register_task
class VariableTracking(SyntheticTask):
    name = "variable_tracking"

    def builder(self, rng: random.Random) -> Callable[[int], Example]:
        if not hasattr(self, "_haystack"):
            self._haystack = haystack(self.options["haystack"])
        units, joiner = self._haystack
        names: list[str] = []
        while len(names) < HOPS + 1:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        value = str(rng.randrange(10**4, 10**5))
        chain = [f"VAR {names[0]} = {value}."]
        chain += [f"VAR {b} = VAR {a}." for a, b in zip(names[:-1], names[1:], strict=True)]
        depths = sorted(rng.random() for _ in chain)  # the chain stays in order through the text
        start = rng.randrange(len(units))
        intro = "Memorize and track the chain of variable assignments hidden in the following text.\n\n"
        question = f"Question: Find all variables that are assigned the value {value} in the text above."
        prefix = (f"\nAnswer: According to the chain of variable assignments in the text above, {len(names)} "
                  f"variables are assigned the value {value}, they are:")

        def build(n: int) -> Example:
            filler = [units[(start + j) % len(units)] for j in range(n)]
            context = intro + joiner.join(insert_at_depths(filler, list(zip(depths, chain, strict=True)))) + "\n"
            return Example(context, question, prefix, answers=names, meta={"value": value})

        return build
