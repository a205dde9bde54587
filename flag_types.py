"""argparse types for numeric flags that carry their valid range, so a value that parses but means nothing
(a count of 0, a fraction of 1.5, NaN, a seed past 2^32) is refused where it enters, in argparse's one
line, and the bad-input matrix (tests/bad_input_matrix.py) derives each flag's bad values from the range
itself: a new flag declared with one of these is probed the moment it exists.

    p.add_argument("--steps", type=count(), default=240)            # an integer ≥ 1
    p.add_argument("--lr", type=real(low=0, low_open=True))         # a finite number > 0
    p.add_argument("--seed", type=SEED)                              # an integer in [0, 2^32)

`__name__` is "int" or "float", the name cache_spec's YAML typing reads to decide what a preset or grid
value must be.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

# Seeds the generators and random eviction accept whole (cache_spec.SEED_LIMIT is the same number: random
# eviction folds seed × 1_000_003 + layer into an int64 buffer).
SEED_LIMIT = 1 << 32


@dataclass(frozen=True)
class Number:
    """An int or float argparse type with an inclusive range [low, high] (either end open on request, or
    absent); floats must be finite."""

    kind: type = int
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    @property
    def __name__(self) -> str:  # noqa: A003 - argparse and cache_spec read the type's name
        return self.kind.__name__

    def describe(self) -> str:
        """The range in words: 'at least 1', 'greater than 0', 'in [0, 1]', 'in [0, 2^32)'."""
        if self.low is not None and self.high is not None:
            high = "2^32" if self.high == SEED_LIMIT else f"{self.high:g}"
            return f"in {'(' if self.low_open else '['}{self.low:g}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'greater than' if self.low_open else 'at least'} {self.low:g}"
        if self.high is not None:
            return f"{'less than' if self.high_open else 'at most'} {self.high:g}"
        return "finite" if self.kind is float else "an integer"

    def contains(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))

    def __call__(self, text: str) -> int | float:
        if self.kind is int:
            try:
                value: int | float = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        else:
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
            if not math.isfinite(value):  # float() accepts 'nan', 'inf' and overflows '1e999' to inf
                raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
        if not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return value

    def bad_values(self) -> list[str]:
        """Words that parse as the flag's kind of number (or as a float argparse would take) but are
        outside its range or not finite: what the bad-input matrix feeds every flag of this type."""
        bad = ["nan", "inf", "-inf", "1e999"] if self.kind is float else ["1.5", "nan", "1e3"]
        step = 1 if self.kind is int else 0.5
        if self.low is not None:
            bad.append(_word(self.low if self.low_open else self.low - step, self.kind))
        if self.high is not None:
            bad.append(_word(self.high if self.high_open else self.high + step, self.kind))
        return bad


def _word(value: float, kind: type) -> str:
    return str(int(value)) if kind is int else repr(float(value))


def count(low: int = 1, high: int | None = None) -> Number:
    """An integer ≥ low (1 by default: a number of steps, items, tokens, workers)."""
    return Number(int, low, high)


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False,
         high_open: bool = False) -> Number:
    """A finite float in the given range."""
    return Number(float, low, high, low_open, high_open)


SEED = Number(int, 0, SEED_LIMIT, high_open=True)
POSITIVE = real(low=0, low_open=True)  # a learning rate, a budget, a capacity, a memory size
NON_NEGATIVE = real(low=0)
# torch threads: 0 is torch's own choice; past a few thousand, set_num_threads fails (or the machine does).
THREADS = count(0, 4096)


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the flags typed in `argv` (with any value, the default included): what a check of
    flags that would be ignored asks about, as a default it cannot tell from a typed value."""
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    return {by_option[w.split("=", 1)[0]].dest for w in argv if w.split("=", 1)[0] in by_option}


def refuse_unused(parser: argparse.ArgumentParser, explicit: set[str], dests: tuple[str, ...], why: str) -> None:
    """A UserError naming the first flag of `dests` typed explicitly: `why` says what ignores it."""
    from errors import UserError

    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    for dest in dests:
        if dest in explicit:
            raise UserError(f"{by_dest[dest].option_strings[0]} would be ignored: {why}")
