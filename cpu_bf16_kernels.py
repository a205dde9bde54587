"""The CPU decode step's bfloat16 kernels: linear layers and attention that stream their operands.

A decode step multiplies every weight by one vector per sequence and attends a few query rows over the
cache, so its speed is the rate at which weights and K/V are read. On an AVX2 CPU without bfloat16
instructions (this project's machine) torch's bf16 products of this shape are slow: a weight times one
vector (oneDNN eagerly, inductor's matmul or its own reduction when compiled) reads cold weights ~1.3x
slower than a plain read, and the attention's two bf16 batched matmuls cost ~0.1-0.25 ms each at 288
slots where the data take microseconds (4 ms and 9 ms at 8128 slots). `cpu_bf16_kernels.c` widens bf16 to
float32 in registers (a shift: bf16 is the top half of a float32), accumulates in float32 and rounds the
result to bf16 as torch does (docs/performance.md has the measured rates).

- `linear(x, weight, bias)`, every linear layer of the model: the kernel for bf16 on the CPU with at most
  MAX_ROWS rows (a decode step of up to that many sequences; a prompt is a matrix product, where oneDNN is
  fast), else `F.linear`. Same values as torch's bf16 linear up to summation order.
- `decode_attention(q, k, v, mask)`, model.grouped_attention on the CPU in bf16 for at most
  MAX_QUERY_ROWS query rows per KV head: one pass over each head's K and V, scores and probabilities in
  float32 (torch's path rounds the scores and the probabilities to bf16 before each product, so this is
  the more exact of the two).

Both are torch ops (`torch.ops.kv_eviction.*`), so a compiled step calls each as one opaque kernel, and both run
only without autograd. The library is built on first use with the C compiler (the one inductor needs on
the CPU too) into the user's cache directory, linked to the OpenMP runtime torch loaded, so it shares
torch's threads (`torch.set_num_threads`). Without AVX2 and FMA or a compiler, or with KV_CPU_KERNELS=0 in
the environment, each op runs torch's own code instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

SOURCE = Path(__file__).with_name("cpu_bf16_kernels.c")
MAX_ROWS = 8  # more rows than this: the matrix product reuses each weight enough for oneDNN's kernels
MAX_QUERY_ROWS = 64  # query rows per KV head (rep x T): a decode step, not a prompt chunk
ENV_SWITCH = "KV_CPU_KERNELS"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def cpu_supports_kernel() -> bool:
    """AVX2 and FMA, read from /proc/cpuinfo (Linux x86; elsewhere: no)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx2" in flags and "fma" in flags


def _torch_openmp_link_flags() -> list[str]:
    """Link against the OpenMP runtime in torch's own lib directory, so the kernel's threads are torch's
    (two runtimes in one process would each keep a pool spinning on the same cores)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libgomp*.so*"))
    if not found:
        return []
    return [f"-L{lib_dir}", f"-l:{found[0].name}", f"-Wl,-rpath,{lib_dir}"]


def cache_directory() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "kv-eviction-bench"


def _build() -> Path | None:
    """The shared library for this source, compiler flags and torch, built once per cache directory (a
    temporary file renamed into place, so concurrent processes never load a half-written library)."""
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        return None
    flags = CFLAGS + _torch_openmp_link_flags()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    try:
        target = cache_directory() / f"cpu_bf16_kernels-{key}.so"  # Path.home() raises without a home
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], check=True, capture_output=True)
            os.replace(built, target)
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        return None
    return target


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The loaded kernel, or None where it cannot run here (see the module's docstring)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_supports_kernel():
        return None
    path = _build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    lib.bf16_matvec.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    lib.bf16_matvec.restype = ctypes.c_int
    lib.bf16_decode_attention.argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_long] * 5 + [ctypes.c_float]
    lib.bf16_decode_attention.restype = ctypes.c_int
    return lib


def kernel_status() -> str:
    """For reports: whether the CPU's bf16 decode step runs these kernels."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"off ({ENV_SWITCH}=0)"
    return "on" if kernel() is not None else "unavailable (needs AVX2, FMA and a C compiler)"


# Ops through torch.library's low-level API: a call costs ~5 us, against ~17 us for torch.library.custom_op,
# and a decode step of the bundled model makes ~210 of them. CPU kernels only: every other device and
# dtype takes torch's path before reaching them (linear, decode_attention).
_LIBRARY = torch.library.Library("kv_eviction", "DEF")
_LIBRARY.define("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("bf16_decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> (Tensor, Tensor)")


def _bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., K] @ weight[N, K].T + bias, all bfloat16 on the CPU, weight contiguous."""
    lib = kernel()
    N, K = weight.shape
    if lib is None or K % 8 or bias is not None and not bias.is_contiguous():
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, K).contiguous()
    y = torch.empty(rows.shape[0], N, dtype=torch.bfloat16)
    status = lib.bf16_matvec(rows.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                             y.data_ptr(), rows.shape[0], N, K)
    if status != 0:
        raise MemoryError("bf16_matvec: out of memory for the float32 copy of the input")
    return y.view(*x.shape[:-1], N)


def torch_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """torch's grouped attention, every path the kernel does not take: q [B, n_kv, R, D] over k, v
    [B, n_kv, L, D], mask broadcastable to [B, n_kv, R, L] -> (out [B, n_kv, R, D] in v's dtype,
    probabilities [B, n_kv, R, L] in float32)."""
    scores = (q @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return probs.to(v.dtype) @ v, probs


def _bf16_decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """torch_attention's contract, bfloat16 q, k, v on the CPU, computed by the kernel."""
    lib = kernel()
    B, H, R, D = q.shape
    L = k.shape[2]
    if lib is None:
        return torch_attention(q, k, v, mask)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = torch.broadcast_to(mask, (B, H, R, L))
    out = torch.empty(B, H, R, D, dtype=torch.bfloat16)
    probs = torch.empty(B, H, R, L, dtype=torch.float32)
    strides = [(ctypes.c_long * 4)(*t.stride()) for t in (q, k, v, mask)]
    status = lib.bf16_decode_attention(q.data_ptr(), strides[0], k.data_ptr(), strides[1], v.data_ptr(), strides[2],
                                       mask.data_ptr(), strides[3], out.data_ptr(), probs.data_ptr(),
                                       B, H, R, L, D, 1.0 / math.sqrt(D))
    if status != 0:
        raise MemoryError("bf16_decode_attention: out of memory for the float32 query rows")
    return out, probs


_LIBRARY.impl("bf16_linear", _bf16_linear, "CPU")
_LIBRARY.impl("bf16_decode_attention", _bf16_decode_attention, "CPU")


@torch.library.register_fake("kv_eviction::bf16_linear")
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("kv_eviction::bf16_decode_attention")
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    B, H, R, D = q.shape
    return q.new_empty(B, H, R, D), q.new_empty(B, H, R, k.shape[2], dtype=torch.float32)


def _takes_kernel(*tensors: Tensor) -> bool:
    # The dtype first: float32 and GPU forwards, which never take the kernels, leave after one comparison.
    return (tensors[0].dtype == torch.bfloat16 and all(t.device.type == "cpu" and t.dtype == torch.bfloat16
                                                       for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through the kernel where it is the faster way (see the module's docstring)."""
    if _takes_kernel(x, weight) and weight.is_contiguous() and x.numel() <= MAX_ROWS * x.shape[-1]:
        return torch.ops.kv_eviction.bf16_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """torch_attention, through the kernel where it is the faster way (see the module's docstring)."""
    if (_takes_kernel(q, k, v) and mask.dtype == torch.bool and q.shape[2] <= MAX_QUERY_ROWS
            and k.shape == v.shape and k.shape[:2] == q.shape[:2] and q.shape[3] % 8 == 0 and q.shape[3] <= 256):
        return torch.ops.kv_eviction.bf16_decode_attention(q, k, v, mask)
    return torch_attention(q, k, v, mask)
