"""`eval.bench --profile_steps` (eval/bench/profile.py): op and kernel names fall into the kinds of work the
profile table reports, and a profile of real decode steps splits the step without counting any time twice."""

from __future__ import annotations

import pytest
import torch

from compiled_step import compile_decode_step
from eval.bench.profile import KIND_NAMES, format_profiles, kernel_kind, profile_decode_steps
from generate import decode_one_token
from tests.conftest import make_tiny_model
from tests.strategy_matrix import attach, cache_args

# Names as torch.profiler reports them: our CPU ops and torch's, and CUDA kernels of cuBLAS, flash attention,
# inductor (triton) and torch's own, written out from the libraries' kernel naming.
NAMES = {
    "kv_eviction::bf16_linears": "linear",
    "kv_eviction::f32_linears": "linear",
    "aten::mm": "linear",
    "aten::addmm": "linear",
    "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "linear",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>": "linear",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1": "linear",
    "triton_tem_fused_mm_0": "linear",
    "kv_eviction::bf16_decode_attention": "attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>": "attention",
    "triton_red_fused__softmax_add_4": "attention",
    "aten::index_put_": "cache write",
    "aten::scatter_": "cache write",
    "triton_poi_fused_index_put_3": "cache write",
    "triton_per_fused_add_mean_mul_pow_rsqrt_0": "fused (inductor)",
    "## Call CompiledFxGraph fbx3k2 ##": "fused (inductor)",
    "TorchDynamo Cache Lookup": "entry (dynamo, wrappers)",
    "Torch-Compiled Region: 0/0": "entry (dynamo, wrappers)",
    "AOTDispatcher Runtime Wrapper Prologue": "entry (dynamo, wrappers)",
    "aten::copy_": "copy / fill",
    "Memcpy HtoD (Pageable -> Device)": "copy / fill",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1>>":
        "copy / fill",
    "aten::argmax": "other",
    "aten::embedding": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_op_and_kernel_names_fall_into_their_kind(name):
    assert kernel_kind(name) == NAMES[name]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_profile_of_decode_steps_splits_the_step_without_counting_twice(compiled):
    """The kinds sum self times (an op's own time, not its children's): on the CPU's one traced thread that
    sum cannot exceed the profiled wall time; the work every step does (the weights' products; eager, the
    attention; compiled, the fused kernels and the compiled code's entry) is there."""
    torch._dynamo.reset()
    model = make_tiny_model()
    model.init_rope_tables()
    attach(model, cache_args("heavy_hitter", "12"))
    step = compile_decode_step() if compiled else decode_one_token
    if compiled:
        step.prepare(model)
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    profile = profile_decode_steps(model, ids, step, 6)
    by_kind = profile["ms_per_step_by_kind"]
    assert set(by_kind) == set(KIND_NAMES) and profile["steps"] == 6 and profile["timeline"] == "cpu ops"
    assert 0 < profile["recorded_ms_per_step"] <= profile["profiled_ms_per_step"] * 1.02
    assert by_kind["linear"] > 0
    if compiled:  # in float32 inductor fuses the attention's ops into its own kernels: "fused" holds it
        assert by_kind["fused (inductor)"] > 0 and by_kind["entry (dynamo, wrappers)"] > 0
    else:
        assert by_kind["attention"] > 0 and by_kind["fused (inductor)"] == 0
    assert all(c.max_cache_length == 12 for c in model.caches())  # the profiled steps ran on the row's caches
    row = {"engine": "ours eager", "strategy": "heavy_hitter", "budget": 12, "context": 24,
           "median_ms_per_step": 1.0, "profile": profile}
    table = format_profiles([row, {**row, "profile": None}])
    assert table.count("| ours eager | heavy_hitter |") == 1


def test_a_prompt_too_short_for_the_profile_is_refused():
    model = make_tiny_model()
    attach(model, cache_args("full", "1.0"))
    with pytest.raises(ValueError, match="more than 8 tokens"):
        profile_decode_steps(model, list(range(8)), decode_one_token, 6)
