"""`python -m eval.bench`: see eval/bench/__init__.py."""

from errors import run_cli
from eval.bench.cli import main

run_cli(main)
