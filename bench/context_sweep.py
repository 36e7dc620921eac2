#!/usr/bin/env python
"""Cost of context depth: minirt vs llama.cpp, same GGUF, same KV cache type, 2 threads.

For each depth d (tokens already in the cache) it measures prefill of ``--n-prompt`` new tokens
and decode of ``--n-gen`` tokens on top of d, and the peak resident memory of the process that did
it; llama.cpp through ``llama-bench -d d -p P -n G -ctk T -ctv T -t 2 -fa 1 -o jsonl`` (one process
per depth, like minirt's side: one child process per depth and type, so each RSS stands alone).

    python bench/context_sweep.py -m qwen2.5-coder-0.5b-instruct --types f16 q8_0 \\
        --out bench/context_sweep      # writes context_sweep.md, context_sweep.json, context_sweep.png
    python bench/context_sweep.py --smoke   # tiny: depths 0 and 64, one repetition, no plot needed

Quality helpers (no timing):

    python bench/context_sweep.py --quality -m gemma3-270m --types q8_0 q4_0   # vs the f32 cache, and llama.cpp's
    python bench/context_sweep.py --perplexity bench/data/kjv_genesis_1-5.txt --types f16 q8_0   # vs llama-perplexity

The llama.cpp binaries are found through ``$MINIRT_LLAMA_BIN`` (a build/bin folder) or PATH. The
plot needs matplotlib (the ``bench`` extra); without it the table is still written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEPTHS = [0, 1024, 4096, 16384, 32768]


def _llama_tool(name: str) -> str | None:
    d = os.environ.get("MINIRT_LLAMA_BIN")
    if d and (Path(d) / name).is_file():
        return str(Path(d) / name)
    return shutil.which(name)


# ------------------------------------------------------------------------------------------- minirt worker

def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One (depth, type) measurement in this process: fill the cache to the depth, then time the
    prefill of n_prompt tokens and the decode of n_gen tokens over it, ``reps`` times."""
    import numpy as np

    import minirt
    from minirt.archs.base import Segment

    depth, P, G = args.depth, args.n_prompt, args.n_gen
    llm = minirt.load(args.model, n_ctx=depth + P + G + 8, threads=args.threads,
                      cache_type_k=args.ctk, cache_type_v=args.ctv)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, llm.n_vocab - 100, depth + P + G).astype(np.int64)
    m, chunk = llm.model, 512
    cache = llm._new_cache()

    def feed(tokens: np.ndarray, want: str) -> None:
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            m.forward(part, [Segment(cache, len(part), want if s + chunk >= len(tokens) else "none")])

    t0 = time.perf_counter()
    feed(ids[:depth], "none")
    fill_s = time.perf_counter() - t0
    pp, tg = [], []
    for _ in range(args.reps):
        cache.truncate(depth)
        t0 = time.perf_counter()
        feed(ids[depth:depth + P], "last")
        pp.append(P / (time.perf_counter() - t0))
        cache.truncate(depth)
        t0 = time.perf_counter()
        for t in ids[depth + P:depth + P + G]:
            m.forward(np.array([t]), [Segment(cache, 1, "last")])
        tg.append(G / (time.perf_counter() - t0))
    out = {"runtime": "minirt", "depth": depth, "ctk": args.ctk, "ctv": args.ctv, "pp_tok_s": float(np.median(pp)),
           "tg_tok_s": float(np.median(tg)), "fill_s": fill_s, "kv_bytes": int(cache.nbytes),
           "kv_bytes_per_token": llm.kv_bytes_per_token,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    llm.close()
    return out


def run_minirt(model: str, depth: int, t: str, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "-m", model, "--depth", str(depth), "--ctk", t, "--ctv", t,
           "--n-prompt", str(a.n_prompt), "--n-gen", str(a.n_gen), "--reps", str(a.reps), "-t", str(a.threads)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if res.returncode != 0:
        return {"runtime": "minirt", "depth": depth, "ctk": t, "error": res.stderr.strip()[-500:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


_RSS_WRAPPER = ("import resource, subprocess, sys\n"
                "r = subprocess.run(sys.argv[1:])\n"
                "print('MAXRSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
                "sys.exit(r.returncode)\n")


def run_llama(path: str, depth: int, t: str, a: argparse.Namespace) -> dict[str, Any]:
    exe = _llama_tool("llama-bench")
    if exe is None:
        return {"runtime": "llama.cpp", "depth": depth, "ctk": t, "error": "llama-bench not found"}
    cmd = [exe, "-m", path, "-d", str(depth), "-p", str(a.n_prompt), "-n", str(a.n_gen), "-ctk", t, "-ctv", t,
           "-t", str(a.threads), "-fa", "1", "-r", str(a.reps), "-o", "jsonl"]
    # through a one-line Python parent whose only child is llama-bench: its RUSAGE_CHILDREN peak is
    # that process's own (this process's covers every child it ever waited for, minirt's included)
    res = subprocess.run([sys.executable, "-c", _RSS_WRAPPER, *cmd], capture_output=True, text=True,
                         timeout=a.timeout)
    m = re.search(r"^MAXRSS_KIB (\d+)$", res.stderr, re.M)
    if res.returncode != 0:
        return {"runtime": "llama.cpp", "depth": depth, "ctk": t, "error": res.stderr.strip()[-500:]}
    out: dict[str, Any] = {"runtime": "llama.cpp", "depth": depth, "ctk": t, "ctv": t, "cmd": " ".join(cmd),
                           "peak_rss_mib": int(m.group(1)) / 1024 if m else None}
    for line in res.stdout.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("n_prompt") == a.n_prompt and row.get("n_gen") == 0:
            out["pp_tok_s"] = float(row["avg_ts"])
        elif row.get("n_gen") == a.n_gen and row.get("n_prompt") == 0:
            out["tg_tok_s"] = float(row["avg_ts"])
    return out


def sweep(a: argparse.Namespace) -> list[dict[str, Any]]:
    from minirt import registry
    from minirt.archs import read_config
    from minirt.gguf import open as gguf_open

    path = str(registry.model_path(a.model))
    with gguf_open(path) as f:
        n_ctx_train = read_config(f).n_ctx_train
    depths = [d for d in a.depths if d + a.n_prompt + a.n_gen <= n_ctx_train]
    rows = []
    for t in a.types:
        for d in depths:
            for side in a.sides:
                r = run_minirt(a.model, d, t, a) if side == "minirt" else run_llama(path, d, t, a)
                print(json.dumps(r), file=sys.stderr, flush=True)
                rows.append(r)
    return rows


def _cell(r: dict[str, Any] | None, key: str, fmt: str = "{:.1f}") -> str:
    if r is None:
        return "–"
    if "error" in r:
        return "error"
    v = r.get(key)
    return fmt.format(v) if v is not None else "–"


def markdown(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    lines = [f"Context sweep: {a.model}, {a.threads} threads, pp{a.n_prompt} and tg{a.n_gen} at each depth "
             "(tok/s, median), peak RSS of the measuring process (MiB).", "",
             "| cache | depth | minirt pp | llama.cpp pp | ratio | minirt tg | llama.cpp tg | ratio "
             "| minirt RSS | llama.cpp RSS |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    keyed = {(r["runtime"], r["ctk"], r["depth"]): r for r in rows}
    for t in a.types:
        for d in sorted({r["depth"] for r in rows if r["ctk"] == t}):
            mr, lc = keyed.get(("minirt", t, d)), keyed.get(("llama.cpp", t, d))

            def ratio(k: str, mr: Any = mr, lc: Any = lc) -> str:
                try:
                    return f"{mr[k] / lc[k]:.2f}×"
                except (TypeError, KeyError, ZeroDivisionError):
                    return "–"
            lines.append(f"| {t} | {d} | {_cell(mr, 'pp_tok_s')} | {_cell(lc, 'pp_tok_s')} | {ratio('pp_tok_s')} "
                         f"| {_cell(mr, 'tg_tok_s')} | {_cell(lc, 'tg_tok_s')} | {ratio('tg_tok_s')} "
                         f"| {_cell(mr, 'peak_rss_mib', '{:.0f}')} | {_cell(lc, 'peak_rss_mib', '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], a: argparse.Namespace, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'minirt[bench]'): no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ("pp_tok_s", "tg_tok_s", "peak_rss_mib"),
                              (f"prefill pp{a.n_prompt} (tok/s)", f"decode tg{a.n_gen} (tok/s)", "peak RSS (MiB)")):
        for runtime, style in (("minirt", "-o"), ("llama.cpp", "--s")):
            for t in a.types:
                pts = sorted((r["depth"], r[key]) for r in rows
                             if r["runtime"] == runtime and r["ctk"] == t and r.get(key) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{runtime} {t}")
        ax.set_xscale("symlog", linthresh=1024)
        ax.set_xlabel("depth (tokens in the cache)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{a.model}, {a.threads} threads")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


# ------------------------------------------------------------------------------------------- quality

_REF_NAMES = {"qwen2.5-coder-0.5b-instruct": "qwen2.5-coder-0.5b", "gemma3-270m": "gemma3-270m"}
_GGML_IDS = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "bf16": 30}


def _reference_prompts(model: str) -> list[list[int]]:
    """The reference prompts with llama.cpp's greedy continuation appended (tests/data/reference)."""
    key = _REF_NAMES.get(model)
    if key is None:
        raise SystemExit(f"--quality knows the reference models only: {', '.join(_REF_NAMES)}")
    ref_dir = Path(__file__).resolve().parent.parent / "tests" / "data" / "reference"
    recs = [json.loads(x) for x in (ref_dir / f"{key}.greedy.jsonl").read_text().splitlines() if x.strip()]
    return [[len(r["prompt_ids"])] + r["prompt_ids"] + r["greedy_ids"] for r in recs]


def _agreement(base: list[Any], other: list[Any]) -> dict[str, float]:
    """Teacher-forced argmax agreement and logits rel-RMS of ``other`` against ``base`` (per prompt
    (n_positions, n_vocab) logits)."""
    import numpy as np

    a, b = np.concatenate(base), np.concatenate(other)
    return {"agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "rel_rms": float(np.sqrt(np.mean((a - b) ** 2) / np.mean(a ** 2)))}


def _reference_agreement(prompts: list[list[int]], logits: dict[str, list[Any]]) -> dict[str, float]:
    """Per cache type, the share of positions whose argmax is the next token of the reference
    continuation (llama.cpp's greedy tokens, made with its default f16 cache): every type scored
    against the same tokens, none of which it produced itself."""
    import numpy as np

    nxt = np.concatenate([np.asarray(p[1:][p[0]:]) for p in prompts])
    return {t: float(np.mean(np.concatenate(v).argmax(-1) == nxt)) for t, v in logits.items()}


def quality(a: argparse.Namespace) -> dict[str, Any]:
    """Per cache type (K and V alike, plus q8_0 values alone), teacher-forced argmax agreement and
    logits rel-RMS against the f32 cache on the reference prompts (llama.cpp's greedy continuations
    fed back); with ``$MINIRT_LLAMA_PYTHON`` (a Python with the llama_cpp binding) llama.cpp's
    own, against its f16 cache, on the same file (a child process, ``--llama-quality``)."""
    import minirt
    from minirt import registry

    prompts = _reference_prompts(a.model)
    out: dict[str, Any] = {"model": a.model, "positions": sum(len(p) - 1 - p[0] for p in prompts)}
    mine: dict[str, list[Any]] = {}
    for t in ["f32", *[x for x in ("f16", *a.types) if x != "f32"], "f16/q8_0"]:
        tk, _, tv = t.partition("/")
        if t in mine:
            continue
        with minirt.load(a.model, n_ctx=512, cache_type_k=tk, cache_type_v=tv or tk, threads=a.threads) as llm:
            mine[t] = [llm.logits(p[1:])[p[0] - 1:-1] for p in prompts]
    out["minirt"] = {t: _agreement(mine["f32"], v) for t, v in mine.items() if t != "f32"}
    out["minirt vs reference tokens"] = _reference_agreement(prompts, mine)
    py = os.environ.get("MINIRT_LLAMA_PYTHON")
    if not py:
        out["llama.cpp"] = "skipped: set MINIRT_LLAMA_PYTHON to a Python with the llama_cpp binding"
        return out
    cmd = [py, __file__, "--llama-quality", "-m", str(registry.resolve(a.model)), "--ref-model", a.model,
           "-t", str(a.threads), "--types", *a.types]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    if res.returncode:
        out["llama.cpp"] = f"failed: {res.stderr.strip()[-400:]}"
    else:
        out["llama.cpp"] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def llama_quality(a: argparse.Namespace) -> dict[str, Any]:
    """llama.cpp's side of :func:`quality` (run under the binding's Python): its own agreement and
    logits rel-RMS against its f16 cache, flash attention on (quantized V needs it)."""
    import numpy as np
    from llama_cpp import Llama

    prompts = _reference_prompts(a.ref_model)
    logits: dict[str, list[Any]] = {}
    for t in ["f16", *[x for x in a.types if x != "f16"], "f16/q8_0"]:
        tk, _, tv = t.partition("/")
        llm = Llama(a.model, n_ctx=512, logits_all=True, type_k=_GGML_IDS[tk], type_v=_GGML_IDS[tv or tk],
                    flash_attn=True, n_threads=a.threads, verbose=False)
        rows = []
        for p in prompts:
            llm.reset()
            llm.eval(p[1:])
            rows.append(np.array(llm.scores[:len(p) - 1])[p[0] - 1:-1])
        logits[t] = rows
        del llm
    out = {t: _agreement(logits["f16"], v) for t, v in logits.items() if t != "f16"}
    out["vs reference tokens"] = _reference_agreement(prompts, logits)
    return out


def perplexity(a: argparse.Namespace) -> dict[str, Any]:
    """Perplexity of a text in chunks of --ppl-ctx tokens, scored on the second half of each chunk
    (llama-perplexity's method), minirt per cache type next to llama-perplexity's."""
    import numpy as np

    import minirt
    from minirt import registry

    text = Path(a.perplexity).read_text(encoding="utf-8")
    n = a.ppl_ctx
    out: dict[str, Any] = {"model": a.model, "text": a.perplexity, "ctx": n}
    for t in a.types:
        with minirt.load(a.model, n_ctx=n, cache_type_k=t, cache_type_v=t, threads=a.threads) as llm:
            # as llama-perplexity: the whole text with the model's special tokens (BOS where it adds one),
            # then each chunk's first token replaced by BOS
            toks = llm.tokenize(text, add_special=True)
            bos = llm.tokenizer.bos_id if getattr(llm.tokenizer, "add_bos", False) else None
            nll, cnt = 0.0, 0
            for s in range(0, len(toks) - n + 1, n):
                ids = list(toks[s:s + n])
                if bos is not None:
                    ids[0] = bos
                lg = llm.logits(ids).astype(np.float64)
                for j in range(n // 2, n - 1):
                    row = lg[j]
                    mx = row.max()
                    nll += mx + np.log(np.exp(row - mx).sum()) - row[ids[j + 1]]
                    cnt += 1
            out[f"minirt_{t}"] = float(np.exp(nll / max(cnt, 1)))
            out["n_tokens"] = len(toks)
        exe = _llama_tool("llama-perplexity")
        if exe:
            path = str(registry.model_path(a.model))
            res = subprocess.run([exe, "-m", path, "-f", a.perplexity, "-c", str(n), "-t", str(a.threads), "-ctk", t,
                                  "-ctv", t, "-fa", "1"], capture_output=True, text=True, timeout=a.timeout)
            m = re.search(r"Final estimate: PPL = ([0-9.]+)", res.stdout + res.stderr)
            out[f"llama_{t}"] = float(m.group(1)) if m else None
    return out


# ------------------------------------------------------------------------------------------- cli

def build_parser() -> argparse.ArgumentParser:
    from minirt.kv_types import CACHE_TYPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--types", nargs="+", default=["f16", "q8_0"], choices=CACHE_TYPES)
    p.add_argument("--depths", nargs="+", type=int, default=DEPTHS)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=32)
    p.add_argument("-r", "--reps", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--sides", nargs="+", default=["minirt", "llama.cpp"], choices=["minirt", "llama.cpp"])
    p.add_argument("--out", default="bench/context_sweep", help="output prefix (.md, .json, .png)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--smoke", action="store_true", help="tiny run that only proves the script works")
    p.add_argument("--quality", action="store_true", help="teacher-forced argmax agreement per cache type")
    p.add_argument("--perplexity", metavar="TEXT", help="perplexity of this text per cache type vs llama-perplexity")
    p.add_argument("--ppl-ctx", type=int, default=512)
    # internal: one measurement in a child process
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ctk", default="f16", help=argparse.SUPPRESS)
    p.add_argument("--ctv", default="f16", help=argparse.SUPPRESS)
    p.add_argument("--llama-quality", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ref-model", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    if a.llama_quality:
        print(json.dumps(llama_quality(a)))
        return 0
    if a.quality:
        print(json.dumps(quality(a), indent=1))
        return 0
    if a.perplexity:
        print(json.dumps(perplexity(a), indent=1))
        return 0
    if a.smoke:
        a.depths, a.n_prompt, a.n_gen, a.reps = [0, 64], 16, 4, 1
    rows = sweep(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, a)
    out.with_suffix(".md").write_text(md, encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    plotted = plot(rows, a, out.with_suffix(".png"))
    print(md)
    print(f"wrote {out.with_suffix('.md')}, {out.with_suffix('.json')}" + (f", {out.with_suffix('.png')}"
                                                                             if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
