"""`python -m eval.reproduce NAME`: the papers' headline claims as shipped experiments.

experiments.py declares them (claim, metric, arms as eval flags, profiles), runner.py runs the arms through
the eval harness and computes the paired differences and verdicts, report.py writes what they leave behind,
cli.py is the command line. docs/DESIGN.md §8 describes the runner and the verdict rule.
"""
