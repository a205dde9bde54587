"""From measured rows to the report: comparisons between rows, the targets, and the tables."""


from __future__ import annotations

TARGET_FRACTION_OF_BOUND = 0.7  # compiled full cache at the longest of --contexts
TARGET_MAX_OVERHEAD = 0.10  # each strategy over a full cache of the same size (debug_ caches decode the full one)
TARGET_SPEEDUP_OF_PREDICTED = 0.9  # budget over full at the longest context: measured speed-up / the bound's
TARGET_PEAK_KV_SHARE = 0.15  # peak device memory of the budget row ≤ weights + this share of the full cache's K/V
TARGET_SCORED_PREFILL = 0.5  # prefill of caches that score the prompt's attention, over the full cache's
SCORED_PREFILL = ("heavy_hitter", "hybrid")
TARGET_BATCHED_OVER_FULL = 3.0  # at --speedup_budget under one memory cap: throughput over the full cache's
def fill_comparisons(rows: list[dict]) -> None:
    """Speed-up of each strategy row over the full cache at the same context (same engine, same new tokens),
    measured (median step times) and as the bandwidth bound predicts it."""
    for r in rows:
        if r["strategy"] == "full" or r["engine"] == "hf generate":
            continue
        full = next((f for f in rows if f["engine"] == r["engine"] and f["strategy"] == "full"
                     and f["context"] == r["context"] and f["new_tokens"] == r["new_tokens"]), None)
        if full is not None:  # median step times: one slow stretch of a shared machine does not decide it
            r["speedup_vs_full"] = round(full["median_ms_per_step"] / r["median_ms_per_step"], 3)
            r["bound_speedup_vs_full"] = round(r["bound_tokens_per_second"] / full["bound_tokens_per_second"], 3)


def summarize_targets(rows: list[dict], speedup_budget: float, weights: int = 0) -> dict:
    """The targets as measured ratios (`weights`: bytes of the model's weights); `met` is None where the
    run has no row to judge by."""
    targets = _bound_and_peer_targets(rows)
    targets["max_eviction_overhead"] = _overhead_target(rows)
    targets["speedup_of_predicted"], longest = _speedup_target(rows, speedup_budget)
    targets["peak_memory_at_longest"] = _peak_memory_target(rows, longest, speedup_budget, weights)
    targets["scored_prefill_of_full"] = _scored_prefill_target(rows)
    targets["recompilations"] = _recompilation_target(rows)
    return targets


def _find(rows: list[dict], engine: str, context: int, strategy: str = "full",
          budget: float | None = None) -> dict | None:
    return next((r for r in rows if r["engine"] == engine and r["context"] == context
                 and r["strategy"] == strategy and (budget is None or r["budget"] == budget)), None)


def _target(value: object, goal: str, met: bool | None) -> dict:
    return {"value": value, "target": goal, "met": met}


def _bound_and_peer_targets(rows: list[dict]) -> dict:
    """The compiled full cache's fraction of the bound, and its speed over transformers' two recipes, at the
    longest context with a transformers row (else the longest compiled one)."""
    hf_contexts = [r["context"] for r in rows if r["engine"].startswith("hf generate")]
    context = max(hf_contexts or [r["context"] for r in rows if r["engine"] == "ours compiled"] or [0])
    ours = _find(rows, "ours compiled", context)
    frac = ours["fraction_of_bound"] if ours else None
    paired = ours.get("fraction_of_bound_paired") if ours else None
    targets = {"compiled_fraction_of_bound": _target(
        frac, f">= {TARGET_FRACTION_OF_BOUND} (context {context})",
        None if frac is None else frac >= TARGET_FRACTION_OF_BOUND),
        "compiled_fraction_of_bound_paired": _target(
        paired, f">= {TARGET_FRACTION_OF_BOUND} (context {context}; each block of steps against the rate probed "
        "around it)", None if paired is None else paired >= TARGET_FRACTION_OF_BOUND)}
    for key, engine, strategy in (("compiled_over_hf_generate", "hf generate", "full (DynamicCache)"),
                                  ("compiled_over_hf_static_compiled", "hf generate, static cache compiled",
                                   "full (StaticCache)")):
        hf = _find(rows, engine, context, strategy)
        ratio = round(hf["median_ms_per_step"] / ours["median_ms_per_step"], 2) if hf and ours else None
        targets[key] = _target(ratio, "> 1", None if ratio is None else ratio > 1)
    return targets


def _overhead_target(rows: list[dict]) -> dict:
    overhead: dict = {}
    for r in rows:
        if r["overhead_vs_same_size_full"] is not None and r["engine"] == "ours compiled":
            overhead[r["strategy"]] = max(overhead.get(r["strategy"], -1.0), r["overhead_vs_same_size_full"])
    judged = [v for s, v in overhead.items() if not s.startswith("debug_")]
    return _target(overhead, f"<= {TARGET_MAX_OVERHEAD} (debug_* excluded)",
                   max(judged) <= TARGET_MAX_OVERHEAD if judged else None)


def _speedup_target(rows: list[dict], speedup_budget: float) -> tuple[dict, int | None]:
    """Each budget row's speed-up over the full cache against the bound's prediction, judged at the longest
    context; also returns that context."""
    speedups = {}
    for r in rows:
        if r["engine"] == "ours compiled" and r["budget"] == speedup_budget and r["speedup_vs_full"] is not None:
            speedups[f"{r['strategy']}@{r['context']}"] = {
                "speedup": r["speedup_vs_full"], "predicted": r["bound_speedup_vs_full"],
                "ratio_of_predicted": round(r["speedup_vs_full"] / r["bound_speedup_vs_full"], 3),
                "context": r["context"]}
    longest = max((v["context"] for v in speedups.values()), default=None)
    at_longest = [v["ratio_of_predicted"] for v in speedups.values() if v["context"] == longest]
    return _target(speedups, f"speed-up / predicted >= {TARGET_SPEEDUP_OF_PREDICTED} at {speedup_budget:g} budget, "
                   f"longest context ({longest})",
                   min(at_longest) >= TARGET_SPEEDUP_OF_PREDICTED if at_longest else None), longest


def _peak_memory_target(rows: list[dict], longest: int | None, speedup_budget: float, weights: int) -> dict:
    peak = {}
    if longest is not None:
        full = _find(rows, "ours compiled", longest)
        for r in rows:
            if (r["engine"] == "ours compiled" and r["context"] == longest and r["strategy"] != "full"
                    and r["budget"] == speedup_budget and full and r["peak_device_memory_mb"] is not None and weights):
                limit = (weights + TARGET_PEAK_KV_SHARE * full["kv_bytes_read_per_step"]) / 2**20
                peak[r["strategy"]] = {"peak_mb": r["peak_device_memory_mb"], "limit_mb": round(limit, 1),
                                       "full_cache_peak_mb": full["peak_device_memory_mb"]}
    return _target(peak, f"<= weights + {TARGET_PEAK_KV_SHARE} x the full cache's K/V",
                   all(v["peak_mb"] <= v["limit_mb"] for v in peak.values()) if peak else None)


def _scored_prefill_target(rows: list[dict]) -> dict:
    prefill = {}
    for r in rows:
        full = _find(rows, r["engine"], r["context"])
        if r["strategy"] in SCORED_PREFILL and r["engine"] == "ours compiled" and full:
            prefill[f"{r['strategy']}@{r['context']}"] = round(
                r["prefill_tokens_per_second"] / full["prefill_tokens_per_second"], 3)
    return _target(prefill, f">= {TARGET_SCORED_PREFILL} of the full cache's prefill",
                   min(prefill.values()) >= TARGET_SCORED_PREFILL if prefill else None)


def _recompilation_target(rows: list[dict]) -> dict:
    checked = [r for r in rows if r["recompile_check_steps"] is not None]
    recompiles = [r["recompilations"] for r in rows if r["recompilations"] is not None]
    check_steps = min((r["recompile_check_steps"] for r in checked), default=None)
    return {"value": max(recompiles) if recompiles else None, "check_steps": check_steps,
            "checked": sorted({r["strategy"] for r in checked}), "target": "0 over >= 256 steps",
            "met": max(recompiles) == 0 and check_steps >= 256 if checked else None}


def summarize_batch_targets(rows: list[dict], speedup_budget: float, judged: list[str]) -> dict:
    """Batched rows under a cap: each strategy's throughput over the dense full cache's at --speedup_budget,
    measured and predicted by the bound (rows on codes keyed with their bits); met when every one of `judged`
    (--speedup_strategies) that ran on dense storage reaches it."""
    def dense(r: dict) -> bool:
        return r.get("cache_bits") in (None, 16)

    def key(r: dict) -> str:
        return f"{r['strategy']}@{r['budget']:g}" + ("" if dense(r) else f"/{r['cache_bits']}bit")

    value = {key(r): {"batch": r["batch_size"], "speedup": r["speedup_vs_full"],
                      "predicted": r["bound_speedup_vs_full"]}
             for r in rows if r["kv_memory_cap_gb"] is not None and r["speedup_vs_full"] is not None}
    full = next((r["batch_size"] for r in rows if r["strategy"] == "full" and dense(r)
                 and r["kv_memory_cap_gb"] is not None), None)
    checked = [v["speedup"] for k, v in value.items() if "/" not in k and k.split("@")[0] in judged
               and float(k.split("@")[1]) == speedup_budget]
    goal = (f">= {TARGET_BATCHED_OVER_FULL}x the full cache's tokens/s under the same cap (full: batch {full}), "
            f"{', '.join(judged)} at {speedup_budget:g}")
    met = min(checked) >= TARGET_BATCHED_OVER_FULL if checked else None
    return {"batched_over_full_at_cap": _target(value, goal, met)}


def format_targets(targets: dict) -> str:
    lines = ["| target | measured | goal | met |", "|---|---|---|---|"]
    for name, t in targets.items():
        value = t["value"]
        if name == "speedup_of_predicted":
            value = ", ".join(f"{k}: {v['speedup']}× vs {v['predicted']}× predicted" for k, v in value.items())
        elif name == "max_eviction_overhead":
            value = ", ".join(f"{k}: {v:+.1%}" for k, v in value.items())
        elif name == "peak_memory_at_longest":
            value = ", ".join(f"{k}: {v['peak_mb']:.0f} MB (limit {v['limit_mb']:.0f}, full cache "
                              f"{v['full_cache_peak_mb']:.0f})" for k, v in value.items())
        elif name == "batched_over_full_at_cap":
            value = ", ".join(f"{k}: {v['speedup']}× at batch {v['batch']} vs {v['predicted']}× predicted"
                              for k, v in value.items())
        elif name == "scored_prefill_of_full":
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif name == "recompilations" and t["check_steps"] is not None:
            value = f"{value} (check runs of {t['check_steps']} steps: {', '.join(t['checked'])})"
        lines.append(f"| {name} | {value} | {t['target']} | {'' if t['met'] is None else t['met']} |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    cols = ["engine", "strategy", "budget", "context", "cache_slots", "prefill_tokens_per_second",
            "decode_tokens_per_second", "median_ms_per_step", "compression_ratio", "fraction_of_bound",
            "fraction_of_bound_paired", "overhead_vs_same_size_full", "speedup_vs_full", "bound_speedup_vs_full",
            "recompilations", "compile_seconds", "peak_rss_mb"]
    short = {"prefill_tokens_per_second": "prefill tok/s", "decode_tokens_per_second": "decode tok/s",
             "compression_ratio": "compression", "fraction_of_bound": "of bound",
             "fraction_of_bound_paired": "of bound, paired", "peak_rss_mb": "peak RSS MB",
             "recompilations": "recompiles", "cache_slots": "slots", "median_ms_per_step": "median ms/step",
             "overhead_vs_same_size_full": "overhead vs same-size full", "speedup_vs_full": "speed-up vs full",
             "bound_speedup_vs_full": "bound speed-up", "compile_seconds": "compile s"}
    lines = ["| " + " | ".join(short.get(c, c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


