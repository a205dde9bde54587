"""`python -m eval.reproduce`: see eval/reproduce/cli.py."""

from errors import run_cli
from eval.reproduce.cli import main

run_cli(main)
