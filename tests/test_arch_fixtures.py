"""Integrity of the committed architecture fixtures (tests/data/archs, made by tools/arch_fixtures).

These check the reference data itself: every GGUF opens with minirt's reader and has the tensors
meta.json lists, the logit arrays have the right shapes, and the llama.cpp-vs-transformers numbers
recorded in meta.json (the bar the architectures are held to) recompute from ref.npz.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import minirt.gguf as gguf

ROOT = Path(__file__).parent / "data" / "archs"
ARCHS = sorted(p.parent.name for p in ROOT.glob("*/meta.json"))
QUANTS = ("f16", "q8_0", "q4_k_m")


def test_fixtures_present() -> None:
    assert len(ARCHS) >= 4, ARCHS
    index = (ROOT / "INDEX.md").read_text()
    for arch in ARCHS:
        assert f"| {arch} |" in index, f"{arch} missing from INDEX.md"


@pytest.mark.parametrize("arch", ARCHS)
def test_fixture_consistent(arch: str) -> None:
    folder = ROOT / arch
    meta = json.loads((folder / "meta.json").read_text())
    ref = np.load(folder / "ref.npz")
    tokens, hf = ref["tokens"], ref["hf"]
    n_seq, seq_len = tokens.shape
    assert tokens.dtype == np.int32 and n_seq >= 3 and seq_len >= 40
    vocab = meta["hf_config"]["vocab_size"]
    assert hf.shape == (n_seq, seq_len, vocab) and hf.dtype == np.float32
    assert tokens.min() >= 0 and tokens.max() < vocab
    # logits that are not flat: the argmax comparisons mean something
    assert float(hf.std(-1).mean()) > 0.1
    for q in QUANTS:
        info = meta["files"][q]
        f = gguf.open(folder / info["file"])
        assert f.architecture == meta["gguf_architecture"]
        assert sorted(t["name"] for t in info["tensors"]) == sorted(f.tensors), q
        cpp = ref[f"llamacpp_{q}"]
        assert cpp.shape == hf.shape and cpp.dtype == np.float32
        a, b = cpp.astype(np.float64), hf.astype(np.float64)
        rel = math.sqrt(np.mean((a - b) ** 2)) / math.sqrt(np.mean(b ** 2))
        agree = float(np.mean(cpp.argmax(-1) == hf.argmax(-1)))
        rec = meta["llamacpp_vs_hf"][q]
        assert rel == pytest.approx(rec["rel_rms"], rel=1e-6), q
        assert agree == pytest.approx(rec["argmax_agreement"], abs=1e-12), q
    # the f16 file is llama.cpp at its most exact: a broken conversion would show here first
    assert meta["llamacpp_vs_hf"]["f16"]["rel_rms"] < 0.02
