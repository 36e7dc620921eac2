"""LoRA adapters in llama.cpp's GGUF layout (``--lora FILE``, ``--lora-scaled FILE SCALE``).

An adapter file (``general.type = "adapter"``, ``adapter.type = "lora"``, the base model's
``general.architecture``) holds, for some weights ``W (out, in)`` of the base model, a pair
``<name>.lora_a (rank, in)`` and ``<name>.lora_b (out, rank)``; the layer then computes
``x W^T + s · (x A^T) B^T`` with ``s = scale · alpha / rank`` (``scale`` alone where alpha is 0),
as llama.cpp's ``build_lora_mm`` does. The token embedding's pair is stored flipped
(``token_embd.weight.lora_a (n_vocab, rank)``, ``lora_b (n_embd, rank)``): a token's row gains
``s · A[id] B^T``. jina-embeddings-v3's converter writes one adapter per task (``adapter.lora.task_name``)
with the text its model card prepends to inputs (``adapter.lora.prompt_prefix``).

The base weights stay quantized and mapped; the low-rank factors are small float32 arrays applied
next to each matmul (no merged copy of any weight), to the token embedding and to the token-type
row encoders add (jina's adapters change it; llama.cpp leaves that pair out).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import GGUFError, InvalidRequestError

log = logging.getLogger(__name__)

MAX_RANK = 4096  # far above any published adapter; bounds the work a hostile file can ask for


@dataclass
class LoraPair:
    """One weight's factors: ``a (rank, in)``, ``b (out, rank)`` (token embedding: ``a (n_vocab, rank)``,
    ``b (n_embd, rank)``), float32, and the effective scale ``s``."""

    a: np.ndarray
    b: np.ndarray
    scale: float = 0.0  # set by LoraAdapter.set_scale


@dataclass
class LoraAdapter:
    """A loaded adapter: its file, the user's scale, alpha and the per-weight pairs."""

    path: str
    scale: float
    alpha: float
    task_name: str | None = None
    prompt_prefix: str = ""  # absent in the file: none (as llama.cpp reads it)
    pairs: dict[str, LoraPair] = field(default_factory=dict)

    def set_scale(self, scale: float) -> None:
        """The user scale from now on (every pair's effective scale follows)."""
        for p in self.pairs.values():
            rank = p.b.shape[1]
            p.scale = float(scale * self.alpha / rank if self.alpha else scale)
        self.scale = float(scale)

    def info(self) -> dict[str, Any]:
        """What llama-server's ``/lora-adapters`` shows of an adapter."""
        return {"path": self.path, "scale": self.scale, "task_name": self.task_name,
                "prompt_prefix": self.prompt_prefix, "n_tensors": len(self.pairs)}


def parse_spec(spec: Any) -> list[tuple[str, float]]:
    """``lora=`` of :func:`minirt.load`: a path, ``(path, scale)``, or a list of either."""
    if spec is None:
        return []
    items = [spec] if isinstance(spec, (str, os.PathLike, tuple)) else spec
    if not isinstance(items, Sequence) or isinstance(items, (bytes, bytearray)):
        raise InvalidRequestError("lora must be a path, a (path, scale) pair or a list of them")
    out = []
    for it in items:
        if isinstance(it, tuple) and len(it) != 2:
            raise InvalidRequestError(f"a lora entry must be (path, scale), got {it!r}")
        path, scale = it if isinstance(it, tuple) else (it, 1.0)
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidRequestError(f"lora path must be a string or path, got {type(path).__name__}")
        out.append((os.fspath(path), check_scale(scale, "lora scale")))
    return out


def check_scale(v: Any, what: str) -> float:
    """An adapter scale: a finite number (bools refused), else :class:`InvalidRequestError` naming ``what``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidRequestError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def _meta_str(f: Any, key: str) -> str | None:
    v = f.metadata.get(key)
    if v is not None and not isinstance(v, str):
        raise GGUFError(f"{f.path}: metadata {key!r} must be a string, got {type(v).__name__}")
    return v


def load_adapter(path: str, scale: float, base: Any) -> LoraAdapter:
    """Read and check the adapter at ``path`` against the base model's GGUF file ``base``."""
    from . import gguf

    f = gguf.open(path)
    try:
        kind = _meta_str(f, "general.type")
        if kind is not None and kind != "adapter":
            raise GGUFError(f"{path}: not a LoRA adapter (general.type is {kind!r}, expected 'adapter')")
        if _meta_str(f, "adapter.type") != "lora":
            raise GGUFError(f"{path}: not a LoRA adapter (adapter.type is "
                            f"{f.metadata.get('adapter.type')!r}, expected 'lora')")
        arch, base_arch = _meta_str(f, "general.architecture"), base.metadata.get("general.architecture")
        if arch != base_arch:
            raise GGUFError(f"{path}: adapter for {arch!r} but the model is {base_arch!r}")
        alpha = f.metadata.get("adapter.lora.alpha", 0.0)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise GGUFError(f"{path}: adapter.lora.alpha must be a finite number, got {alpha!r}")
        ad = LoraAdapter(path=path, scale=scale, alpha=float(alpha), task_name=_meta_str(f, "adapter.lora.task_name"),
                         prompt_prefix=_meta_str(f, "adapter.lora.prompt_prefix") or "")
        halves: dict[str, dict[str, Any]] = {}
        for name, t in f.tensors.items():
            for suffix in (".lora_a", ".lora_b"):
                if name.endswith(suffix):
                    halves.setdefault(name[:-len(suffix)], {})[suffix[-1]] = t
                    break
            else:
                raise GGUFError(f"{path}: tensor {name!r} is neither a .lora_a nor a .lora_b")
        if not halves:
            raise GGUFError(f"{path}: the adapter has no tensors")
        for name, ab in sorted(halves.items()):
            if set(ab) != {"a", "b"}:
                raise GGUFError(f"{path}: LoRA pair of {name!r} lacks its lora_{'a' if 'a' not in ab else 'b'}")
            w = base.tensors.get(name)
            if w is None:
                raise GGUFError(f"{path}: LoRA tensor {name!r} is not in the model (an adapter for another model?)")
            ad.pairs[name] = _pair(path, name, w.shape, ab["a"], ab["b"])
    finally:
        f.close()
    ad.set_scale(scale)
    return ad


def _pair(path: str, name: str, wshape: tuple[int, ...], ta: Any, tb: Any) -> LoraPair:
    """The factors of weight ``name`` (numpy shape ``wshape``), checked before anything is read (the
    scale is the adapter's to set)."""
    if len(wshape) == 1:  # a one-row table written as a vector (one token type, after llama-quantize)
        wshape = (1, wshape[0])
    if len(wshape) != 2 or len(ta.shape) != 2 or len(tb.shape) != 2:
        raise GGUFError(f"{path}: LoRA for {name!r} must pair 2-D tensors with a 2-D weight "
                        f"(weight {wshape}, a {ta.shape}, b {tb.shape})")
    out, n_in = wshape
    rank = tb.shape[1]
    if name.endswith("token_embd.weight"):  # flipped: a (n_vocab, rank), b (n_embd, rank)
        ok = ta.shape == (out, rank) and tb.shape == (n_in, rank)
    else:
        ok = ta.shape == (rank, n_in) and tb.shape == (out, rank)
    if not ok or not 0 < rank <= MAX_RANK:
        raise GGUFError(f"{path}: LoRA tensors of {name!r} have shapes a {ta.shape}, b {tb.shape}, which do not "
                        f"fit the weight {wshape} (rank 1..{MAX_RANK})")
    a = np.ascontiguousarray(ta.dequantize(), dtype=np.float32).reshape(ta.shape)
    b = np.ascontiguousarray(tb.dequantize(), dtype=np.float32).reshape(tb.shape)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise GGUFError(f"{path}: LoRA tensors of {name!r} hold NaN or infinite values")
    return LoraPair(a, b)


def load(spec: Any, base: Any) -> list[LoraAdapter]:
    """Every adapter ``spec`` names (see :func:`parse_spec`), checked against ``base``."""
    out = []
    for path, scale in parse_spec(spec):
        ad = load_adapter(path, scale, base)
        log.info("LoRA adapter %s: %d weights, scale %g%s", path, len(ad.pairs), scale,
                 f", task {ad.task_name!r}" if ad.task_name else "")
        out.append(ad)
    return out


class LoraSet:
    """The adapters a model runs with, indexed by base tensor name."""

    def __init__(self, adapters: Sequence[LoraAdapter]) -> None:
        self.adapters = list(adapters)
        self.by_name: dict[str, list[LoraPair]] = {}
        for ad in self.adapters:
            for name, p in ad.pairs.items():
                self.by_name.setdefault(name, []).append(p)

    def add_linear(self, y: np.ndarray, x: np.ndarray, lin: Any) -> None:
        """y (T, out) += every adapter's ``s · (x A^T) B_rows^T`` for the matmul of ``lin`` (a whole
        tensor or a row view of a fused one) on x (T, in)."""
        name, r0 = lin.source
        if name.endswith("token_embd.weight"):  # a tied output head: the embedding pair is not a matmul pair
            return
        for p in self.by_name.get(name, ()):
            b = p.b[r0:r0 + lin.out_features]
            y += np.float32(p.scale) * ((x @ p.a.T) @ b.T)

    def row_delta(self, name: str, row: int, n: int) -> np.ndarray:
        """Every adapter's change ``s · B[row] A`` (n,) of row ``row`` of the table ``name`` (a small
        embedding table stored as a matrix pair, e.g. token types); zeros where none has it."""
        out = np.zeros(n, np.float32)
        for p in self.by_name.get(name, ()):
            if p.a.shape[1] == n and row < p.b.shape[0]:
                out += np.float32(p.scale) * (p.b[row] @ p.a)
        return out

    def add_embedding(self, x: np.ndarray, ids: np.ndarray, name: str) -> None:
        """x (T, d) += ``s · A[ids] B^T`` for the token embedding ``name``."""
        for p in self.by_name.get(name, ()):
            x += np.float32(p.scale) * (p.a[ids] @ p.b.T)
