"""The CPU weights in one buffer (weight_arena.py): layout, values, ties, strides, and huge pages where the OS
gives them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from checkpoint import bundled_checkpoint_path, load_checkpoint
from checkpoint_gguf import read_gguf
from tests.conftest import make_tiny_model
from weight_arena import ALIGNMENT, HUGE_PAGE, Slot, WeightArena, dense_slot, pack_parameters, transparent_huge_pages


def distinct_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def assert_packed_in_order(model: torch.nn.Module, arena: WeightArena) -> None:
    """Every parameter inside the arena, in registration order, on its own cache-aligned span."""
    start, end = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.nbytes
    assert start % HUGE_PAGE == 0
    previous_end = start
    for p in distinct_parameters(model):
        span = Slot(tuple(p.shape), tuple(p.stride()), p.dtype).nbytes
        assert start <= p.data_ptr() and p.data_ptr() + span <= end
        assert p.data_ptr() % ALIGNMENT == 0
        assert p.data_ptr() >= previous_end, "overlapping or out of registration order"
        previous_end = p.data_ptr() + span


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def loaded(request):
    model, _ = load_checkpoint(None, "cpu", request.param)
    return model, request.param


def test_loaded_weights_are_the_checkpoint_tensors_in_one_buffer(loaded):
    """The bundled GGUF loaded on the CPU: every weight equals the reader's tensor in the model's dtype, and all
    live in one arena, in the order of the model's parameters (a step's order)."""
    model, dtype = loaded
    arena = model.weight_arena
    assert isinstance(arena, WeightArena)
    assert_packed_in_order(model, arena)
    params = dict(model.named_parameters())
    _, tensors, _, _ = read_gguf(bundled_checkpoint_path())
    compared = 0
    for name, tensor, _ in tensors:
        assert torch.equal(params[name], tensor.to(dtype)), name
        compared += 1
    assert compared == len(params)
    assert model.output.weight is model.tok_embeddings.weight  # the tied embedding: one slot


def test_float32_wide_projections_stay_input_major_in_the_arena(loaded):
    """Input-major where the CPU kernels cannot run (MKL's products then); row-major where they do."""
    import cpu_bf16_kernels

    model, dtype = loaded
    w1, w2 = model.layers[0].feed_forward.w1.weight, model.layers[0].feed_forward.w2.weight
    if dtype == torch.float32 and not cpu_bf16_kernels.float32_kernels_available():
        assert w1.stride() == (1, w1.shape[0]) and w2.stride() == (w2.shape[1], 1)
    else:
        assert w1.is_contiguous() and w2.is_contiguous()
    assert model.weight_arena.contains(w1) and model.weight_arena.contains(w2)


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(sys.platform != "linux" or transparent_huge_pages() not in ("always", "madvise"),
                    reason="needs Linux with transparent huge pages (always or madvise)")
def test_loaded_weights_sit_on_huge_pages(loaded):
    """Where the kernel hands out transparent huge pages on request, the arena asked for them before its first
    write, and its mapping holds some (the kernel may fall back to 4 KB pages when memory is fragmented)."""
    model, _ = loaded
    arena = model.weight_arena
    assert arena.huge_pages
    assert anon_huge_kb(arena.buffer.data_ptr()) >= HUGE_PAGE // 1024


def test_pack_parameters_keeps_identity_values_ties_and_outputs():
    model = make_tiny_model(tie_embeddings=True)
    vocab = model.args.vocab_size
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    identities = {name: id(p) for name, p in model.named_parameters()}
    idx = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = model(idx, torch.arange(7))
    arena = pack_parameters(model)
    assert_packed_in_order(model, arena)
    for name, p in model.named_parameters():
        assert id(p) == identities[name] and torch.equal(p, before[name]), name
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert torch.equal(model(idx, torch.arange(7)), logits)


def test_pack_parameters_gives_tensors_sharing_memory_one_slot():
    """Two parameters viewing one memory (ties made by assigning .data) stay tied: one slot, one copy."""
    a = torch.nn.Linear(8, 16, bias=False)
    b = torch.nn.Linear(8, 16, bias=False)
    b.weight.data = a.weight.data
    model = torch.nn.Sequential(a, b)
    arena = pack_parameters(model)
    assert a.weight.data_ptr() == b.weight.data_ptr()
    assert len(arena.slots) == 1


def test_pack_parameters_refuses_a_model_off_the_cpu():
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="on the CPU"):
        pack_parameters(model)


@pytest.mark.parametrize("make, stride", [
    (lambda: torch.randn(6, 10), (10, 1)),
    (lambda: torch.randn(10, 6).t(), (1, 6)),  # input-major: its strides kept
    (lambda: torch.randn(6, 20)[:, ::2], (10, 1)),  # gaps: stored contiguous
    (lambda: torch.randn(4, 5).expand(3, 4, 5), (20, 5, 1)),  # overlaps: stored contiguous
    (lambda: torch.randn(3, 4, 5).permute(2, 0, 1), (1, 20, 5)),
    (lambda: torch.randn(0, 4), (4, 1)),
], ids=["contiguous", "transposed", "strided", "expanded", "permuted", "empty"])
def test_a_slot_holds_the_tensor_with_its_dense_layout(make, stride):
    tensor = make()
    arena = WeightArena([("a", Slot((3,), (1,), torch.bfloat16)), ("t", dense_slot(tensor))])
    placed = arena.place("t", tensor)
    assert torch.equal(placed, tensor) and placed.stride() == stride
    if tensor.numel():  # an empty tensor points nowhere
        assert arena.contains(placed) and placed.data_ptr() % ALIGNMENT == 0


def test_an_empty_arena():
    arena = WeightArena([])
    assert arena.nbytes == 0 and arena.slots == {}


def test_moving_the_weights_out_drops_the_arena():
    """`.to()` and its kin give the parameters new memory; the model lets go of the arena then, so the old
    buffer is freed with its last view rather than held beside the moved weights."""
    model = make_tiny_model()
    model.weight_arena = arena = pack_parameters(model)
    model.to(torch.float64)
    assert model.weight_arena is None
    assert not any(arena.contains(p) for p in model.parameters())
