"""Table of every architecture fixture: minirt's and llama.cpp's logit error against transformers'
float32 forward (relative RMS, argmax agreement over all and over decisive positions), per file.

    python bench/arch_parity.py [ARCH ...]

Reads ``tests/data/archs`` (see ``tools/arch_fixtures/README.md``); needs no peer at run time (the
llama.cpp logits are stored there)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.arch_parity import QUANTS, compare, fixtures  # noqa: E402


def main(argv: list[str]) -> int:
    archs = argv or fixtures()
    print("| arch | file | rel RMS minirt | rel RMS llama.cpp | argmax minirt | argmax llama.cpp | decisive argmax "
          "minirt / llama.cpp (share of positions) | minirt vs llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    moe = []
    for a in archs:
        for q in QUANTS:
            try:
                r = compare(a, q)
            except Exception as e:  # noqa: BLE001 - a table row says why an architecture does not run
                print(f"| {a} | {q} | {type(e).__name__}: {str(e)[:80]} | | | | | |")
                continue
            decisive = f"{r['minirt_decisive_argmax']:.3f} / {r['llamacpp_decisive_argmax']:.3f}"
            print(f"| {a} | {q} | {r['minirt_rel_rms']:.4f} | {r['llamacpp_rel_rms']:.4f} | {r['minirt_argmax']:.3f} | "
                  f"{r['llamacpp_argmax']:.3f} | {decisive} ({r['decisive_fraction']:.2f}) | "
                  f"{r['minirt_vs_llamacpp_rel_rms']:.4f} |")
            if r["moe"]:
                moe.append(r)
    if moe:
        print("\nMixtures of experts, over the positions where minirt and llama.cpp routed alike "
              "(tests/arch_parity.same_routing_positions):\n")
        print("| arch | file | share of positions | rel RMS minirt | rel RMS llama.cpp |")
        print("|---|---|---|---|---|")
        for r in moe:
            print(f"| {r['arch']} | {r['quant']} | {r['same_routing_fraction']:.3f} | "
                  f"{r['minirt_rel_rms_same_routing']:.4f} | {r['llamacpp_rel_rms_same_routing']:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
