"""Constrained vs unconstrained decode speed (tok/s), both real models.

The constrained request follows a JSON schema that cannot end before ``--tokens`` (an array of at
least 10,000 records: nested objects, enums, integers, strings), so both sides decode exactly the
same number of tokens; the unconstrained one runs with ``ignore_eos``. Each round runs both, in
alternating order; the figures are medians over ``--repetitions`` rounds. ``--batch N`` decodes
N sequences together (one matcher each) through ``submit``.

    python bench/constrained.py [--models qwen,gemma] [--tokens 128] [--repetitions 5] [--batch 1]

Prints one JSON line per model: median decode tok/s unconstrained / constrained and their ratio
(the target is >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import minirt

MODELS = {"qwen": "qwen2.5-coder-0.5b-instruct", "gemma": "gemma3-270m"}
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "artist", "doctor", "pilot"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 10_000}
MESSAGES = [{"role": "user", "content": "List people as JSON records with name, age, role, address, tags."}]


def decode_tps(llm: minirt.Model, n: int, batch: int, constrained: bool) -> float:
    kw = dict(max_tokens=n, temperature=0.7, seed=1)
    kw.update(json_schema=SCHEMA) if constrained else kw.update(ignore_eos=True)
    if batch == 1:
        c = llm.chat(MESSAGES, **kw)
        assert len(c.token_ids) == n, (c.finish_reason, len(c.token_ids))
        return c.timings["generated_tokens_per_s"]
    hs = [llm.submit(messages=MESSAGES, **{**kw, "seed": i}) for i in range(batch)]
    cs = [h.result() for h in hs]
    assert all(len(c.token_ids) == n for c in cs)
    # aggregate: all sequences decode in the same steps, so per-sequence rates add up
    return sum(c.timings["generated_tokens_per_s"] for c in cs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen,gemma")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    for key in a.models.split(","):
        with minirt.load(MODELS.get(key, key), threads=a.threads, n_ctx=max(512, a.tokens + 128)) as llm:
            decode_tps(llm, 8, a.batch, True)  # warm-up: packed weights, grammar tokenizer
            decode_tps(llm, 8, a.batch, False)
            plain, cons = [], []
            for r in range(a.repetitions):
                order = (False, True) if r % 2 == 0 else (True, False)
                for constrained in order:
                    (cons if constrained else plain).append(decode_tps(llm, a.tokens, a.batch, constrained))
            p, c = statistics.median(plain), statistics.median(cons)
            print(json.dumps({"model": key, "batch": a.batch, "tokens": a.tokens, "repetitions": a.repetitions,
                              "unconstrained_tok_s": round(p, 2), "constrained_tok_s": round(c, 2),
                              "ratio": round(c / p, 3), "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
