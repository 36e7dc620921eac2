#!/usr/bin/env python
"""minirt vs llama.cpp, side by side on the same GGUF (see bench/README.md).

    python bench/compare.py                       # default model, full run (~10 min on 2 cores)
    python bench/compare.py --quick               # smoke run: one repetition, pp128, tg32
    python bench/compare.py -m gemma3-270m --markdown --json out.json
    MINIRT_LLAMA_PYTHON=/path/to/llama-venv/bin/python python bench/compare.py

Everything lives in :mod:`minirt.bench`; this script only adds the repository to ``sys.path``
so it runs from a checkout without installing.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minirt.bench import build_parser, main  # noqa: E402
from minirt.errors import MinirtError  # noqa: E402


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return main(args)
    except MinirtError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(run())
