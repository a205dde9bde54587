"""The `--compile` decode step: a compiled transformer block shared by the layers (or the whole step as one
graph), and on CUDA the step replayed as one CUDA graph. generate.py's loops call it like the eager step."""

from __future__ import annotations

import time

import torch
from torch import Tensor

import cpu_bf16_kernels
from checkpoint import COMPILE_SCOPES
from model import Transformer


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (differences of it count a run's compiles).
    torch._dynamo is imported here, not at the top: its ~1 s import is never needed by a command refused at
    its flags."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _run_block(layer: torch.nn.Module, x: Tensor, cos: Tensor, sin: Tensor, input_pos: Tensor) -> Tensor:
    return layer(x, cos, sin, input_pos)


def _run_step(model: Transformer, token: Tensor, input_pos: Tensor) -> Tensor:
    return model(token, input_pos)[:, -1]


class CompiledDecodeStep:
    """The `--compile` decode step: one compiled transformer block shared by every layer, and on CUDA the
    whole step (all layers, embedding and head) replayed as one CUDA graph.

    Why a block, not the whole model: dynamo traces the block once and every layer reuses the graph (the
    layers' weights and cache buffers are its inputs), so a cold compile costs one layer instead of 30 (it
    was ~1 minute for the 30-layer model on 2 CPU cores); layers whose caches differ in strategy or size
    get a graph each. Why a CUDA graph: a decode step of a small batch is hundreds of small kernels, and
    launching them one by one from Python costs more than running them; a replayed graph is one launch.
    The graph reads its inputs from static tensors (the token and the position are copied in) and every
    cache buffer keeps its address, since caches are updated in place.

    `prepare(model)` compiles and captures before the prompt, on the model's freshly reset caches: the
    warm-up steps write into them, so they are reset again afterwards (generate calls it; the time is
    reported as compile seconds, apart from decode speed). A step called on caches it was not prepared
    for still runs compiled, without the graph.

    `scope="step"` (`--compile_scope step`) compiles the whole step as one graph instead: on the CPU, where
    no CUDA graph hides the per-call costs, each compiled block's call costs ~180 µs beyond its kernels
    (dynamo's frame entry and guards, the AOT and inductor wrappers: measured on the bundled model, warm
    weights, 2 threads), 5 ms of a ~27 ms step at 256 slots; one graph pays that once. Its cold compile
    traces and lowers every layer (60-75 s cold for the 30-layer model on 2 cores, against ~32 s for a block).
    """

    def __init__(self, cuda_graph: bool = True, scope: str = "block", backend: str = "inductor") -> None:
        if scope not in COMPILE_SCOPES:
            raise ValueError(f"compile scope {scope!r}: one of {', '.join(COMPILE_SCOPES)}")
        self.scope = scope
        # Without inductor's stride asserts on the custom ops' outputs: ~25 a block, ~0.55 us each, 750 a CPU
        # step (0.97 of the step time over five in-process pairs, docs/performance.md); on a GPU they run at
        # capture only. The compiled-vs-eager matrices check what they would catch (an op whose output
        # strides differ from its fake implementation's). `backend="aot_eager"` (tests only) traces the same
        # graph through dynamo and AOT autograd and runs it eagerly: one graph, the same guards, no code
        # generation (a cold inductor compile is ~3-10 s on 2 cores, a trace ~1-2 s).
        options = {"size_asserts": False} if backend == "inductor" else None
        self.block = torch.compile(_run_block, fullgraph=True, dynamic=False, backend=backend, options=options)
        self.whole_step = torch.compile(_run_step, fullgraph=True, dynamic=False, backend=backend,
                                        options=options)
        self.cuda_graph = cuda_graph
        # Per set of caches (their ids) and positions per step (1 shared, or one per row): the captured graph,
        # its static inputs (token, position) and logits.
        self.graphs: dict[tuple[tuple[int, ...], int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        self.prepared: set[tuple[tuple[int, ...], int]] = set()
        # Per prepared set, the model's cache_epoch whose first step ran with every guard (see __call__).
        self.guards_checked: dict[tuple[tuple[int, ...], int], int] = {}
        self.compile_seconds = 0.0

    def compiled_step(self, model: Transformer, token: Tensor, input_pos: Tensor) -> Tensor:
        cpu_bf16_kernels.load_before_tracing(model.tok_embeddings.weight)
        if self.scope == "step":
            if token.stride(0) != token.shape[1]:  # a column of a longer sequence (teacher forcing): dynamo guards
                token = token.clone(memory_format=torch.contiguous_format)  # strides, and prepare's are plain
            return self.whole_step(model, token, input_pos)
        # Layers may differ in strategy or budget (patterns, debug shadows): one graph per kind of layer.
        limit = max(torch._dynamo.config.recompile_limit, 2 * model.args.n_layer)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return model(token, input_pos, run_block=self.block)[:, -1]

    def prepare(self, model: Transformer, batch_size: int = 1, per_row_positions: bool = False) -> None:
        """Compile (and on CUDA capture) the step for `batch_size` rows, at one shared position per step or,
        with `per_row_positions`, one per row (input_pos [B], generate_batch)."""
        key = (tuple(id(c) for c in model.caches()), batch_size if per_row_positions else 1)
        if key in self.prepared:
            return
        started = time.perf_counter()
        device = model.tok_embeddings.weight.device
        with torch.inference_mode():  # inputs made here are inference tensors, like the loop's (no guard miss)
            token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
            input_pos = torch.zeros(key[1], dtype=torch.long, device=device)
            model.reset_caches()
            if device.type == "cuda" and self.cuda_graph:
                stream = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # warm-up (compiles) off the capture's stream, as CUDA asks
                    for _ in range(2):
                        self.compiled_step(model, token, input_pos)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = self.compiled_step(model, token, input_pos)
                self.graphs[key] = (graph, token, input_pos, logits)
                torch.cuda.synchronize(device)
            else:
                for _ in range(2):
                    self.compiled_step(model, token, input_pos)
            model.reset_caches()
        self.prepared.add(key)
        self.compile_seconds += time.perf_counter() - started

    def __call__(self, model: Transformer, token: Tensor, input_pos: Tensor) -> Tensor:
        key = (tuple(id(c) for c in model.caches()), input_pos.numel())
        captured = self.graphs.get(key) if self.graphs else None
        if captured is None:
            if self.guards_checked.get(key) != model.cache_epoch:
                if key in self.prepared:
                    self.guards_checked[key] = model.cache_epoch
                return self.compiled_step(model, token, input_pos)
            # Without a CUDA graph, dynamo checks every guard of a block at each of its 30 calls a step (a profile
            # put ~1.8 ms of a ~12 ms CPU step at 256 slots on it; an in-process A/B of this stance measured no
            # difference past the noise, docs/performance.md). Once a prepared set's graphs exist and the
            # first step since the caches were last reset or refilled passed every guard, a step only tells those
            # graphs apart (the guards that differ between them): decoding changes tensors' values, not what a
            # guard reads (shapes, dtypes, the caches' settings).
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self.compiled_step(model, token, input_pos)
        graph, static_token, static_pos, logits = captured
        static_token.copy_(token)
        static_pos.copy_(input_pos)
        graph.replay()
        return logits  # overwritten by the next replay: sample from it before then

    def graphs_per_set(self, model: Transformer) -> int:
        """Graphs `prepare` compiles for the model's caches at one shape: one per kind of layer, or one."""
        if self.scope == "step":
            return 1
        return len({(type(c), c.max_cache_length) for c in model.caches()})


def compile_decode_step(cuda_graph: bool = True, scope: str = "block", backend: str = "inductor") -> CompiledDecodeStep:
    return CompiledDecodeStep(cuda_graph, scope, backend)
