"""Shared fixtures: the bundled SmolLM2 model (loaded once, float32) and a tiny random-weight model
for pure logic tests and compilation (compiling the 30-layer model takes about a minute here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checkpoint import bundled_checkpoint_path, load_checkpoint  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

# transformers' from_pretrained arguments for the bundled GGUF: its folder and gguf_file.
HF_BUNDLED_ARGS = (str(bundled_checkpoint_path().parent), bundled_checkpoint_path().name)
TINY_ARGS = dict(n_layer=2, n_head=4, n_kv_head=2, dim=64, intermediate_size=128, vocab_size=256,
                 rope_base=10000.0, context_length=1024)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One torch thread per worker process (and per process a test starts): two processes with two threads
        # each on two cores spin-wait and run several times slower.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    config.addinivalue_line("markers", "slow: end-to-end tests and the compiled strategy matrix (run by default; "
                                       "make test-fast skips them)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one; run with -m cuda)")


@pytest.fixture(scope="session")
def bundled_session():
    torch.manual_seed(0)
    return load_checkpoint(None, "cpu", torch.float32)


@pytest.fixture
def bundled(bundled_session):
    """(model, tokenizer) for the bundled SmolLM2-135M-Instruct in float32, with no caches attached."""
    bundled_session[0].remove_caches()
    return bundled_session


@pytest.fixture(scope="session")
def hf_bundled_session():
    """The bundled GGUF loaded by transformers itself (its own dequantizer and un-permutation), float32: the
    independent reference of the parity and adapter tests. Loaded once (about a minute here)."""
    import transformers  # a test dependency (requirements-dev.txt), never used by the tool

    folder, name = HF_BUNDLED_ARGS
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_bundled_tokenizer():
    """transformers' tokenizer of the bundled GGUF (read from its metadata, ~6 s here), loaded once."""
    import transformers

    folder, name = HF_BUNDLED_ARGS
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{arch: (transformers model, our model, tokenizer)} for every architecture the adapter supports
    (tests/adapter_helpers.ARCHS): tiny random checkpoints written by transformers and loaded by us, float32;
    written once per test module (under a second)."""
    from tests.adapter_helpers import ARCHS
    from tests.arch_helpers import save_tiny_model

    models = {}
    for arch in ARCHS:
        directory = tmp_path_factory.mktemp(arch)
        hf = save_tiny_model(arch, directory)
        models[arch] = (hf, *load_checkpoint(str(directory), "cpu", torch.float32))
    return models


@pytest.fixture
def hf_bundled(hf_bundled_session):
    """The transformers reference with its default attention back (the adapter tests switch it)."""
    hf_bundled_session.set_attn_implementation("sdpa")
    return hf_bundled_session


def make_tiny_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**TINY_ARGS, **overrides}))
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)  # sharp attention, so cache differences show in logits
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint saved as a Hugging Face directory, written once per test module."""
    from tests.eval_helpers import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
