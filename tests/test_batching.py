"""Batched decoding: rows of different lengths decoded together give, row by row, what each row gives
alone at batch 1 (the reference): every registered strategy and its debug_ twin, every storage, adakv,
re-rotated positions, an appended chunk, fed long prompts, eager and compiled."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch._dynamo.utils import counters

import cpu_bf16_kernels
from cache import KVCache, cache_statistics, row_statistics
from cache_setup import attach_caches, attach_row_caches, cache_config
from gates import attach_random_gates
from generate import (
    compile_decode_step,
    decode_one_token,
    generate,
    generate_batch,
    prefill,
    prefill_rows,
    shares_prefill,
)
from generation_stats import row_stats
from tests.conftest import make_tiny_model
from tests.strategy_matrix import (
    ADAKV,
    ALL,
    ALLOCATIONS,
    BUDGETS,
    CHUNKABLE,
    STORAGE_BUDGETS,
    TOKEN_CLASSES,
    VOCAB,
    cache_args,
    inner,
)

LENGTHS = (24, 19, 13)  # prompt tokens per row: three budgets from a fractional --max_cache_length
NEW = 12
QUANTIZED_ATOL = 2e-3  # quantized storages: one code may flip at a rounding boundary (see the test)
ATOL = 1e-4  # float32 logits; the batch only changes how many (empty, masked) slots a row's sums run over


def sequences(seed: int = 0) -> list[torch.Tensor]:
    """No token twice in a row's sequence: a repeated token has the same key norm at any position (RoPE
    keeps norms), an exact tie for l2 that the batch's matmuls round differently from batch 1's."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(VOCAB, generator=g)[: n + NEW] for n in LENGTHS]


def tiny_model(**shape):
    model = make_tiny_model(**shape)
    attach_random_gates(model, seed=0)  # used only by caches that need gates
    return model


def held(cache: KVCache) -> list[list[int]]:
    """Positions held per KV head, sorted (row 0 of `cache`: inside a row context, that row)."""
    c = inner(cache)
    pos = c.pos[0].expand(c.n_kv_heads, -1)
    return [sorted(pos[h][c.mask[0, h, 0]].tolist()) for h in range(c.n_kv_heads)]


def flat(value) -> list[float]:
    return [x for v in value for x in flat(v)] if isinstance(value, list) else [] if value is None else [value]


def teacher_forced(model, seq: torch.Tensor, prompt: int, step, prefill_length: int | None = None):
    """Batch 1: logits after the prompt and after each forced token, [NEW, vocab]; what the caches hold."""
    with torch.inference_mode():
        model.reset_caches()
        rows = [prefill(model, seq[None, :prompt], prefill_length)]
        for p in range(prompt, len(seq) - 1):
            rows.append(step(model, seq[None, p : p + 1], torch.tensor([p])).clone())
    return torch.cat(rows), [held(c) for c in model.caches()]


def teacher_forced_batch(model, seqs: list[torch.Tensor], step, prefill_lengths=None, device: str = "cpu",
                         pack: bool | None = None):
    """The same for every row at once: prompts prefilled (generate.prefill_rows: packed into one forward pass
    with `pack`, by default where the products are not batch-invariant), then one step for all rows per token
    (logits on the CPU)."""
    seqs = [s.to(device) for s in seqs]
    lengths = torch.tensor(LENGTHS, device=device)
    with torch.inference_mode():
        model.reset_caches()
        rows = [prefill_rows(model, [s[:n] for s, n in zip(seqs, LENGTHS, strict=True)], prefill_lengths, pack=pack)]
        for i in range(NEW - 1):
            token = torch.stack([s[n + i] for s, n in zip(seqs, LENGTHS, strict=True)])[:, None]
            rows.append(step(model, token, lengths + i).clone())  # a CUDA graph's logits are overwritten next step
    kept = []
    for b in range(len(seqs)):
        with model.cache_row(b):
            kept.append([held(c) for c in model.caches()])
    return torch.stack(rows, dim=1).cpu(), kept  # [B, NEW, vocab]


def attention_slots(model) -> list[int]:
    """The slots each layer's attention runs over: a cache's budget, or a debug twin's whole sequence (its
    reference cache holds every position, so a short row of a batch has the longest row's slots)."""
    return [c.pos.shape[-1] for c in model.caches()]


def assert_rows_match(args, step=decode_one_token, feed: bool = False, model=None, atol: float = ATOL,
                      pack: bool | None = None, seqs: list[torch.Tensor] | None = None) -> None:
    """Each row of a batch decodes what it decodes alone: the same held positions, and logits within `atol`,
    or bit for bit where the rows are prefilled alone (not `pack`), the products are batch-invariant (the
    CPU's kernels, cpu_bf16_kernels.linears) and so is the attention: bfloat16's kernel, or float32's torch
    attention when every row has the same slots (a row of a batch has the slots of its largest row, and
    float32's sums run over the empty ones too, in another order)."""
    model = model or tiny_model()
    seqs = sequences() if seqs is None else seqs
    row_specs = attach_row_caches(model, args, list(LENGTHS), NEW, classes=TOKEN_CLASSES)
    batch_slots = attention_slots(model)
    feed_lengths = [min(n, *(s.max_cache_length for s in specs)) for n, specs in zip(LENGTHS, row_specs,
                                                                                      strict=True)]
    logits, kept = teacher_forced_batch(model, seqs, step, feed_lengths if feed else None, pack=pack)
    stats = [row_statistics(model.caches(), b) for b in range(len(LENGTHS))]
    for b, (seq, n) in enumerate(zip(seqs, LENGTHS, strict=True)):
        specs = attach_caches(model, args, n, NEW, classes=TOKEN_CLASSES)
        alone, alone_kept = teacher_forced(model, seq, n, step, feed_lengths[b] if feed else None)
        assert [s.max_cache_length for s in specs] == [s.max_cache_length for s in row_specs[b]]
        same_slots = attention_slots(model) == batch_slots
        if not pack and model.batch_invariant() and (model.output.weight.dtype == torch.bfloat16 or same_slots):
            assert torch.equal(logits[b], alone), f"row {b}: {(logits[b] - alone).abs().max()} from alone"
        else:
            torch.testing.assert_close(logits[b], alone, atol=atol, rtol=atol, msg=f"row {b}")
        assert kept[b] == alone_kept, f"row {b}: held positions differ"
        reference = cache_statistics(model.caches())
        for key in ("compression_ratio", "tokens_held_per_head", "evictions_per_layer", "cache_budget_per_layer",
                    "cache_budget_per_head", "attention_loss_mean"):
            assert flat(stats[b].get(key)) == pytest.approx(flat(reference.get(key)), abs=2e-4), (b, key)


# Prefilled alone (the CPU's path) at both budgets; packed into one pass (a GPU's) at the fractional one, where
# the rows' budgets differ.
ALONE_AND_PACKED = [("absolute", None), ("fraction", None), ("fraction", True)]


@pytest.mark.parametrize(("budget", "pack"), ALONE_AND_PACKED, ids=["absolute-alone", "fraction-alone",
                                                                    "fraction-packed"])
@pytest.mark.parametrize("strategy", ALL)
def test_every_strategy_decodes_rows_as_alone(strategy, budget, pack):
    """Rows prefilled alone: bit for bit where assert_rows_match says; packed: within ATOL."""
    assert_rows_match(cache_args(strategy, BUDGETS[budget]), pack=pack)


@pytest.mark.parametrize("strategy", ALL)
def test_every_strategy_decodes_rows_bit_for_bit_in_bfloat16(strategy):
    """In bfloat16 a product's rounding flips which tokens a strategy keeps, so a batch's rows equal their
    batch-1 runs only if every product and attention gives a row what it gives alone; the CPU's do
    (cpu_bf16_kernels). The bundled model's widths (576, 1536; 9 query heads on 3 KV heads), at which
    oneDNN's bf16 products round by their row count on an AMX Xeon, and rows of different slots."""
    model = tiny_model(dim=576, intermediate_size=1536, n_head=9, n_kv_head=3).to(torch.bfloat16)
    assert model.batch_invariant(len(LENGTHS))
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"]), model=model)


@pytest.mark.parametrize("storage", ["2bit", "4bit", "8bit", "kivi4"])
@pytest.mark.parametrize("strategy", ["heavy_hitter", "debug_tova"])
def test_quantized_storages_decode_rows_bit_for_bit_in_bfloat16(strategy, storage):
    """The CPU's attention from the codes (per-token and KIVI kernels) shares the softmax that ignores a row's
    trailing empty slots: quantized rows too are their batch-1 rows, bit for bit."""
    model = tiny_model(dim=576, intermediate_size=1536, n_head=9, n_kv_head=3).to(torch.bfloat16)
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"], storage), model=model)


def test_rows_beyond_one_kernel_call_are_prefilled_packed():
    """Past MAX_ROWS rows a decode step's products leave the kernel for oneDNN's or MKL's (faster there, and
    rounded by the batch): rows are then not batch-invariant, and their prompts are packed, as on a GPU."""
    model = tiny_model()
    for rows, invariant in ((cpu_bf16_kernels.MAX_ROWS, True), (cpu_bf16_kernels.MAX_ROWS + 1, False)):
        attach_row_caches(model, cache_args("tova", BUDGETS["absolute"]), [20] * rows, NEW, classes=TOKEN_CLASSES)
        assert model.batch_invariant() is invariant
        assert shares_prefill(model, [torch.arange(20)] * rows, None) is not invariant


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strategy", ["l2", "debug_l2", "tova"])
def test_exact_score_ties_break_as_alone(strategy, dtype):
    """Repeated tokens: a layer-0 key repeats its norm at every position (RoPE keeps norms), an exact tie for
    l2 that only the last bit of the products breaks, so a row keeps its batch-1 tokens only if its products
    are its batch-1 products, bit for bit (eval.batching.TIED_SCORES: where they are not, l2 runs one row)."""
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 6, (n + NEW,), generator=g) + 40 for n in LENGTHS]  # 6 ordinary tokens, repeated
    assert_rows_match(cache_args(strategy, BUDGETS["absolute"]), model=tiny_model().to(dtype), seqs=seqs)


QUANTIZED = [s for s in STORAGE_BUDGETS if s[0] != "dense"] + [("2bit", "fraction"), ("8bit", "absolute")]


@pytest.mark.parametrize(("storage", "budget"), QUANTIZED)
@pytest.mark.parametrize("strategy", ["heavy_hitter", "keydiff", "hybrid", "debug_tova"])
def test_quantized_storages_decode_rows_as_alone(strategy, storage, budget):
    """Same held positions; logits within 2e-3: a value on a rounding boundary of its quantization grid can
    take the neighbouring code in one of the runs (the batch's matmuls round its float32 sums differently),
    which moved one step's logits by 7.7e-4 at 8 bits (heavy_hitter, measured on an AVX-512 Xeon; other
    steps within 1.5e-5). A batching bug moves whole rows by orders of magnitude more."""
    assert_rows_match(cache_args(strategy, BUDGETS[budget], storage), atol=QUANTIZED_ATOL)


@pytest.mark.parametrize("flags", [["--history_window_size", "16"], ["--attn_thresholding"]])
def test_heavy_hitter_history_per_row(flags):
    """A history window's column counter is per row: a window of 16 is full after the longer prompts, not the
    shortest (13 columns)."""
    assert_rows_match(cache_args("heavy_hitter", BUDGETS["fraction"], "dense", *flags))


@pytest.mark.parametrize("strategy", ["heavy_hitter", "l2", "debug_tova"])
def test_pooled_heads_decode_rows_as_alone(strategy):
    assert strategy in ADAKV
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"], "dense", *ALLOCATIONS["adakv"]))


@pytest.mark.parametrize("strategy", ["recent_global", "tova", "hybrid"])
def test_rerotated_rows_decode_as_alone(strategy):
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"], "dense", "--rerotate_positions"))


@pytest.mark.parametrize(("chunk", "pack"), [("5", None), ("6", None), ("5", True)],
                         ids=["5-alone", "6-alone", "5-packed"])
@pytest.mark.parametrize("strategy", CHUNKABLE)
def test_rows_prefilled_in_chunks_decode_as_alone(strategy, chunk, pack):
    """--prefill_chunk: each row's prompt (24, 19, 13 tokens) compressed to its own budget after every chunk in
    its row context (with `pack`, the rows' chunks packed into one pass per offset, as on a GPU), then decoded
    with the others: every strategy and twin that accepts chunks. Chunks of 5 end the rows in partial chunks of 4, 4
    and 3 tokens; chunks of 6 end two rows in a one-token chunk (a decode step in the row) and rows finish at
    different passes."""
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"], "dense", "--prefill_chunk", chunk), pack=pack)


# Per-layer budgets and strategies: each row resolves its own budgets from its own length, layer by layer.
PATTERNS = {
    "budgets_repeat": ["--cache_strategy", "heavy_hitter", "--max_cache_length", "10", "16",
                       "--cache_length_pattern", "repeat"],
    "pyramid": ["--cache_strategy", "tova", "--max_cache_length", "0.5", "--cache_length_pattern", "pyramid"],
    "funnel": ["--cache_strategy", "keydiff", "--max_cache_length", "0.5", "--cache_length_pattern", "funnel"],
    "strategy_pattern": ["--cache_strategy", "l2", "heavy_hitter", "--cache_strategy_pattern", "repeat",
                         "--max_cache_length", "0.5"],
    "prompt_rule": ["--cache_strategy", "recent_global", "--prompt_compression_strategy", "keep_it_odd",
                    "--max_cache_length", "0.5"],
    "preset": ["--cache_config", "heavy_hitter_pyramid", "--max_cache_length", "0.5"],  # PyramidKV's preset
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_budget_and_strategy_patterns_decode_rows_as_alone(pattern):
    assert_rows_match(cache_config([*PATTERNS[pattern], "--global_tokens", "2", "--recent_window", "2"]))


@pytest.mark.parametrize("strategy", ["heavy_hitter", "gated", "kivi"])
def test_fed_long_prompts_decode_rows_as_alone(strategy):
    storage = "kivi4" if strategy == "kivi" else "dense"
    assert_rows_match(cache_args("l2" if strategy == "kivi" else strategy, BUDGETS["absolute"], storage), feed=True)


def test_shared_positions_still_decode_equal_rows():
    """The shared-position API (equal-length rows, input_pos [1]) is the per-row one with equal positions."""
    model = tiny_model()
    args = cache_args("heavy_hitter", BUDGETS["fraction"])
    seqs = torch.stack([s[:LENGTHS[2] + NEW] for s in sequences()])
    attach_caches(model, args, LENGTHS[2], NEW, classes=TOKEN_CLASSES, batch_size=3)
    with torch.inference_mode():
        model.reset_caches()
        shared = [prefill(model, seqs[:, : LENGTHS[2]])]
        for p in range(LENGTHS[2], seqs.shape[1] - 1):
            shared.append(decode_one_token(model, seqs[:, p : p + 1], torch.tensor([p])))
    for b in range(3):
        attach_caches(model, args, LENGTHS[2], NEW, classes=TOKEN_CLASSES)
        alone, _ = teacher_forced(model, seqs[b], LENGTHS[2], decode_one_token)
        torch.testing.assert_close(torch.stack(shared, dim=1)[b], alone, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("strategy", ["heavy_hitter", "hybrid", "debug_gated"])
def test_appended_chunks_at_each_rows_positions(strategy):
    """The kvpress protocol per row: a prompt prefilled within a prompt budget, then a chunk appended at the
    row's own positions in its row context, then decoding together."""
    model = tiny_model()
    args = cache_args(strategy, BUDGETS["fraction"])
    seqs, chunk = sequences(1), 4

    def run(rows: list[int]):
        with torch.inference_mode():
            model.reset_caches()
            for i, b in enumerate(rows):
                n = LENGTHS[b] - chunk
                with model.cache_row(i) if len(rows) > 1 else nullcontext():
                    for cache in model.caches():
                        inner(cache).prompt_budget = n // 2
                    prefill(model, seqs[b][None, :n])
                    last = model(seqs[b][None, n : LENGTHS[b]], torch.arange(n, LENGTHS[b]), append=True)[:, -1]
            out = [last]
            token = torch.stack([seqs[b][LENGTHS[b]] for b in rows])[:, None]
            out.append(decode_one_token(model, token, torch.tensor([LENGTHS[b] for b in rows])))
            return out[-1]

    attach_row_caches(model, args, list(LENGTHS), NEW, classes=TOKEN_CLASSES)
    together = run([0, 1, 2])
    for b in range(3):
        attach_caches(model, args, LENGTHS[b], NEW, classes=TOKEN_CLASSES)
        torch.testing.assert_close(together[b : b + 1], run([b]), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_batch_gives_each_row_its_own_generation(temperature):
    model = tiny_model()
    args = cache_args("tova", BUDGETS["fraction"])
    prompts = [s[:n].tolist() for s, n in zip(sequences(2), LENGTHS, strict=True)]
    attach_row_caches(model, args, list(LENGTHS), NEW, classes=TOKEN_CLASSES)
    rows = generate_batch(model, prompts, NEW, eos_ids=[], temperature=temperature, top_k=50, seed=3)
    for prompt, row in zip(prompts, rows, strict=True):
        attach_caches(model, args, len(prompt), NEW, classes=TOKEN_CLASSES)
        assert row.tokens == generate(model, prompt, NEW, eos_ids=[], temperature=temperature, top_k=50, seed=3).tokens
        assert row.decode_steps == NEW - 1


@pytest.mark.parametrize("strategy", ["full", "heavy_hitter", "debug_tova"])
def test_rows_stop_at_their_own_eos(strategy):
    """A row that stops keeps being decoded with the others; its statistics are still its batch-1 ones."""
    model = tiny_model()
    args = cache_args(strategy, BUDGETS["fraction"])
    prompts = [s[:n].tolist() for s, n in zip(sequences(3), LENGTHS, strict=True)]
    attach_row_caches(model, args, list(LENGTHS), NEW, classes=TOKEN_CLASSES)
    free = generate_batch(model, prompts, NEW, eos_ids=[])
    eos = free[1].tokens[3]
    stopped = generate_batch(model, prompts, NEW, eos_ids=[eos])
    assert any(len(s.tokens) < NEW for s in stopped) and any(len(s.tokens) == NEW for s in stopped)
    reported = [row_stats(len(p), s, model, b) for b, (p, s) in enumerate(zip(prompts, stopped, strict=True))]
    for prompt, f, s, ours in zip(prompts, free, stopped, reported, strict=True):
        cut = f.tokens.index(eos) + 1 if eos in f.tokens else NEW
        assert s.tokens == f.tokens[:cut] and s.stopped_at_eos == (eos in f.tokens)
        attach_caches(model, args, len(prompt), NEW, classes=TOKEN_CLASSES)
        assert generate(model, prompt, NEW, eos_ids=[eos]).tokens == s.tokens
        expected = cache_statistics(model.caches())
        for key in ("tokens_held_per_head", "evictions_per_layer", "compression_ratio"):
            assert ours[key] == expected[key], key
        if strategy.startswith("debug_"):
            assert ours["attention_loss_mean"] == pytest.approx(expected["attention_loss_mean"], abs=1e-5)


def test_every_buffer_has_the_row_first_or_is_declared_shared():
    """The per-buffer audit, over the registry: a buffer the row context would slice must be per row."""
    for strategy in ALL:
        for storage in ("dense", "kivi4"):
            model = tiny_model()
            attach_row_caches(model, cache_args(strategy, "0.5", storage), list(LENGTHS), NEW, classes=TOKEN_CLASSES)
            for cache in model.caches():
                for module in cache.modules():
                    shared = getattr(module, "row_shared_buffers", ())
                    for name, buf in module.named_buffers(recurse=False):
                        assert name in shared or buf.shape[0] == len(LENGTHS), (strategy, storage, name)


def decode_rows_at_one_position(strategy: str, storage: str, compiled: bool, device: str = "cpu"):
    """The batched bench's step: rows of equal prompt lengths, each prefilled in its row, then decoded at one
    shared position per step (input_pos [1]); compiled with prepare(model, B) (a CUDA graph on CUDA).
    Returns the logits [steps, B, vocab] (on the CPU), each row's kept positions per layer, and the graphs
    compiled after prepare (None eager)."""
    n, g = LENGTHS[0], torch.Generator().manual_seed(0)
    seqs = [torch.randperm(VOCAB, generator=g)[: n + NEW].to(device) for _ in LENGTHS]
    model = tiny_model().to(device)
    model.init_rope_tables()
    attach_row_caches(model, cache_args(strategy, BUDGETS["fraction"], storage), [n] * len(seqs), NEW,
                      classes=TOKEN_CLASSES)
    step, graphs = decode_one_token, None
    if compiled:
        torch._dynamo.reset()
        step = compile_decode_step()
        step.prepare(model, len(seqs))
        counters.clear()
    logits = []
    with torch.inference_mode(), torch._dynamo.config.patch(error_on_recompile=True):
        model.reset_caches()
        prefill_rows(model, [s[:n] for s in seqs])
        for i in range(NEW - 1):
            token = torch.stack([s[n + i] for s in seqs])[:, None]
            logits.append(step(model, token, torch.tensor([n + i], device=device)).cpu())
    if compiled:
        graphs = counters["stats"]["unique_graphs"]
    kept = []
    for b in range(len(seqs)):
        with model.cache_row(b):
            kept.append([held(c) for c in model.caches()])
    return torch.stack(logits), kept, graphs


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "storage"), [("hybrid", "kivi4")])
def test_compiled_rows_at_one_shared_position_equal_eager(strategy, storage):
    """Compiled, those rows keep eager's positions in every row and layer and its logits (float32: ATOL on
    dense storage, QUANTIZED_ATOL on quantized), with every graph compiled by prepare. One case (a compile,
    FastGen's own decode, KIVI's flush in every row at once): what differs from the per-row-position cases
    below is only input_pos's shape."""
    eager_logits, eager_kept, _ = decode_rows_at_one_position(strategy, storage, compiled=False)
    compiled_logits, compiled_kept, graphs = decode_rows_at_one_position(strategy, storage, compiled=True)
    assert compiled_kept == eager_kept and graphs == 0
    atol = QUANTIZED_ATOL if storage != "dense" else ATOL
    torch.testing.assert_close(compiled_logits, eager_logits, atol=atol, rtol=atol)


# Each case a compile: attention state, FastGen's own decode, a graph constant (the seed), a debug twin; KIVI's
# per-row flush on two of them.
COMPILED = [("heavy_hitter", "dense"), ("hybrid", "kivi4"), ("random", "dense"), ("debug_keydiff", "kivi4")]


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "storage"), COMPILED)
def test_compiled_rows_decode_as_alone_without_recompiling(strategy, storage):
    step = compile_decode_step()
    model = tiny_model()
    args = cache_args(strategy, BUDGETS["fraction"], storage)
    attach_row_caches(model, args, list(LENGTHS), NEW, classes=TOKEN_CLASSES)
    step.prepare(model, len(LENGTHS), per_row_positions=True)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        logits, _ = teacher_forced_batch(model, sequences(), step)
    assert counters["stats"]["unique_graphs"] == 0  # every graph was compiled by prepare
    for b, (seq, n) in enumerate(zip(sequences(), LENGTHS, strict=True)):
        attach_caches(model, args, n, NEW, classes=TOKEN_CLASSES)
        alone, _ = teacher_forced(model, seq, n, decode_one_token)
        torch.testing.assert_close(logits[b], alone, atol=ATOL, rtol=ATOL)


CHUNKED_WITH = {  # packed chunks beside the settings that change how a chunk is attended or re-prefilled
    "adakv": ("heavy_hitter", ALLOCATIONS["adakv"]),  # each head re-prefilled over its own held tokens
    "adakv_debug": ("debug_tova", ALLOCATIONS["adakv"]),
    "adakv_kvzip": ("kvzip", ALLOCATIONS["adakv"]),  # each head's chunk scored over its own held sinks
    "rerotated": ("tova", ("--rerotate_positions",)),  # the chunk at ranks after the row's held tokens
    "kivi": ("keydiff", ("--cache_bits", "4", "--cache_quantization", "kivi")),
    "per_token_2bit": ("heavy_hitter", ("--cache_bits", "2")),
}


@pytest.mark.parametrize("case", sorted(CHUNKED_WITH))
def test_rows_prefilled_in_chunks_with_pools_ranks_and_codes_decode_as_alone(case):
    strategy, flags = CHUNKED_WITH[case]
    atol = QUANTIZED_ATOL if "--cache_bits" in flags else ATOL
    assert_rows_match(cache_args(strategy, BUDGETS["fraction"], "dense", *flags, "--prefill_chunk", "5"), atol=atol)
