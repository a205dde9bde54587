"""Rows decoded together: which runs may batch, batch-1 caches beside batched ones for the bench, and the
full cache's logits from one causal forward pass (the fidelity reference).

Every row evicts on its own ([B, ...] buffers, docs/DESIGN.md §4). The fidelity windows of a run share
positions (one length); the items of a generation task each sit in a row at their own position
(rows.greedy_answers: prefilled together where they start together, each row's cache fed its own tokens). A
row's statistics are read in its row context (Transformer.cache_row), where its caches are a batch-1 cache.
tests/test_eval_batching.py and tests/test_eval_generation_batching.py check that a row in a batch keeps and
records what it does alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import cache_setup
import cpu_bf16_kernels
from cache import KVCache
from cache_spec import LayerCacheSpec
from generate import ROUNDING_SENSITIVE_DTYPES, note_if_rows_round_by_batch
from model import Transformer
from tokenizer import Tokenizer

# Strategies whose scores tie exactly across repeats of a token: l2 scores a key by its norm, which RoPE
# keeps, and a layer-0 key is a function of the token alone. Which of the tied slots is evicted is then
# decided by the last bit of the norms, so a row keeps other tokens in a batch than alone wherever a batch's
# products round differently from one row's (per-window KL differed by up to 0.03 at batch 4, on the tiny
# model and pydoc text, before the CPU's products were batch-invariant). Runs that use these strategies (to
# evict, through a debug_ shadow, or as the prompt rule) decode at most MAX_ROWS rows together where the CPU
# kernels keep that many rows batch-invariant (Transformer.batch_invariant), and one row at a time where
# the products are not (a GPU, the CPU without its kernels), so their records stay a batch-1 run's.
TIED_SCORES = frozenset({"l2"})


def rows_per_batch(model: Transformer, specs: list[LayerCacheSpec], asked: int) -> int:
    """The rows to decode together: `asked`, or fewer where more rows would not be batch-invariant
    (Transformer.batch_invariant) and that rounding would change what a row keeps: in bfloat16 and float16,
    where the last bit of a product flips which tokens a strategy keeps (on the CPU, 12 bfloat16 rows of the
    bundled model each held other positions than alone after 16 steps, benchmarks.batched_prefill
    --decode_steps), and for TIED_SCORES in any dtype. Then as many rows as stay batch-invariant (MAX_ROWS with
    the CPU kernels), so the records stay a batch-1 run's; where none do (a GPU, the CPU without its kernels),
    TIED_SCORES decode one row at a time and the others `asked` rows, with a note."""
    tied = any(s.strategy.removeprefix("debug_") in TIED_SCORES or s.prompt_compression in TIED_SCORES
               for s in specs)
    sensitive = model.tok_embeddings.weight.dtype in ROUNDING_SENSITIVE_DTYPES
    if asked == 1 or not (tied or sensitive) or model.batch_invariant(asked):
        return asked
    rows = min(asked, cpu_bf16_kernels.MAX_ROWS)
    if model.batch_invariant(rows):
        return rows
    if tied:
        return 1
    note_if_rows_round_by_batch(model, asked, " (the run is reused at any --batch_size; --batch_size 1 for "
                                              "batch-1 records)")
    return asked


def longest_first(prompts: list[list[int]], run: Callable[[list[int]], list]) -> list:
    """`run(order)` with the items' indices longest prompt first (ties in the items' order), its results put
    back in the items' order. Rows decoding together then hold prompts of similar lengths, and the longest
    start first, so the last rows to finish are short ones."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list = [None] * len(prompts)
    for i, result in zip(order, run(order), strict=True):
        results[i] = result
    return results


def attach_row_caches(model: Transformer, specs: list[LayerCacheSpec], capacity: int, rows: int,
                      tokenizer: Tokenizer | None = None, classes: dict[str, Tensor] | None = None,
                      ) -> tuple[list[KVCache], list[KVCache]]:
    """Caches for `rows` rows attached to `model`, and batch-1 caches of the same specs, for fill_rows and
    copy_row (the bench prefills one prompt and copies it into every row). The batch-1 caches are built
    first by cache_setup.setup_caches, for what it prepares (gates, the checks)."""
    cache_setup.setup_caches(model, specs, capacity, tokenizer=tokenizer, classes=classes)
    single = model.caches()
    if rows == 1:
        return single, single
    cache_setup.setup_caches(model, specs, capacity, tokenizer=tokenizer, classes=classes, batch_size=rows)
    return model.caches(), single


def copy_row(caches: list[KVCache], single: list[KVCache], row: int) -> list[KVCache]:
    """`single` (batch-1 caches of the same specs) holding row `row` of `caches`: statistics and kept
    positions then come from the code that measures a batch-1 run, on exactly that row's state. A buffer
    without a batch dimension (a per-layer constant, a debug cache's step flags) is copied whole."""
    if single is caches:
        return single
    for big, small in zip(caches, single, strict=True):
        for (name, src), (_, dst) in zip(big.named_buffers(), small.named_buffers(), strict=True):
            part = src if src.shape == dst.shape else src[row: row + 1]
            if part.shape != dst.shape:
                raise ValueError(f"cache buffer {name} {tuple(src.shape)} has no leading batch dimension")
            dst.copy_(part)
    return single


def fill_rows(caches: list[KVCache], single: list[KVCache]) -> None:
    """Every row of `caches` set to the state of `single` (batch-1 caches of the same specs): B rows of one
    prefilled prompt, for a speed measurement whose prefill of B prompts would cost B times as long."""
    if single is caches:
        return
    for big, small in zip(caches, single, strict=True):
        for dst, src in zip(big.buffers(), small.buffers(), strict=True):
            dst.copy_(src)  # [1, ...] broadcasts over the rows; a buffer without rows is copied whole


def step_compression(caches: list[KVCache]) -> tuple[list[float], list[bool]]:
    """Per row, now: the compression ratio as cache.cache_statistics reports it (mean over layers and
    heads, rounded as there), and whether what attention reads is lossless, every token seen held at
    full precision in every layer and head (then the row's logits are exact attention: the full cache's).

    `lossless` reads the attended cache itself (KVCache's ratio), not a debug_ cache's shadow."""
    per_layer = [c.compression_ratio_per_head() for c in caches]
    own = [r if type(c).compression_ratio_per_head is KVCache.compression_ratio_per_head
           else KVCache.compression_ratio_per_head(c) for c, r in zip(caches, per_layer, strict=True)]
    reported = torch.stack(per_layer).transpose(0, 1).contiguous()
    attended = torch.stack(own).transpose(0, 1)
    ratios = [round(float(r.mean()), 4) for r in reported]  # [layers, n_kv] per row, as cache_statistics
    lossless = (attended.flatten(1).amax(dim=1) == 0).tolist()
    return ratios, lossless


def reference_hidden(model: Transformer, ids: Tensor) -> Tensor:
    """The last block's output at every position of each row of `ids` [B, T], by a causal forward pass
    without caches, [B, T, dim]: exact attention over the row, i.e. the full cache's states. Rows go one at
    a time (the prompt attention of a long row is the memory peak); caches are left detached."""
    model.remove_caches()
    captured: list[Tensor] = []
    # The hook keeps the states before the head: logits of a whole window are T x vocab floats per row.
    handle = model.layers[-1].register_forward_hook(lambda module, inputs, out: captured.append(out))
    try:
        positions = torch.arange(ids.shape[1], device=ids.device)
        for row in ids:
            model(row[None], positions, last_logits_only=True)
    finally:
        handle.remove()
    return torch.cat(captured)


def lm_head(model: Transformer, hidden: Tensor) -> Tensor:
    """Float32 logits of final states [..., dim], as Transformer.forward computes them after its blocks."""
    logits = model.output(model.norm(hidden)).float()
    cap = model.args.final_logit_softcap
    return cap * torch.tanh(logits / cap) if cap else logits


class ReferenceLogits:
    """The full cache's next-token logits of every row at a position, from reference_hidden, computed for
    `chunk` positions at a time (one matmul with the head's weights read once, while only chunk x vocab
    floats per row are held)."""

    def __init__(self, model: Transformer, hidden: Tensor, chunk: int = 32) -> None:
        self.model, self.hidden, self.chunk = model, hidden, chunk
        self.start, self.stop, self.logits = 0, 0, hidden.new_empty(0)

    def at(self, pos: int) -> Tensor:
        """Logits after feeding position `pos` (they predict token pos + 1), [B, vocab]."""
        if not self.start <= pos < self.stop:
            self.logits = lm_head(self.model, self.hidden[:, pos: pos + self.chunk])
            self.start, self.stop = pos, pos + self.logits.shape[1]
        return self.logits[:, pos - self.start]
