"""Check that minirt's GGUF reader and tokenizer load every fixture file (run with the repository's venv).

Prints one line per file: path, ``general.architecture`` as minirt reads it, and whether
``minirt.tokenizer.Tokenizer.from_gguf`` accepts the vocabulary (with the error when it does not).
"""
from __future__ import annotations

import sys
from pathlib import Path

import minirt.gguf as g
from minirt.tokenizer import Tokenizer


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "tests" / "data" / "archs"
    bad = 0
    for path in sorted(root.glob("*/*.gguf")):
        f = g.open(path)
        try:
            tok = Tokenizer.from_gguf(f)
            status = f"tokenizer ok ({len(tok.encode('Hello world 123'))} ids for 'Hello world 123')"
        except Exception as e:  # report, don't stop: some vocabularies wait for the tokenizer work
            status = f"tokenizer FAILED: {type(e).__name__}: {e}"
            bad += 1
        print(f"{path.relative_to(root)}: architecture={f.architecture}; {status}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
