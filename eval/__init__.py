"""Evaluation harness: tasks, fidelity metrics, a results table, resumable parallel sweeps, plots.

    python -m eval        one cache configuration on some tasks, next to the full cache   (eval/cli.py)
    python -m eval.sweep  strategies × budgets × tasks × seeds, resumable, in parallel   (eval/sweep.py)
    python -m eval.plot   quality vs measured compression, attention loss, KL vs position  (eval/plot.py)
    python -m eval.bench  decode speed against the machine's memory-bandwidth bound         (eval/bench/)
"""
