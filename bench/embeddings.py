"""Embedding throughput: a batch of texts of ~N tokens through minirt and through llama.cpp.

minirt: ``Model.embed(texts)`` (the texts batched into forward passes of ``--n-batch`` tokens).
llama.cpp: the ``llama_cpp`` binding's ``Llama(embedding=True).embed(texts)`` on the same file with
the same thread count and batch size (it also packs several sequences per decode). Both runs embed
the same token ids (the texts are made of the file's own vocabulary and tokenized once by each
side). Prints texts/s and tokens/s of each (median of ``-r`` repetitions after one warm-up) and the
ratio, plus the cosine between the two sides' vectors as a sanity check.

    python bench/embeddings.py -m path/to/bge-small-en-v1.5-f16.gguf -n 64 --tokens 100 -t 2
    python bench/embeddings.py -m tests/data/embed/bert/model-f16.gguf -n 4 --tokens 16 -r 1 --no-peer   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import minirt  # noqa: E402

WORDS = ("river stone cloud paper window garden silver music engine forest winter market signal orbit "
         "harbor lantern canvas meadow thunder library").split()


def make_texts(llm: minirt.Model, n: int, n_tokens: int, seed: int = 0) -> list[str]:
    """``n`` pseudo-sentences of about ``n_tokens`` tokens each (measured with the model's tokenizer)."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        words: list[str] = []
        while len(llm.tokenize(" ".join(words))) < n_tokens:
            words.append(str(rng.choice(WORDS)))
        texts.append(" ".join(words))
    return texts


def time_it(fn, reps: int) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    out = fn()  # warm-up (and the vectors)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="GGUF path or registry name of an embedding model")
    ap.add_argument("-n", "--n-texts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per text (about)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-b", "--n-batch", type=int, default=2048, help="tokens per forward pass (both sides)")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="do not run llama.cpp")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    llm = minirt.load(args.model, embedding=True, threads=args.threads, n_batch=args.n_batch)
    texts = make_texts(llm, args.n_texts, args.tokens)
    n_tok = sum(len(llm.tokenize(t)) for t in texts)
    t_mr, v_mr = time_it(lambda: llm.embed(texts), args.repetitions)
    res = {"model": str(args.model), "n_texts": len(texts), "tokens": n_tok, "threads": args.threads,
           "minirt": {"s": t_mr, "texts_per_s": len(texts) / t_mr, "tokens_per_s": n_tok / t_mr}}
    print(f"minirt     {t_mr:8.3f} s  {len(texts) / t_mr:8.1f} texts/s  {n_tok / t_mr:9.1f} tok/s  "
          f"({len(texts)} texts, {n_tok} tokens, {args.threads} threads)")
    if not args.no_peer:
        try:
            import llama_cpp
        except ImportError:
            print("llama.cpp: the llama_cpp binding is not importable; skipped")
        else:
            peer = llama_cpp.Llama(model_path=str(llm.path), embedding=True, n_ctx=max(args.n_batch, 512),
                                   n_batch=args.n_batch, n_ubatch=args.n_batch, n_threads=args.threads,
                                   n_threads_batch=args.threads, verbose=False)
            t_lc, v_lc = time_it(lambda: peer.embed(texts, normalize=True), args.repetitions)
            a, b = np.asarray(v_mr, dtype=np.float64), np.asarray(v_lc, dtype=np.float64)
            cos = float(np.min(np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))))
            res["llamacpp"] = {"s": t_lc, "texts_per_s": len(texts) / t_lc, "tokens_per_s": n_tok / t_lc}
            res["ratio"] = t_lc / t_mr
            res["min_cosine"] = cos
            print(f"llama.cpp  {t_lc:8.3f} s  {len(texts) / t_lc:8.1f} texts/s  {n_tok / t_lc:9.1f} tok/s")
            print(f"minirt / llama.cpp throughput: {t_lc / t_mr:.2f}x   (min cosine between the two: {cos:.6f})")
            peer.close()
    llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
