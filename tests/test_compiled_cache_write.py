"""A compiled decode step writes the new token's K/V, and its slot's bookkeeping, into the cache in place.

Inductor functionalizes in-place updates of graph inputs; a `scatter_` along the slot dimension came out as
a fresh buffer of the whole cache (the old contents plus the new row) that attention read and that was
copied back after the step: two passes over every layer's K/V per token. The write is an `index_put_` when
compiled (kv_storage.scatter_rows), which inductor performs in place. Checked on inductor's generated code
for dense storage: no buffer of the K/V buffers' shape is allocated by the step (the quantized storages
dequantize every slot each step, a buffer of that shape by design), nor one of the shape and dtype of the
per-slot state a step writes at the new token's slot only (positions, mask, a strategy's scores:
kv_storage.scatter_slots). For every registered strategy, its twin and its adakv form, a step traced as
compiled (is_compiling true, but eager, so the whole registry costs no compile) writes none of its cache's
per-slot state with a scatter_, the write inductor copies. The cache after the compiled step equals the
eager one within 1e-5 (float32; compiled sums round in another order); the compiled matrices in
test_strategies check the decisions.
"""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.overrides import TorchFunctionMode

from generate import compile_decode_step, decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.strategy_matrix import ADAKV, ALL, ALLOCATIONS, PROMPT, attach, cache_args, inner, token_ids


def cache_buffer_shapes(model) -> set[tuple[int, ...]]:
    storage = model.caches()[0].storage
    return {tuple(b.shape) for b in storage.buffers() if b.dim() == 4 and b.shape[2] > 1}


def allocations(code: str, with_dtype: bool = False) -> set[tuple]:
    """The shapes (and dtypes: `torch.bool`) of the buffers inductor's output code allocates."""
    found = set()
    for line in code.splitlines():
        if "empty_strided_cpu((" in line:
            after = line.split("empty_strided_cpu((", 1)[1]
            shape = tuple(int(x) for x in after.split(")", 1)[0].split(",") if x.strip())
            found.add((shape, after.rsplit(", ", 1)[1].split(")", 1)[0]) if with_dtype else shape)
    return found


def slot_state(cache) -> dict[tuple, str]:
    """(shape, dtype) -> name of the cache's own buffers (not its storage's) that have a slot dimension."""
    c = inner(cache)
    slots = {c.max_cache_length, c.max_cache_length + 1}  # hybrid keeps a scratch slot past the last
    return {(tuple(b.shape), str(b.dtype)): name for name, b in c.named_buffers()
            if not name.startswith("storage.") and slots & set(b.shape[1:])}


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
    state = slot_state(model.caches()[0])
    assert {"mask", "pos"} <= set(state.values())
    copied = {state[a] for code in codes for a in allocations(code, with_dtype=True) if a in state}
    assert not copied, f"the compiled step copies per-slot state {copied}"
    for ours, theirs in zip(model.buffers(), eager_model.buffers(), strict=True):
        if ours.is_floating_point():
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(ours, theirs)


class ScatterWrites(TorchFunctionMode):
    """Records the tensors that `Tensor.scatter_` writes into."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.scatter_:
            self.targets.append(args[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("strategy", "allocation"), [(s, "uniform") for s in ALL] + [(s, "adakv") for s in ADAKV])
def test_a_compiled_step_scatters_into_no_slot_state(strategy, allocation, monkeypatch):
    model = make_tiny_model()
    attach(model, cache_args(strategy, "0.5", "dense", *ALLOCATIONS[allocation]))
    ids = token_ids()
    with torch.inference_mode():
        prefill(model, ids[:, :PROMPT])
        writes = ScatterWrites()
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        # A compiled CPU step's branches (lagkv's torch.cond), taken eagerly: an eager torch.cond would trace its
        # branches with dynamo while is_compiling is patched, and dynamo keeps the patched function as the one it
        # folds to True, so every later compile in this process would fail on the real one.
        monkeypatch.setattr(torch, "cond", lambda pred, true_fn, false_fn, operands:
                            true_fn(*operands) if bool(pred) else false_fn(*operands))
        with writes:
            for p in range(PROMPT, PROMPT + 4):  # past the budget's 20 slots: the steps evict
                decode_one_token(model, ids[:, p : p + 1], torch.tensor([p]))
    caches = [c for cache in model.caches() for c in (cache, inner(cache))]
    state = {id(b): name for c in caches for name, b in c.named_buffers() if not name.startswith("storage.")
             and c.max_cache_length in b.shape[1:]}
    scattered = {state[id(t)] for t in writes.targets if id(t) in state}
    assert not scattered, f"per-slot state written by scatter_ in a compiled step: {scattered}"


@pytest.mark.parametrize(("shape", "dim", "src"), [((2, 3, 1, 10), 3, True), ((2, 1, 10), 2, "tensor"),
                                                   ((2, 3, 10, 4), 3, 0.5), ((2, 3, 10), 2, float("inf"))])
def test_scatter_slots_compiled_equals_torch_scatter(shape, dim, src):
    """kv_storage.scatter_slots traced (an index_put_) writes what torch's scatter_ writes: distinct slots per
    row, a tensor or a scalar source, the slot dimension last or not, index sizes below the buffer's."""
    from kv_storage import scatter_slots

    g = torch.Generator().manual_seed(0)
    dtype = torch.bool if src is True else torch.float32
    buf = torch.rand(shape, generator=g).gt(0.5) if dtype == torch.bool else torch.randn(shape, generator=g)
    index_shape = list(shape)
    index_shape[dim] = 2
    if dim == 3 and len(shape) == 4 and shape[2] > 1:
        index_shape[2] = shape[2] - 1  # a smaller index than the buffer in another dimension
    index = torch.rand(*shape[:dim], shape[dim], *shape[dim + 1:], generator=g).argsort(dim=dim)
    index = index.narrow(dim, 0, 2)[tuple(slice(0, n) for n in index_shape)]
    value = torch.randn(index.shape, generator=g) if src == "tensor" else src
    expected = buf.clone().scatter_(dim, index, value)
    compiled = torch.compile(lambda b, i, v: scatter_slots(b, dim, i, v), fullgraph=True)
    ours = buf.clone()
    compiled(ours, index, value)
    assert torch.equal(ours, expected)
