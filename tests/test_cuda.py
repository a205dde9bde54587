"""On a CUDA device (`pytest -m cuda`; skipped where there is none): the strategy x storage matrix, eager
and compiled (CUDA graph), keeps exactly the positions the CPU keeps, step for step, in float32, and so do
the other axes of the registry matrices (adakv's pooled budgets, --rerotate_positions past the model's
context, --prefill_chunk); batched rows as a CUDA graph give the CPU's logits; the compiled step does not
recompile over 256 steps; logits match transformers on CUDA for small random models built with
transformers' own classes; a left-padded batch through transformers' generate and the adapter keeps the
CPU's tokens and positions; and eval's compiled runs (QA rows, fidelity windows) keep the CPU's records."""

from __future__ import annotations

import pytest
import torch

from cache_spec import build_caches, resolve_cache_spec
from checkpoint import load_checkpoint
from generate import compile_decode_step, decode_one_token, prefill
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    ADAKV,
    ALL,
    ALLOCATIONS,
    CHUNKABLE,
    COMPILED_TWINS,
    PROMPT,
    STORAGES,
    STRATEGIES,
    attach,
    cache_args,
    held_positions,
    run,
    token_ids,
)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LOGIT_ATOL = 1e-3  # float32 on both sides, TF32 off


def kept_per_step(strategy: str, storage: str, device: str, step=decode_one_token, flags: tuple = (),
                  context_length: int | None = None) -> list:
    model = make_tiny_model(**({"context_length": context_length} if context_length else {})).to(device)
    model.init_rope_tables()
    # Distinct tokens: RoPE preserves norms, so two equal tokens have equal layer-0 key norms, an exact tie
    # (for l2) that rounding breaks differently on each device.
    ids = token_ids().to(device)
    ids[0] = torch.randperm(256, generator=torch.Generator().manual_seed(0))[: ids.shape[1]].to(device)
    caches = attach(model, cache_args(strategy, "0.5", storage, *flags), device=device)
    if hasattr(step, "prepare"):
        step.prepare(model)
    kept = []
    with torch.inference_mode():
        run(model, ids, step, lambda p: kept.append([held_positions(c) for c in caches]))
    return kept


@pytest.mark.parametrize("storage", sorted(STORAGES))
@pytest.mark.parametrize("strategy", ALL)
def test_cuda_eager_keeps_what_the_cpu_keeps(strategy, storage):
    assert kept_per_step(strategy, storage, "cuda") == kept_per_step(strategy, storage, "cpu")


# The registry matrices' other axes, eager: (flags, the strategies the CPU matrix runs them on). Re-rotation
# runs past a 32-token context (the sequence is 40) where the cache can, as in test_rerotate.
AXES = {"adakv": (tuple(ALLOCATIONS["adakv"]), ADAKV), "rerotate_positions": (("--rerotate_positions",), ALL),
        "prefill_chunk": (("--prefill_chunk", "8"), CHUNKABLE),
        # ThinK's whole held keys during the chunks (cache_chunking.py), under three kinds of prompt rule.
        "think_prefill_chunk": (("--prefill_chunk", "8", *STORAGES["think"]), ["heavy_hitter", "tova", "full"]),
        # A pool's chunks: each head re-prefilled alone (its own sinks for kvzip, the layer's moments for compactor,
        # its own noise for keyformer).
        "adakv_prefill_chunk": ((*ALLOCATIONS["adakv"], "--prefill_chunk", "8"),
                                ["heavy_hitter", "kvzip", "compactor", "keyformer"])}


def past_the_context(strategy: str, flags: tuple) -> int | None:
    from tests.test_rerotate import CONTEXT, holds_whole_sequence

    return CONTEXT if "--rerotate_positions" in flags and not holds_whole_sequence(strategy) else None


@pytest.mark.parametrize(("axis", "strategy"), [(a, s) for a, (_, names) in AXES.items() for s in names])
def test_cuda_eager_keeps_what_the_cpu_keeps_on_every_axis(axis, strategy):
    flags = AXES[axis][0]
    context = past_the_context(strategy, flags)
    cuda = kept_per_step(strategy, "dense", "cuda", flags=flags, context_length=context)
    assert cuda == kept_per_step(strategy, "dense", "cpu", flags=flags, context_length=context)


# Compiled on CUDA: every strategy on dense storage with the twins the CPU's compiled matrix compiles (one per
# set of traits: a twin's wrapper is the same code around each strategy of a set), every storage under
# heavy_hitter. Each case is a cold triton compile of seconds on a lent GPU's few minutes.
COMPILED = [(s, "dense") for s in STRATEGIES + COMPILED_TWINS] + \
           [("heavy_hitter", s) for s in sorted(STORAGES) if s != "dense"]


@pytest.mark.parametrize(("strategy", "storage"), COMPILED)
def test_cuda_graph_keeps_what_the_cpu_keeps(strategy, storage):
    torch._dynamo.reset()
    compiled = kept_per_step(strategy, storage, "cuda", compile_decode_step())
    assert compiled == kept_per_step(strategy, storage, "cpu")


@pytest.mark.parametrize(("strategy", "storage"), [("heavy_hitter", "dense"), ("hybrid", "kivi4")])
def test_cuda_graph_batched_rows_at_one_position_keep_what_the_cpu_keeps(strategy, storage):
    """The batched bench's step (rows at one shared position, prepare(model, B)) as a CUDA graph keeps in
    every row and layer the positions the CPU's eager rows keep."""
    from tests.test_batching import decode_rows_at_one_position

    _, cuda_kept, graphs = decode_rows_at_one_position(strategy, storage, compiled=True, device="cuda")
    _, cpu_kept, _ = decode_rows_at_one_position(strategy, storage, compiled=False)
    assert cuda_kept == cpu_kept and graphs == 0


def rows_at_their_own_positions(strategy: str, storage: str, device: str, compiled: bool, *flags: str):
    """generate.py's batch (tests/test_batching.py's rows: unequal prompts, each row at its own positions,
    input_pos [B]), teacher-forced: logits [B, steps, vocab] on the CPU and each row's kept positions."""
    from cache_setup import attach_row_caches
    from tests.test_batching import LENGTHS, NEW, TOKEN_CLASSES, sequences, teacher_forced_batch, tiny_model

    model = tiny_model().to(device)
    model.init_rope_tables()
    attach_row_caches(model, cache_args(strategy, "0.5", storage, *flags), list(LENGTHS), NEW,
                      classes=TOKEN_CLASSES)
    step = decode_one_token
    if compiled:
        torch._dynamo.reset()
        step = compile_decode_step()
        step.prepare(model, len(LENGTHS), per_row_positions=True)
    return teacher_forced_batch(model, sequences(), step, device=device)


@pytest.mark.parametrize(("strategy", "storage"), [("recent_global", "dense"), ("heavy_hitter", "dense"),
                                                   ("hybrid", "kivi4")])
def test_cuda_graph_rows_at_their_own_positions_keep_what_the_cpu_keeps(strategy, storage):
    """Rows of unequal prompts decoded at their own positions as one CUDA graph keep in every row and layer the
    positions the CPU's eager batch keeps (which equal each row decoded alone, tests/test_batching.py), and on
    dense storage give its logits within LOGIT_ATOL."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda_logits, cuda_kept = rows_at_their_own_positions(strategy, storage, "cuda", compiled=True)
    cpu_logits, cpu_kept = rows_at_their_own_positions(strategy, storage, "cpu", compiled=False)
    assert cuda_kept == cpu_kept
    if storage == "dense":
        assert (cuda_logits - cpu_logits).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("strategy", ["heavy_hitter", "tova", "debug_keydiff"])
def test_cuda_rows_prefilled_in_packed_chunks_keep_what_the_cpu_keeps(strategy):
    """The rows' chunks packed pass by pass (--prefill_chunk 5, packed_prefill.prefill_packed_chunks), eager on
    CUDA: every row and layer keeps the positions the CPU's packed chunks keep (which equal each row alone)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _, cuda_kept = rows_at_their_own_positions(strategy, "dense", "cuda", False, "--prefill_chunk", "5")
    _, cpu_kept = rows_at_their_own_positions(strategy, "dense", "cpu", False, "--prefill_chunk", "5")
    assert cuda_kept == cpu_kept


@pytest.mark.parametrize("strategy", ["full", "recent_global"])
def test_cuda_graph_batched_logits_match_the_cpu(strategy):
    """SDPA's decode attention (the caches that need no probabilities), compiled as a CUDA graph over a batch of
    rows, gives the CPU's eager float32 logits within LOGIT_ATOL at every step and keeps its positions."""
    from tests.test_batching import decode_rows_at_one_position

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda_logits, cuda_kept, _ = decode_rows_at_one_position(strategy, "dense", compiled=True, device="cuda")
    cpu_logits, cpu_kept, _ = decode_rows_at_one_position(strategy, "dense", compiled=False)
    assert (cuda_logits - cpu_logits).abs().max().item() < LOGIT_ATOL and cuda_kept == cpu_kept


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_step_does_not_recompile_over_256_steps(strategy):
    """The compiled block without the graph (dynamo runs its guards every step), on a budget of 16 that
    evicts at every one of the 256 steps."""
    model = make_tiny_model().to("cuda")
    model.init_rope_tables()
    prompt = PROMPT
    attach(model, cache_args(strategy, "16"), device="cuda", new=256)
    ids = torch.randint(0, 256, (1, prompt + 256), device="cuda")
    step = compile_decode_step(cuda_graph=False)
    torch._dynamo.reset()
    with torch.inference_mode():
        model.reset_caches()
        prefill(model, ids[:, :prompt])
        step(model, ids[:, prompt : prompt + 1], torch.tensor([prompt], device="cuda"))  # compiles
        with torch._dynamo.config.patch(error_on_recompile=True):
            for p in range(prompt + 1, prompt + 256):
                logits = step(model, ids[:, p : p + 1], torch.tensor([p], device="cuda"))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_logits_match_transformers_on_cuda(tmp_path, arch):
    """Prefill + 32 decode steps through a full cache on CUDA against transformers' forward on CUDA."""
    from tests.arch_helpers import VOCAB, save_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    theirs = save_tiny_model(arch, tmp_path).to("cuda")
    ours, _ = load_checkpoint(tmp_path, "cuda", torch.float32)
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(0)).to("cuda")
    specs = resolve_cache_spec(cache_args("full", "1.0"), ours.args.n_layer, 16, 32)
    a = ours.args
    ours.setup_caches(build_caches(specs, 1, a.n_kv_head, a.head_dim, 48, torch.float32, "cuda"))
    with torch.inference_mode():
        reference = theirs(ids).logits.float()[0, 15:]
        ours.reset_caches()
        rows = [prefill(ours, ids[:, :16])[0]]
        for p in range(16, 48):  # prefill + 32 decode steps through the cache
            rows.append(decode_one_token(ours, ids[:, p : p + 1], torch.tensor([p], device="cuda"))[0])
    got = torch.stack(rows)  # positions 15 .. 47
    assert (got - reference).abs().max().item() < LOGIT_ATOL
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


def adapter_batch_run(hf, strategy: str, device: str) -> tuple[list, list]:
    """A left-padded batch of three prompts through transformers' generate on `device` with the adapter's cache:
    (each row's greedy tokens, each row's kept positions per layer and KV head)."""
    import transformers_adapter as ta
    from tests.adapter_helpers import BATCH_LENGTHS, cache_flags, distinct_prompt

    hf = hf.to(device)
    prompts = [distinct_prompt(n, seed) for seed, n in enumerate(BATCH_LENGTHS)]
    x, mask = ta.left_padded(prompts)
    T = x.shape[1]
    cache = ta.make_cache(hf, cache_flags(strategy), BATCH_LENGTHS, 8)
    # past_key_values=: the name every transformers 5.x takes (5.24 added cache=; the GPU machine has 5.17).
    out = hf.generate(x.to(device), attention_mask=mask.to(device), past_key_values=cache, max_new_tokens=8,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = out[:, T:].tolist()
    kept = []
    for b in range(len(prompts)):
        for c in cache.kv_caches:
            with c.row(b):
                kept.append(held_positions(c))
    return tokens, kept


@pytest.mark.parametrize("strategy", ["heavy_hitter", "tova", "debug_keydiff"])
def test_adapter_padded_batch_keeps_what_the_cpu_keeps(tmp_path, strategy):
    pytest.importorskip("transformers")
    from tests.arch_helpers import save_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = save_tiny_model("llama", tmp_path)
    cpu = adapter_batch_run(hf, strategy, "cpu")
    assert adapter_batch_run(hf, strategy, "cuda") == cpu


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.bfloat16, 5e-4), (torch.float32, 1e-5)])
@pytest.mark.parametrize("first_query", [0, 300])
def test_fused_received_attention_on_cuda_equals_a_dense_float64_pass(dtype, rtol, first_query):
    """The GPUs' default path for H2O's received attention (flash for bfloat16, the memory-efficient kernel for
    float32; called directly, so a kernel that refuses fails here instead of falling back to the blocks) at
    Llama-3.1-8B's head shapes, against the float64 definition over the same rounded inputs."""
    from prompt_compression import received_attention_fused, received_attention_path
    from tests.test_strategies_more import dense_received_attention

    g = torch.Generator().manual_seed(0)
    B, H, n_kv, T, D = 1, 32, 8, 1024, 128
    q = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype)
    k = (torch.randn(B, n_kv, T, D, generator=g) * 2).to(dtype)
    assert received_attention_path(q.cuda()) == "fused"
    got = received_attention_fused(q.cuda(), k.cuda(), first_query).double().cpu()
    torch.testing.assert_close(got, dense_received_attention(q, k, first_query), rtol=rtol, atol=1e-5)


def eval_records(tiny_dir, path, device: str, compiled: bool) -> tuple:
    """The QA items through eval's rows (batch 2, heavy_hitter, both protocols) and two fidelity windows at batch
    2, on `device`, with eval's compiled step (no CUDA graph, prepared before the first item) or eager: each QA
    item's answer tokens and kept positions, and the fidelity windows' per-position KL and kept positions."""
    from eval.tasks import get_task
    from tests.eval_helpers import PYDOC_EXCERPT, tiny_runtime
    from tests.test_eval_generation_batching import CACHE_FLAGS, PROTOCOLS, qa_run

    step = compile_decode_step(cuda_graph=False) if compiled else None
    records = []
    for flags in PROTOCOLS.values():
        torch._dynamo.reset()
        out = qa_run(tiny_dir, path, 2, "--device", device, "--cache_strategy", "heavy_hitter", *flags, step=step)
        assert out.timings.compiling_steps == 0
        records.append([(item["output_ids"], [k.tolist() for k in item["kept_positions"]]) for item in out.items])
    rt = tiny_runtime(tiny_dir, "--device", device, "--text_file", str(PYDOC_EXCERPT), "--seq_len", "96",
                      "--prefill_tokens", "40", "--limit", "2", "--batch_size", "2", "--cache_strategy", "tova",
                      *CACHE_FLAGS)
    if compiled:
        torch._dynamo.reset()
        rt.step = compile_decode_step(cuda_graph=False)
    with torch.inference_mode():
        fidelity = get_task("fidelity")(rt.args).run(rt)
    assert fidelity.timings.compiling_steps == 0
    kl = [p["kl"] for p in fidelity.predictions]
    return records, kl, [[k.tolist() for k in item["kept_positions"]] for item in fidelity.items]


def test_cuda_eval_compiled_keeps_the_cpu_records(tiny_dir, tmp_path):
    """eval on CUDA, its step compiled before the first item or window, rows at positions of their own: every
    QA item's answer and kept positions are the CPU eager run's, and so are the fidelity windows' kept positions,
    with per-position KL within 1e-4."""
    from tests.test_eval_generation_batching import qa_file

    torch.backends.cuda.matmul.allow_tf32 = False
    path = qa_file(tmp_path, n=3)
    cuda_records, cuda_kl, cuda_kept = eval_records(tiny_dir, path, "cuda", compiled=True)
    cpu_records, cpu_kl, cpu_kept = eval_records(tiny_dir, path, "cpu", compiled=False)
    assert cuda_records == cpu_records and cuda_kept == cpu_kept
    for got, want in zip(cuda_kl, cpu_kl, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
