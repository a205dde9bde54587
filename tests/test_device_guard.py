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

from cache_setup import attach_row_caches
from gates import attach_random_gates
from generate import decode_one_token, prefill, prefill_rows
from model import Transformer
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    ADAKV,
    ADAKV_STORAGES,
    ALL,
    ALLOCATIONS,
    NEW,
    PROMPT,
    STORAGES,
    TOKEN_CLASSES,
    TRAIT_REPRESENTATIVES,
    attach,
    cache_args,
    token_ids,
)

# Every strategy on every storage with uniform budgets; the pooled caches of --budget_allocation adakv on theirs.
CASES = [(s, st, "uniform") for s in ALL for st in sorted(STORAGES)] + \
        [(s, st, "adakv") for s in ADAKV for st in ADAKV_STORAGES]
# In bfloat16 as well: every strategy and twin on dense storage, and every storage (its codes and scales) for
# one strategy per set of traits and its twin.
BF16_STRATEGIES = set(TRAIT_REPRESENTATIVES) | {f"debug_{s}" for s in TRAIT_REPRESENTATIVES}
DTYPE_CASES = [(*case, torch.float32) for case in CASES] + \
              [(*case, torch.bfloat16) for case in CASES if case[1] == "dense" or case[0] in BF16_STRATEGIES]


@pytest.mark.parametrize(("strategy", "storage", "allocation", "dtype"), DTYPE_CASES)
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


# Every strategy on dense storage; KIVI's per-row residual on a few; the pooled caches.
ROW_CASES = [(s, "dense", "uniform") for s in ALL] + \
            [(s, "kivi4", "uniform") for s in ("l2", "hybrid", "debug_heavy_hitter")] + \
            [(s, "dense", "adakv") for s in ADAKV]


@pytest.mark.parametrize(("strategy", "storage", "allocation"), ROW_CASES)
def test_rows_of_their_own_lengths_stay_on_the_model_device(strategy, storage, allocation):
    """Batched rows (cache_setup.setup_row_caches): per-row budgets, prompts prefilled in their row contexts,
    a decode step at one position per row."""
    model = make_tiny_model().to(device="meta")
    model.init_rope_tables()
    attach_random_gates(model, seed=0)
    model.to(device="meta")
    lengths = [PROMPT, PROMPT - 5, PROMPT - 11]
    attach_row_caches(model, cache_args(strategy, "0.5", storage, *ALLOCATIONS[allocation]), lengths, NEW,
                      classes=TOKEN_CLASSES)
    ids = token_ids().to("meta")
    with torch.inference_mode():
        prefill_rows(model, [ids[0, :n] for n in lengths])
        positions = torch.tensor(lengths, device="meta")
        for i in range(3):
            logits = decode_one_token(model, ids[:, i : i + 1].expand(3, 1), positions + i)
    assert logits.device.type == "meta" and logits.shape == (3, model.args.vocab_size)
    for cache in model.caches():
        on_cpu = [name for name, buf in cache.named_buffers() if buf.device.type != "meta"]
        assert not on_cpu, f"{strategy}: buffers left on the host: {on_cpu}"


@pytest.mark.parametrize("overrides", [{}, {"partial_rotary_factor": 0.5}, {"local_rope_base": 10.0}])
def test_a_model_built_on_the_meta_device_has_rope_tables_of_the_real_shapes(overrides):
    """Built on `meta` (as the loaders build it) the model's RoPE tables are shapes only, not computed there
    (a meta tensor's arithmetic imports torch._dynamo): every table has the shape a real model's has."""
    real = make_tiny_model(**overrides)
    with torch.device("meta"):
        meta = Transformer(real.args)
    names = ["rope_cos", "rope_sin"] + (["rope_local_cos", "rope_local_sin"] if real.args.local_rope_base else [])
    for name in names:
        table, expected = getattr(meta, name), getattr(real, name)
        assert table.is_meta and table.shape == expected.shape and table.dtype == expected.dtype, name
        assert expected.numel() > 0, name
