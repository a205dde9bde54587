"""A compiled decode step writes the new token's K/V into the cache buffers in place.

Inductor functionalizes in-place updates of graph inputs; a `scatter_` along the slot dimension came out as
a fresh buffer of the whole cache (the old contents plus the new row) that attention read and that was
copied back after the step: two passes over every layer's K/V per token. The write is an `index_put_` when
compiled (kv_storage._scatter_rows), which inductor performs in place. Checked on inductor's generated code
for dense storage: no buffer of the K/V buffers' shape is allocated by the step (the quantized storages
dequantize every slot each step, a buffer of that shape by design). The cache after the compiled step equals
the eager one within 1e-5 (float32; compiled sums round in another order); the compiled matrices in
test_strategies check the decisions.
"""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from generate import compile_decode_step, decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.strategy_matrix import PROMPT, attach, cache_args, token_ids


def cache_buffer_shapes(model) -> set[tuple[int, ...]]:
    storage = model.caches()[0].storage
    return {tuple(b.shape) for b in storage.buffers() if b.dim() == 4 and b.shape[2] > 1}


def allocations(code: str) -> set[tuple[int, ...]]:
    shapes = set()
    for line in code.splitlines():
        if "empty_strided_cpu((" in line:
            inner = line.split("empty_strided_cpu((", 1)[1].split(")", 1)[0]
            shapes.add(tuple(int(x) for x in inner.split(",") if x.strip()))
    return shapes


@pytest.mark.parametrize("strategy", ["full", "heavy_hitter", "hybrid", "l2"])
def test_the_compiled_step_allocates_no_copy_of_the_cache(strategy):
    storage = "dense"
    model = make_tiny_model()
    attach(model, cache_args(strategy, "16" if strategy != "full" else "64", storage))
    ids = token_ids()
    step = compile_decode_step()
    with torch.inference_mode():
        prefill(model, ids[:, :PROMPT])
        eager_model = make_tiny_model()
        attach(eager_model, cache_args(strategy, "16" if strategy != "full" else "64", storage))
        prefill(eager_model, ids[:, :PROMPT])
        token, pos = ids[:, PROMPT : PROMPT + 1], torch.tensor([PROMPT])
        _, codes = run_and_get_code(step.compiled_step, model, token, pos)
        decode_one_token(eager_model, token, pos)
    shapes = cache_buffer_shapes(model)
    assert shapes and codes
    copied = [s for code in codes for s in allocations(code) if s in shapes]
    assert not copied, f"the compiled step allocates cache-sized buffers {copied}"
    for ours, theirs in zip(model.buffers(), eager_model.buffers(), strict=True):
        if ours.is_floating_point():
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(ours, theirs)
