"""Decode speed side by side, in one process, same model, dtype and prompt for every row:
Hugging Face `generate` (default dynamic cache, when transformers is installed), ours eager, ours
compiled with the full cache, and ours compiled with each strategy at each budget.

Decode of one sequence is memory-bound: each step reads every weight and the cached K/V once. The
machine's read bandwidth is measured in the same run, and each row is compared with the bound it
implies: bandwidth / (weight bytes + K/V bytes read per step). The probe runs again after the rows (reported
beside it, not used): on a shared host it can move by 2x within minutes. The compiled full rows also report
`fraction_of_bound_paired`: blocks of their steps, each against the probes taken just before and after it.

Each strategy row also measures its eviction overhead against a full cache of the same size (no eviction
work; as many slots, so attention, weights and K/V reads are the same): both decode `--new_tokens` steps in
alternating blocks (ABBA, robust to other jobs on the machine) and `overhead_vs_same_size_full` compares
their median step times. One same-size reference row per size is shared by every strategy of that size
(the full cache with a prompt of slots - new tokens; its compiled graph is kept for the pairing).

A cold compile of the 30-layer decode step costs 40-60 s per distinct (strategy, shape), so by default
(`--dry_run` prints the plan and an estimate of its duration; 18 compiles, about 24 minutes on 2 idle cores):
- HF generate, ours eager and ours compiled with the full cache at --contexts (512 2048 4096 8192; 8192 is
  cut to 8192 - new tokens to fit the model's context), and ours compiled at --bound_contexts (256);
- every strategy at --speedup_budget (0.1) at --strategy_contexts (4096): the overhead and speed-up targets;
- --budget_strategies (heavy_hitter, whose per-step work grows most with the cache; `all` for every
  strategy, about 15 more minutes) also at each of --budgets (0.1 0.25 0.5) there;
- --speedup_strategies (recent_global) at --speedup_budget at --speedup_contexts (8192), speed-up only;
- once per compiled strategy, --recompile_steps (256) more decode steps on its graph, with a prompt that lets
  the cache fill and then evict, counting new graphs.
bench.json / bench.md end with the targets (TARGET_*) as measured ratios.

`--batch_sizes` measures throughput under a memory cap instead (eval/bench/batched.py): the full cache and
each strategy at each of --budgets, at the largest of those batch sizes whose measured caches fit
--kv_memory_gb, decoded as one batch of rows of a --batch_context prompt, on each storage of
--batch_cache_bits (dense, or per-token codes); tokens/s summed over the rows, the ratio to the dense full cache
under the same cap, and the bound B x bandwidth / (weights + B rows' K/V).

    python -m eval.bench                 # the default plan
    python -m eval.bench --dry_run       # the plan, the number of compiles, prefill tokens and steps
    python -m eval.bench --quick         # about a minute: one short context, eager rows
    python -m eval.bench --batch_sizes 1 4 8 16 32 --kv_memory_gb 0.4 --dtype float32 --strategies recent_global
"""
