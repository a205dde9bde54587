"""The CPU model's weights in one buffer, in the order a decode step reads them, on 2 MB pages where the OS
gives them.

A CPU decode step streams every weight once, ~120 products of 0.2-3.5 MB each for the bundled model. Held as
separate allocations on 4 KB pages, those streams are scattered over 66 000 pages a step (269 MB); in one
buffer they follow each other, and on transparent huge pages (asked for with `madvise`, which is how most
Linux kernels hand them out) a 2 MB page holds ~3 of the bundled model's weights. Measured in one process
on the bundled model, bf16, 2 threads, 256 cached tokens, alternating blocks of compiled steps against the
same weights as separate tensors (docs/performance.md): 0.88-0.945 of the step time with the weights in
this buffer on huge pages, 0.94 in one buffer on 4 KB pages.

`WeightArena(layout)` allocates the buffer for named tensors (shape, dtype, strides) and `slot(name)` gives
each one's view: checkpoint.build_model copies every loaded tensor into its slot as it arrives, so the
model is never held twice; `pack_parameters(model)` moves an already built model's parameters into one.
The buffer is an anonymous memory map, kept alive by the tensors that view it.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page; the buffer starts on such a boundary
ALIGNMENT = 64  # bytes between slots: each weight starts on a cache line (and an AVX-512 vector)


@dataclass(frozen=True)
class Slot:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the span the strides reach (a dense tensor: its elements, whatever their order)."""
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True)) if all(self.shape) else 0
        return span * self.dtype.itemsize


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class WeightArena:
    """One buffer holding named tensors back to back, in the order given (see the module's docstring)."""

    def __init__(self, layout: Iterable[tuple[str, Slot]]) -> None:
        self.slots: dict[str, Slot] = dict(layout)
        offsets, end = {}, 0
        for name, slot in self.slots.items():
            offsets[name] = end
            end += -(-slot.nbytes // ALIGNMENT) * ALIGNMENT
        self.offsets = offsets
        self.nbytes = end
        raw, self.huge_pages = _allocate(end + HUGE_PAGE) if end else (torch.empty(0, dtype=torch.uint8), False)
        start = (-raw.data_ptr()) % HUGE_PAGE if end else 0
        self.buffer = raw[start : start + end]

    def slot(self, name: str) -> torch.Tensor:
        """The tensor stored at `name`'s slot (uninitialised until written)."""
        slot, offset = self.slots[name], self.offsets[name]
        flat = self.buffer[offset : offset + slot.nbytes].view(slot.dtype)
        return flat.as_strided(slot.shape, slot.stride)

    def place(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s values copied into `name`'s slot (converted to the slot's dtype); the slot's tensor."""
        target = self.slot(name)
        with torch.no_grad():
            target.copy_(tensor)
        return target

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory lies in this buffer."""
        start = self.buffer.data_ptr()
        return start <= tensor.data_ptr() < start + self.nbytes


def _allocate(nbytes: int) -> tuple[torch.Tensor, bool]:
    """(nbytes of fresh memory as a uint8 tensor, whether huge pages were asked for): an anonymous map where the
    OS has them (its views keep it alive), else torch's allocator."""
    anonymous = getattr(mmap, "MAP_ANONYMOUS", None)
    if anonymous is None:  # Windows
        return torch.empty(nbytes, dtype=torch.uint8), False
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | anonymous)
    huge = _ask_for_huge_pages(memory)
    return torch.frombuffer(memory, dtype=torch.uint8), huge


def _ask_for_huge_pages(buffer: mmap.mmap) -> bool:
    """madvise(MADV_HUGEPAGE) over the map, before any page is touched; False where the OS has no such advice
    or refuses it (transparent huge pages off): the buffer then stays on ordinary pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        buffer.madvise(advice)
    except OSError:
        return False
    return True


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (always, madvise: the arena gets them; never), or "absent"
    (not Linux, or no such setting): for reports, since the weights' pages change a CPU step's speed."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "absent"


def dense_slot(tensor: torch.Tensor) -> Slot:
    """`tensor`'s slot: its own strides when they are a permutation of a dense layout (checkpoint.build_model's
    input-major float32 projections), else contiguous."""
    shape = tuple(tensor.shape)
    stride = tuple(tensor.stride()) if is_dense(shape, tuple(tensor.stride())) else contiguous_strides(shape)
    return Slot(shape, stride, tensor.dtype)


def is_dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether the strides lay the elements out without gaps or overlaps in some order of the dimensions."""
    expected = 1
    for s, n in sorted((s, n) for n, s in zip(shape, stride, strict=True) if n != 1):
        if s != expected:
            return False
        expected *= n
    return True


def pack_parameters(model: nn.Module) -> WeightArena:
    """Move every parameter of `model` (a CPU model) into one arena, in registration order, which is the order
    a step uses them; tied parameters (one tensor, or views of one memory) keep one slot. Each parameter
    keeps its identity and values; its old memory is freed as it moves (not held twice). Parameters only: a
    buffer viewing a parameter's memory (the stacked projections of `Transformer.fuse_projections`, which
    the CPU does not use) would keep the old memory."""
    params = list(model.named_parameters())  # one entry per tensor: tied parameters appear once
    if any(p.device.type != "cpu" for _, p in params):
        raise ValueError("pack_parameters: the model's parameters must be on the CPU")

    def memory(p: torch.Tensor) -> tuple:
        return p.data_ptr(), tuple(p.shape), tuple(p.stride()), p.dtype

    names = {}
    for name, p in params:
        names.setdefault(memory(p), name)
    arena = WeightArena((name, dense_slot(p)) for name, p in params if names[memory(p)] == name)
    placed: dict[str, torch.Tensor] = {}
    for _, p in params:
        name = names[memory(p)]
        if name not in placed:
            placed[name] = arena.place(name, p.data)
        p.data = placed[name]
    return arena
