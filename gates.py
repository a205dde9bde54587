"""Learned forget gates for the `gated` KV cache (TRIM-KV's retention score, arXiv 2512.03324; trained in the
forget-gate form, train_gates.py).

Per layer, a linear map from the layer's attention input (the attention-normed hidden state) to one
logit per KV head; log_gate = logsigmoid(logit) ≤ 0 is the token's log retention per step, so after
`age` steps its retention is exp(log_gate × age). The gated cache evicts the token with the lowest
log_gate × age; `train_gates.py` learns the gates by distillation (see its docstring).

Files are safetensors (never pickle): tensors `layers.{i}.weight` [n_kv, dim] and `layers.{i}.bias`
[n_kv]; the metadata identifies the model the gates were trained on and records how they were trained.

Identity. Caches are attached through `cache_setup.setup_caches(model, specs, ...)`, which sees the model
but not the checkpoint path, so a gates file is matched to the model itself: its shape (layers, heads,
dims, vocabulary) and a probe of its weights (norms of a few embedding rows and the per-layer mean of
the attention-norm weights), compared with a 2% tolerance so that the same model in bfloat16 or
another quantization still matches. The checkpoint's name (GGUF `general.name`) is stored for messages.
A fine-tune of the same base model may pass the probe: pass --gates_path to be explicit.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from atomic_files import atomic_target
from errors import UserError
from file_stamps import file_stamp
from model import Transformer

GATES_DIR = Path(__file__).resolve().parent / "gates"
FORMAT = "kv-evict-gates/1"
# logsigmoid(6) ≈ −0.0025: a new gate keeps a token at ≈ 0.5 retention after ~280 steps (little forgetting).
INIT_BIAS = 6.0
PROBE_ROWS = 16
PROBE_RTOL = 0.02
SHAPE_KEYS = ("n_layer", "n_head", "n_kv_head", "dim", "head_dim", "vocab_size")
TRAIN_HINT = "train them with `python train_gates.py --checkpoint_path CHECKPOINT` and pass --gates_path FILE"


class Gate(nn.Module):
    """One layer's gate: attention-normed hidden state [B, T, dim] -> log forget gates [B, n_kv, T]."""

    def __init__(self, dim: int, n_kv_head: int, init_bias: float = INIT_BIAS) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, n_kv_head)
        # Zero weights and a large bias: every gate starts near 1 (log-gate ≈ 0), so training starts from
        # the full model's behaviour and the capacity term has to earn each bit of forgetting.
        nn.init.zeros_(self.proj.weight)
        nn.init.constant_(self.proj.bias, init_bias)

    def forward(self, x: Tensor) -> Tensor:
        # Gates are kept in float32 whatever the model's dtype: a bf16 logit near 6 would round the
        # log-gate (≈ −0.0025) by ~30%, and the cache multiplies it by ages in the thousands.
        logits = self.proj(x.to(self.proj.weight.dtype))
        return F.logsigmoid(logits.float()).transpose(1, 2)


def new_gates(model: Transformer, init_bias: float = INIT_BIAS) -> list[Gate]:
    a = model.args
    device = model.tok_embeddings.weight.device
    return [Gate(a.dim, a.n_kv_head, init_bias).to(device) for _ in range(a.n_layer)]


def attach_gates(model: Transformer, gates: list[Gate] | None, source: tuple | None = None) -> None:
    """Give layer i gate i (None removes them). Gates stay float32 on the model's device. `source`: the file they
    were loaded from, as file_stamp gives it (None: made in memory, random or being trained), read by prepare_gates."""
    if gates is not None and len(gates) != model.args.n_layer:
        raise ValueError(f"got {len(gates)} gates for {model.args.n_layer} layers")
    device = model.tok_embeddings.weight.device
    for i, layer in enumerate(model.layers):
        layer.attention.gate = None if gates is None else gates[i].to(device=device, dtype=torch.float32)
    model.gates_file = source


def attached_gates(model: Transformer) -> list[Gate] | None:
    gates = [layer.attention.gate for layer in model.layers]
    return None if any(g is None for g in gates) else gates


def attach_random_gates(model: Transformer, seed: int = 0) -> list[Gate]:
    """Random, frozen gates (for tests on random-weight models): logits ≈ N(1.5, 1.5²) for unit-RMS
    inputs, so log-gates spread over about [−3, −0.01] and tokens really get different retention."""
    generator = torch.Generator().manual_seed(seed)
    gates = new_gates(model)
    dim = model.args.dim
    with torch.no_grad():
        for gate in gates:
            w = torch.randn(gate.proj.weight.shape, generator=generator) * (1.5 / dim**0.5)
            gate.proj.weight.copy_(w)
            gate.proj.bias.fill_(1.5)
    for gate in gates:
        gate.requires_grad_(False)
    attach_gates(model, gates)
    return gates


# ---- model identity --------------------------------------------------------------------------------------


def model_shape(model: Transformer) -> dict[str, int]:
    return {key: int(getattr(model.args, key)) for key in SHAPE_KEYS}


def weight_probe(model: Transformer) -> list[float]:
    """Norms of PROBE_ROWS evenly spaced embedding rows, then the mean |attention-norm weight| per layer."""
    w = model.tok_embeddings.weight.detach()
    rows = torch.linspace(0, w.shape[0] - 1, PROBE_ROWS).long().to(w.device)
    norms = w[rows].float().norm(dim=-1)
    norm_means = torch.stack([layer.attention_norm.weight.detach().float().abs().mean() for layer in model.layers])
    return [round(float(x), 6) for x in torch.cat([norms, norm_means]).cpu()]


def describe(shape: dict) -> str:
    return (f"{shape['n_layer']} layers, {shape['n_head']} heads / {shape['n_kv_head']} KV heads, "
            f"dim {shape['dim']}, vocab {shape['vocab_size']}")


def identity_mismatch(metadata: dict[str, str], model: Transformer) -> str | None:
    """Why a gates file does not fit `model`, or None when it does."""
    try:
        shape = json.loads(metadata["model_shape"])
        probe = json.loads(metadata["weight_probe"])
    except (KeyError, json.JSONDecodeError):
        return "it has no model identity in its metadata"
    if not isinstance(shape, dict) or set(shape) != set(SHAPE_KEYS):
        return "its model identity in the metadata is malformed"
    if shape != model_shape(model):
        return f"it was trained for a model with {describe(shape)}, this one has {describe(model_shape(model))}"
    ours = torch.tensor(weight_probe(model))
    try:
        theirs = torch.tensor(probe, dtype=ours.dtype)
    except (TypeError, ValueError, RuntimeError):
        return "its weight probe in the metadata is malformed"
    if theirs.shape != ours.shape or not torch.allclose(ours, theirs, rtol=PROBE_RTOL, atol=1e-6):
        return "its model has the same shape but different weights"
    return None


# ---- files -------------------------------------------------------------------------------------------


def read_metadata(path: str | Path) -> dict[str, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error type for a malformed header
        raise UserError(f"cannot read gates file {path}: {str(e).splitlines()[0]}") from None


def save_gates(gates: list[Gate], model: Transformer, path: str | Path, info: dict, overwrite: bool = False) -> Path:
    """Write the gates with the model's identity and `info` (how they were trained) as metadata.

    Atomic (atomic_files.atomic_target), and an existing file is kept unless `overwrite`.
    """
    from safetensors.torch import save_file

    tensors = {}
    for i, gate in enumerate(gates):
        tensors[f"layers.{i}.weight"] = gate.proj.weight.detach().float().cpu().contiguous()
        tensors[f"layers.{i}.bias"] = gate.proj.bias.detach().float().cpu().contiguous()
    metadata = {"format": FORMAT, "model_shape": json.dumps(model_shape(model)),
                "weight_probe": json.dumps(weight_probe(model)), "info": json.dumps(info, sort_keys=True)}
    with atomic_target(path, overwrite) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return Path(path)


def checked_tensors(tensors: dict[str, Tensor], model: Transformer, path: Path) -> None:
    """Every gate tensor present, of the model's shape, and finite: NaN gates would evict at random (a
    NaN score never compares lowest) while the run reports success. The tensor is named."""
    a = model.args
    expected = {}
    for i in range(a.n_layer):
        expected[f"layers.{i}.weight"] = (a.n_kv_head, a.dim)
        expected[f"layers.{i}.bias"] = (a.n_kv_head,)
    for name, shape in expected.items():
        if name not in tensors:
            raise UserError(f"gates file {path}: tensor {name} is missing")
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise UserError(f"gates file {path}: tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise UserError(f"gates file {path}: tensor {name} has non-finite values (NaN or inf) or is not float")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise UserError(f"gates file {path}: unexpected tensor {extra[0]}")


def load_gates(path: str | Path, model: Transformer) -> list[Gate]:
    """Frozen gates from `path`, refused (one-line UserError) when they were trained for another model."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise UserError(f"gates file not found: {path}")
    metadata = read_metadata(path)
    if metadata.get("format") != FORMAT:
        raise UserError(f"{path} is not a gates file (format {metadata.get('format')!r}, expected {FORMAT!r})")
    why = identity_mismatch(metadata, model)
    if why:
        try:
            info = json.loads(metadata.get("info", "{}"))
        except json.JSONDecodeError:
            info = {}
        info = info if isinstance(info, dict) else {}
        raise UserError(f"the gates in {path} ({info.get('model_name', 'unknown model')}) do not fit this model: "
                        f"{why}; {TRAIN_HINT}")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for truncated or garbled data
        raise UserError(f"cannot read gates file {path}: {str(e).splitlines()[0]}") from None
    checked_tensors(tensors, model, path)
    gates = new_gates(model)
    for i, gate in enumerate(gates):
        gate.proj.weight.data.copy_(tensors[f"layers.{i}.weight"])
        gate.proj.bias.data.copy_(tensors[f"layers.{i}.bias"])
        gate.requires_grad_(False)
    return gates


def find_gates_file(model: Transformer, directory: Path = GATES_DIR) -> Path | None:
    """The first gates file shipped in `directory` whose metadata matches `model`."""
    for path in sorted(directory.glob("*.safetensors")):
        metadata = read_metadata(path)
        if metadata.get("format") == FORMAT and identity_mismatch(metadata, model) is None:
            return path
    return None


def prepare_gates(model: Transformer, gates_path: str | None) -> None:
    """Make sure `model` carries gates for a gated cache: the given file, else the gates made in memory and
    attached (random ones in tests), else the shipped file that matches the model, else a UserError. A model
    serves many runs (eval loads it once): gates an earlier run loaded from another file, or from a file since
    replaced, are not this run's; the very file already attached is kept (new gate modules would make a
    compiled step compile again)."""
    if gates_path:
        path = Path(gates_path)
    elif attached_gates(model) is not None and getattr(model, "gates_file", None) is None:
        return
    else:
        path = find_gates_file(model)
        if path is None:
            raise UserError(f"no trained gates for this model ({describe(model_shape(model))}) in {GATES_DIR}; "
                            f"{TRAIN_HINT}")
    try:
        stamp = file_stamp(path)
    except OSError:  # load_gates says why in one line
        stamp = None
    if stamp is None or attached_gates(model) is None or getattr(model, "gates_file", None) != stamp:
        attach_gates(model, load_gates(path, model), stamp)
