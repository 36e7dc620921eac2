"""Write native/iq_grids.c: the i-quant codebooks (grids) of ggml, copied from llama.cpp's
ggml/src/ggml-common.h (iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid, iq3s_grid, iq1s_grid).

That C file is the only copy of these tables in minirt: the native kernels compile it, and the numpy
specs (minirt/quants/iqgrids.py) read their values from its text. The grids are not derivable (ggml
chose each set of lattice points by a search), so they are stored.

    python tools/quant_fixtures/gen_iq_grids.py /path/to/llama.cpp/ggml/src/ggml-common.h [out.c]

With gguf-py importable, the result is also checked against gguf.quants' own (packed) grids.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

GRIDS = (("iq2xxs_grid", "uint64_t", 256), ("iq2xs_grid", "uint64_t", 512), ("iq2s_grid", "uint64_t", 1024),
         ("iq3xxs_grid", "uint32_t", 256), ("iq3s_grid", "uint32_t", 512), ("iq1s_grid", "uint64_t", 2048))


def read_tables(header: str) -> dict[str, list[int]]:
    out = {}
    for name, ctype, n in GRIDS:
        m = re.search(rf"GGML_TABLE_BEGIN\({ctype}, {name}, \w+\)(.*?)GGML_TABLE_END\(\)", header, re.S)
        if m is None:
            raise SystemExit(f"{name} not found")
        vals = [int(v, 16) for v in re.findall(r"0x([0-9a-fA-F]+)", m.group(1))]
        if len(vals) != n:
            raise SystemExit(f"{name}: {len(vals)} values, expected {n}")
        out[name] = vals
    return out


def check_against_gguf(tables: dict[str, list[int]]) -> None:
    try:
        import numpy as np
        from gguf import quants as gq
    except ImportError:
        print("gguf-py not importable: grids not cross-checked", file=sys.stderr)
        return
    for name, cls in (("iq2xxs_grid", gq.IQ2_XXS), ("iq2xs_grid", gq.IQ2_XS), ("iq2s_grid", gq.IQ2_S),
                      ("iq3xxs_grid", gq.IQ3_XXS), ("iq3s_grid", gq.IQ3_S), ("iq1s_grid", gq.IQ1_S)):
        cls.init_grid()
        ref = cls.grid.reshape(cls.grid_shape)
        width = 8 if name != "iq3xxs_grid" and name != "iq3s_grid" else 4
        a = np.array(tables[name], dtype=np.uint64 if width == 8 else np.uint32)
        mine = a.view(np.uint8).reshape(-1, width)
        mine = mine.view(np.int8) if name == "iq1s_grid" else mine
        assert np.array_equal(mine.astype(np.float32), ref), name
    print("grids match gguf.quants", file=sys.stderr)


def main() -> None:
    header = Path(sys.argv[1]).read_text(encoding="utf-8")
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[2] / "native" / "iq_grids.c"
    tables = read_tables(header)
    check_against_gguf(tables)
    lines = ["/* The i-quant grids of ggml (ggml/src/ggml-common.h of llama.cpp), written by",
             " * tools/quant_fixtures/gen_iq_grids.py: do not edit. This is minirt's only copy: the numpy specs",
             " * (minirt/quants/iqgrids.py) read the values below from this file's text.",
             " * Each entry packs 8 (uint64) or 4 (uint32) grid bytes, element 0 in the lowest byte; iq1s_grid",
             " * bytes are int8 (-1, 0, 1). */",
             '#include "common.h"', ""]
    for name, ctype, n in GRIDS:
        w = 16 if ctype == "uint64_t" else 8
        per = 4 if ctype == "uint64_t" else 8
        lines.append(f"const {ctype} mr_{name}[{n}] = {{")
        vals = tables[name]
        for i in range(0, n, per):
            lines.append("    " + " ".join(f"0x{v:0{w}x}," for v in vals[i:i + per]))
        lines.append("};")
        lines.append("")
    out.write_text("\n".join(lines), encoding="utf-8")
    print(out)


if __name__ == "__main__":
    main()
