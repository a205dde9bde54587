"""A CPU-only guard against device bugs: every strategy of the matrix (and its debug_ twin) on every
storage (and every pooled cache of `--budget_allocation adakv`) is built, prefilled and decoded with the model
and its caches on the `meta` device.

Meta tensors carry shapes and dtypes but no data, and PyTorch refuses to mix them with CPU tensors in
an operation, exactly as it refuses to mix CUDA and CPU tensors. So a buffer registered without
`device=`, or a temporary created on the default (CPU) device inside a cache, fails here on a machine
without a GPU, where it would otherwise fail only on a GPU ("expected self and mask to be on the same
device"). Statistics (which read values back to the host) are not exercised: they have no data here.
"""

from __future__ import annotations

import pytest
import torch

from generate import decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    ADAKV,
    ADAKV_STORAGES,
    ALL,
    ALLOCATIONS,
    PROMPT,
    STORAGES,
    attach,
    cache_args,
    token_ids,
)

# Every strategy on every storage with uniform budgets; the pooled caches of --budget_allocation adakv on theirs.
CASES = [(s, st, "uniform") for s in ALL for st in sorted(STORAGES)] + \
        [(s, st, "adakv") for s in ADAKV for st in ADAKV_STORAGES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("strategy", "storage", "allocation"), CASES)
def test_prefill_and_decode_keep_every_tensor_on_the_model_device(strategy, storage, allocation, dtype):
    model = make_tiny_model().to(device="meta", dtype=dtype)
    model.init_rope_tables()
    caches = attach(model, cache_args(strategy, "0.5", storage, *ALLOCATIONS[allocation]), device="meta", dtype=dtype)
    ids = token_ids().to("meta")
    with torch.inference_mode():
        prefill(model, ids[:, :PROMPT])
        for p in range(PROMPT, PROMPT + 3):
            logits = decode_one_token(model, ids[:, p : p + 1], torch.tensor([p], device="meta"))
    assert logits.device.type == "meta" and logits.shape == (1, model.args.vocab_size)
    for cache in caches:
        on_cpu = [name for name, buf in cache.named_buffers() if buf.device.type != "meta"]
        assert not on_cpu, f"{strategy}: buffers left on the host: {on_cpu}"
