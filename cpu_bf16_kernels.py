"""The CPU decode step's kernels: bfloat16 linear layers and attention, and float32 linear layers, that
stream their operands.

A decode step multiplies every weight by one vector per sequence and attends a few query rows over the
cache, so its speed is the rate at which weights and K/V are read. torch's bf16 products of this shape are
slow on the CPU: a weight times one vector (oneDNN eagerly, inductor's matmul or its own reduction when
compiled) read cold weights ~1.3x slower than a plain read on an AVX2 machine and ~2x slower on an
AVX-512 one, and the attention's two bf16 batched matmuls cost ~0.1-0.25 ms each at 288 slots where the
data take microseconds (4 ms and 9 ms at 8128 slots). `cpu_bf16_kernels.c` streams each weight once:
with AVX-512 BF16 (VDPBF16PS: 32 bf16 products a line) where the CPU has it, else by widening bf16 to
float32 in registers (a shift: bf16 is the top half of a float32); either way it accumulates in float32
and rounds the result to bf16 as torch does (docs/performance.md has the measured rates).

- `linears(x, weights, biases)`, the projections of one input (q, k, v; gate, up) stacked into one call,
  and `linear(x, weight, bias)`, every other linear layer: the kernel for bf16 on the CPU with at most
  MAX_ROWS rows (a decode step of up to that many sequences; a prompt is a matrix product, where oneDNN is
  fast), else `F.linear`, a batch's prompts one sequence per call (`batch_invariant`). Same values as torch's
  bf16 linear up to summation order. float32 row-major weights take the same streaming in float32
  (`f32_linears`): MKL's float32 product of 2-8 rows read the weights at about a third of its one-row rate
  here, and this kernel reads them at the one-row rate or better (docs/performance.md).
- `decode_attention(q, k, v, mask)`, attention.grouped_attention on the CPU in bf16 for at most
  MAX_QUERY_ROWS query rows per KV head: one pass over each head's K and V, scores and probabilities in
  float32 (torch's path rounds the scores and the probabilities to bf16 before each product, so this is
  the more exact of the two).
- `per_token_decode_attention` and `kivi_decode_attention`, a decode step's attention read straight from
  quantized storage's codes (kv_storage's per-token and KIVI storages, float32 or bf16; the C kernels in
  `cpu_quantized_attention.c`): each slot widened in registers instead of a full-size K and V rebuilt every
  step, which had made quantized storage decode slower than dense.

Both are torch ops (`torch.ops.kv_eviction.*`, schemas here, CPU implementations in C++ in
`cpu_bf16_ops.cpp`, so a call costs the dispatcher's few microseconds), which a compiled step calls as
opaque kernels; both run only without autograd. The library is built on first use with the C and C++
compilers (the ones inductor needs on the CPU too; ~10 s once) into the user's cache directory, linked to
torch and to the OpenMP runtime torch loaded, so it shares torch's threads (`torch.set_num_threads`).
Without AVX2 and FMA or the compilers, or with KV_CPU_KERNELS=0 in the environment, every call takes
torch's own code instead.
"""

from __future__ import annotations

import ctypes
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

C_SOURCE = Path(__file__).with_name("cpu_bf16_kernels.c")
# Every C file compiled into the library, and the header they share (hashed with them).
C_SOURCES = (C_SOURCE, Path(__file__).with_name("cpu_quantized_attention.c"))
C_HEADER = Path(__file__).with_name("cpu_kernels_common.h")
CXX_SOURCE = Path(__file__).with_name("cpu_bf16_ops.cpp")
MAX_ROWS = 8  # more rows than this: the matrix product reuses each weight enough for oneDNN's kernels
MAX_QUERY_ROWS = 64  # query rows per KV head (rep x T): a decode step, not a prompt chunk
ENV_SWITCH = "KV_CPU_KERNELS"
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC"]
CXXFLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared", "-w"]


def cpu_supports_kernel() -> bool:
    """AVX2 and FMA, read from /proc/cpuinfo (Linux x86; elsewhere: no)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx2" in flags and "fma" in flags


def _torch_link_flags() -> list[str]:
    """torch's headers and libraries, and the OpenMP runtime in torch's own lib directory, so the kernel's
    threads are torch's (two runtimes in one process would each keep a pool spinning on the same cores)."""
    root = Path(torch.__file__).parent
    lib_dir = root / "lib"
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    flags = [f"-I{root / 'include'}", abi, f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]
    found = sorted(lib_dir.glob("libgomp*.so*"))
    return flags + ([f"-l:{found[0].name}"] if found else [])


def cache_directory() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "kv-eviction-bench"


def _compilers() -> tuple[str, str] | None:
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    return (cc, cxx) if cc and cxx else None


def _build() -> Path | None:
    """The shared library for these sources, compilers, flags and torch, built once per cache directory (the
    C kernels, then the C++ ops linked to them and to torch; a temporary file renamed into place, so
    concurrent processes never load a half-written library). ~10 s the first time."""
    compilers = _compilers()
    if compilers is None:
        return None
    cc, cxx = compilers
    link = _torch_link_flags()
    recipe = " ".join([cc, *CFLAGS, cxx, *CXXFLAGS, *link, torch.__version__]).encode()
    sources = b"".join(path.read_bytes() for path in (*C_SOURCES, C_HEADER, CXX_SOURCE))
    key = hashlib.sha256(sources + recipe).hexdigest()[:16]
    try:
        target = cache_directory() / f"cpu_bf16_kernels-{key}.so"  # Path.home() raises without a home
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            objects, built = [str(Path(tmp) / f"{c.stem}.o") for c in C_SOURCES], Path(tmp) / target.name
            for source, obj in zip(C_SOURCES, objects, strict=True):
                subprocess.run([cc, *CFLAGS, "-c", str(source), "-o", obj], check=True, capture_output=True)
            subprocess.run([cxx, *CXXFLAGS, str(CXX_SOURCE), *objects, "-o", str(built), *link], check=True,
                           capture_output=True)
            os.replace(built, target)
    except (OSError, RuntimeError, subprocess.CalledProcessError):
        return None
    return target


# The ops' schemas; their CPU implementations are registered by cpu_bf16_ops.cpp when the library loads.
# Every other device and dtype takes torch's path before reaching them (linears, decode_attention).
_LIBRARY = torch.library.Library("kv_eviction", "DEF")
_LIBRARY.define("bf16_linears(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIBRARY.define("f32_linears(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor")
_LIBRARY.define("bf16_decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> (Tensor, Tensor)")
_LIBRARY.define("per_token_decode_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor k_zero, Tensor v_codes, "
                "Tensor v_scale, Tensor v_zero, Tensor mask, int bits) -> (Tensor, Tensor)")
_LIBRARY.define("kivi_decode_attention(Tensor q, Tensor k_codes, Tensor k_group, Tensor k_scale, Tensor k_zero, "
                "Tensor v_codes, Tensor v_scale, Tensor v_zero, Tensor k_res, Tensor v_res, Tensor slot_res, "
                "Tensor mask, int bits) -> (Tensor, Tensor)")

_library: ctypes.CDLL | None = None
# None until the first load attempt, then whether the ops have their kernels. Read by linears and
# decode_attention, also inside a compiled trace (a plain global: dynamo guards on its value, so a graph
# traced before the library loaded is traced again after).
_ops_ready: bool | None = None


def kernel() -> ctypes.CDLL | None:
    """The loaded library (its ops registered), or None where it cannot run here (see the module's
    docstring); built and loaded on the first call."""
    global _library, _ops_ready
    if _ops_ready is None:
        path = None if os.environ.get(ENV_SWITCH, "1") == "0" or not cpu_supports_kernel() else _build()
        if path is not None:
            try:
                torch.ops.load_library(str(path))
                _library = ctypes.CDLL(str(path))  # the same loaded library: its instruction-set switch
                _library.bf16_kernels_isa.argtypes = [ctypes.c_int]
                _library.bf16_kernels_isa.restype = ctypes.c_int
            except (OSError, RuntimeError):
                _library = None
        _ops_ready = _library is not None
    return _library


def _kernels_on() -> bool:
    # The first eager call loads the library; a trace never builds it (it keeps torch's path until then).
    if _ops_ready is None and not torch.compiler.is_compiling():
        kernel()
    return bool(_ops_ready)


def load_before_tracing(weight: Tensor) -> None:
    """Load the library now if a model with this weight (bf16 on the CPU) would use it: a compiled decode step
    calls this before its first trace, which would otherwise keep torch's path and be traced again once an
    eager call had loaded the kernels."""
    if _ops_ready is None and weight.dtype in LINEAR_OPS and weight.device.type == "cpu":
        kernel()


def float32_kernels_available() -> bool:
    """Whether float32 decode products take f32_linears here (loads the library on the first call): what
    checkpoint.build_model stores its float32 weights for."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and kernel() is not None


def kernel_status() -> str:
    """For reports: whether the CPU's bf16 decode step runs these kernels."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"off ({ENV_SWITCH}=0)"
    lib = kernel()
    if lib is None:
        return "unavailable (needs AVX2, FMA and C and C++ compilers)"
    return "on (AVX-512 BF16)" if lib.bf16_kernels_isa(-1) else "on (AVX2 + FMA)"


def set_instruction_set(avx512bf16: bool) -> bool:
    """Choose the linear kernel's dot product: AVX-512 BF16 (the default where the CPU has it) or AVX2 + FMA
    (every CPU the kernels run on). Returns whether AVX-512 BF16 is now in use. For tests and benchmarks,
    which run both paths on one machine."""
    lib = kernel()
    return bool(lib is not None and lib.bf16_kernels_isa(1 if avx512bf16 else 0))


def torch_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """torch's grouped attention, every path the kernel does not take: q [B, n_kv, R, D] over k, v
    [B, n_kv, L, D], mask broadcastable to [B, n_kv, R, L] -> (out [B, n_kv, R, D] in v's dtype,
    probabilities [B, n_kv, R, L] in float32)."""
    scores = (q @ k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.shape[-1]))
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return probs.to(v.dtype) @ v, probs


@torch.library.register_fake("kv_eviction::bf16_linears")
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


@torch.library.register_fake("kv_eviction::f32_linears")
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


@torch.library.register_fake("kv_eviction::bf16_decode_attention")
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    B, H, R, D = q.shape
    return q.new_empty(B, H, R, D), q.new_empty(B, H, R, k.shape[2], dtype=torch.float32)


def _quantized_attention_fake(q: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    B, H, R, D = q.shape
    return q.new_empty(B, H, R, D), q.new_empty(B, H, R, mask.shape[-1], dtype=torch.float32)


@torch.library.register_fake("kv_eviction::per_token_decode_attention")
def _(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor, v_scale: Tensor, v_zero: Tensor,
      mask: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    return _quantized_attention_fake(q, mask)


@torch.library.register_fake("kv_eviction::kivi_decode_attention")
def _(q: Tensor, k_codes: Tensor, k_group: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor, v_scale: Tensor,
      v_zero: Tensor, k_res: Tensor, v_res: Tensor, slot_res: Tensor, mask: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    return _quantized_attention_fake(q, mask)


def _takes_kernel(*tensors: Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> bool:
    # The dtype first: GPU forwards and other dtypes, which never take the kernels, leave after one comparison.
    dtype = tensors[0].dtype
    return (dtype in dtypes and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and _kernels_on())


LINEAR_OPS = {torch.bfloat16: "bf16_linears", torch.float32: "f32_linears"}


def streams(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> bool:
    """Whether a few rows of x times these weights take the streaming kernels (bfloat16 or float32 on the CPU,
    row-major weights: float32's input-major ones, stored so where the kernels cannot run, keep MKL's
    product), whose rows' sums do not depend on the other rows."""
    return (_takes_kernel(x, *weights, dtypes=tuple(LINEAR_OPS)) and x.shape[-1] % 8 == 0
            and all(w.is_contiguous() for w in weights)
            and all(b is None or b.dtype == x.dtype and b.is_contiguous() for b in biases))


def batch_invariant(weight: Tensor, rows: int) -> bool:
    """Whether products with this weight give each of `rows` sequences decoding together, bit for bit, what the
    sequence gets alone (see linears): the kernels run, and a decode step's rows fit one kernel call. Beyond
    MAX_ROWS oneDNN's and MKL's products, faster there, round by the batch: 16 bfloat16 rows of the bundled
    model took 74 ms a step through oneDNN against 115 ms through the kernel 8 rows at a time (AMX Xeon,
    2 threads). The model's prefill packs prompts only where the rows are not batch-invariant
    (generate.shares_prefill)."""
    return rows <= MAX_ROWS and streams(weight[:1], [weight], [None])  # one row of the weight's own kind


def linears(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """[F.linear(x, w, b) for each weight], through one kernel call where it is the faster way (see the
    module's docstring): the projections of one input read as one stream of stacked weights.

    Where the kernels run, the rows of a batch of up to MAX_ROWS sequences also get exactly the products they
    get alone. oneDNN's and MKL's matrix products round a row differently with the number of rows in the call
    (on an AMX Xeon, bf16 rows of a 4 x 256-token product differ from the 256-token product's), and in
    bfloat16 that flips which tokens a strategy keeps: a batch of fidelity windows measured a window's KL at
    0.082 against 0.072 alone. A decode step's rows go through the kernel, each row's sums its own, and x
    [B, T, dim] with T > 1 (the batch's prompts) one sequence at a time, as each sequence's call alone."""
    if streams(x, weights, biases):
        if x.numel() <= MAX_ROWS * x.shape[-1]:
            y = getattr(torch.ops.kv_eviction, LINEAR_OPS[x.dtype])(x, weights, biases)
            return list(y.split([w.shape[0] for w in weights], dim=-1)) if len(weights) > 1 else [y]
        if x.dim() == 3 and x.shape[0] > 1 and x.shape[1] > 1:
            parts = [linears(x[b: b + 1], weights, biases) for b in range(x.shape[0])]
            return [torch.cat(outputs) for outputs in zip(*parts, strict=True)]
    return [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, through the kernel where it is the faster way (see the module's docstring)."""
    return linears(x, [weight], [bias])[0]


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """torch_attention, through the kernel where it is the faster way (see the module's docstring)."""
    if (mask.dtype == torch.bool and q.shape[2] <= MAX_QUERY_ROWS and k.shape == v.shape
            and k.shape[:2] == q.shape[:2] and q.shape[3] % 8 == 0 and q.shape[3] <= 256 and _takes_kernel(q, k, v)):
        return torch.ops.kv_eviction.bf16_decode_attention(q, k, v, mask)
    return torch_attention(q, k, v, mask)


def _takes_quantized(q: Tensor, mask: Tensor, bits: int, *cache_dtype: Tensor) -> bool:
    """Whether a quantized decode attention runs in the kernel: a decode step's rows (not a prompt's), a head size
    whose codes unpack in groups of 8 bytes, on the CPU in float32 or bf16 with the kernels built."""
    D = q.shape[-1]
    return (mask.dtype == torch.bool and q.shape[2] <= MAX_QUERY_ROWS and D <= 256 and D * bits % 64 == 0
            and _takes_kernel(q, *cache_dtype, dtypes=(torch.bfloat16, torch.float32)))


def per_token_decode_attention(q: Tensor, k: tuple[Tensor, Tensor, Tensor], v: tuple[Tensor, Tensor, Tensor],
                               mask: Tensor, bits: int) -> tuple[Tensor, Tensor] | None:
    """torch_attention over per-token quantized K and V (each (codes [B, n_kv, L, D * bits / 8] uint8, scale,
    zero [B, n_kv, L, 1]), quantization_utils' format), read from the codes by the kernel without rebuilding
    them: (out, probabilities) as torch_attention gives over the dequantized K and V, up to rounding. None
    where the kernel does not take it (see _takes_quantized): the caller dequantizes then."""
    if k[0].shape == v[0].shape and k[0].shape[:2] == q.shape[:2] and _takes_quantized(q, mask, bits, *k[1:], *v[1:]):
        return torch.ops.kv_eviction.per_token_decode_attention(q, *k, *v, mask, bits)
    return None


def kivi_decode_attention(q: Tensor, keys: tuple[Tensor, Tensor, Tensor, Tensor],
                          values: tuple[Tensor, Tensor, Tensor], residual: tuple[Tensor, Tensor, Tensor],
                          mask: Tensor, bits: int) -> tuple[Tensor, Tensor] | None:
    """torch_attention over KIVI's storage (kv_storage.ResidualQuantizedStorage's buffers, over the mask's L
    slots): keys (codes, group id per slot, per-group scale, zero), values (codes, scale, zero per channel
    group) and the residual (keys, values, each slot's entry), read by the kernel: each slot's key dequantized
    with its key group's per-channel scales, its value with its channel groups', or both read from the residual
    where the slot's token is there. None where the kernel does not take it (see _takes_quantized)."""
    if keys[0].shape[:2] == q.shape[:2] and _takes_quantized(q, mask, bits, *keys[2:], *values[1:], *residual[:2]):
        return torch.ops.kv_eviction.kivi_decode_attention(q, *keys, *values, *residual, mask, bits)
    return None
