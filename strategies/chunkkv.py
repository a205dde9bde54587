"""`chunkkv`: ChunkKV (Liu et al. 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
Long-Context LLM Inference", arXiv 2502.00299).

ChunkKV keeps whole chunks of consecutive tokens rather than isolated ones: a chunk's score aggregates
its tokens' scores, and the best chunks are kept, so a kept token keeps its neighbours (the phrase it
belongs to). `ChunkedScores` does this for any rule: over the chunks of `--chunk_size` consecutive
positions (chunk c: positions c·C .. c·C + C − 1) it sums the rule's per-token scores of the held tokens
and divides by the number of the chunk's positions seen so far (C for a whole chunk: kvpress's mean, which
ranks whole chunks as the paper's sum does and does not rank a chunk still being filled, the prompt's last
or the one decode is writing, below whole ones for the positions it has yet to see), and gives every token
its chunk's score, so the shared top-k (prompt_compression.py) and the argmin eviction keep or drop chunks
together. Within a chunk the later token ranks a hair lower (a factor 1 − 10⁻⁴·(pos mod C)/C), so a
chunk cut at the budget keeps its first tokens, and the order is strict.

`chunkkv` chunks TOVA's score (strategies/tova.py: the latest query's attention, the one-query form of
the observation-window attention ChunkKV sums).

- Prompt: the last prompt query's attention summed per chunk, the best chunks kept.
- Decode (the paper compresses the prompt only): the latest step's attention summed over the *held*
  tokens of each chunk (an evicted token's position still counts in the divisor); the lowest chunk loses
  its last token, which lowers its score further, so the next steps go on evicting it: chunks leave whole,
  one token a step.

Where this differs from the paper: its window is the last W prompt queries (SnapKV's), here one query,
so that the decode rule (the latest query) is the prompt rule; its layer-wise index reuse (one layer's
kept chunks reused by the next) needs layers to share indices, which per-layer caches do not. kvpress's
ChunkKVPress sums the scores over a layer's KV heads and keeps one chunk set per layer; here each KV head
keeps its own chunks, as every head-specific strategy here.
"""

from __future__ import annotations

from torch import Tensor

from cache import KVCache, Setting, register_strategy, row_positions
from strategies.tova import TovaCache

CHUNK = Setting("chunk_size", 10, low=1, help="tokens per chunk (consecutive positions kept or evicted together)")
TIE = 1e-4  # within-chunk tie-break, far below the gaps between chunk scores that matter


def chunk_scores(scores: Tensor, pos: Tensor, chunk: int, n_chunks: int, end: int | Tensor) -> Tensor:
    """Each held token's chunk score: the sum of `scores` [B, heads, L] over its chunk's held tokens (pos ≥ 0;
    pos [B, 1 or heads, L]) over the number of the chunk's positions before `end` (an int, or [1 or B, 1, 1]
    per row), with the within-chunk tie-break: [B, heads, L] float32 (0 for empty slots)."""
    pos = pos.expand_as(scores)
    held = pos >= 0
    ids = pos.clamp(min=0) // chunk
    values = scores.float().masked_fill(~held, 0.0)
    sums = values.new_zeros(*scores.shape[:2], n_chunks).scatter_add_(2, ids, values).gather(2, ids)
    seen = (end - ids * chunk).clamp(min=1, max=chunk)
    return (sums / seen * (1 - TIE * (pos.clamp(min=0) % chunk).float() / chunk)).masked_fill(~held, 0.0)


class ChunkedScores(KVCache):
    """Mixed in before a strategy class: its token and prompt scores, summed per chunk."""

    settings = (CHUNK,)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.chunk = int(self.setting(CHUNK))
        if self.capacity_needed >= 1 << 62:
            raise ValueError(f"a {self.name} cache needs capacity_needed (the positions it will see)")
        self.n_chunks = -(-self.capacity_needed // self.chunk)

    def token_scores(self, input_pos: Tensor) -> Tensor:
        # The positions before the one being inserted have been seen.
        return chunk_scores(super().token_scores(input_pos), self.pos, self.chunk, self.n_chunks,
                            row_positions(input_pos))

    @classmethod
    def prompt_scores(cls, cache: KVCache, k: Tensor, q: Tensor) -> Tensor:
        scores = super().prompt_scores(cache, k, q)
        chunk = int(cache.setting(CHUNK))
        pos = cache.scored_positions(k)  # true positions: a chunked prefill scores held tokens + a chunk
        end = cache.scored_length(k)
        return chunk_scores(scores, pos, chunk, -(-end // chunk), end)


@register_strategy
class ChunkKVCache(ChunkedScores, TovaCache):
    name = "chunkkv"
    hyperparameters = ("global_tokens", "recent_window")
