"""Per-channel balance of keys and queries for block-quantized K caches.

Attention needs only the dot products q·k, and q·k = (q ⊘ s)·(k ⊙ s) for any per-channel factors s
of a KV head. A block-quantized cache (q8_0, q4_0, ...) sets each 32-value block's step by its
largest value, so channels that are large in the keys but matter little to the queries spend the
precision that the channels the queries weigh most would need. Storing ``s ⊙ k`` with

    s_c = (E[q_c²] / E[k_c²]) ^ (1/4)        (per layer, KV head and channel; q over the head's group)

makes the expected error of the scores, Σ_c (q_c / s_c)² · σ²(s ⊙ k), smallest (Cauchy–Schwarz: the
quantization noise of s ⊙ k is about the same on every channel once the Hadamard rotation has
spread it). The factors are rounded to powers of two, so multiplying and dividing by them is exact
in float32: the scores change only by the quantization error, never by rounding of the transform.

E[q²] and E[k²] (keys less their offset, :meth:`minirt.blocks.Attention.key_offset`) are measured at
load, once, on a forward pass over ``N_TOKENS`` pseudo-random token ids of the model's own
vocabulary: the channel statistics that matter come from the weights (the few hidden dimensions
with large activations, K biases, q/k norm gains), not from the text; the same ids give the same
factors on every load. Measured on Qwen2.5-0.5B (``bench/context_sweep.py --quality``): teacher-forced
argmax agreement of a q8_0 cache with the f32 cache 99.17% → 99.86%, q4_0 81.9% → 95.0%.

Only where the K type is block-quantized (as the key offset), and only rows that are attention keys
(not LFM2's convolution rows). ``MINIRT_KV_BALANCE=0`` turns it off. The factors of a GGUF file are
kept in ``$MINIRT_HOME/kv_balance/`` (a few KB, keyed by the file's path, size and modification time
and the minirt version), so the measuring pass runs once per model: on a 7B model it is seconds. Any
positive factors give the same attention, so a damaged or foreign cache file can cost precision at
worst; it is checked (shape, range) and measured anew when it does not fit.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

N_TOKENS = 128  # positions of the measuring pass (fewer: noisier factors; more: a slower load)
MAX_LOG2 = 6  # factors stay within 2^-6 .. 2^6
SEED = 0x6B76  # the token ids of the measuring pass


def enabled() -> bool:
    """False when ``MINIRT_KV_BALANCE=0``."""
    return os.environ.get("MINIRT_KV_BALANCE", "1") != "0"


def measure(model: Any, n_tokens: int = N_TOKENS) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per cache layer, (E[k²] (Hkv, Dk), E[q²] (Hkv, Dk)) over one forward pass of ``n_tokens``
    pseudo-random ids through ``model`` (a :class:`minirt.forward.Transformer`) with an f32 cache:
    keys less the layer's key offset, queries of every layer reading that cache summed over each KV
    head's group, as attention sees them (after norms and RoPE)."""
    from .forward import Segment, kv_cache_for

    cfg = model.cfg
    offsets = cfg.kv_offsets or [None] * cfg.n_layer
    ek: dict[int, np.ndarray] = {}
    eq: dict[int, np.ndarray] = {}

    def probe(i: int, src: int, q: np.ndarray, k: np.ndarray | None) -> None:
        if k is not None:
            kk = k.astype(np.float64)
            if offsets[i] is not None:
                kk -= offsets[i][None].astype(np.float64)
            ek[i] = ek.get(i, 0.0) + (kk ** 2).sum(0)
        qq = (q.astype(np.float64) ** 2).sum(0)  # (H, Dk)
        hkv = ek[src].shape[0] if src in ek else qq.shape[0]
        eq[src] = eq.get(src, 0.0) + qq.reshape(hkv, -1, qq.shape[1]).sum(1)

    V = cfg.n_vocab
    lo, hi = min(1000, V // 2), min(20000, V)  # ordinary tokens of a real vocabulary
    ids = np.random.default_rng(SEED).integers(lo, max(hi, lo + 1), n_tokens)
    cache = kv_cache_for(replace(cfg, kv_scales=None), n_tokens, "f32", "f32")
    model.probe = probe
    try:
        model.forward(ids, [Segment(cache, n_tokens, "none")])
    finally:
        model.probe = None
    return {i: (ek[i] / n_tokens, eq[i] / n_tokens) for i in ek if i in eq}


def scales_from(energies: dict[int, tuple[np.ndarray, np.ndarray]], n_layer: int) -> tuple[np.ndarray | None, ...]:
    """Per layer the power-of-two factors (Hkv, Dk) float32 of :func:`measure`'s energies (None for
    layers without keys of their own). Each head's energies are taken relative to their mean (the
    factors' overall size does not matter), with a floor for channels that are always zero."""
    out: list[np.ndarray | None] = [None] * n_layer
    for i, (ek, eq) in energies.items():
        rk = ek / np.maximum(ek.mean(-1, keepdims=True), 1e-30)
        rq = eq / np.maximum(eq.mean(-1, keepdims=True), 1e-30)
        e = np.round(0.25 * np.log2((rq + 1e-6) / (rk + 1e-6)))
        out[i] = np.exp2(np.clip(e, -MAX_LOG2, MAX_LOG2)).astype(np.float32)
    return tuple(out)


NO_FACTORS = -128  # the exponents of a layer without factors (outside any factor's range)


def to_exponents(scales: Sequence[np.ndarray | None], hk: int, dk: int) -> np.ndarray:
    """Per-layer factors as their base-2 exponents (n_layer, hk, dk) int8: NO_FACTORS rows for layers
    without, 0 beyond a smaller layer's own (Hkv, Dk). What state files and the kept file hold."""
    e = np.full((len(scales), hk, dk), NO_FACTORS, np.int8)
    for i, s in enumerate(scales):
        if s is not None:
            e[i] = 0
            e[i, :s.shape[0], :s.shape[1]] = np.log2(s).astype(np.int8)
    return e


def from_exponents(e: np.ndarray, shapes: Sequence[tuple[int, int] | None]) -> tuple[np.ndarray | None, ...] | None:
    """The inverse of :func:`to_exponents` for layers of (Hkv, Dk) ``shapes`` (None: a layer without
    factors); None when an exponent is outside [-MAX_LOG2, MAX_LOG2] (a damaged or foreign array)."""
    out: list[np.ndarray | None] = []
    for i, s in enumerate(shapes):
        row = e[i]
        if s is None or (row == NO_FACTORS).all():
            out.append(None)
            continue
        x = row[:s[0], :s[1]].astype(np.int16)
        if np.abs(x).max() > MAX_LOG2:
            return None
        out.append(np.exp2(x).astype(np.float32))
    return tuple(out)


def _cache_path(model: Any) -> Path | None:
    """Where the factors of ``model``'s GGUF file are kept (None: the model has no file)."""
    from . import __version__
    from .registry import home

    path = getattr(getattr(model, "file", None), "path", None)
    if not path:
        return None
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    key = f"{real}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{__version__}|{N_TOKENS}|{SEED}|{MAX_LOG2}"
    return home() / "kv_balance" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.npy"


def _load_cached(path: Path, shapes: list[tuple[int, int] | None]) -> tuple[np.ndarray | None, ...] | None:
    """Factors read back from ``path`` when it holds exactly the layers ``shapes`` describes."""
    hk = max((s[0] for s in shapes if s is not None), default=0)
    dk = max((s[1] for s in shapes if s is not None), default=0)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > len(shapes) * hk * dk + 4096:  # bounded read
            return None
        e = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if e.dtype != np.int8 or e.shape != (len(shapes), hk, dk):
        return None
    return from_exponents(e, shapes)


def _store_cached(path: Path, scales: tuple[np.ndarray | None, ...], shapes: list[tuple[int, int] | None]) -> None:
    hk = max((s[0] for s in shapes if s is not None), default=0)
    dk = max((s[1] for s in shapes if s is not None), default=0)
    e = to_exponents(scales, hk, dk)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, e, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as err:  # a read-only home: measured again next time
        log.debug("could not keep the key balance in %s: %s", path, err)


def balance(model: Any) -> bool:
    """Measure (or read back) and set ``model``'s key scales (``model.cfg.kv_scales``, and the native
    decode step's): caches made for it afterwards store block-quantized keys scaled. False when
    disabled or the model has no attention keys to scale."""
    if not enabled() or not model.desc.causal:
        return False
    cfg = model.cfg
    rot = cfg.kv_rotate or [True] * cfg.n_layer
    layers = cfg.kv_layers or [(cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v)] * cfg.n_layer
    shapes = [None if s is None or not rot[i] else (s[0], s[1]) for i, s in enumerate(layers)]
    path = _cache_path(model)
    scales = _load_cached(path, shapes) if path is not None else None
    if scales is None:
        energies = {i: e for i, e in measure(model).items() if rot[i]}
        if not energies:
            return False
        scales = scales_from(energies, cfg.n_layer)
        if path is not None:
            _store_cached(path, scales, shapes)
    elif all(s is None for s in scales):
        return False
    model.set_kv_scales(scales)
    spread = [int(np.log2(s).max() - np.log2(s).min()) for s in scales if s is not None]
    log.info("balanced block-quantized keys of %d layers (factor spread up to 2^%d)", len(spread), max(spread))
    return True
