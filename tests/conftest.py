"""Shared fixtures: the two real models (pulled into $MINIRT_HOME on first use) and the references."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REFERENCE_DIR = Path(os.environ.get("MINIRT_REFERENCE_DIR") or Path(__file__).resolve().parents[2] / "shared" / "reference")
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
    """Records of ``../shared/reference/<name>.<kind>.jsonl`` (kind: tokenizer | greedy)."""
    p = REFERENCE_DIR / f"{REF_NAMES[key]}.{kind}.jsonl"
    if not p.is_file():
        pytest.fail(f"reference file missing: {p} (set MINIRT_REFERENCE_DIR)")
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def reference_npz(key: str):
    import numpy as np

    p = REFERENCE_DIR / f"{REF_NAMES[key]}.float_ref.npz"
    if not p.is_file():
        pytest.fail(f"reference file missing: {p} (set MINIRT_REFERENCE_DIR)")
    return np.load(p)
