"""Shared fixtures: the two real models (pulled into $MINIRT_HOME on first use) and the references.

The llama.cpp and float32 references live in ``tests/data/reference`` (rebuilt by its
``regenerate.py``, see tests/README.md); nothing here reads outside the repository and $MINIRT_HOME.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REFERENCE_DIR = Path(__file__).resolve().parent / "data" / "reference"
MODEL_NAMES = {"qwen": "qwen2.5-coder-0.5b-instruct", "gemma": "gemma3-270m"}
REF_NAMES = {"qwen": "qwen2.5-coder-0.5b", "gemma": "gemma3-270m"}


def _model_path(key: str) -> Path:
    from minirt import registry

    return registry.resolve(MODEL_NAMES[key])


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return _model_path("qwen")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return _model_path("gemma")


@pytest.fixture(scope="session", params=["qwen", "gemma"])
def real_model(request) -> tuple[str, Path]:
    """(key, path) for each real model in turn."""
    return request.param, _model_path(request.param)


def reference_jsonl(key: str, kind: str) -> list[dict]:
    """Records of ``tests/data/reference/<name>.<kind>.jsonl`` (kind: tokenizer | greedy)."""
    p = REFERENCE_DIR / f"{REF_NAMES[key]}.{kind}.jsonl"
    if not p.is_file():
        pytest.fail(f"reference file missing: {p} (see tests/README.md)")
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def reference_npz(key: str):
    """The float32 reference ``<name>.float_ref.npz``: at the last prompt position its top-32
    (``last_top_ids`` / ``last_top_logits``, descending) and its logits at llama.cpp's top-20 ids
    (``last_logits_at_llama_top20``); ``greedy`` and ``tf_argmax`` as JSON strings."""
    import numpy as np

    p = REFERENCE_DIR / f"{REF_NAMES[key]}.float_ref.npz"
    if not p.is_file():
        pytest.fail(f"reference file missing: {p} (see tests/README.md)")
    return np.load(p)


SERVER_N_CTX = 128  # context of the tiny model the server tests serve


@pytest.fixture(scope="module")
def server_tiny_path(tmp_path_factory) -> str:
    """A tiny random 2-layer model (tests/tiny_models.py, seed 11) for the server tests."""
    from tests.tiny_models import TinySpec, write_tiny

    p = tmp_path_factory.mktemp("srv") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=11))
    return str(p)


@pytest.fixture(scope="module")
def server_llm(server_tiny_path):
    """``server_tiny_path`` loaded with n_ctx=SERVER_N_CTX, closed after the module."""
    import minirt

    m = minirt.load(server_tiny_path, n_ctx=SERVER_N_CTX)
    yield m
    m.close()


@pytest.fixture(scope="module")
def nat():
    """The loaded native kernel module (minirt.kernels.native); skips only when the machine has no C
    compiler at all (any other build failure is an error)."""
    import minirt
    from minirt.kernels import native

    try:
        native._load()
    except minirt.BackendError as e:
        if "no C compiler" in str(e):
            pytest.skip(f"native kernels unavailable: {e}")
        raise
    return native
