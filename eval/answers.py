"""Final answers of math word problems: extraction from a long generation and a normalising comparison.

Extraction, first that applies: the last closed `\\boxed{...}` (or `\\fbox{...}`) with nested braces, as
MATH's `last_boxed_only_string` / `remove_boxed` (Hendrycks et al. 2021, arXiv 2103.03874); else the last
answer statement ("the (final) answer is X", GSM8K's "#### X"); else the last number in the text.

Comparison: MATH's `is_equiv` on `_strip_string`-normalised answers (spaces, \\left/\\right, \\!, dollars,
degrees, percent, units on the right, \\dfrac/\\tfrac, \\frac12, a/b, "x = 5", a leading ".5"), with
Minerva's additions (Lewkowycz et al. 2022, arXiv 2206.14858, normalize_final_answer: unit words, \\text
wrappers, thousands commas), and exact rational equality when both sides are numbers, which covers
trailing zeros and "0.5" against "\\frac12" (MATH maps only the literal 0.5). AIME and GSM8K answers are
integers: numbers compared with the reference integer.
"""

from __future__ import annotations

import re
from fractions import Fraction

# ---- extraction ------------------------------------------------------------------------------------------


def _closed_group(text: str, start: int) -> str | None:
    """The text inside the brace group opening at text[start] == "{", or None when it never closes (a
    generation cut off by its budget)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last closed \\boxed{...} / \\fbox{...}; `\\boxed 5` (no braces) is its next token."""
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*", text))):
        end = match.end()
        if end < len(text) and text[end] == "{":
            inside = _closed_group(text, end)
            if inside is not None:
                return inside.strip()
        elif match.group().endswith(" ") and end < len(text):
            return re.split(r"[\s$]", text[end:], maxsplit=1)[0]
    return None


_STATEMENT = re.compile(r"(?:####|answer is\s*:?)[ \t]*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def answer_statement(text: str) -> str | None:
    """X of the last "the answer is X" / "#### X": its line, cut at the end of its sentence, the inside of a
    $...$ when it is one."""
    found = _STATEMENT.findall(text)
    if not found:
        return None
    answer = re.split(r"\.\s", found[-1], maxsplit=1)[0].strip().rstrip(".").strip()
    math = re.fullmatch(r"\$+(.+?)\$+", answer)
    return (math.group(1) if math else answer).strip() or None


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].rstrip(",") if found else None


def extract_answer(text: str) -> tuple[str | None, str]:
    """(the answer, how it was found: "boxed", "statement", "last_number" or "none")."""
    for how, extract in (("boxed", last_boxed), ("statement", answer_statement), ("last_number", last_number)):
        answer = extract(text)
        if answer:
            return answer, how
    return None, "none"


# ---- normalisation ---------------------------------------------------------------------------------------

# Minerva's unit words (a subset), removed only after a number, so a text answer is never cut.
_UNITS = ("square", "sq", "units", "unit", "cubic", "cm", "mm", "km", "meters", "meter", "m", "inches", "inch",
          "feet", "foot", "ft", "yards", "miles", "mph", "degrees", "degree", "dollars", "dollar", "cents", "cent",
          "hours", "hour", "minutes", "minute", "seconds", "second", "days", "day", "weeks", "years", "percent",
          "pounds", "grams", "kg", "liters", "cups", "students", "people", "points", "ways")
_UNIT_WORDS = "|".join(_UNITS)
_UNIT_AFTER_NUMBER = re.compile(rf"^(-?[\d.,/]*\d)\s*(?:\\(?:text|mbox|mathrm){{\s*)?(?:(?:{_UNIT_WORDS})\b\s*)+}}?"
                                r"(?:\^\{?[23]\}?)?$")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mbox|mathrm|mathbf)\{([^{}]*)\}")


def _strip_units(s: str) -> str:
    # MATH's _remove_right_units: everything from "\text{ " (a space inside: a unit) is dropped.
    s = s.split("\\text{ ")[0] if "\\text{ " in s else s
    s = _UNIT_AFTER_NUMBER.sub(r"\1", s.strip())
    return _TEXT_WRAPPER.sub(r"\1", s)


def _fix_fracs(s: str) -> str:
    # MATH's _fix_fracs: \frac12 -> \frac{1}{2}, \frac1{b} -> \frac{1}{b}, \frac{a}2 -> \frac{a}{2}.
    s = re.sub(r"\\frac([0-9a-zA-Z])([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([0-9a-zA-Z])\{", r"\\frac{\1}{", s)
    return re.sub(r"\\frac\{([^{}]*)\}([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)


def normalize_math(answer: str) -> str:
    """A MATH-style canonical form of an answer (see the module's docstring for the sources)."""
    s = answer.strip().replace("\n", "").replace("\\!", "")
    s = re.sub(r"\\[dt]frac", r"\\frac", s).replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s).replace("°", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = _strip_units(s)
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = "0" + s if s.startswith(".") else s
    s = "-0" + s[1:] if s.startswith("-.") else s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:  # "x = 5", "k=5": the value (MATH's rule)
        s = sides[1]
    s = s.replace(" ", "")
    s = re.sub(r"\\sqrt([0-9a-zA-Z])", r"\\sqrt{\1}", s)
    s = _fix_fracs(s)
    s = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)  # MATH's _fix_a_slash_b
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # Minerva: thousands separators
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.\d+", s):  # trailing zeros: 2.50 -> 2.5, 3.0 -> 3
        s = s.rstrip("0").rstrip(".")
    return s


def numeric_value(normalized: str) -> Fraction | None:
    """The exact value of a normalised answer that is a number (integer, decimal, \\frac{a}{b}), else None."""
    if re.fullmatch(r"-?\d+(?:\.\d+)?", normalized):
        return Fraction(normalized)
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", normalized)
    if frac and Fraction(frac.group(3)) != 0:
        value = Fraction(frac.group(2)) / Fraction(frac.group(3))
        return -value if frac.group(1) else value
    return None


def math_equal(prediction: str | None, reference: str) -> bool:
    """MATH's is_equiv on the normalised strings, or exact equality of their values when both are numbers."""
    if prediction is None:
        return False
    pred, ref = normalize_math(prediction), normalize_math(reference)
    if pred == ref:
        return True
    pred_value, ref_value = numeric_value(pred), numeric_value(ref)
    return pred_value is not None and pred_value == ref_value


def integer_equal(prediction: str | None, reference: int) -> bool:
    """AIME / GSM8K: the prediction, normalised (commas, dollars, units), is a number equal to the integer."""
    if prediction is None:
        return False
    return numeric_value(normalize_math(prediction)) == reference
