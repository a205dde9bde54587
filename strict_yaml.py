"""YAML for presets and grids, read strictly: what PyYAML would accept but silently misread is refused in
one line naming the file.

- A key given twice in one mapping: PyYAML keeps the last value without a word, so a preset that sets
  `max_cache_length` twice runs with whichever came last.
- A number in exponent notation that YAML 1.1 (PyYAML's dialect) reads as text: its floats need a dot and
  a signed exponent, so `1e-1`, `1.0e5` and `2E-3` are strings there, and a flag that takes a number then
  reports "got '1e-1'" without saying why. Quoted, such a word is a deliberate string and is kept.
"""

from __future__ import annotations

import re

import yaml

from errors import UserError

# Looks like a number in exponent notation; YAML 1.1 resolves it to a float only with a dot and a sign.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d[\d_]*(\.\d*)?|\.\d+)[eE][-+]?\d+")
_YAML11_FLOAT = re.compile(r"[-+]?([0-9][0-9_]*)?\.[0-9.]*([eE][-+][0-9]+)?")


def _as_yaml11_float(word: str) -> str:
    """How to write `word` so YAML 1.1 reads the same number: a dot in the mantissa, a sign on the exponent."""
    mantissa, exponent = re.split(r"[eE]", word)
    if "." not in mantissa:
        mantissa += ".0"
    if exponent[0] not in "+-":
        exponent = "+" + exponent
    return f"{mantissa}e{exponent}"


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _loader(source: str) -> type[yaml.SafeLoader]:
    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            seen: dict[object, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: PyYAML's own error says so
                    break
                if first is not None:
                    raise UserError(f"{source} line {_line(key_node)}: key {key!r} is given twice (first on line "
                                    f"{first}); YAML would keep only the last value")
                seen[key] = _line(key_node)
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_str(self, node: yaml.ScalarNode) -> str:
            value = super().construct_yaml_str(node)
            if node.style is None and _EXPONENT_NUMBER.fullmatch(value) and not _YAML11_FLOAT.fullmatch(value):
                raise UserError(f"{source} line {_line(node)}: {value} is text in YAML 1.1, not a number (its floats "
                                f"need a dot and a signed exponent): write {_as_yaml11_float(value)}, or quote "
                                "it for text")
            return value

    StrictLoader.add_constructor("tag:yaml.org,2002:str", StrictLoader.construct_yaml_str)
    return StrictLoader


def strict_load(text: str, source: str) -> object:
    """The YAML document in `text`, or a UserError naming `source` (e.g. "cache config configs/x.yaml") for a
    duplicate key or an exponent number YAML 1.1 reads as text; malformed YAML raises yaml.YAMLError."""
    return yaml.load(text, Loader=_loader(source))  # noqa: S506 - a SafeLoader subclass
