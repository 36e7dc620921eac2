"""Gemma 4's layout beyond its logits (those are in tests/test_archs.py): layers with their own KV
shapes and layers that read another's cache (``KVCache(layers=...)``), per-layer inputs in the
fused decode step, and what the runtime does with such a cache: the KV budget, the prefix cache,
state files of every cache type, context shift.

The fixture (``tests/data/archs/gemma4``, made by llama.cpp's converter from a random transformers
Gemma 4): 6 layers sliding, full, ... (head sizes 64 / 128, 2 KV heads), the last two reading the
caches of layers 2 (sliding) and 3 (full)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import minirt
from minirt import kv_types
from minirt.forward import Segment, kv_cache_for
from minirt.kv_cache import KVCache
from tests.arch_parity import ARCH_DIR, rel_rms

G4 = ARCH_DIR / "gemma4"
LAYERS = [(2, 64, 64), (2, 128, 128), (2, 64, 64), (2, 128, 128), None, None]


@pytest.fixture(scope="module")
def q8_path() -> str:
    p = G4 / "model-q8_0.gguf"
    if not p.is_file():
        pytest.fail(f"missing fixture {p}")
    return str(p)


def test_description_has_kv_sharing_and_per_layer_shapes(q8_path):
    with minirt.load(q8_path, n_ctx=64) as llm:
        d, c = llm.model.desc, llm.model.cfg
        assert d.kv_layers() == LAYERS
        assert [b.attn.kv_source for b in d.blocks] == [None] * 4 + [2, 3]
        assert [b.attn.window for b in d.blocks] == [16, 0] * 3
        assert [b.mlp.n_ff for b in d.blocks] == [256] * 4 + [512] * 2  # double-wide MLP on the shared layers
        assert (c.n_head_kv, c.head_dim_k, c.head_dim_v) == (2, 128, 128) and c.kv_layers == tuple(LAYERS)
        # bytes per token over the four layers with a cache of their own, f16 (the default)
        assert llm.kv_bytes_per_token == 2 * 2 * 2 * (64 + 128) * 2
        assert llm.model.desc.per_layer_inputs.width == 64


def _filled(layers, n_ctx=4096, t="f32") -> KVCache:
    c = KVCache(6, 2, 128, 128, n_ctx, type_k=t, type_v=t, layers=layers)
    rng = np.random.default_rng(0)
    for i, s in enumerate(layers):
        if s is not None:
            h, dk, dv = s
            c.store(i, 0, rng.normal(size=(h, 300, dk)).astype(np.float32) + i,
                    rng.normal(size=(h, 300, dv)).astype(np.float32) - i)
    c.n_past = 300
    return c


def test_each_layer_has_its_own_shape_carved_from_its_slot():
    c = _filled(LAYERS)
    for i, s in enumerate(LAYERS):
        if s is None:
            with pytest.raises(ValueError, match="no cache of its own"):
                c.layer(i)
            continue
        k, v = c.layer(i)
        assert k.shape == (s[0], 4096, s[1]) and v.shape == (s[0], 4096, s[2])
        assert k.flags.c_contiguous and np.shares_memory(k, c.k[i])  # the front of layer i's slot
        # each layer's rows are its own: the values written for layer i come back for layer i
        assert abs(float(c.read(i, 0, 300)[0].mean()) - i) < 0.05
    assert c.bytes_per_token == 2 * 2 * (64 + 128) * 2 * 4  # f32, four layers with a cache


def test_truncate_releases_only_what_it_drops():
    c = _filled(LAYERS)
    if not hasattr(mmap, "MADV_DONTNEED"):
        pytest.skip("no MADV_DONTNEED on this platform")
    before = [np.array(c.read(i, 0, 200)[0]) for i in range(4)]
    c.truncate(200)
    for i in range(4):  # kept positions intact; the whole pages of the dropped ones read as zeros again
        k, _ = c.layer(i)
        np.testing.assert_array_equal(c.read(i, 0, 200)[0], before[i])
        # each head's row starts on a page; position 208 of a 64-wide f32 row is the first whole page
        assert not k[:, 208:300].any() and k[:, 199].any()


def test_copy_prefix_export_import_round_trip():
    src = _filled(LAYERS, t="q8_0")
    dst = KVCache(6, 2, 128, 128, 4096, type_k="q8_0", type_v="q8_0", layers=LAYERS)
    dst.copy_prefix_from(src, 120)
    k, v = src.export(120)
    assert k.shape == (6, 2, 120, kv_types.get("q8_0").width(128))
    back = KVCache(6, 2, 128, 128, 4096, type_k="q8_0", type_v="q8_0", layers=LAYERS)
    back.import_rows(k, v, 120)
    for i in range(4):
        for a, b in ((dst.layer(i), src.layer(i)), (back.layer(i), src.layer(i))):
            np.testing.assert_array_equal(a[0][:, :120], b[0][:, :120])
            np.testing.assert_array_equal(a[1][:, :120], b[1][:, :120])
    # float rows of another type: stored layer by layer at each layer's own size, each layer's
    # rotation (of its own head size) undone
    q8 = kv_types.get("q8_0")
    assert [src.rotation(i) for i in range(4)] == [(64, 64), (128, 64), (64, 64), (128, 64)]
    f = KVCache(6, 2, 128, 128, 4096, layers=LAYERS)
    f.import_rows(*(q8.dequantize(a) for a in (k, v)), 120, float_rows=True, stored_as=(q8, q8))
    for i in range(4):
        np.testing.assert_allclose(f.read(i, 0, 120)[0], src.read(i, 0, 120)[0], rtol=0, atol=1e-6)


def test_fused_decode_matches_the_per_op_path(q8_path):
    """The native decode step (KV sharing, value norm, per-layer inputs, output scale, per-layer head
    sizes) against the reference backend, over 20 steps past the sliding window."""
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    ref = np.load(G4 / "ref.npz")
    out = {}
    for backend in ("native", "reference"):
        with minirt.load(q8_path, n_ctx=64, backend=backend) as llm:
            assert (llm.model.native_stack is not None) == (backend == "native")
            m, ids = llm.model, ref["tokens"][0]
            cache = kv_cache_for(m.cfg, 64)
            rows = [m.forward(ids[:8], [Segment(cache, 8, "last")])[0].copy()]
            rows += [m.forward(np.array([t]), [Segment(cache, 1, "last")])[0].copy() for t in ids[8:28]]
            out[backend] = np.stack(rows)
    assert rel_rms(out["native"], out["reference"]) < 1e-3


@pytest.mark.parametrize("t", ["f16", "q8_0", "f32"])
def test_prefix_cache_and_state_files(q8_path, tmp_path, t):
    st = tmp_path / "g4.state"
    prompt = list(range(10, 60))
    with minirt.load(q8_path, n_ctx=128, cache_type_k=t, cache_type_v=t) as m:
        first = m.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        again = m.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert again.token_ids == first.token_ids and again.usage["cached_tokens"] > 0
        saved = m.save_state(st)
        follow = saved + first.token_ids[-1:]
        want = m.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids
    with minirt.load(q8_path, n_ctx=128, cache_type_k=t, cache_type_v=t) as m2:
        assert m2.load_state(st) == saved
        c = m2.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert c.usage["cached_tokens"] == len(saved) and c.token_ids == want
    with minirt.load(q8_path, n_ctx=128, cache_type_k="f32", cache_type_v="f32") as m3:  # converted on load
        assert m3.load_state(st) == saved


def test_context_shift_rotates_each_layers_own_keys(q8_path):
    """A shift re-rotates the keys of every layer with a cache of its own, at its own head size and
    RoPE (sliding: 64 dims, base 10000; full: 128 dims with the proportional factors), moves the
    values, and leaves the layers that read another's cache alone (they have nothing stored)."""
    from minirt.blocks import apply_rope

    with minirt.load(q8_path, n_ctx=64, cache_type_k="f32", cache_type_v="f32") as llm:
        m = llm.model
        cache = kv_cache_for(m.cfg, 64, "f32", "f32")
        rng = np.random.default_rng(1)
        raw, vals = {}, {}
        for i, b in enumerate(m.desc.blocks):
            if b.attn.kv_source is not None:
                continue
            a = b.attn
            k = rng.normal(size=(30, a.n_head_kv, a.head_dim_k)).astype(np.float32)
            raw[i] = k.copy()
            apply_rope(k, *a.rope.cos_sin(np.arange(30)), a.rope.neox, a.rope.dim)
            vals[i] = rng.normal(size=(a.n_head_kv, 30, a.head_dim_v)).astype(np.float32)
            cache.store(i, 0, k.transpose(1, 0, 2), vals[i])
        cache.n_past = 30
        m.shift_cache(cache, n_keep=4, n_discard=10)
        assert cache.n_past == 20
        keep = np.r_[0:4, 14:30]
        for i, k0 in raw.items():
            a = m.desc.blocks[i].attn
            want = k0[keep].copy()
            apply_rope(want, *a.rope.cos_sin(np.arange(20)), a.rope.neox, a.rope.dim)
            k, v = cache.read(i, 0, 20)
            np.testing.assert_allclose(k, want.transpose(1, 0, 2), rtol=0, atol=2e-5)
            np.testing.assert_array_equal(v, vals[i][:, keep])
