"""The scoring rules' claims (TOVA, K-norm, KeyDiff, Q-Filters, CriticalKV, ChunkKV, Ada-KV, Expected Attention,
R-KV, LagKV, MorphKV, LaCache, D2O):
each against the rule its paper measures itself against, declared as experiments.py declares the others (and
registered into the same EXPERIMENTS when experiments.py loads).

Where a paper's score is one of this tool's rules with one thing added (CriticalKV's value norm, ChunkKV's
chunks), the control is that rule without it, so the comparison isolates what the paper adds; where it is a
new rule, the control is its paper's baseline, with the same budget and the same protected tokens.
"""

from __future__ import annotations

from eval.reproduce.experiments import (
    FIDELITY_EXTRAS,
    HALF_BLIND,
    NEEDLES,
    PROFILED_PROMPT,
    SHORT_WINDOWS,
    Arm,
    Comparison,
    Experiment,
    register,
)

# A fifth of each window, as the h2o experiment; sinks and the default 10-token recent window in both arms
# unless the paper's method protects nothing (TOVA).
FIFTH = ("--max_cache_length", "0.2")


def against_tova(name: str, paper: str, claim: str, strategy: str, labels: tuple[str, str],
                 notes: tuple[str, ...]) -> Experiment:
    """A rule that is TOVA's score with one factor added (CriticalKV's value norm, ChunkKV's chunks, R-KV's
    redundancy) against `tova` with every other flag equal, so the comparison isolates the factor: KL on a prompt
    compressed to a fifth of the window, then decoded under eviction. `labels`: (treatment, control)."""
    treatment, control = labels
    return Experiment(
        name=name, paper=paper, claim=claim,
        task="fidelity", metric="kl_mean", higher_is_better=False,
        common=FIFTH,
        arms=(Arm(treatment, ("--cache_strategy", strategy)), Arm(control, ("--cache_strategy", "tova"))),
        comparisons=(Comparison(treatment, control),),
        varies=frozenset({"cache_strategy"}),
        profiles=PROFILED_PROMPT, extra_metrics=FIDELITY_EXTRAS,
        notes=notes,
    )

register(Experiment(
    name="tova",
    paper="TOVA (Oren et al., Transformers are Multi-State RNNs, arXiv 2401.06104)",
    claim="Dropping at each step the token the current query attends to least, with no accumulated history and no "
          "protected tokens, keeps the next-token distribution closer to the full cache than a window with 4 "
          "attention sinks (StreamingLLM) and than H2O's heavy hitters with half the budget recent, at the same "
          "budget.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=FIFTH,
    arms=(Arm("tova", ("--cache_strategy", "tova", "--global_tokens", "0", "--recent_window", "0")),
          Arm("streamingllm", ("--cache_strategy", "recent_global", "--global_tokens", "4")),
          Arm("h2o", ("--cache_strategy", "heavy_hitter", "--global_tokens", "0", "--recent_window", "0.5"))),
    comparisons=(Comparison("tova", "streamingllm", "against 4 sinks + window"),
                 Comparison("tova", "h2o", "against H2O's heavy hitters + recent half")),
    varies=frozenset({"cache_strategy", "global_tokens", "recent_window"}),
    profiles=SHORT_WINDOWS, extra_metrics=FIDELITY_EXTRAS,
    notes=("Each arm as its paper runs it: TOVA protects nothing (its attention keeps the sinks on its own), "
           "StreamingLLM keeps 4 sinks and the window, H2O splits the budget half heavy hitters, half recent, "
           "without sinks.",
           "The paper measures perplexity on long texts (PG-19) with LLaMA-2; this is KL to the full cache on pydoc "
           "text, the 32-token prompt within the budget, so only decode-time eviction is compared.",
           "TOVA's score is the latest query's attention averaged over the query heads of a KV group, one cache "
           "per KV head (the paper averages over all heads of a layer)."),
))

register(Experiment(
    name="knorm",
    paper="K-norm (Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, "
          "arXiv 2406.11430)",
    claim="Keeping the keys with the lowest L2 norm keeps the next-token distribution closer to the full cache than "
          "keeping random ones, at the same budget and the same protected tokens, at half and at a fifth of the "
          "sequence.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=("--global_tokens", "4", "--recent_window", "10"),
    arms=(Arm("lowest key norm, half", ("--cache_strategy", "l2", "--max_cache_length", "0.5")),
          Arm("random, half", ("--cache_strategy", "random", "--max_cache_length", "0.5")),
          Arm("lowest key norm, fifth", ("--cache_strategy", "l2", *FIFTH)),
          Arm("random, fifth", ("--cache_strategy", "random", *FIFTH))),
    comparisons=(Comparison("lowest key norm, half", "random, half", "half the sequence: the paper's lossless regime"),
                 Comparison("lowest key norm, fifth", "random, fifth", "a fifth, as the other experiments")),
    varies=frozenset({"cache_strategy"}),
    profiles=SHORT_WINDOWS, extra_metrics=FIDELITY_EXTRAS,
    notes=("The paper reports language modelling stable up to half of the cache evicted by the norm; random "
           "eviction is the baseline the norm has to beat. Both arms keep the 4 sinks and a 10-token recent window, "
           "so the norm decides only among the others.",
           "Language-modelling loss in the paper (Llama-2, Llama-3, Gemma); KL to the full cache here, decode-time "
           "eviction (the 32-token prompt fits both budgets)."),
))

register(Experiment(
    name="keydiff",
    paper="KeyDiff (Park et al., arXiv 2504.15364)",
    claim="Evicting the key most similar to the mean direction of the held keys keeps the next-token distribution "
          "closer to the full cache than a window with 4 attention sinks (StreamingLLM), both reading no attention, "
          "at the same budget.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=(*FIFTH, "--global_tokens", "4"),
    arms=(Arm("keydiff", ("--cache_strategy", "keydiff", "--recent_window", "10")),
          Arm("streamingllm", ("--cache_strategy", "recent_global"))),
    comparisons=(Comparison("keydiff", "streamingllm"),),
    varies=frozenset({"cache_strategy", "recent_window"}),
    profiles=SHORT_WINDOWS, extra_metrics=FIDELITY_EXTRAS,
    notes=("KeyDiff's paper compares eviction rules on LongBench, a long prompt processed in blocks under a fixed "
           "cache; here decode-time eviction on pydoc text against StreamingLLM, the attention-free rule every "
           "eviction paper compares with.",
           "Both keep the 4 sinks; keydiff also protects its 10 newest tokens, all recent_global holds beyond the "
           "sinks is its window."),
))

register(Experiment(
    name="qfilters",
    paper="Q-Filters (Godey et al., arXiv 2503.02812)",
    claim="Keeping the keys with the largest projection on the queries' principal direction keeps the next-token "
          "distribution closer to the full cache than keeping the keys of lowest norm (K-norm), both reading no "
          "attention, at the same budget and the same protected tokens.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=(*FIFTH, "--global_tokens", "4", "--recent_window", "10"),
    arms=(Arm("q-filters", ("--cache_strategy", "qfilters")),
          Arm("k-norm", ("--cache_strategy", "l2"))),
    comparisons=(Comparison("q-filters", "k-norm"),),
    varies=frozenset({"cache_strategy"}),
    profiles=SHORT_WINDOWS, extra_metrics=FIDELITY_EXTRAS,
    notes=("The paper's streaming-generation comparison (perplexity, sinks + eviction) is against K-norm; here KL "
           "to the full cache on pydoc text, decode-time eviction.",
           "The directions are the shipped calibration's (qfilters/, calibrate_qfilters.py: a few windows of the "
           "project's calibration text), not the paper's pretraining-corpus filters."),
))

register(against_tova(
    name="criticalkv",
    paper="CriticalKV (Feng et al., arXiv 2502.03805)",
    claim="Weighting each token's attention by the norm of its value (a bound on how much evicting it moves the "
          "layer's output) keeps the next-token distribution closer to the full cache than the attention alone, "
          "at the same budget, the prompt compressed and then decoded under eviction.",
    strategy="critical_kv", labels=("output-aware", "attention only"),
    notes=("critical_kv's attention is TOVA's (the latest query's, per KV group), so the control is tova: the same "
           "attention without the value norm, which isolates the paper's output-aware factor.",
           "‖v‖ stands in for the paper's ‖W_o v‖ (strategies/critical_kv.py); the paper compresses LongBench "
           "prompts after SnapKV's or Ada-KV's first stage, here a 128-token prompt of pydoc text compressed to a "
           "fifth of the window, then 96 positions decoded under eviction."),
))

register(against_tova(
    name="chunkkv",
    paper="ChunkKV (Liu et al., arXiv 2502.00299)",
    claim="Keeping whole chunks of consecutive tokens by their summed scores keeps the next-token distribution "
          "closer to the full cache than keeping single tokens by the same scores, at the same budget, the prompt "
          "compressed and then decoded under eviction.",
    strategy="chunkkv", labels=("chunks", "tokens"),
    notes=("chunkkv sums TOVA's score (the latest query's attention) over chunks of 10 tokens, the paper's chunk "
           "size; the control is tova, the same score token by token, which isolates the chunking.",
           "The paper compresses LongBench and GSM8K prompts with SnapKV's observation window against token-level "
           "SnapKV; here one query, a 128-token prompt compressed to a fifth of the window, then decode-time "
           "eviction."),
))

register(Experiment(
    name="adakv",
    paper="Ada-KV (Feng et al., arXiv 2407.11550)",
    claim="Sharing a layer's budget among its heads by their attention mass (Ada-SnapKV) keeps the next-token "
          "distribution closer to the full cache than giving every head the same budget (SnapKV), at the same "
          "total budget.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=(*FIFTH, "--cache_strategy", "heavy_hitter"),
    arms=(Arm("adaptive heads", ("--budget_allocation", "adakv")),
          Arm("uniform heads", ("--budget_allocation", "uniform"))),
    comparisons=(Comparison("adaptive heads", "uniform heads"),),
    varies=frozenset({"budget_allocation"}),
    profiles=PROFILED_PROMPT, extra_metrics=FIDELITY_EXTRAS,
    notes=("The paper's setting is prompt compression on LongBench (Ada-SnapKV against SnapKV); here a 128-token "
           "prompt of pydoc text compressed to a fifth of the window by SnapKV's rule, each head then evicting "
           "within its own quota while 96 positions are decoded.",
           "Each head keeps at least --adakv_floor (default 0.2, the safeguard α of Ada-KV's code and kvpress) of a "
           "uniform head's budget."),
))

register(Experiment(
    name="expected_attention",
    paper="Expected Attention (kvpress, Devoto et al., arXiv 2510.00636)",
    claim="Scoring keys by the attention a Gaussian model of the coming queries is expected to give them keeps the "
          "next-token distribution closer to the full cache than the keys' norms (K-norm), both query-agnostic, at "
          "the same budget, the prompt compressed and then decoded under eviction.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=(*FIFTH, "--global_tokens", "4", "--recent_window", "10"),
    arms=(Arm("expected attention", ("--cache_strategy", "expected_attention")),
          Arm("k-norm", ("--cache_strategy", "l2"))),
    comparisons=(Comparison("expected attention", "k-norm"),),
    varies=frozenset({"cache_strategy"}),
    profiles=PROFILED_PROMPT, extra_metrics=FIDELITY_EXTRAS,
    notes=("The paper compresses prompts (RULER, LongBench) against other query-agnostic presses, K-norm among them; "
           "here a 128-token prompt compressed to a fifth of the window, then decode-time eviction by the same "
           "scores.",
           "The query statistics are of the last 64 post-RoPE prompt queries (strategies/expected_attention.py says "
           "how this differs from kvpress's pre-RoPE statistics)."),
))

register(against_tova(
    name="rkv",
    paper="R-KV (Cai et al., arXiv 2505.24133)",
    claim="Subtracting each token's redundancy (its key's mean cosine similarity to the other held keys) from its "
          "attention keeps the next-token distribution closer to the full cache than the attention alone, at the "
          "same budget, the prompt compressed and then decoded under eviction.",
    strategy="rkv", labels=("redundancy-aware", "attention only"),
    notes=("rkv's importance is TOVA's score (the latest query's attention), so the control is tova: the comparison "
           "isolates the redundancy term (λ 0.07, the default, the reference code's).",
           "The paper's claim is for reasoning models' long chains of thought, which repeat themselves (DeepSeek-R1 "
           "distillations on math); this is pydoc text on the bundled instruct model, and its redundancy term is "
           "the softmax share of the mean similarity without the reference code's zeroing of each key's newest "
           "near-copy (strategies/rkv.py says how it differs)."),
))

register(Experiment(
    name="lagkv",
    paper="LagKV (Liang et al., arXiv 2504.04704)",
    claim="Scoring each token by how its key and value stand out against the next partition's range, reading no "
          "attention, retrieves a needle more often than SnapKV's and StreamingLLM's selections, at the same "
          "budget, the context compressed before the question is seen.",
    task="niah_single", metric="string_match", higher_is_better=True,
    # The compactor experiment's setting: each context compressed once to half its length, the question appended
    # whole, nothing evicted while answering.
    common=HALF_BLIND,
    arms=(Arm("lagkv", ("--cache_strategy", "lagkv")),
          Arm("snapkv query-agnostic", ("--cache_strategy", "heavy_hitter")),
          Arm("streamingllm", ("--cache_strategy", "recent_global"))),
    comparisons=(Comparison("lagkv", "snapkv query-agnostic", "against SnapKV"),
                 Comparison("lagkv", "streamingllm", "against StreamingLLM")),
    varies=frozenset({"cache_strategy"}),
    profiles=NEEDLES,
    notes=("The paper's RULER comparison (SnapKV and StreamingLLM at several ratios) on niah_single, half of each "
           "~512-token context; partitions of 128 tokens (--lag_size, the default) and 4 sinks.",
           "SnapKV's window is the context's last 32 tokens (the question comes after compression), as in the "
           "compactor experiment, whose arm this one shares."),
))

# Long answers: a short prompt, then many more decoded positions than the budget holds, so what is kept is decided
# while decoding (MorphKV's and LaCache's setting), in 224-token windows as the prompt-profiled experiments.
LONG_DECODE = {"quick": ("--seq_len", "224", "--prefill_tokens", "32", "--limit", "8"),
               "full": ("--seq_len", "2048", "--prefill_tokens", "128", "--limit", "20")}

register(Experiment(
    name="morphkv",
    paper="MorphKV (Ghadia et al., ICML 2025, arXiv 2503.00979)",
    claim="Ranking the older tokens at every step by the attention of the recent window's queries keeps the "
          "next-token distribution over a long answer closer to the full cache than H2O's attention accumulated "
          "since insertion, at the same budget and with the same protected tokens.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=FIFTH,
    arms=(Arm("recent queries", ("--cache_strategy", "morphkv")),
          Arm("h2o", ("--cache_strategy", "heavy_hitter"))),
    comparisons=(Comparison("recent queries", "h2o"),),
    varies=frozenset({"cache_strategy"}),
    profiles=LONG_DECODE, extra_metrics=FIDELITY_EXTRAS,
    notes=("The paper measures long-response benchmarks (LongGenBench, LongWriter) on 7-8B models against SnapKV and "
           "H2O; here teacher-forced fidelity on pydoc text, 32 tokens prefilled and 192 decoded into a fifth of "
           "the window. Both arms keep 4 sinks and the default 10-token window, so MorphKV's observers are the "
           "window's 9 queries before the one entering (its preset's window of 33 would leave a 44-token budget "
           "almost nothing to rank); sum fusion, the authors' LongBench setting.",),
))

register(Experiment(
    name="lacache",
    paper="LaCache (Shi et al., ICML 2025, arXiv 2507.14204)",
    claim="Giving each layer a different rung of a ladder over the old tokens, laddered again as the cache fills, "
          "keeps the next-token distribution over a long decode closer to the full cache than the attention sinks "
          "and a window alone (StreamingLLM), at the same budget.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    common=(*FIFTH, "--global_tokens", "4"),
    arms=(Arm("ladder", ("--cache_strategy", "lacache")),
          Arm("streamingllm", ("--cache_strategy", "recent_global"))),
    comparisons=(Comparison("ladder", "streamingllm"),),
    varies=frozenset({"cache_strategy"}),
    profiles=LONG_DECODE, extra_metrics=FIDELITY_EXTRAS,
    notes=("The paper's perplexity over long streams and LongBench on 7-8B models; here teacher-forced fidelity on "
           "pydoc text, 32 tokens prefilled and 192 decoded into a fifth of the window (44 tokens), on the bundled "
           "model's 30 layers (the default span, 15: blocks of 2, one kept per layer).",
           "Both arms keep the first 4 tokens and the tokens' own positions (the authors run positions within the "
           "cache, --rerotate_positions here, to stream past the context, which these windows do not reach); "
           "lacache's unswept tail is the default 10-token recent window, recent_global's all it holds past the "
           "sinks."),
))

register(Experiment(
    name="d2o",
    paper="D2O, Dynamic Discriminative Operations (Wan et al., ICLR 2025, arXiv 2406.13035)",
    claim="Merging an evicted token's key and value into the kept token its key is nearest to, when the similarity "
          "reaches a moving threshold, keeps the next-token distribution closer to the full cache than dropping it, "
          "with the same eviction rule and budget.",
    task="fidelity", metric="kl_mean", higher_is_better=False,
    # The preset's split, H2O's: half the budget for the recent tokens, 4 sinks (the authors' hard-coded start).
    common=("--cache_strategy", "d2o", "--max_cache_length", "0.2", "--global_tokens", "4", "--recent_window", "0.5"),
    arms=(Arm("merging", ()),
          Arm("dropping", ("--d2o_no_merge",))),
    comparisons=(Comparison("merging", "dropping"),),
    varies=frozenset({"d2o_no_merge"}),
    profiles=SHORT_WINDOWS, extra_metrics=FIDELITY_EXTRAS,
    notes=("The paper compares D2O with eviction methods (H2O among them) on 7-8B models and long-context "
           "benchmarks; here teacher-forced fidelity on pydoc text: the 32-token prompt fills the fifth of the "
           "window, then one eviction, merged or dropped, per decoded token.",
           "Both arms evict by d2o's own rule (the attention received in all, per KV head), so the comparison "
           "isolates the merge; after a merge the attention, and so what is evicted next, differs. D2O's layer "
           "level (budgets by attention variance) is not built (strategies/d2o.py)."),
))
