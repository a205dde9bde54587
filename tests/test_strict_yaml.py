"""strict_yaml: what PyYAML reads without a word but wrongly (a key given twice, an exponent number YAML 1.1
takes for text) is one UserError naming the file and the line; everything else loads as yaml.safe_load does."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from errors import UserError
from strict_yaml import strict_load

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("text", "message"), [
    ("a: 1\nb: 2\na: 3\n", "f.yaml line 3: key 'a' is given twice (first on line 1); YAML would keep only the last "
                           "value"),
    ("outer:\n  k: 1\n  k: 2\n", "f.yaml line 3: key 'k' is given twice (first on line 2)"),
    ("- {x: 1, x: 1}\n", "f.yaml line 1: key 'x' is given twice"),
    ("a: 1e-1\n", "f.yaml line 1: 1e-1 is text in YAML 1.1, not a number (its floats need a dot and a signed "
                  "exponent): write 1.0e-1, or quote it for text"),
    ("a: [0.5, 1.0e5]\n", "write 1.0e+5"),
    ("a: -2E-3\n", "write -2.0e-3"),
])
def test_refused_in_one_line(text, message):
    with pytest.raises(UserError) as info:
        strict_load(text, "f.yaml")
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text", [
    "a: 1.0e-1\nb: 1.0e+5\nc: .5\nd: 1_000\ne: abc\nf: e5\ng: '1e-1'\nh: \"2E3\"\n",
    "a: {k: 1}\nb: {k: 2}\n",  # the same key in two mappings
    "- a: 1\n- a: 2\n",
])
def test_everything_else_loads_as_safe_load(text):
    assert strict_load(text, "f.yaml") == yaml.safe_load(text)


def test_the_shipped_presets_are_strict():
    presets = sorted((ROOT / "configs").glob("*.yaml"))
    assert presets
    for path in presets:
        assert strict_load(path.read_text(), str(path)) == yaml.safe_load(path.read_text())


def test_malformed_yaml_is_still_yamls_error():
    with pytest.raises(yaml.YAMLError):
        strict_load("a: [1\n", "f.yaml")
