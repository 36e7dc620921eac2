#!/usr/bin/env python
"""Quick end-to-end decode / prefill speed of minirt on one model (no peer, no subprocess).

    python bench/native_decode.py -m qwen2.5-coder-0.5b-instruct -p 128 -g 64 -r 3
    python bench/native_decode.py -m gemma3-270m --batch 16     # 16 sequences decoded together

For side-by-side numbers against llama.cpp use bench/compare.py; this script is for iterating on
kernels: it prints prefill and decode tokens/s of each repetition and the best.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import minirt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-g", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=0, help="decode this many sequences in one forward pass")
    args = ap.parse_args()
    n_ctx = args.n_prompt + 2 * args.n_gen + 8

    llm = minirt.load(args.model, n_ctx=args.n_prompt + 2 * args.n_gen + 8, threads=args.threads)
    rng = np.random.default_rng(0)
    best_pp = best_tg = 0.0
    for rep in range(args.repetitions):
        ids = rng.integers(1000, 20000, args.n_prompt).tolist()
        if args.batch:
            from minirt.archs.base import Segment
            from minirt.kv_cache import KVCache

            model = llm.model
            c = model.cfg
            caches = [KVCache(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, n_ctx)
                      for _ in range(args.batch)]
            for c in caches:
                model.forward(np.array(ids, dtype=np.int64), [Segment(c, len(ids), "last")])
            t0 = time.perf_counter()
            for i in range(args.n_gen):
                toks = np.full(args.batch, 1000 + i, dtype=np.int64)
                model.forward(toks, [Segment(c, 1, "last") for c in caches])
            dt = time.perf_counter() - t0
            tg = args.batch * args.n_gen / dt
            t1 = time.perf_counter()
            for i in range(args.n_gen):  # one of the sequences alone, for comparison
                model.forward(np.array([2000 + i]), [Segment(caches[0], 1, "last")])
            single = args.n_gen / (time.perf_counter() - t1)
            print(f"rep {rep}: batched decode {args.batch} x {args.n_gen}: {tg:.1f} tok/s total "
                  f"({dt / args.n_gen * 1e3:.1f} ms per step); one sequence alone {single:.1f} tok/s "
                  f"-> {tg / single:.2f}x", flush=True)
            best_tg = max(best_tg, tg)
            continue
        out = llm.generate(ids, max_tokens=args.n_gen, temperature=0.0, ignore_eos=True)
        t = out.timings
        pp, tg = t["prompt_tokens_per_s"], t["generated_tokens_per_s"]
        print(f"rep {rep}: pp{args.n_prompt} {pp:7.1f} tok/s   tg{args.n_gen} {tg:6.2f} tok/s", flush=True)
        best_pp, best_tg = max(best_pp, pp), max(best_tg, tg)
    print(f"best: pp {best_pp:.1f}  tg {best_tg:.2f}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
