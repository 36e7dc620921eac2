"""The embedding output of a description: pooling type, reranker classifier head and the dense
projections after pooling, read from GGUF metadata and tensors (shared by every architecture).

``<arch>.pooling_type`` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank); without the key
a file with a classifier head is a reranker (converters never write "rank": llama.cpp is told
``--pooling rank``), any other is generative only (``ModelDesc.pooling`` None) unless the
architecture gives a default (encoders: cls).
Rerankers (rank) have ``cls.weight``/``cls.bias`` (a d×d projection then tanh — GELU for
ModernBERT — and an optional ``cls.norm``) and/or ``cls.output.weight``/``.bias`` (n_cls_out × d);
``<arch>.classifier.pooling_type`` says whether the head reads the first token or the mean.
EmbeddingGemma's sentence-transformers Dense modules are ``dense_2`` then ``dense_3``.
"""

from __future__ import annotations

import numpy as np

from ..blocks import POOLING_TYPES, Linear, Pooling
from ..errors import GGUFError
from ..gguf import GGUFFile
from .base import HParams, meta_float, meta_int, norm


def pooling_from_meta(f: GGUFFile, hp: HParams, default: str | None = None, cls_act: str = "tanh",
                      softmax: bool = False, override: str | None = None, causal: bool = False) -> Pooling | None:
    """The file's pooling (None when it has no ``pooling_type`` and no ``default``); ``override``:
    the caller's choice instead of the file's (llama.cpp's ``--pooling``). ``causal``: a decoder,
    whose classifier reads the last token (the only one that saw the whole input), as llama.cpp."""
    key = f"{f.architecture}.pooling_type"
    if override is not None:
        kind = override
    elif key not in f.metadata:
        # converters do not write "rank" (llama.cpp is told --pooling rank); a classifier head says it
        if "cls.output.weight" in f.tensors or "cls.weight" in f.tensors:
            default = "rank"
        if default is None:
            return None
        kind = default
    else:
        kind = POOLING_TYPES[meta_int(f, "pooling_type", lo=0, hi=len(POOLING_TYPES) - 1)]
    p = Pooling(kind=kind, cls_act=cls_act, softmax=softmax)
    d = hp.n_embd
    if kind == "rank":
        if "cls.weight" in f.tensors:
            p.cls = _linear(f, "cls", d, d)
            p.cls_norm = norm(f, "cls.norm", d, meta_float(f, "attention.layer_norm_epsilon", 1e-12, hi=1.0),
                              kind="layer", required=False)
        if "cls.output.weight" in f.tensors:
            t = f.tensors["cls.output.weight"]
            if len(t.shape) not in (1, 2) or t.shape[-1] != d:
                raise GGUFError(f"{f.path}: tensor 'cls.output.weight' has shape {t.shape}, expected (n_out, {d})")
            p.cls_out = _linear(f, "cls.output", t.shape[0], d) if len(t.shape) == 2 else _one_row(f, "cls.output", d)
        if p.cls is None and p.cls_out is None:
            raise GGUFError(f"{f.path}: pooling type rank needs a classifier head ('cls' or 'cls.output' tensors)")
        cp = meta_int(f, "classifier.pooling_type", 3 if causal else 2, lo=0, hi=len(POOLING_TYPES) - 1)
        p.cls_pool = {1: "mean", 3: "last"}.get(cp, "cls")
        labels = f.metadata.get(f"{f.architecture}.classifier.output_labels")
        if isinstance(labels, (list, np.ndarray)):
            p.labels = [str(x) for x in labels]
    n_in = d
    for name in ("dense_2", "dense_3"):
        if name + ".weight" in f.tensors:
            t = f.tensors[name + ".weight"]
            if len(t.shape) != 2 or t.shape[1] != n_in:
                raise GGUFError(f"{f.path}: tensor {name + '.weight'!r} has shape {t.shape}, expected (n_out, {n_in})")
            p.dense.append(_linear(f, name, t.shape[0], n_in))
            n_in = t.shape[0]
    return p


def _linear(f: GGUFFile, name: str, out_f: int, in_f: int) -> Linear:
    from .base import linear

    return linear(f, name, out_f, in_f, bias=None)


def _one_row(f: GGUFFile, name: str, d: int) -> Linear:
    """A one-output classifier (``cls.output.weight`` of one label is stored as a vector (d,)) as a
    Linear of one row: the same bytes viewed (1, row_bytes)."""
    t = f.tensors[name + ".weight"]
    lin = object.__new__(Linear)
    lin.name, lin.qtype, lin.out_features, lin.in_features = t.name, t.qtype, 1, d
    lin.w = t.data.reshape(1, -1)
    b = f.tensors.get(name + ".bias")
    lin.bias = None if b is None else np.ascontiguousarray(b.dequantize().reshape(-1)[:1], dtype=np.float32)
    if lin.bias is not None and b.dequantize().size != 1:
        raise GGUFError(f"{f.path}: tensor {name + '.bias'!r} must have one element")
    lin.backend_data, lin.parent = None, None
    from ..quants import get_spec

    get_spec(t.qtype)  # a type that can be read
    return lin
