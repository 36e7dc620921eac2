"""Reproduce the numbers behind README's "What llama.cpp does with some features".

``variants``: the committed specs with one feature changed (mistral with a 16-token window, exaone4 as
4 LLLG layers with a 16-token window, gemma4 without its q/k norm scale), built like the fixtures into
``--out`` (not the repository). ``kvcache``: the llama fixture's HF model converted to f32, llama.cpp's
error against transformers with its default f16 KV cache and with an f32 one. Same environment and
arguments as ``make_fixtures.py``.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import make_fixtures as mf


def variants(llama_dir: Path, out: Path) -> None:
    mf.ARCHS["mistral"]["kwargs"]["sliding_window"] = 16
    mf.ARCHS["exaone4"]["kwargs"].update(num_hidden_layers=4, sliding_window=16, layer_types=mf._layer_types(4, 4))
    del mf.ARCHS["gemma4"]["scale"]
    mf.main(["--llama-cpp", str(llama_dir), "--out", str(out), "mistral", "exaone4", "gemma4"])


def kvcache(llama_dir: Path, work: Path) -> None:
    import llama_cpp
    spec = mf.ARCHS["llama"]
    model_dir = work / "llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    mf.build_hf(spec, model_dir, 1234)
    gguf32 = work / "llama-f32.gguf"
    subprocess.run([sys.executable, "-c", mf._CONVERT, str(llama_dir), spec["pre"], str(model_dir),
                    "--outtype", "f32", "--outfile", str(gguf32)], check=True, capture_output=True)
    tokens = np.random.default_rng(1234).choice(mf.token_pool(gguf32), size=(mf.N_SEQ, mf.SEQ_LEN)).astype(np.int32)
    hf = mf.hf_logits(spec, model_dir, tokens)
    for name, kv_type in (("f16 KV cache (default)", 1), ("f32 KV cache", 0)):
        llm = llama_cpp.Llama(model_path=str(gguf32), logits_all=True, n_ctx=256, n_batch=256, n_threads=2,
                              verbose=False, type_k=kv_type, type_v=kv_type)
        outs = []
        for seq in tokens:
            llm.reset()
            llm.eval(seq.tolist())
            outs.append(np.array(llm.scores[: len(seq)], dtype=np.float32))
        llm.close()
        print(f"llama f32 GGUF, {name}: {mf.errors(np.stack(outs), hf)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["variants", "kvcache"])
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="arch_findings_")))
    args = ap.parse_args()
    if args.what == "variants":
        variants(args.llama_cpp, args.out)
    else:
        kvcache(args.llama_cpp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
