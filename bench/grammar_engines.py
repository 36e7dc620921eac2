"""Token-mask cost of the two grammar engines minirt could use, on a real vocabulary.

For each engine: time to compile a JSON schema, a GBNF grammar and JSON-object mode, then the
time per generated token to consume the token and compute the next mask while walking a fixed
valid output. Reported as medians over the tokens of the output (ms).

    python bench/grammar_engines.py [--model PATH] [--engines llguidance,xgrammar]

xgrammar needs torch (a hard dependency of its wheel); run it where torch is installed, e.g.
``PYTHONPATH=DIR_WITH_XGRAMMAR python bench/grammar_engines.py --engines xgrammar``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "kind": {"enum": ["person", "robot"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}
OUTPUT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
                     "address": {"city": "London", "zip": "W1"}, "kind": "person"}, separators=(",", ":"))
GBNF = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
'''


def vocab(path: str) -> tuple[list[bytes], list[int], object]:
    from minirt import gguf
    from minirt.tokenizer import Tokenizer

    tk = Tokenizer.from_gguf(gguf.open(path))
    toks = [(b"\xff" if tk.is_control(i) else b"") + tk.token_to_piece(i) for i in range(tk.n_vocab)]
    return toks, sorted(tk.eog_ids), tk


def bench_llguidance(path: str) -> dict[str, float]:
    from minirt import gguf
    from minirt.grammar import GrammarEngine, compile_constraint
    from minirt.tokenizer import Tokenizer

    tk = Tokenizer.from_gguf(gguf.open(path))
    t0 = time.perf_counter()
    eng = GrammarEngine(tk, tk.n_vocab)
    eng.lltokenizer()
    out = {"tokenizer_s": time.perf_counter() - t0}
    ids = tk.encode(OUTPUT)
    for name, kw in (("json_schema", {"json_schema": SCHEMA}), ("gbnf", {"grammar": GBNF}),
                     ("json_object", {"response_format": {"type": "json_object"}})):
        t0 = time.perf_counter()
        c = compile_constraint(eng, **kw)
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        if name != "json_schema":
            continue
        per = []
        m = c.matcher()
        for tok in ids:
            t0 = time.perf_counter()
            m.compute(None)
            per.append(time.perf_counter() - t0)
            m.consume(tok)
        out["json_schema_mask_ms_median"] = 1e3 * statistics.median(per)
        out["json_schema_mask_ms_max"] = 1e3 * max(per)
    return out


def bench_xgrammar(path: str) -> dict[str, float]:
    import torch  # noqa: F401  (xgrammar imports it anyway)
    import xgrammar as xgr

    toks, eog, tk = vocab(path)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo([t[1:] if t.startswith(b"\xff") else t for t in toks], xgr.VocabType.RAW,
                             vocab_size=len(toks), stop_token_ids=eog,
                             add_prefix_space=False)
    comp = xgr.GrammarCompiler(info, max_threads=1)
    out = {"tokenizer_s": time.perf_counter() - t0}
    ids = tk.encode(OUTPUT)
    for name, fn in (("json_schema", lambda: comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                      separators=(",", ":"))),
                     ("gbnf", lambda: comp.compile_grammar(GBNF)),
                     ("json_object", lambda: comp.compile_builtin_json_grammar())):
        t0 = time.perf_counter()
        g = fn()
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        if name != "json_schema":
            continue
        m = xgr.GrammarMatcher(g)
        bm = xgr.allocate_token_bitmask(1, info.vocab_size)
        per = []
        for tok in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            per.append(time.perf_counter() - t0)
            assert m.accept_token(tok), tok
        out["json_schema_mask_ms_median"] = 1e3 * statistics.median(per)
        out["json_schema_mask_ms_max"] = 1e3 * max(per)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/minirt/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--engines", default="llguidance,xgrammar")
    a = ap.parse_args()
    np.set_printoptions(precision=3)
    for e in a.engines.split(","):
        fn = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}[e]
        print(e, json.dumps({k: round(v, 4) for k, v in fn(a.model).items()}))


if __name__ == "__main__":
    main()
