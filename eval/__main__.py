"""`python -m eval`: see eval/cli.py."""

from errors import run_cli
from eval.cli import main

run_cli(main)
