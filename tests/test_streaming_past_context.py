"""benchmarks.streaming_past_context with any strategy: before anything is evicted a streaming run scores the
tokens exactly as full attention does (the same prefill, positions re-rotated within a cache that holds every token
at its own rank), and its paired comparison against the first run is the mean of the per-block differences."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import streaming_past_context as streaming
from checkpoint import load_checkpoint
from errors import run_cli
from eval.data import pydoc_corpus
from generate import decode_one_token

BUDGET = 24


@pytest.mark.parametrize("strategy", ["recent_global", "lacache", "d2o", "heavy_hitter"])
def test_until_the_cache_fills_a_stream_scores_as_full_attention(strategy, tiny_dir):
    model, tokenizer = load_checkpoint(str(tiny_dir), "cpu", torch.float32)
    ids = torch.tensor([tokenizer.encode(pydoc_corpus())[:64]])
    config = streaming.streaming_config(strategy, BUDGET, 4, 4)
    nll = streaming.streaming_nll(model, ids, config, BUDGET, decode_one_token, strategy)
    reference = streaming.reference_nll(model, ids)
    # Tokens 1..BUDGET come from the prefill's logits; token BUDGET + 1 from the first step, the cache holding all
    # BUDGET tokens and the new one's slot taken by an eviction only from then on.
    torch.testing.assert_close(nll[:BUDGET], reference[:BUDGET], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(nll[BUDGET + 8 :], reference[BUDGET + 8 :], atol=1e-3), "later tokens lose context"


def test_the_paired_comparison_is_the_mean_of_block_differences_within_and_past_the_context():
    context, block = 16, 4
    reference = torch.rand(40, generator=torch.Generator().manual_seed(0))
    shifted = reference.clone()
    shifted[context - 1 :] += 0.5  # past the context: every token's loss higher by 0.5
    out = streaming.paired_against(shifted, reference, context, block)
    assert out["within_context"]["delta_mean_nll"] == 0 and out["within_context"]["blocks"] == 3  # 15 tokens
    past = out["past_context"]
    assert math.isclose(past["delta_mean_nll"], 0.5, abs_tol=1e-6) and past["blocks"] == 6  # 25 tokens
    assert math.isclose(past["ci_low"], 0.5, abs_tol=1e-6) and math.isclose(past["ci_high"], 0.5, abs_tol=1e-6)


def test_a_run_past_the_context_compares_each_strategy_with_the_first(tiny_dir, tmp_path):
    out = tmp_path / "streaming.json"
    result = streaming.main(["--checkpoint_path", str(tiny_dir), "--tokens", "1200", "--budget", "32", "--strategies",
                             "recent_global", "lacache", "--global_tokens", "4", "--segment", "512", "--block", "64",
                             "--out", str(out)])
    names = list(result["runs"])
    assert names == ["recent_global, global_tokens=4", "lacache, global_tokens=4"] and out.exists()
    against = result["runs"][names[1]]["against_first"]
    assert set(against) == {"within_context", "past_context"}
    assert against["past_context"]["blocks"] == 2  # 176 tokens past the context


@pytest.mark.parametrize("strategy", ["full", "debug_l2"])
def test_a_cache_of_the_whole_sequence_is_refused_past_the_context_before_any_run(strategy, tiny_dir, tmp_path,
                                                                                   capsys):
    """The tiny checkpoint's context is 1024 tokens: a full cache of 1100 cannot be re-rotated. Refused with one
    line before the first strategy runs; within the context it runs."""
    out = tmp_path / "streaming.json"
    flags = ["--checkpoint_path", str(tiny_dir), "--budget", "32", "--global_tokens", "4", "--no_reference"]
    with pytest.raises(SystemExit) as exit_:
        run_cli(streaming.main, [*flags, "--tokens", "1100", "--strategies", "recent_global", strategy,
                                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "holds the whole sequence" in err[0] and not out.exists()
    result = streaming.main([*flags, "--tokens", "96", "--strategies", "recent_global", strategy])
    assert len(result["runs"]) == 2
