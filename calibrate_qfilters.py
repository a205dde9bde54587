"""Calibrate the Q-Filters (`qfilters`, strategies/qfilters.py) of a checkpoint on a CPU, offline.

    python calibrate_qfilters.py      # the bundled model -> qfilters/SmolLM2-135M-Instruct.json
    python calibrate_qfilters.py --windows 1 --seq_len 128 --out /tmp/qf.json   # a smoke run

Each text window is prefilled through the model with capture caches (strategies/kvzip.capture_queries),
which read every layer's queries after RoPE and the model's query scale, exactly as attention uses them.
Per (layer, query head) the queries are stacked over all windows; each head's first right singular vector
(the top eigenvector of the summed Gram matrix Σ q qᵀ, the same vector) is oriented so that the queries'
mean projection on it is positive, and a KV head's filter is the mean of its query heads' (arXiv
2503.02812, as the authors' make_filters).

Data: --windows evenly spaced --seq_len windows of the training split of train_gates.py (CPython's
documentation), so benchmarks on its held-out split stay unseen. The result is deterministic for the same
arguments and thread count; it is written atomically and never replaced without --overwrite.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from atomic_files import write_json_atomic
from checkpoint import add_checkpoint_argument
from errors import CliParser, run_cli
from flag_types import THREADS, count
from strategies.kvzip import capture_queries
from strategies.qfilters import QFILTERS_DIR, group_directions, query_moments
from train_gates import start_calibration


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="calibrate_qfilters.py", description=__doc__)
    add_checkpoint_argument(p)
    p.add_argument("--out", default=None, help="output file (default: qfilters/<checkpoint name>.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--windows", type=count(), default=8, help="text windows measured")
    p.add_argument("--seq_len", type=count(2), default=512, help="tokens per window")
    p.add_argument("--threads", type=THREADS, default=1, help="torch threads (1: reproducible; 0: torch's choice)")
    return p


def query_filters(model, windows: list[torch.Tensor]) -> list[list[list[float]]]:
    """The filter of every (layer, KV head) from the queries of `windows` (each [1, T]): [layer][head][D]."""
    n_kv = model.args.n_kv_head
    gram: list[torch.Tensor | None] = [None] * len(model.layers)
    total: list[torch.Tensor | None] = [None] * len(model.layers)

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        g, s = query_moments(q)
        gram[layer] = g.sum(0) if gram[layer] is None else gram[layer] + g.sum(0)
        total[layer] = s.sum(0) if total[layer] is None else total[layer] + s.sum(0)

    with torch.inference_mode(), capture_queries(model, observe):
        for ids in windows:
            model(ids, torch.arange(ids.shape[1]), last_logits_only=True)
    return [[[round(float(x), 6) for x in head] for head in group_directions(g, s, n_kv)]
            for g, s in zip(gram, total, strict=True)]


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    out, name, model, chosen, windows = start_calibration(args, QFILTERS_DIR)
    filters = query_filters(model, windows)
    payload = {
        "model": name, "n_layer": model.args.n_layer, "n_kv_head": model.args.n_kv_head,
        "head_dim": model.args.head_dim,
        "measure": "mean over a KV group's query heads of each one's first right singular vector of its queries "
                   "(after RoPE), oriented by their mean",
        "windows": chosen, "seq_len": args.seq_len, "filters": filters,
    }
    write_json_atomic(out, payload, args.overwrite)
    print(f"wrote {out} ({len(filters)} layers × {len(filters[0])} KV heads × {len(filters[0][0])}, "
          f"{time.perf_counter() - t0:.0f}s)")
    return out


if __name__ == "__main__":
    run_cli(main)
