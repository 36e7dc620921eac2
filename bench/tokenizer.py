"""Tokenizer throughput: minirt vs llama.cpp's tokenizer, side by side, on the same ~100 KB text.

The text is generated here (seeded, nothing downloaded): English prose (common words plus
made-up ones, so the vocabulary is not all cached), Python code, and Chinese / Japanese text, in
alternating chunks. Each model's vocabulary is loaded once by each tokenizer; the repetitions are
interleaved (llama.cpp, minirt, llama.cpp, ...) so machine noise hits both alike; the table gives
medians and the ratio of throughputs.

minirt is timed *cold* (its per-word cache cleared before every repetition: the fair comparison,
llama.cpp keeps no such cache) and *warm* (the cache filled by the previous repetition).

llama.cpp runs in another Python that has the ``llama_cpp`` binding (llama-cpp-python), as a
subprocess: ``$MINIRT_LLAMA_CPP_PYTHON``, else ``../llvenv/bin/python`` beside the repository.
It is called with ``Llama(model_path, vocab_only=True).tokenize(text, add_bos=False,
special=False)``. Without it the llama.cpp columns say so; nothing is estimated.

    python bench/tokenizer.py                  # both registry models (pulled if missing)
    python bench/tokenizer.py --reps 9 --kb 200
    python bench/tokenizer.py path/to/model.gguf
    python bench/tokenizer.py --llama-models path/to/llama.cpp/models   # every ggml-vocab-*.gguf there
    python bench/tokenizer.py --cases          # one file per vocabulary kind and BPE pre-tokenizer type

``--llama-models`` benchmarks the full-size vocab-only GGUFs llama.cpp ships (SPM, BPE with their
pre-tokenizers, WordPiece, Unigram, Gemma 4); ``--cases`` the vocabularies of the tokenizer tests
(``tests/data/tokenizers``): each BPE pre-tokenizer type on the same small trained vocabulary, and
the RWKV / PLaMo-2 ones (tiny vocabularies: they time the algorithm, not a real model's table).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import minirt  # noqa: E402
from minirt import registry  # noqa: E402
from minirt.tokenizer import Tokenizer  # noqa: E402

DEFAULT_MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma3-270m"]

_COMMON = (
    "the of and to a in is it you that he was for on are with as his they be at one have this from or had by "
    "not word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two has "
    "look more day could go come did number sound no most people my over know water than call first who may "
    "down side been now find any new work part take get place made live where after back little only round man "
    "year came show every good me give our under name very through just form sentence great think say help low "
    "line differ turn cause much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high such follow act why ask "
    "men change went light kind off need house picture try us again animal point mother world near build self "
    "earth father head stand own page should country found answer school grow study still learn plant cover food "
    "sun four between state keep eye never last let thought city tree cross farm hard start might story saw far "
    "sea draw left late run don't while press close night real life few north open seem together next white "
    "children begin got walk example ease paper group always music those both mark often letter until mile river"
).split()
_SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vor", "qui", "zel", "ban", "dro", "eth", "fin", "gul", "hor", "ix",
              "jun", "pra", "sto", "ult", "wey"]


def build_text(n_bytes: int, seed: int = 0) -> str:
    """~n_bytes of UTF-8: English prose, Python code and CJK text in alternating chunks."""
    rnd = random.Random(seed)

    def made_up() -> str:
        return "".join(rnd.choice(_SYLLABLES) for _ in range(rnd.randint(1, 3)))

    def word() -> str:
        return rnd.choice(_COMMON) if rnd.random() < 0.85 else made_up()

    def english(n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            words = [word() for _ in range(rnd.randint(5, 18))]
            words[0] = words[0].capitalize()
            if rnd.random() < 0.2:
                words.insert(rnd.randrange(len(words)), str(rnd.randint(1, 99999)))
            s = " ".join(words) + rnd.choice([".", ".", ".", "?", "!", ", and", ";"])
            s += "\n\n" if rnd.random() < 0.15 else " "
            out.append(s)
            size += len(s)
        return "".join(out)

    def code(n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            f, a, b = f"{made_up()}_{made_up()}", made_up(), made_up()
            s = (f"def {f}({a}, {b}=None):\n"
                 f'    """Return the {word()} of {a} ({word()} {word()})."""\n'
                 f"    if {b} is None:\n"
                 f"        {b} = [{rnd.randint(0, 999)}, {rnd.random():.3f}]\n"
                 f"    for i in range(len({a})):\n"
                 f"        {b}.append({a}[i] * {rnd.randint(2, 9)})  # {word()} {word()}\n"
                 f"    return {{'{a}': {b}, \"n\": len({b})}}\n\n")
            out.append(s)
            size += len(s)
        return "".join(out)

    han = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    kana = [chr(c) for c in range(0x3041, 0x3097)] + [chr(c) for c in range(0x30A1, 0x30FB)]

    def cjk(n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            s = "".join(rnd.choice(han) if rnd.random() < 0.7 else rnd.choice(kana) for _ in range(rnd.randint(6, 30)))
            s += rnd.choice(["。", "，", "！", "？", "、"]) + ("\n" if rnd.random() < 0.2 else "")
            out.append(s)
            size += len(s.encode("utf-8"))
        return "".join(out)

    parts: list[str] = []
    total = 0
    while total < n_bytes:
        for chunk in (english(3000), code(2000), cjk(1500)):
            parts.append(chunk)
            total += len(chunk.encode("utf-8"))
    return "".join(parts)


_WORKER = r"""
import sys, json, time, llama_cpp
model, text_path = sys.argv[1], sys.argv[2]
text = open(text_path, encoding="utf-8").read().encode("utf-8")
llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
print(json.dumps({"ready": True, "version": getattr(llama_cpp, "__version__", "?")}), flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    ids = llm.tokenize(text, add_bos=False, special=False)
    dt = time.perf_counter() - t
    print(json.dumps({"s": dt, "ids": ids if line.strip() == "ids" else None}), flush=True)
"""


def llama_python() -> tuple[str | None, str]:
    """(interpreter with llama_cpp, or None; a line saying which / why not)."""
    env = os.environ.get("MINIRT_LLAMA_CPP_PYTHON")
    cand = env or str(REPO.parent / "llvenv" / "bin" / "python")
    if not Path(cand).is_file():
        return None, f"llama.cpp: NOT AVAILABLE ({cand} not found; set MINIRT_LLAMA_CPP_PYTHON)"
    r = subprocess.run([cand, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True)
    if r.returncode:
        return None, f"llama.cpp: NOT AVAILABLE ({cand} cannot import llama_cpp)"
    return cand, f"llama.cpp: llama-cpp-python {r.stdout.strip()} via {cand}"


class LlamaWorker:
    """llama.cpp's tokenizer in a subprocess, one tokenize() per request."""

    def __init__(self, python: str, model: Path, text_path: Path) -> None:
        self.p = subprocess.Popen([python, "-c", _WORKER, str(model), str(text_path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._read()

    def _read(self) -> dict:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("llama.cpp worker exited (could it load the model?)")
        return json.loads(line)

    def run(self, want_ids: bool = False) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write("ids\n" if want_ids else "go\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        self.p.wait(timeout=30)


def bench_model(path: Path, text: str, text_path: Path, reps: int, py: str | None) -> dict:
    n_bytes = len(text.encode("utf-8"))
    with minirt.gguf.open(path) as f:
        t = time.perf_counter()
        tok = Tokenizer.from_gguf(f)
        load_s = time.perf_counter() - t
    tok.encode("warm up the lazily built regexes")
    ids = tok.encode(text)
    worker = LlamaWorker(py, path, text_path) if py else None
    same = None
    if worker:
        same = worker.run(want_ids=True)["ids"] == ids
    cold, warm, ll = [], [], []
    for _ in range(reps):
        if worker:
            ll.append(worker.run()["s"])
        tok.clear_cache()
        t = time.perf_counter()
        tok.encode(text)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        tok.encode(text)
        warm.append(time.perf_counter() - t)
    if worker:
        worker.close()
    return {"model": path.name, "bytes": n_bytes, "tokens": len(ids), "load_s": load_s, "same_ids": same,
            "llama_s": statistics.median(ll) if ll else None, "cold_s": statistics.median(cold),
            "warm_s": statistics.median(warm)}


def case_files(tmp: Path) -> list[Path]:
    """GGUF files for the tokenizer-test cases: one per (model, pre-tokenizer type)."""
    import importlib.util

    script = REPO / "tests" / "data" / "tokenizers" / "regenerate.py"
    spec = importlib.util.spec_from_file_location("regenerate", script)
    assert spec is not None and spec.loader is not None
    regen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen)
    from minirt.pretokenizers import PRE_NAMES

    out, seen = [], set()
    for vocab, model, pre in regen.cases():
        if vocab == regen.BYTELEVEL:
            continue  # the trained vocabulary carries the same pre-tokenizers
        key = (vocab, model, PRE_NAMES[pre].type if pre else None)
        if key in seen:
            continue
        seen.add(key)
        p = tmp / f"case-{vocab.split('.')[0]}-{model}-{key[2] or 'none'}.gguf"
        regen.write_gguf(p, regen.case_metadata(vocab, model, pre))
        out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="GGUF paths or registry names (default: both registry models)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kb", type=int, default=100, help="text size in KB (default 100)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--llama-models", type=Path, help="also every ggml-vocab-*.gguf in this folder")
    ap.add_argument("--cases", action="store_true", help="also the tokenizer tests' vocabularies, one per type")
    args = ap.parse_args(argv)

    names = args.models or ([] if (args.llama_models or args.cases) else DEFAULT_MODELS)
    paths = [Path(m) if Path(m).is_file() else registry.resolve(m) for m in names]
    if args.llama_models:
        paths += sorted(args.llama_models.glob("ggml-vocab-*.gguf"))
    text = build_text(args.kb * 1000)
    py, who = llama_python()
    print(who)
    print(f"text: {len(text.encode('utf-8'))} bytes UTF-8, {len(text)} characters (English, Python, CJK); "
          f"{args.reps} interleaved repetitions, medians; 2-core shared machine: indicative")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text_path = Path(tmp) / "bench.txt"
        text_path.write_text(text, encoding="utf-8")
        if args.cases:
            paths += case_files(Path(tmp))
        for p in paths:
            rows.append(bench_model(p, text, text_path, args.reps, py))

    def mbs(n: int, s: float | None) -> str:
        return f"{s * 1e3:7.1f} ms {n / s / 1e6:5.2f} MB/s" if s else f"{'n/a':>21}"

    print()
    print(f"| {'model':44} | tokens | {'llama.cpp':21} | {'minirt cold':21} | ratio | "
          f"{'minirt warm':21} | ratio | same ids |")
    print(f"|{'-' * 46}|-------:|{'-' * 23}|{'-' * 23}|------:|{'-' * 23}|------:|----------|")
    for r in rows:
        ratio_c = f"{r['llama_s'] / r['cold_s']:5.2f}" if r["llama_s"] else "  n/a"
        ratio_w = f"{r['llama_s'] / r['warm_s']:5.2f}" if r["llama_s"] else "  n/a"
        same = {True: "yes", False: "NO", None: "n/a"}[r["same_ids"]]
        print(f"| {r['model']:44} | {r['tokens']:6} | {mbs(r['bytes'], r['llama_s'])} | {mbs(r['bytes'], r['cold_s'])} "
              f"| {ratio_c} | {mbs(r['bytes'], r['warm_s'])} | {ratio_w} | {same:8} |")
    print("\nratio = minirt throughput / llama.cpp throughput (> 1: minirt is faster); "
          + ", ".join(f"{r['model']}: tokenizer load {r['load_s'] * 1e3:.0f} ms" for r in rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"llama_cpp": who, "rows": rows}, indent=2))
    return 0 if all(r["same_ids"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
