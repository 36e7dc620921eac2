#!/usr/bin/env python
"""Rebuild the reference files in this folder from llama.cpp and transformers (see tests/README.md).

Three steps, each under the interpreter that has what it needs (neither is a dependency of minirt
or of its tests; the tests only read the files this script writes):

    # 1. llama.cpp (the Python binding of llama-cpp-python 0.3.36): NAME.tokenizer.jsonl, NAME.greedy.jsonl
    python tests/data/reference/regenerate.py llama --out DIR
    # 2. transformers (+ torch, accelerate), the same GGUF dequantized to float32: NAME.float_ref.npz
    #    (reads DIR/NAME.greedy.jsonl)
    python tests/data/reference/regenerate.py float --out DIR
    # 3. compare DIR with the committed files (exit status 1 on any difference)
    python tests/data/reference/regenerate.py compare DIR

The inputs (tokenizer texts, greedy prompts) are ``inputs.json``; the models are read from
``$MINIRT_HOME`` (default ``~/.cache/minirt``, where ``minirt pull`` puts them) or ``--models DIR``.
Only numpy and the standard library are imported at module level.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# reference name -> GGUF file (the registry's files for qwen2.5-coder-0.5b-instruct and gemma3-270m)
MODELS = {"qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
          "gemma3-270m": "gemma-3-270m-q4_k_m.gguf"}
N_GREEDY = 32      # new tokens per greedy prompt
TOP_LLAMA = 20     # llama.cpp logits kept per prompt (last prompt position)
TOP_FLOAT = 32     # float32 reference logits kept per prompt: its own top-k, descending
N_THREADS = 2


def _inputs() -> dict:
    return json.loads((HERE / "inputs.json").read_text(encoding="utf-8"))


def _model_dir(arg: str | None) -> Path:
    return Path(arg or os.environ.get("MINIRT_HOME") or Path.home() / ".cache" / "minirt")


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def top_desc(row: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values, descending; ties keep the lower id first (like argmax)."""
    return np.argsort(-row, kind="stable")[:k]


# ----------------------------------------------------------------------------------------------
# 1. llama.cpp
# ----------------------------------------------------------------------------------------------
def llama_part(out: Path, models: Path) -> None:
    import llama_cpp  # noqa: F401  (fails early with a clear ImportError)
    from llama_cpp import Llama

    inp = _inputs()
    for name, file in MODELS.items():
        llm = Llama(model_path=str(models / file), n_ctx=512, n_threads=N_THREADS, n_threads_batch=N_THREADS,
                    logits_all=False, verbose=False)
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n_vocab = llm.n_vocab()

        def last_logits(llm: Llama = llm, n_vocab: int = n_vocab) -> np.ndarray:
            p = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return np.ctypeslib.as_array(p, shape=(n_vocab,)).astype(np.float32)

        tok = []
        for text in inp["tokenizer_texts"]:
            raw = text.encode("utf-8")
            ids = llm.tokenize(raw, add_bos=False, special=False) if raw else []
            ids_sp = llm.tokenize(raw, add_bos=False, special=True) if raw else []
            detok = llm.detokenize(ids).decode("utf-8", errors="replace")
            tok.append({"text": text, "ids": ids, "ids_special": ids_sp, "detok": detok})
        _write_jsonl(out / f"{name}.tokenizer.jsonl", tok)

        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        greedy = []
        for prompt in inp["greedy_prompts"]:
            ids = llm.tokenize(prompt.encode("utf-8"), add_bos=add_bos, special=True)
            llm.reset()
            llm.eval(ids)
            lg = last_logits()
            top = top_desc(lg, TOP_LLAMA)
            rec = {"prompt": prompt, "prompt_ids": ids, "greedy_ids": [], "greedy_text": "",
                   "last_top20_ids": [int(t) for t in top],
                   "last_top20_logits": [round(float(lg[t]), 4) for t in top]}  # 4 decimals, as committed
            for _ in range(N_GREEDY):  # top_k=1 sampling is argmax
                t = int(lg.argmax())
                rec["greedy_ids"].append(t)
                if llama_cpp.llama_vocab_is_eog(vocab, t):
                    break
                llm.eval([t])
                lg = last_logits()
            rec["greedy_text"] = llm.detokenize(rec["greedy_ids"], prev_tokens=ids).decode("utf-8", errors="replace")
            greedy.append(rec)
        _write_jsonl(out / f"{name}.greedy.jsonl", greedy)
        llm.close()
        print(f"llama.cpp: wrote {name}.tokenizer.jsonl ({len(tok)}) and {name}.greedy.jsonl ({len(greedy)})")


# ----------------------------------------------------------------------------------------------
# 2. transformers, float32
# ----------------------------------------------------------------------------------------------
def float_part(out: Path, models: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(N_THREADS)
    for name, file in MODELS.items():
        greedy_path = out / f"{name}.greedy.jsonl"
        recs = _read_jsonl(greedy_path if greedy_path.is_file() else HERE / greedy_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(models), gguf_file=file, dtype=torch.float32)
        model.eval()
        top_ids, top_logits, at_llama, fgreedy, tf = [], [], [], [], []
        with torch.no_grad():
            for r in recs:
                p, g = r["prompt_ids"], r["greedy_ids"]
                # teacher-forced: llama.cpp's trajectory fed back, argmax from the last prompt token on
                lg = model(torch.tensor([p + g])).logits[0].float().numpy()
                tf.append([int(a) for a in lg[len(p) - 1:].argmax(-1)])
                last = lg[len(p) - 1].astype(np.float16)  # float16 as committed; argmax and ties on these
                t = top_desc(last, TOP_FLOAT)
                top_ids.append(t)
                top_logits.append(last[t])
                at_llama.append(last[np.array(r["last_top20_ids"])])
                # float32 greedy: plain argmax for N_GREEDY tokens, end-of-generation tokens included
                ids = list(p)
                o = model(torch.tensor([ids]), use_cache=True)
                new = []
                for _ in range(N_GREEDY):
                    nxt = int(o.logits[0, -1].argmax())
                    new.append(nxt)
                    o = model(torch.tensor([[nxt]]), past_key_values=o.past_key_values, use_cache=True)
                fgreedy.append(new)
        np.savez_compressed(out / f"{name}.float_ref.npz",
                            last_top_ids=np.array(top_ids, dtype=np.int32),
                            last_top_logits=np.array(top_logits, dtype=np.float16),
                            last_logits_at_llama_top20=np.array(at_llama, dtype=np.float16),
                            greedy=np.array(json.dumps(fgreedy)), tf_argmax=np.array(json.dumps(tf)))
        print(f"transformers: wrote {name}.float_ref.npz ({len(recs)} prompts)")


def trim_float_ref(full_npz: Path, greedy_jsonl: Path, out: Path) -> None:
    """The committed layout from a full-vocabulary ``last_logits`` npz (the older, 17 MB format)."""
    z = np.load(full_npz)
    recs = _read_jsonl(greedy_jsonl)
    rows = z["last_logits"]
    tops = [top_desc(row, TOP_FLOAT) for row in rows]
    np.savez_compressed(out, last_top_ids=np.array(tops, dtype=np.int32),
                        last_top_logits=np.array([row[t] for row, t in zip(rows, tops)], dtype=np.float16),
                        last_logits_at_llama_top20=np.array(
                            [row[np.array(r["last_top20_ids"])] for row, r in zip(rows, recs)], dtype=np.float16),
                        greedy=z["greedy"], tf_argmax=z["tf_argmax"])


# ----------------------------------------------------------------------------------------------
# 3. compare
# ----------------------------------------------------------------------------------------------
def _diff_jsonl(a: Path, b: Path, atol: float) -> list[str]:
    ra, rb = _read_jsonl(a), _read_jsonl(b)
    if len(ra) != len(rb):
        return [f"{a.name}: {len(ra)} records vs {len(rb)}"]
    bad = []
    for i, (x, y) in enumerate(zip(ra, rb)):
        for k in sorted(set(x) | set(y)):
            u, v = x.get(k), y.get(k)
            if k.endswith("_logits") and u is not None and v is not None:
                if len(u) != len(v) or not np.allclose(u, v, rtol=0, atol=atol):
                    bad.append(f"{a.name}[{i}].{k}: max diff {np.max(np.abs(np.subtract(u, v))):.3g}")
            elif u != v:
                bad.append(f"{a.name}[{i}].{k}: {str(u)[:80]!r} vs {str(v)[:80]!r}")
    return bad


def _diff_npz(a: Path, b: Path, atol: float) -> list[str]:
    za, zb = np.load(a), np.load(b)
    bad = [f"{a.name}: keys {sorted(za.files)} vs {sorted(zb.files)}"] if set(za.files) != set(zb.files) else []
    for k in sorted(set(za.files) & set(zb.files)):
        u, v = za[k], zb[k]
        if u.dtype.kind in "US":
            if str(u) != str(v):
                bad.append(f"{a.name}.{k} differs")
        elif k.endswith("_logits"):
            d = np.abs(u.astype(np.float32) - v.astype(np.float32)).max()
            if d > atol:
                bad.append(f"{a.name}.{k}: max diff {d:.3g}")
        elif not np.array_equal(u, v):
            bad.append(f"{a.name}.{k}: {int((u != v).sum())} entries differ")
    return bad


def compare(new: Path, atol: float) -> int:
    bad, seen = [], 0
    for p in sorted(new.iterdir()):
        ref = HERE / p.name
        if p.suffix not in (".jsonl", ".npz") or not ref.is_file():
            continue
        seen += 1
        bad += _diff_jsonl(p, ref, atol) if p.suffix == ".jsonl" else _diff_npz(p, ref, atol)
    for line in bad:
        print(line)
    print(f"{seen} file(s) compared, {len(bad)} difference(s)")
    return 1 if bad or not seen else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("llama", "float"):
        s = sub.add_parser(cmd)
        s.add_argument("--out", type=Path, default=HERE, help="output folder (default: this folder)")
        s.add_argument("--models", help="folder with the GGUF files (default: $MINIRT_HOME or ~/.cache/minirt)")
    s = sub.add_parser("compare")
    s.add_argument("dir", type=Path)
    s.add_argument("--atol", type=float, default=0.0, help="tolerance on logits (default: exact)")
    a = ap.parse_args(argv)
    if a.cmd == "compare":
        return compare(a.dir, a.atol)
    a.out.mkdir(parents=True, exist_ok=True)
    (llama_part if a.cmd == "llama" else float_part)(a.out, _model_dir(a.models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
