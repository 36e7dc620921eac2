"""GGUF-level check of the low-bit types on files llama.cpp's llama-quantize wrote (the llama architecture
fixture in each type, see tools/quant_fixtures/quant_models.py), committed in tests/data/quant_models with
llama.cpp's logits on each."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("quant_models", REPO / "tools" / "quant_fixtures" / "quant_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_low_bit_gguf_files_match_llama_cpp():
    qm = _tool()
    out = qm.default_out()
    assert (out / "llamacpp.npz").is_file(), f"no llama-quantize outputs in {out}"
    rows = qm.check(out, "native")
    assert {r["type"] for r in rows} >= {"Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S",
                                        "TQ1_0", "TQ2_0", "MXFP4"}, rows
    for r in rows:
        assert math.isfinite(r["minirt_vs_hf"]), r
        if math.isnan(r["llamacpp_vs_hf"]):
            continue  # llama.cpp's forward failed on this file: nothing to compare with
        # same file, same weights: minirt's error is llama.cpp's (it quantizes activations more finely)
        assert r["minirt_vs_hf"] <= 1.01 * r["llamacpp_vs_hf"], r
        assert r["minirt_vs_llamacpp"] < 0.05 and r["argmax_vs_llamacpp"] >= 0.9, r


def test_low_bit_gguf_files_decode_like_llama_cpp():
    """The same files decoded one token at a time (the decode kernels: int8 activations for Q2_K / Q3_K /
    TQ2_0, the i-quants and TQ1_0 on AVX-512, as llama.cpp's q8_K; MXFP4's multi-row kernel) against
    llama.cpp's logits at the same positions: minirt's error against transformers stays within 1% of
    llama.cpp's."""
    import sys

    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from arch_parity import decode_logits, rel_rms

    qm = _tool()
    out = qm.default_out()
    ref = np.load(qm.FIXTURE / "ref.npz")
    cpp = np.load(out / "llamacpp.npz")
    n0 = 4  # prefill 4 ids, then decode one at a time
    for name in ("Q2_K", "Q3_K", "TQ2_0", "MXFP4", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                 "TQ1_0"):
        mine = decode_logits(out / f"llama-{name}.gguf", ref["tokens"], n0)
        c, hf = cpp[name][:, n0 - 1:-1], ref["hf"][:, n0 - 1:-1]
        assert mine.shape == c.shape, (name, mine.shape, c.shape)
        assert rel_rms(mine, hf) <= 1.01 * rel_rms(c, hf), name
        assert rel_rms(mine, c) < 0.05 and np.mean(mine.argmax(-1) == c.argmax(-1)) >= 0.9, name
