"""Per-sequence KV cache (step 6 of the pipeline: only the new token is computed).

One cache holds, for every layer, the keys and values of every position processed so far, in
arrays preallocated for ``n_ctx`` positions. They are allocated zero-filled, which the OS
provides lazily: memory becomes resident only as positions are written, so a large ``n_ctx``
costs address space, not RAM, until it is used. Positions a cache forgets (``clear``,
``truncate``: a recycled or prefix-reused cache) give their pages back, so the resident memory
of idle caches is what the scheduler's KV budget counts for them.

Layout: ``k[layer]`` is ``(n_head_kv, n_ctx, width_k)``, ``v[layer]`` is
``(n_head_kv, n_ctx, width_v)``, so one head's keys for positions ``0..n`` are contiguous
for the attention kernels. Rows are stored in the cache's element types (``type_k``, ``type_v``,
see :mod:`minirt.kv_types`: f32, f16, bf16 or ggml blocks such as q8_0); ``width`` is head_dim for
the float types and the row's bytes for block types. New rows are quantized as they are written
(:meth:`KVCache.store`); :meth:`KVCache.read` gives float32 rows back (state files, context shift,
reference paths), while the native attention reads the stored rows directly.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import kv_types

_SMALL = 4 << 20  # below this numpy's own zeroed allocation is fine


def _anon_map(a: np.ndarray) -> mmap.mmap | None:
    """The anonymous mapping under an array made by :func:`lazy_zeros`, or None (numpy memory)."""
    b = a
    while b is not None and not isinstance(b, mmap.mmap):
        b = getattr(b, "base", None)
        if isinstance(b, memoryview):
            b = b.obj
    return b if isinstance(b, mmap.mmap) else None


def drop_positions(a: np.ndarray, n: int, end: int | None = None) -> int:
    """Give the pages of positions ``n..end-1`` (default: to the end) of a C-contiguous (..., n_ctx, dim)
    array carved from a :func:`lazy_zeros` mapping (a whole (layers, heads, n_ctx, dim) cache array or
    one layer's (heads, n_ctx, dim) view of it) back to the OS (MADV_DONTNEED: they read as zeros again
    and are resident no more); only pages wholly inside each head's range go, so rows sharing a page
    with a kept one stay intact. Returns the bytes released; 0 for numpy memory (small caches, under 4 MiB)."""
    m = _anon_map(a)
    if m is None or not hasattr(mmap, "MADV_DONTNEED") or a.ndim < 2 or not a.flags.c_contiguous or a.size == 0:
        return 0
    n_ctx, d = a.shape[-2:]
    end = n_ctx if end is None else min(end, n_ctx)
    if end <= n:
        return 0
    rows = a.size // (n_ctx * d)
    base = a.ctypes.data - np.frombuffer(m, dtype=np.uint8).ctypes.data  # where a starts in the mapping
    row, lo_b, hi_b = n_ctx * d * a.itemsize, n * d * a.itemsize, end * d * a.itemsize
    page, freed = mmap.PAGESIZE, 0
    if lo_b == 0 and end == n_ctx:
        spans = [(base, base + rows * row)]  # the whole array at once
    else:
        spans = [(base + r * row + lo_b, base + r * row + hi_b) for r in range(rows)]
    for lo, hi in spans:
        lo, hi = -(-lo // page) * page, hi // page * page  # whole pages inside the span only
        if hi > lo:
            try:
                m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):
                return freed
            freed += hi - lo
    return freed


def lazy_zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zero-filled array whose memory becomes resident 4 KiB at a time, as it is written.

    Not ``np.zeros``: numpy asks the kernel for transparent huge pages on large allocations, and a
    cache laid out (layer, head, n_ctx, dim) touches one 2 MiB page per layer and head on its first
    token: ~100 MB resident and ~0.3 s of page zeroing for a 32k context holding 16 tokens."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < _SMALL or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(shape, dtype=dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # pragma: no cover - kernels without THP
            pass
    return np.frombuffer(m, dtype=dtype).reshape(shape)  # the array keeps the mapping alive


class KVCache:
    """Keys and values of one sequence for every layer, plus the token ids they came from.

    Layers of different shapes (Gemma 4: other head sizes on its sliding layers) each get their own
    ``(n_head_kv_i, n_ctx, width_i)`` arrays, carved from the front of their layer's slot of ``k`` /
    ``v`` (which are sized by the largest shape): pages become resident only as they are written,
    so the unused tail of a slot, and the slot of a layer that reads another's cache (``None`` in
    ``layers``), cost address space only. Then ``k`` / ``v`` are storage, and :meth:`layer`,
    :meth:`export` and :meth:`import_rows` the way to each layer's rows."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim_k: int, head_dim_v: int, n_ctx: int,
                 dtype: np.dtype | type | None = None, type_k: str | None = None, type_v: str | None = None,
                 layers: Sequence[tuple[int, int, int] | None] | None = None,
                 rotate: Sequence[bool] | None = None,
                 key_offsets: Sequence[np.ndarray | None] | None = None,
                 windows: Sequence[int] | None = None,
                 key_scales: Sequence[np.ndarray | None] | None = None,
                 recurrent: Sequence[tuple[tuple[int, ...], ...] | None] | None = None) -> None:
        """``type_k`` / ``type_v``: KV element type names (default f32); ``dtype`` (float32 or float16)
        is the older way to ask for f32 / f16 of both. ``layers``: per layer (n_head_kv, head_dim_k,
        head_dim_v), or None for a layer without a cache of its own; the other sizes are then the
        largest of these. ``rotate``: per layer whether its rows are attention keys and values, which
        block-quantized types store under a Hadamard rotation (:meth:`rotation`); default every layer.
        ``key_offsets``: per layer a constant (n_head_kv, head_dim_k) that a block-quantized K type
        stores its keys less (:meth:`minirt.blocks.Attention.key_offset`), or None. ``windows``: per
        layer the window of a causal sliding-window layer (0: it sees its whole context); such a layer
        keeps only recent rows resident (:meth:`release_stale`). ``key_scales``: per layer powers of two
        (n_head_kv, head_dim_k) that a block-quantized K type multiplies its keys by, and the queries
        over them divided by (:mod:`minirt.kv_balance`), or None. ``recurrent``: per layer the shapes of
        its per-sequence recurrent state (float32 arrays, :meth:`state`), or None."""
        if n_ctx <= 0:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        if dtype is not None:
            base = kv_types.of_array(np.empty(0, dtype)).name
            type_k, type_v = type_k or base, type_v or base
        self.kt = kv_types.get(type_k or "f32")
        self.vt = kv_types.get(type_v or "f32")
        self.n_ctx = n_ctx
        self.n_layer = n_layer
        self.head_dim_k, self.head_dim_v = head_dim_k, head_dim_v
        self._k = lazy_zeros((n_layer, n_head_kv, n_ctx, self.kt.width(head_dim_k)), self.kt.dtype)
        self._v = lazy_zeros((n_layer, n_head_kv, n_ctx, self.vt.width(head_dim_v)), self.vt.dtype)
        # a device backend holding this cache (minirt.kernels.cuda) writes new positions on the device only:
        # the host rows of positions device_rows[0]..device_rows[1]-1 are then stale until ``device_sync``
        # copies them back (and clears device_rows), which every host access (k, v, layer) does first.
        # host_epoch counts those accesses: the device knows whether the host rows may have changed since
        # it last looked at them. ``device_state``: the device holds the live recurrent state (hybrid models),
        # the host's copy is stale until ``device_sync`` brings it back, which every host access to it does first
        self.device_sync: Callable[[KVCache], None] | None = None
        self.device_rows: tuple[int, int] | None = None
        self.device_state = False
        self.host_epoch = 0
        self.layers = None if layers is None else list(layers)
        self._views: list[tuple[np.ndarray, np.ndarray] | None] | None = None
        if self.layers is not None:
            if len(self.layers) != n_layer:
                raise ValueError(f"{len(self.layers)} layer shapes for {n_layer} layers")
            # head_dim_v 0: a layer without values (LFM2's convolution rows are its keys)
            self._views = [None if s is None else (self._carve(self._k[i], s[0], self.kt.width(s[1])),
                                                   self._carve(self._v[i], s[0], self.vt.width(s[2]) if s[2] else 0))
                           for i, s in enumerate(self.layers)]
        if rotate is not None and len(rotate) != n_layer:
            raise ValueError(f"{len(rotate)} rotation flags for {n_layer} layers")
        self._rotatable = [True] * n_layer if rotate is None else [bool(r) for r in rotate]
        self._rot = [self.rotation_for(i, self.kt, self.vt) for i in range(n_layer)]
        if key_offsets is not None and len(key_offsets) != n_layer:
            raise ValueError(f"{len(key_offsets)} key offsets for {n_layer} layers")
        self._offsets = [None] * n_layer if key_offsets is None else list(key_offsets)
        if key_scales is not None and len(key_scales) != n_layer:
            raise ValueError(f"{len(key_scales)} key scales for {n_layer} layers")
        self._scales = [None] * n_layer if key_scales is None else list(key_scales)
        self._qscales: dict[tuple[int, int], np.ndarray] = {}  # (layer, n_head) → (n_head, Dk) 1 / scale
        if windows is not None and len(windows) != n_layer:
            raise ValueError(f"{len(windows)} windows for {n_layer} layers")
        self.windows = [0] * n_layer if windows is None else [max(0, int(w)) for w in windows]
        # per windowed layer, positions [lo, hi) whose rows were given back (zeros now); see release_stale
        self._stale = [(0, 0)] * n_layer
        self.keep_rows = 0  # positions never given back (a context shift's n_keep keeps them in use)
        self.n_past = 0
        # recurrent layers (Qwen3.5's delta-net): the live state belongs to position _state_pos (n_past,
        # or -1 once a failed step left it half-updated); one snapshot of every such layer at _snap_pos
        self.recurrent = [None] * n_layer if recurrent is None else list(recurrent)
        if len(self.recurrent) != n_layer:
            raise ValueError(f"{len(self.recurrent)} recurrent state shapes for {n_layer} layers")
        self._state = [None if sh is None else tuple(np.zeros(x, np.float32) for x in sh) for sh in self.recurrent]
        self._snap: list[tuple[np.ndarray, ...] | None] = [None] * n_layer
        self._state_pos, self._snap_pos = 0, -1
        # ids of positions 0..n_past-1: lets a new request reuse a shared prefix and lets the
        # repetition penalties see the history
        self.tokens = np.zeros(n_ctx, dtype=np.int32)

    def _host(self) -> None:
        """Before the host reads or writes rows or recurrent state: bring back what only the device holds."""
        if (self.device_rows is not None or self.device_state) and self.device_sync is not None:
            self.device_sync(self)
        self.host_epoch += 1

    @property
    def k(self) -> np.ndarray:
        """Key storage (n_layer, n_head_kv, n_ctx, width) of the cache's K type, current on the host."""
        self._host()
        return self._k

    @k.setter
    def k(self, a: np.ndarray) -> None:
        self._k = a

    @property
    def v(self) -> np.ndarray:
        """Value storage, as :attr:`k`."""
        self._host()
        return self._v

    @v.setter
    def v(self, a: np.ndarray) -> None:
        self._v = a

    @staticmethod
    def _carve(slot: np.ndarray, heads: int, width: int) -> np.ndarray:
        """The front of a layer's slot (H, n_ctx, W) as its own contiguous (heads, n_ctx, width) array."""
        n_ctx = slot.shape[1]
        if heads > slot.shape[0] or width > slot.shape[2]:
            raise ValueError(f"a layer of {heads} heads x {width} does not fit the cache's "
                             f"{slot.shape[0]} x {slot.shape[2]}")
        return slot.reshape(-1)[:heads * n_ctx * width].reshape(heads, n_ctx, width)

    @property
    def types(self) -> tuple[str, str]:
        """(type_k, type_v) names, as llama.cpp calls them."""
        return self.kt.name, self.vt.name

    def rotation_for(self, i: int, kt: kv_types.KVType, vt: kv_types.KVType) -> tuple[int, int]:
        """(keys, values) Hadamard rotation sizes (0: none) that layer ``i`` of a cache of types kt / vt
        stores its rows under (:meth:`minirt.kv_types.KVType.rotation`)."""
        if not self._rotatable[i]:
            return 0, 0
        shape = self.layers[i] if self.layers is not None else (0, self.head_dim_k, self.head_dim_v)
        if shape is None:  # reads another layer's cache
            return 0, 0
        _, dk, dv = shape
        return kt.rotation(dk, keys=True), vt.rotation(dv, keys=False) if dv else 0

    def rotation(self, i: int) -> tuple[int, int]:
        """(keys, values) rotation sizes of layer ``i``'s stored rows. Attention over them rotates its
        queries by the keys' (:meth:`rotate_queries`) and, where values are rotated, its output
        back (:meth:`unrotate_output`); :meth:`store` and :meth:`read` take and give plain rows."""
        return self._rot[i]

    def key_offset(self, i: int, kt: kv_types.KVType | None = None) -> np.ndarray | None:
        """The constant (Hkv, Dk) layer ``i``'s keys are stored less of in a cache of K type ``kt``
        (default this cache's): block types only, where the layer has one."""
        return self._offsets[i] if (kt or self.kt).quantized else None

    def key_scale(self, i: int, kt: kv_types.KVType | None = None) -> np.ndarray | None:
        """The powers of two (Hkv, Dk) layer ``i``'s keys are stored multiplied by in a cache of K type
        ``kt`` (default this cache's): block types only, where the model was balanced."""
        return self._scales[i] if (kt or self.kt).quantized else None

    @property
    def key_scales(self) -> list[np.ndarray | None] | None:
        """Per layer :meth:`key_scale` (None: no layer has one); state files record them."""
        sc = [self.key_scale(i) for i in range(self.n_layer)]
        return None if all(x is None for x in sc) else sc

    @property
    def transformed(self) -> bool:
        """Whether any layer's rows are stored less a key offset, scaled or rotated (state files record it)."""
        return any(nk or nv for nk, nv in self._rot) or any(
            self.key_offset(i) is not None or self.key_scale(i) is not None for i in range(self.n_layer))

    def to_plain(self, i: int, k: np.ndarray, v: np.ndarray, kt: kv_types.KVType | None = None,
                 vt: kv_types.KVType | None = None, key_scale: Any = "own") -> tuple[np.ndarray, np.ndarray]:
        """Dequantized rows k (Hkv, n, Dk), v (Hkv, n, Dv) of layer ``i`` as a cache of types kt / vt
        (default this cache's) stores them → the plain keys and values (rotation undone, scale divided
        out, offset added). ``key_scale``: the scale the rows were stored under where it is not this
        cache's (a state file's; None: unscaled)."""
        kt, vt = kt or self.kt, vt or self.vt
        nk, nv = self.rotation_for(i, kt, vt)
        k = kv_types.rotate(k, nk)
        sc = self.key_scale(i, kt) if isinstance(key_scale, str) else key_scale
        if sc is not None:
            k = k * (np.float32(1.0) / sc)[:, None, :]  # powers of two: exact
        off = self.key_offset(i, kt)
        if off is not None:
            k = k + off[:, None, :]
        return k, kv_types.rotate(v, nv)

    def query_scale(self, i: int, n_head: int) -> np.ndarray | None:
        """(n_head, Dk) factors queries of ``n_head`` heads take for attention over layer ``i``'s stored
        keys: 1 / the key scale of each head's KV head (None: keys unscaled)."""
        sc = self.key_scale(i)
        if sc is None:
            return None
        qs = self._qscales.get((i, n_head))
        if qs is None:
            qs = self._qscales[(i, n_head)] = np.repeat(np.float32(1.0) / sc, n_head // sc.shape[0], axis=0)
        return qs

    def rotate_queries(self, i: int, q: np.ndarray) -> np.ndarray:
        """Queries q (T, H, Dk) for attention over layer ``i``'s stored keys (q itself when untransformed):
        scaled by :meth:`query_scale`, rotated as the keys are."""
        qs = self.query_scale(i, q.shape[1])
        if qs is not None:
            return kv_types.rotate(q * qs, self._rot[i][0], inplace=True)  # q * qs: a temporary
        return kv_types.rotate(q, self._rot[i][0])

    def unrotate_output(self, i: int, o: np.ndarray) -> np.ndarray:
        """Attention output o (T, H·Dv) over layer ``i``'s stored values back to the plain basis."""
        return kv_types.rotate(o, self._rot[i][1])

    def store(self, i: int, p0: int, k: np.ndarray | None, v: np.ndarray | None) -> None:
        """Write float32 keys k (Hkv, n, Dk) and values v (Hkv, n, Dv) of layer ``i`` at positions
        p0..p0+n-1, rotated (:meth:`rotation`) and quantized to the cache types (None: leave that
        half alone)."""
        kc, vc = self.layer(i)
        nk, nv = self._rot[i]
        if k is not None:
            off, sc = self.key_offset(i), self.key_scale(i)
            fresh = off is not None or sc is not None  # then k is a temporary of our own
            if off is not None:
                k = k - off[:, None, :]
                if sc is not None:
                    k *= sc[:, None, :]
            elif sc is not None:
                k = k * sc[:, None, :]
            kc[:, p0:p0 + k.shape[1]] = quantize_rows(kv_types.rotate(k, nk, inplace=fresh), self.kt)
        if v is not None and vc.shape[-1]:
            vc[:, p0:p0 + v.shape[1]] = quantize_rows(kv_types.rotate(v, nv), self.vt)

    def read(self, i: int, p0: int, p1: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 keys (Hkv, p1-p0, Dk) and values (Hkv, p1-p0, Dv) of layer ``i``, positions p0..p1-1
        (plain: :meth:`to_plain`)."""
        kc, vc = self.layer(i)
        v = dequantize_rows(vc[:, p0:p1], self.vt) if vc.shape[-1] else np.zeros(vc[:, p0:p1].shape, np.float32)
        return self.to_plain(i, dequantize_rows(kc[:, p0:p1], self.kt), v)

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(k, v) arrays (Hkv, n_ctx, width) of layer ``i``."""
        if self._views is None:
            return self.k[i], self.v[i]
        self._host()
        kv = self._views[i]
        if kv is None:
            raise ValueError(f"layer {i} has no cache of its own (it reads another layer's)")
        return kv

    def _own_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self._views is None or self._views[i] is not None]

    def export(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored rows of positions 0..n-1 of every layer as (n_layer, n_head_kv, n, width) arrays (state
        files): views of ``k`` / ``v`` for a uniform cache; copies padded with zero bytes (heads,
        widths, layers without a cache) when the layers differ."""
        if self._views is None:
            return self.k[:, :, :n], self.v[:, :, :n]
        k = np.zeros(self.k.shape[:2] + (n,) + self.k.shape[3:], self.k.dtype)
        v = np.zeros(self.v.shape[:2] + (n,) + self.v.shape[3:], self.v.dtype)
        for i in self._own_layers():
            kc, vc = self.layer(i)
            k[i, :kc.shape[0], :, :kc.shape[2]] = kc[:, :n]
            v[i, :vc.shape[0], :, :vc.shape[2]] = vc[:, :n]
        return k, v

    def import_rows(self, k: np.ndarray, v: np.ndarray, n: int, float_rows: bool = False,
                    stored_as: tuple[kv_types.KVType, kv_types.KVType] | None = None,
                    stored_scales: Sequence[np.ndarray | None] | None = None) -> None:
        """Fill positions 0..n-1 from arrays shaped as :meth:`export` gives them: stored rows of this
        cache's types and rotation, or float32 rows (n_layer, n_head_kv, n, head_dim) with ``float_rows``
        (quantized here); ``stored_as``: the (type_k, type_v) of a cache whose stored form (key offset,
        rotation) such float rows are still in (dequantized from a state file of those types), undone
        first, with ``stored_scales`` the per-layer key scales they were stored under (None: none)."""
        for i in self._own_layers():
            kc, vc = self.layer(i)
            if float_rows:
                hk, dk, dv = (self.layers[i] if self.layers is not None
                              else (kc.shape[0], self.head_dim_k, self.head_dim_v))
                ki, vi = k[i, :hk, :, :dk], v[i, :hk, :, :dv]
                if stored_as is not None:
                    ki, vi = self.to_plain(i, ki, vi, *stored_as,
                                           key_scale=None if stored_scales is None else stored_scales[i])
                self.store(i, 0, ki, vi)
            else:
                kc[:, :n] = k[i, :kc.shape[0], :, :kc.shape[2]]
                vc[:, :n] = v[i, :vc.shape[0], :, :vc.shape[2]]
        self._stale_after_import(n)

    @property
    def nbytes(self) -> int:
        """Bytes reserved (address space) for the whole context, recurrent state included."""
        return self._k.nbytes + self._v.nbytes + self.state_nbytes()

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes over every layer's own cache."""
        if self._views is None:
            return (self._k.nbytes + self._v.nbytes) // self.n_ctx
        return sum(a.nbytes for i in self._own_layers() for a in self._views[i]) // self.n_ctx

    def token_ids(self) -> np.ndarray:
        """Ids of the cached positions (a view)."""
        return self.tokens[: self.n_past]

    # a windowed layer gives back rows older than its window plus STALE_SLACK positions (so editing or
    # regenerating the last turn still reuses the cache), STALE_STEP positions at a time
    STALE_SLACK = 1024
    STALE_STEP = 512

    def release_stale(self) -> int:
        """Give back the pages of rows no query can read any more: in a causal sliding-window layer, the
        positions older than its window (plus :attr:`STALE_SLACK`) — so its resident rows stay about
        window + slack at any context length, as llama.cpp's SWA cache. Called after each forward
        step; returns the bytes released. Prefix reuse then checks :meth:`valid_prefix`."""
        freed = 0
        for i in self._own_layers():
            w = self.windows[i]
            if not w:
                continue
            lo, hi = self._stale[i]
            if hi <= lo:
                lo = hi = self.keep_rows
            new_hi = self.n_past - w - self.STALE_SLACK
            if new_hi - hi < self.STALE_STEP:
                continue
            for a in self.layer(i):
                if a.shape[-1]:
                    # from the range's start: pages straddling the previous end go once wholly inside
                    got = drop_positions(a, lo, new_hi)
                    if _anon_map(a) is None:  # a small cache in numpy memory: zeroed, so it behaves the same
                        a[:, hi:new_hi] = 0
                    freed += got
            self._stale[i] = (lo, new_hi)
        return freed

    def valid_prefix(self, n: int, keep: int = 0) -> int:
        """The longest prefix of at most ``n`` positions a request may keep and continue from: every
        windowed layer must still hold the rows its queries at position n will read, and the first
        ``keep`` rows (what a context shift of that request keeps). Where a given-back range
        (:meth:`release_stale`) is in the way: the start of that range, whose rows before it are all there."""
        changed = True
        while changed:
            changed = False
            for i, (lo, hi) in enumerate(self._stale):
                if hi > lo and lo < n and (n < hi + self.windows[i] or lo < keep):
                    n, changed = lo, True
        if self.has_state:  # a recurrent state exists at its position and a snapshot's only
            snap = self._snap_pos if self._snap_whole() else -1  # a step that failed may have taken only part
            n = max([0] + [p for p in (self._state_pos, snap) if 0 < p <= n])
        return n

    # -- recurrent state ---------------------------------------------------------------------------
    @property
    def has_state(self) -> bool:
        """True when some layer keeps a per-sequence recurrent state instead of per-position rows."""
        return any(s is not None for s in self._state)

    def state(self, i: int) -> tuple[np.ndarray, ...]:
        """Layer i's recurrent state after position ``n_past − 1`` (arrays updated in place by the forward
        pass). Raises ValueError if a failed step left it inconsistent with the positions."""
        st = self._state[i]
        if st is None:
            raise ValueError(f"layer {i} keeps no recurrent state")
        self._host()
        if self._state_pos != self.n_past:
            raise ValueError(f"the recurrent state is not at position {self.n_past} (a step failed); "
                             "the cache must be cleared")
        return st

    def snapshot(self, i: int, pos: int, *arrays: np.ndarray) -> None:
        """Keep a copy of layer i's state as it is after ``pos`` positions (the forward pass takes one
        before a prompt's last token, which a later request with the same prompt recomputes)."""
        if pos != self._snap_pos:
            self._snap = [None] * self.n_layer
            self._snap_pos = pos
        self._snap[i] = tuple(a.copy() for a in arrays)

    def step_done(self, n: int) -> None:
        """The forward pass appended n positions (n_past already advanced): the state is at n_past."""
        if self.has_state and self._state_pos >= 0:
            self._state_pos = self.n_past

    def step_failed(self) -> None:
        """A forward step raised: the recurrent state (if any) may be half-updated; only the snapshot
        (or position 0) may be continued from."""
        if self.has_state:
            self._state_pos = -1

    def _snap_whole(self) -> bool:
        return all((a is None) == (b is None) for a, b in zip(self._snap, self._state, strict=True))

    def _set_state_at(self, n: int) -> None:
        # the live state for a kept prefix of n positions: the live one, the snapshot's, or zeros at 0
        if not self.has_state or n == self._state_pos:
            return
        self._host()
        if n == self._snap_pos and self._snap_whole():
            for live, snap in zip(self._state, self._snap, strict=True):
                if live is not None:
                    for dst, src in zip(live, snap, strict=True):
                        dst[...] = src
        elif n == 0:
            for live in self._state:
                for a in live or ():
                    a.fill(0)
        else:
            raise ValueError(f"no recurrent state at position {n} (kept: {self._state_pos}, snapshot: "
                             f"{self._snap_pos})")
        self._state_pos = n
        if self._snap_pos > n:
            self._snap, self._snap_pos = [None] * self.n_layer, -1

    def state_size(self) -> int:
        """Float32 values of every layer's live recurrent state (the length of :meth:`export_state`)."""
        return sum(a.size for st in self._state for a in (st or ()))

    def export_state(self) -> np.ndarray:
        """Every layer's live recurrent state, flattened in layer order, (state_size,) float32 (state
        files); raises ValueError when it is not at n_past (a failed step)."""
        if self._state_pos != self.n_past:
            raise ValueError(f"the recurrent state is not at position {self.n_past} (a step failed)")
        self._host()
        parts = [a.reshape(-1) for st in self._state for a in (st or ())]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def import_state(self, flat: np.ndarray, n: int) -> None:
        """Set the live recurrent state from :meth:`export_state`'s layout, as the state after n positions."""
        if flat.shape != (self.state_size(),):
            raise ValueError(f"recurrent state of {flat.shape} values, expected ({self.state_size()},)")
        self._host()
        j = 0
        for st in self._state:
            for a in st or ():
                a[...] = flat[j:j + a.size].reshape(a.shape)
                j += a.size
        self._state_pos, self._snap, self._snap_pos = n, [None] * self.n_layer, -1

    def state_nbytes(self) -> int:
        """Bytes of the recurrent state and its snapshot."""
        return sum(a.nbytes for st in self._state + self._snap for a in (st or ()))

    def stale_after_shift(self, n_keep: int, n_discard: int) -> None:
        """Update the given-back ranges after a context shift moved positions n_keep + n_discard.. down
        by n_discard (the rows before n_keep stay, the discarded ones are gone)."""
        src0, out = n_keep + n_discard, []
        for lo, hi in self._stale:
            lo, hi = max(lo, src0) - n_discard, hi - n_discard
            out.append((lo, hi) if hi > lo else (0, 0))
        self._stale = out

    def _stale_after_import(self, n: int) -> None:
        # a state file's rows may include given-back (zero) ones it does not mark: claim, as given
        # back, every row no query from position n on reads (a superset of what the writer gave back)
        self._stale = [(0, n - w - 1) if w and n - w - 1 > 0 else (0, 0) for w in self.windows]

    def clear(self) -> None:
        """Forget every position; their pages go back to the OS (address space stays reserved)."""
        self.n_past = 0
        self._stale = [(0, 0)] * self.n_layer
        self.keep_rows = 0
        self._drop(0)
        self._snap_pos = -1
        self._set_state_at(0)

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` positions (e.g. to reuse a shared prompt prefix). The pages of
        the others are released, so a recycled cache holds only what the KV budget counts for it
        (its ``n_past`` positions) rather than every page it ever touched."""
        if not 0 <= n <= self.n_past:
            raise ValueError(f"cannot truncate a cache of {self.n_past} positions to {n}")
        self._set_state_at(n)  # before anything changes: raises where no state exists (valid_prefix says where)
        self.n_past = n
        self._stale = [(min(lo, n), min(hi, n)) for lo, hi in self._stale]
        self._drop(n)

    def _drop(self, n: int) -> None:
        # every position from n on, not just up to n_past: a step that failed after writing its
        # keys leaves pages beyond n_past; untouched ranges cost the kernel a page-table walk only
        if self._views is None:
            drop_positions(self.k, n)
            drop_positions(self.v, n)
            return
        for i in self._own_layers():
            for a in self.layer(i):
                drop_positions(a, n)

    def copy_prefix_from(self, other: KVCache, n: int) -> None:
        """Copy the first ``n`` positions of ``other`` (same model) into this cache."""
        if other.types != self.types:
            raise ValueError(f"cannot copy a {other.types} cache into a {self.types} one")
        if n > self.n_ctx or n > other.n_past:
            raise ValueError(f"cannot copy {n} positions (source has {other.n_past}, room {self.n_ctx})")
        if other.has_state:
            other._host()
            self._host()
            src = (other._state if n == other._state_pos else other._snap if n == other._snap_pos else
                   None if n else [None if s is None else tuple(np.zeros_like(a) for a in s) for s in other._state])
            if src is None:
                raise ValueError(f"the source cache has no recurrent state at position {n}")
            for live, st in zip(self._state, src, strict=True):
                for dst, a in zip(live or (), st or (), strict=True):
                    dst[...] = a
            self._state_pos, self._snap, self._snap_pos = n, [None] * self.n_layer, -1
        if self._views is None:
            self.k[:, :, :n] = other.k[:, :, :n]
            self.v[:, :, :n] = other.v[:, :, :n]
        else:
            for i in self._own_layers():
                for dst, src in zip(self.layer(i), other.layer(i), strict=True):
                    dst[:, :n] = src[:, :n]
        self.tokens[:n] = other.tokens[:n]
        self.n_past = n
        self._stale = [(min(lo, n), min(hi, n)) for lo, hi in other._stale]

    def release(self) -> None:
        """Drop the arrays so their memory returns to the OS now rather than at garbage collection."""
        empty = np.zeros((self.n_layer, 0, 0, 0), dtype=self._k.dtype)
        self.k = self.v = empty
        # what only the device held goes with the positions
        self.device_sync, self.device_rows, self.device_state = None, None, False
        self._state = [None] * self.n_layer
        self._snap = [None] * self.n_layer
        if self._views is not None:
            self._views = [None] * self.n_layer
        self.n_ctx = 0
        self.n_past = 0


def quantize_rows(x: np.ndarray, t: kv_types.KVType) -> np.ndarray:
    """float32 rows → stored rows: the native quantizer when the kernels are loaded (the same bytes
    the decode step writes), else the numpy reference (bit-identical)."""
    if t.name == "f32":
        return x
    if t.name == "f16":
        return x.astype(np.float16)
    from .kernels import native

    if native.loaded():
        return native.kv_quantize(x, t.name)
    return t.quantize(x)


def dequantize_rows(s: np.ndarray, t: kv_types.KVType) -> np.ndarray:
    if t.name in ("f32", "f16"):
        return s.astype(np.float32)
    from .kernels import native

    if native.loaded():
        return native.kv_dequantize(s, t.name)
    return t.dequantize(s)
