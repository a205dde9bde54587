"""The CPU bf16 decode kernels (cpu_bf16_kernels.py) against float64 references written from the
definitions, torch's own bf16 path, and their compiled calls.

Tolerances: a bf16 result is within one bf16 ulp (2^-7 relative) of the float64 value of the same bf16
inputs, plus an absolute 1e-6 x the row's scale for sums that cancel; probabilities (float32 end to end) within
1e-6 absolute.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import cpu_bf16_kernels as kernels

ULP = 2.0**-7


def within_one_ulp(got: torch.Tensor, exact: torch.Tensor, scale: float) -> bool:
    return bool(((got.double() - exact).abs() <= ULP * exact.abs() + 1e-6 * scale).all())


def test_the_kernels_build_and_load_on_this_machine():
    # The project's machines (and CI's) have AVX2, FMA and gcc: the tests below exercise the C code, not the
    # fallback.
    assert kernels.cpu_supports_kernel()
    assert kernels.kernel_status().startswith("on (")


def has_avx512bf16() -> bool:
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    return {"avx512f", "avx512bw", "avx512_bf16"} <= set(flags)


# The kernels' two instruction sets: AVX2 + FMA everywhere, AVX-512 (BF16) where this CPU has it (the default
# there): the linears' dot products and the attention's chunk loops.
INSTRUCTION_SETS = [False, pytest.param(True, marks=pytest.mark.skipif(not has_avx512bf16(),
                                                                      reason="this CPU has no AVX-512 BF16"))]


@pytest.fixture(params=INSTRUCTION_SETS, ids=["avx2_fma", "avx512_bf16"])
def instruction_set(request):
    assert kernels.set_instruction_set(request.param) == request.param
    yield request.param
    kernels.set_instruction_set(True)  # back to the best available


def test_the_best_instruction_set_is_the_default():
    assert kernels.set_instruction_set(True) == has_avx512bf16()
    assert kernels.kernel_status() == ("on (AVX-512 BF16)" if has_avx512bf16() else "on (AVX2 + FMA)")


@pytest.mark.parametrize("rows,n,k,bias", [(1, 1536, 576, False), (3, 193, 576, True), (8, 64, 40, False),
                                           (5, 7, 1544, True)])
def test_linear_is_within_one_bf16_ulp_of_the_exact_product(rows, n, k, bias, instruction_set):
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    with torch.inference_mode():
        y = kernels.linear(x, w, b)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert within_one_ulp(y, exact, math.sqrt(k))
    # torch's bf16 linear rounds the same float32 sum: the two agree on nearly every element.
    assert (y == F.linear(x, w, b)).float().mean() > 0.99


@pytest.mark.parametrize("rows,k", [(1, 576), (4, 40), (2, 1544)])
def test_stacked_linears_equal_each_weight_alone(rows, k, instruction_set):
    # q, k and v (or gate and up) in one call: each output is the single weight's product, bit for bit (the
    # same dot product per output element, whichever thread takes it), also for uneven splits and biases.
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(1, rows, k, generator=g).bfloat16()
    weights = [torch.randn(n, k, generator=g).bfloat16() for n in (96, 17, 33)]
    biases = [torch.randn(96, generator=g).bfloat16(), None, torch.randn(33, generator=g).bfloat16()]
    with torch.inference_mode():
        stacked = kernels.linears(x, weights, biases)
        alone = [kernels.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    assert [y.shape for y in stacked] == [(1, rows, 96), (1, rows, 17), (1, rows, 33)]
    assert all(torch.equal(a, b) for a, b in zip(stacked, alone, strict=True))
    for y, w, b in zip(stacked, weights, biases, strict=True):
        assert within_one_ulp(y, x.double() @ w.double().T + (0 if b is None else b.double()), math.sqrt(k))


def test_linear_keeps_leading_dimensions_and_reads_strided_inputs(instruction_set):
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    strided = torch.randn(2, 1, 128, dtype=torch.bfloat16)[:, :, ::2]  # not contiguous
    w = torch.randn(96, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        for inp in (x, strided):
            y = kernels.linear(inp, w)
            assert y.shape == (2, 1, 96)
            assert within_one_ulp(y, inp.double() @ w.double().T, 8.0)


def test_linear_leaves_prompts_input_major_weights_and_autograd_to_torch():
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    prompt = torch.randn(1, kernels.MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(kernels.linear(prompt, w), F.linear(prompt, w))
        x32, w32 = torch.randn(1, 64), torch.randn(48, 64)
        assert torch.equal(kernels.linear(prompt.float(), w32), F.linear(prompt.float(), w32))
        by_column = w32.t().contiguous().t()  # float32's layout where the kernels cannot run
        assert torch.equal(kernels.linear(x32, by_column), F.linear(x32, by_column))
    trained = w.clone().requires_grad_(True)
    y = kernels.linear(prompt[:, :1], trained)
    y.float().sum().backward()  # the custom op has no backward: reaching it would raise here
    assert trained.grad is not None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("k", "bias"), [(576, True), (72, False), (1536, False)])
def test_float32_linears_equal_the_float64_product(rows, k, bias, monkeypatch):
    """f32_linears (float32 decode rows, 1 to MAX_ROWS; torch's F.linear is made to fail, so the kernel is what
    ran): within float32 summation error of the float64 product, several weights stacked in one call (a K
    that is not a multiple of 32 takes the 8-wide tail), and each row exactly what it gives alone (no row's
    sum depends on the others: rows go in pairs, an odd last one alone, each in the same order)."""
    g = torch.Generator().manual_seed(rows * 10 + k)
    x = torch.randn(rows, k, generator=g)
    weights = [torch.randn(n, k, generator=g) for n in (40, 96)]
    biases = [torch.randn(n, generator=g) if bias else None for n in (40, 96)]
    assert kernels.float32_kernels_available()
    monkeypatch.setattr(kernels.F, "linear", lambda *a, **kw: pytest.fail("F.linear ran, not the kernel"))
    with torch.inference_mode():
        got = kernels.linears(x, weights, biases)
        alone = [kernels.linears(x[r : r + 1], weights, biases) for r in range(rows)]
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
        torch.testing.assert_close(got[i].double(), exact, rtol=0, atol=2e-5 * math.sqrt(k))
        assert torch.equal(got[i], torch.cat([a[i] for a in alone]))


def exact_attention(q, k, v, mask):
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1)
    return probs @ v.double(), probs


@pytest.mark.parametrize("b,h,r,length,d", [(1, 3, 3, 288, 64), (2, 2, 5, 37, 128), (3, 1, 9, 1000, 64),
                                            (1, 4, 64, 9, 8)])
def test_decode_attention_matches_the_exact_softmax(b, h, r, length, d, instruction_set):
    g = torch.Generator().manual_seed(b * 1000 + length)
    q = torch.randn(b, h, r, d, generator=g).bfloat16()
    k = torch.randn(b, h, length, d, generator=g).bfloat16()
    v = torch.randn(b, h, length, d, generator=g).bfloat16()
    mask = torch.rand(b, h, 1, length, generator=g) > 0.3
    mask[..., 0] = True
    with torch.inference_mode():
        out, probs = kernels.decode_attention(q, k, v, mask)
    exact_out, exact_probs = exact_attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and probs.dtype == torch.float32
    assert (probs.double() - exact_probs).abs().max() < 1e-6
    assert torch.equal(probs == 0, ~mask.expand_as(probs))  # masked slots get exactly nothing
    assert within_one_ulp(out, exact_out, 1.0)
    # torch's bf16 path rounds scores and probabilities to bf16: the kernel is the closer of the two.
    ref_out, ref_probs = kernels.torch_attention(q, k, v, mask)
    assert (probs.double() - exact_probs).abs().max() <= (ref_probs.double() - exact_probs).abs().max()


def test_decode_attention_reads_broadcast_and_strided_caches(instruction_set):
    g = torch.Generator().manual_seed(7)
    held = torch.randn(1, 2, 50, 64, generator=g).bfloat16()
    k = held.expand(3, -1, -1, -1)  # one cache shared by three rows: stride 0
    v = torch.randn(3, 2, 50, 128, generator=g).bfloat16()[..., ::2]  # last dimension strided
    q = torch.randn(3, 2, 4, 64, generator=g).bfloat16()
    mask = (torch.rand(3, 1, 4, 50, generator=g) > 0.5) | (torch.arange(50) == 0)
    with torch.inference_mode():
        out, probs = kernels.decode_attention(q, k, v, mask)
    exact_out, exact_probs = exact_attention(q, k, v, mask)
    assert (probs.double() - exact_probs).abs().max() < 1e-6
    assert within_one_ulp(out, exact_out, 1.0)


def test_decode_attention_of_a_batch_equals_each_row_alone_on_any_number_of_threads(instruction_set):
    # The slots are split into fixed chunks whose partial sums are added in order: a row's result does not
    # depend on the batch around it or on the threads (bit for bit), over lengths of one and several chunks.
    g = torch.Generator().manual_seed(11)
    for length in (40, 600):
        q = torch.randn(3, 2, 4, 64, generator=g).bfloat16()
        k, v = (torch.randn(3, 2, length, 64, generator=g).bfloat16() for _ in range(2))
        mask = torch.rand(3, 1, 4, length, generator=g) > 0.3
        threads = torch.get_num_threads()
        with torch.inference_mode():
            batch = kernels.decode_attention(q, k, v, mask)
            try:
                torch.set_num_threads(1 if threads > 1 else 2)
                other = kernels.decode_attention(q, k, v, mask)
            finally:
                torch.set_num_threads(threads)
            rows = [kernels.decode_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask[i:i + 1]) for i in range(3)]
        for got in (other, tuple(torch.cat(parts) for parts in zip(*rows, strict=True))):
            assert all(torch.equal(a, b) for a, b in zip(batch, got, strict=True))


@pytest.mark.parametrize("length", [1, 13, 37, 256, 301])
def test_decode_attention_ignores_masked_slots_after_a_rows_own(length, instruction_set):
    """A row of a batch has the slots of the batch's largest row, the ones past its own empty (masked): its
    output and probabilities are bit for bit those over its own slots alone, for lengths inside the first block
    of 8, in a partial last block, at a chunk's end and past it (ATTENTION_CHUNK 256)."""
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, 3, 3, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 3, length + 300, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.rand(1, 3, 1, length, generator=g) > 0.2
    mask[..., 0] = True
    wider = torch.cat([mask, torch.zeros(1, 3, 1, 300, dtype=torch.bool)], dim=-1)
    with torch.inference_mode():
        own = kernels.decode_attention(q, k[:, :, :length], v[:, :, :length], mask)
        for extra in (1, 5, 8, 300):
            out, probs = kernels.decode_attention(q, k[:, :, :length + extra], v[:, :, :length + extra],
                                                  wider[..., :length + extra])
            assert torch.equal(out, own[0]), extra
            assert torch.equal(probs[..., :length], own[1]) and not probs[..., length:].any(), extra


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_of_products_gives_each_sequence_its_own_products(dtype):
    """linears where the kernels run: every row of a batch gets, bit for bit, what its sequence gets alone (the
    bundled model's shapes; oneDNN's bf16 product of 4 x 200 rows rounds some rows differently from 200 rows'
    on an AMX Xeon), for prompts [B, T] and for MAX_ROWS decode rows (one kernel call; beyond it, oneDNN's
    and MKL's products, not batch-invariant)."""
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, 576, generator=g).to(dtype) for n in (1536, 1536)]
    head = torch.randn(4096, 576, generator=g).to(dtype)
    with torch.inference_mode():
        prompts, decode_rows = torch.randn(4, 200, 576, generator=g), torch.randn(kernels.MAX_ROWS, 1, 576, generator=g)
        for x in (prompts.to(dtype), decode_rows.to(dtype)):
            for ws in (weights, [head]):
                together = kernels.linears(x, ws, [None] * len(ws))
                alone = [kernels.linears(x[b: b + 1], ws, [None] * len(ws)) for b in range(x.shape[0])]
                for i, y in enumerate(together):
                    assert torch.equal(y, torch.cat([a[i] for a in alone])), (tuple(x.shape), i)
    assert kernels.batch_invariant(head, kernels.MAX_ROWS) and not kernels.batch_invariant(head, kernels.MAX_ROWS + 1)
    assert not kernels.batch_invariant(head.t().contiguous().t(), 1)  # an input-major weight: torch's product


def test_decode_attention_with_every_slot_masked_is_nan_as_in_torch(instruction_set):
    q = torch.randn(1, 1, 2, 64).bfloat16()
    k, v = torch.randn(1, 1, 10, 64).bfloat16(), torch.randn(1, 1, 10, 64).bfloat16()
    mask = torch.zeros(1, 1, 2, 10, dtype=torch.bool)
    mask[0, 0, 1, 3] = True
    with torch.inference_mode():
        out, probs = kernels.decode_attention(q, k, v, mask)
        ref_out, ref_probs = kernels.torch_attention(q, k, v, mask)
    assert probs[0, 0, 0].isnan().all() and ref_probs[0, 0, 0].isnan().all()
    assert out[0, 0, 0].isnan().all() and ref_out[0, 0, 0].isnan().all()
    assert torch.equal(probs[0, 0, 1], ref_probs[0, 0, 1])  # the one visible slot: probability 1


@pytest.mark.parametrize("rows,d", [(kernels.MAX_QUERY_ROWS + 1, 64), (3, 12), (3, 264)])
def test_decode_attention_leaves_long_query_blocks_and_odd_head_sizes_to_torch(rows, d):
    q = torch.randn(1, 1, rows, d).bfloat16()
    k, v = torch.randn(1, 1, 20, d).bfloat16(), torch.randn(1, 1, 20, d).bfloat16()
    mask = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    with torch.inference_mode():
        got, ref = kernels.decode_attention(q, k, v, mask), kernels.torch_attention(q, k, v, mask)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_compiled_calls_equal_eager_calls():
    def step(x, w, w2, q, k, v, mask):
        out, probs = kernels.decode_attention(q, k, v, mask)
        return kernels.linear(x, w), *kernels.linears(x, [w, w2], [None, None]), out, probs

    g = torch.Generator().manual_seed(3)
    args = (torch.randn(1, 1, 64, generator=g).bfloat16(), torch.randn(80, 64, generator=g).bfloat16(),
            torch.randn(24, 64, generator=g).bfloat16(),
            torch.randn(1, 2, 3, 64, generator=g).bfloat16(), torch.randn(1, 2, 30, 64, generator=g).bfloat16(),
            torch.randn(1, 2, 30, 64, generator=g).bfloat16(), torch.rand(1, 2, 1, 30, generator=g) > 0.2)
    with torch.inference_mode():
        eager = step(*args)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(*args)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


def test_the_build_fails_cleanly_without_a_compiler_and_happens_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert kernels._build() is None
    monkeypatch.setenv("CC", "no-such-compiler")
    real_which = kernels.shutil.which
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None if name == "cc" else real_which(name))
    assert kernels._build() is None
    monkeypatch.delenv("CC")
    built = kernels._build()
    assert built is not None and built.parent == tmp_path / "kv-eviction-bench" and built.exists()
    assert kernels._build() == built  # built once per cache directory


def test_a_compiled_bf16_step_loads_the_kernels_before_its_first_trace(monkeypatch):
    # As in a fresh process: nothing loaded yet. The step's first trace must already see the kernels (one
    # graph, calling them), not trace torch's path and then again once an eager call has loaded them.
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    from generate import compile_decode_step
    from tests.conftest import make_tiny_model
    from tests.strategy_matrix import attach, cache_args

    monkeypatch.setattr(kernels, "_ops_ready", None)
    monkeypatch.setattr(kernels, "_library", None)
    torch._dynamo.reset()
    model = make_tiny_model().to(torch.bfloat16)
    attach(model, cache_args("full", "64", "dense"), dtype=torch.bfloat16)
    graphs = counters["stats"]["unique_graphs"]
    step = compile_decode_step()
    with torch.inference_mode():
        token = torch.tensor([[5]])
        _, codes = run_and_get_code(step.compiled_step, model, token, torch.tensor([0]))
        for pos in range(1, 4):  # prefill's and eager calls' loading would show here as a second graph
            step(model, token, torch.tensor([pos]))
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert any("kv_eviction.bf16_linears" in code and "kv_eviction.bf16_decode_attention" in code for code in codes)


def test_the_switch_turns_the_kernels_off_for_a_fresh_process():
    code = ("import torch, torch.nn.functional as F, cpu_bf16_kernels as k\n"
            "x, w = torch.randn(1, 64).bfloat16(), torch.randn(32, 64).bfloat16()\n"
            "assert torch.equal(k.linear(x, w), F.linear(x, w)) and k.kernel() is None\n"
            "print(k.kernel_status())\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, kernels.ENV_SWITCH: "0"},
                         capture_output=True, text=True, check=True, cwd=kernels.C_SOURCE.parent).stdout
    assert out.strip() == f"off ({kernels.ENV_SWITCH}=0)"
