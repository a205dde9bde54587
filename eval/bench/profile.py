"""Where a decode step's time goes (`eval.bench --profile_steps N`): torch.profiler over N decode steps of a
bench row, the time grouped by the kind of work (the weights' matrix products, attention over the cache,
the cache write, inductor's fused kernels, the compiled code's entry costs, copies).

On the CPU the profiler records the main thread's ops, so the kinds split the step's wall time (an op's
self time: its own, not its children's; the worker threads of a parallel kernel run inside it). On CUDA it
records each kernel's device time, so the kinds split the time the GPU computes, and what remains of the
step's wall time is the GPU waiting for the host. There the step is profiled without its CUDA graph (the
same kernels, launched one by one): whether a profiler sees the kernels inside a replayed graph depends on
CUPTI's version, and the row's own timing already is the replayed graph's."""


from __future__ import annotations

import re
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from generate import prefill

# First match wins, so the specific kinds come before the patterns that would also match them (inductor
# names a fused kernel after its ops: triton_poi_fused_index_put_3 is a cache write, triton_tem_fused_mm_0 a
# matrix product). Patterns are matched case-insensitively against op and kernel names.
KINDS: list[tuple[str, re.Pattern]] = [(kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in (
    ("attention", r"attention|flash|fmha|sdpa|softmax"),
    ("cache write", r"index_put|scatter|index_copy"),
    ("linear", r"bf16_linears|f32_linears|gemm|gemv|nvjet|cutlass|cublas|xmma|splitk|triton_tem"
               r"|aten::(mm|addmm|bmm|linear|matmul)$"),
    ("fused (inductor)", r"triton_|cpp_fused|CompiledFxGraph"),
    ("entry (dynamo, wrappers)", r"TorchDynamo|Torch-Compiled Region|AOTDispatcher|Pregraph|CompiledFunction"),
    ("copy / fill", r"memcpy|memset|copy|fill|aten::cat$|_to_copy"),
)]
OTHER = "other"
KIND_NAMES = [kind for kind, _ in KINDS] + [OTHER]


def kernel_kind(name: str) -> str:
    """The kind of work an op or kernel named `name` does (KINDS), else "other"."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), OTHER)


def group_by_kind(events, steps: int, on_device: bool) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """(ms per step by kind, the five most expensive names with their ms per step) from a profile's
    key_averages(): device (CUDA) self time of kernels, or CPU self time of ops."""
    totals: dict[str, float] = dict.fromkeys(KIND_NAMES, 0.0)
    by_name: dict[str, float] = {}
    for e in events:
        if on_device:
            if e.device_type != DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        if us <= 0:
            continue
        ms = us / 1000 / steps
        totals[kernel_kind(e.key)] += ms
        by_name[e.key] = by_name.get(e.key, 0.0) + ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {k: round(v, 3) for k, v in totals.items()}, [(name[:80], round(ms, 3)) for name, ms in top]


def profile_decode_steps(model, ids: list[int], step, steps: int) -> dict:
    """Prefill all but the last `steps` + 2 tokens of `ids` on the model's caches (reset first), decode 2
    steps unprofiled (a first step may still compile), then `steps` greedy steps under torch.profiler.
    The caches see what the timed run's saw, so a budget below the prompt evicts at every step."""
    device = model.tok_embeddings.weight.device
    on_device = device.type == "cuda"
    n = len(ids) - steps - 2
    if n < 1:
        raise ValueError(f"profiling {steps} steps needs a prompt of more than {steps + 2} tokens, got {len(ids)}")
    run = getattr(step, "compiled_step", step) if on_device else step
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with torch.inference_mode():
        model.reset_caches()
        token = prefill(model, torch.tensor([ids[:n]], device=device)).argmax(dim=-1, keepdim=True)
        pos = torch.tensor([n], device=device)
        for _ in range(2):
            token = run(model, token.view(1, 1), pos).argmax(dim=-1, keepdim=True)
            pos = pos + 1
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                token = run(model, token.view(1, 1), pos).argmax(dim=-1, keepdim=True)
                pos = pos + 1
            if on_device:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - started
    by_kind, top = group_by_kind(prof.key_averages(), steps, on_device)
    return {"steps": steps, "timeline": "cuda kernels" if on_device else "cpu ops",
            "profiled_ms_per_step": round(1000 * wall / steps, 3), "ms_per_step_by_kind": by_kind,
            "recorded_ms_per_step": round(sum(by_kind.values()), 3), "top": top}


def format_profiles(rows: list[dict]) -> str:
    """The rows' profiles as one table: ms per step by kind, the recorded sum, the row's own timed ms/step
    (on CUDA, a replayed graph's, so the GPU's idle share is 1 - recorded / timed) and the top op."""
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return ""
    steps, timeline = profiled[0]["profile"]["steps"], profiled[0]["profile"]["timeline"]
    cols = ["engine", "strategy", "budget", "context", "timed ms/step", "recorded ms/step", *KIND_NAMES, "top"]
    lines = [f"Where a decode step's time goes (torch.profiler, {steps} steps, {timeline}; ms per step):", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in profiled:
        p = r["profile"]
        name, ms = p["top"][0] if p["top"] else ("", 0.0)
        cells = [r["engine"], r["strategy"], r["budget"], r["context"], r["median_ms_per_step"],
                 p["recorded_ms_per_step"], *(p["ms_per_step_by_kind"][k] for k in KIND_NAMES), f"{name} ({ms})"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
