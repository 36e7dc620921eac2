"""GGUF-level check of the low-bit types: llama.cpp's own llama-quantize writes a tiny model in each
type, and minirt's logits on that file are compared with llama.cpp's (and with transformers').

The model is the llama architecture fixture (tests/data/archs/llama: hidden 256, FFN 512, vocabulary 512,
random weights); its f16 GGUF is quantized with ``--pure`` (every matrix in the type; the IQ1/IQ2 types
with an importance matrix from llama-imatrix over the fixture's own token sequences, their embedding and
output matrices, which the importance matrix does not cover, in Q8_0), except MXFP4, which
llama-quantize only writes for expert tensors: there MXFP4_MOE's mix is used with every matrix forced to
mxfp4 by ``--tensor-type``. The files are committed in ``tests/data/quant_models`` (made with
``make --out tests/data/quant_models`` on the no-AMX build of 2026-12-01; 0.2-0.6 MB each), which
``check`` and ``tests/test_quant_models.py`` read; without them ``$MINIRT_HOME/quant_models``.

Two steps, two environments:

    # 1. with the llama_cpp binding (writes <out>/llama-<TYPE>.gguf and <out>/llamacpp.npz)
    /work/tools/llama_python tools/quant_fixtures/quant_models.py make --llama-cpp /path/to/llama.cpp
    # 2. with minirt's venv: one line per type, error vs transformers and vs llama.cpp
    python tools/quant_fixtures/quant_models.py check [--backend native|numba]

The bar (as for the architecture fixtures): minirt's error against transformers <= llama.cpp's, and its
logits close to llama.cpp's on the same file. ``tests/test_quant_models.py`` runs ``check`` when the files exist.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "archs" / "llama"
# type name -> (llama-quantize ftype, needs an importance matrix)
TYPES = {
    "Q2_K": ("Q2_K", False), "Q3_K": ("Q3_K_M", False),
    "IQ1_S": ("IQ1_S", True), "IQ1_M": ("IQ1_M", True), "IQ2_XXS": ("IQ2_XXS", True), "IQ2_XS": ("IQ2_XS", True),
    "IQ2_S": ("IQ2_S", True), "IQ3_XXS": ("IQ3_XXS", True), "IQ3_S": ("IQ3_S", True),
    "TQ1_0": ("TQ1_0", False), "TQ2_0": ("TQ2_0", False), "MXFP4": ("MXFP4_MOE", False),
}
_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output")


COMMITTED = REPO / "tests" / "data" / "quant_models"  # the files the tests read (made by ``make --out`` here)


def default_out() -> Path:
    """Where ``check`` reads: the committed files, else ``$MINIRT_HOME/quant_models``."""
    if (COMMITTED / "llamacpp.npz").is_file():
        return COMMITTED
    home = Path(os.environ.get("MINIRT_HOME") or Path.home() / ".cache" / "minirt")
    return home / "quant_models"


def make(llama_cpp: Path, out: Path) -> None:
    from llama_cpp import Llama

    out.mkdir(parents=True, exist_ok=True)
    bins = llama_cpp / "build" / "bin"
    f16 = FIXTURE / "model-f16.gguf"
    tokens = np.load(FIXTURE / "ref.npz")["tokens"]
    imat = out / "imatrix.gguf"
    if not imat.exists():
        # calibration text: the fixture vocabulary's pieces of its own reference sequences
        llm = Llama(str(f16), n_ctx=256, verbose=False)
        text = " ".join(llm.detokenize([int(t) for t in seq]).decode("utf-8", "replace") for seq in tokens) * 8
        del llm
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as tf:
            tf.write(text)
        subprocess.run([str(bins / "llama-imatrix"), "-m", str(f16), "-f", tf.name, "-o", str(imat), "-c", "64",
                        "-t", "2", "--no-ppl"], check=True, capture_output=True)
    logits = {}
    for name, (ftype, needs_imatrix) in TYPES.items():
        dst = out / f"llama-{name}.gguf"
        cmd = [str(bins / "llama-quantize")]
        if name == "MXFP4":
            for m in _MATRICES:
                cmd += ["--tensor-type", f"{m}=mxfp4"]
        else:
            cmd += ["--pure"]
        if needs_imatrix:  # the embedding and output have no imatrix entries (llama-imatrix sees matmuls only)
            cmd += ["--imatrix", str(imat), "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0"]
        cmd += [str(f16), str(dst), ftype, "2"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(name, f"llama-quantize failed (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
            continue
        # llama.cpp's forward in a child process: a crash there is reported, not fatal
        npy = out / f"llamacpp-{name}.npy"
        res = subprocess.run([sys.executable, __file__, "_eval", str(dst), str(npy)], capture_output=True, text=True)
        if res.returncode != 0:
            print(name, dst.stat().st_size, f"bytes; llama.cpp's forward failed (exit {res.returncode})")
            continue
        logits[name] = np.load(npy)
        npy.unlink()
        print(name, dst.stat().st_size, "bytes")
    np.savez_compressed(out / "llamacpp.npz", tokens=tokens, **logits)


def llamacpp_eval(path: Path, npy: Path) -> None:
    """llama.cpp's logits (n_seq, T, V) of every position of the fixture's sequences, as the fixtures do."""
    from llama_cpp import Llama

    tokens = np.load(FIXTURE / "ref.npz")["tokens"]
    llm = Llama(str(path), logits_all=True, n_ctx=256, n_batch=256, n_threads=2, verbose=False)
    rows = []
    for seq in tokens:
        llm.reset()
        llm.eval([int(t) for t in seq])
        rows.append(np.array(llm.scores[:len(seq)], dtype=np.float32))
    np.save(npy, np.stack(rows))


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the file holds (minirt's reader)."""
    import minirt.gguf as g

    with g.open(str(path)) as f:
        counts: dict[str, int] = {}
        for t in f:
            counts[t.qtype] = counts.get(t.qtype, 0) + 1
    return counts


def check(out: Path, backend: str) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    from arch_parity import minirt_logits, rel_rms

    ref = np.load(FIXTURE / "ref.npz")
    cpp = np.load(out / "llamacpp.npz")
    hf = ref["hf"]
    nan = float("nan")
    rows = []
    for name in TYPES:
        path = out / f"llama-{name}.gguf"
        if not path.exists():
            continue
        mine = minirt_logits(path, ref["tokens"], backend=backend)
        c = cpp[name] if name in cpp else None  # None: llama.cpp's forward failed on this file
        rows.append({"type": name, "tensors": tensor_types(path), "minirt_vs_hf": rel_rms(mine, hf),
                     "llamacpp_vs_hf": rel_rms(c, hf) if c is not None else nan,
                     "minirt_vs_llamacpp": rel_rms(mine, c) if c is not None else nan,
                     "argmax_vs_llamacpp": float(np.mean(mine.argmax(-1) == c.argmax(-1))) if c is not None else nan})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree with build/bin")
    mk.add_argument("--out", type=Path, default=default_out())
    ck = sub.add_parser("check")
    ck.add_argument("--out", type=Path, default=default_out())
    ck.add_argument("--backend", default="native")
    ev = sub.add_parser("_eval")  # internal: one llama.cpp forward in a child process
    ev.add_argument("path", type=Path)
    ev.add_argument("npy", type=Path)
    a = ap.parse_args()
    if a.cmd == "_eval":
        llamacpp_eval(a.path, a.npy)
        return 0
    if a.cmd == "make":
        make(a.llama_cpp, a.out)
        return 0
    rows = check(a.out, a.backend)
    print(f"{'type':8s} {'minirt/hf':>9s} {'llama.cpp/hf':>12s} {'minirt/llama.cpp':>16s} {'argmax=':>7s}  tensors")
    for r in rows:
        print(f"{r['type']:8s} {r['minirt_vs_hf']:9.4f} {r['llamacpp_vs_hf']:12.4f} {r['minirt_vs_llamacpp']:16.5f} "
              f"{r['argmax_vs_llamacpp']:7.3f}  {r['tensors']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
