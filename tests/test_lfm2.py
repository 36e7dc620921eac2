"""LFM2's short-convolution layers beyond their logits (those are in tests/test_archs.py): the
``B·x`` rows they keep per position in the cache, and what the runtime does with that state —
batching several sequences in one pass, the prefix cache, state files of every cache type,
context shift.

The fixture (``tests/data/archs/lfm2``, made by llama.cpp's converter from a random transformers
LFM2): 6 layers conv, conv, attention, conv, attention, conv; hidden 256, GQA 4/2, 3 taps."""

from __future__ import annotations

import numpy as np
import pytest

import minirt
from minirt.blocks import ShortConv
from minirt.forward import Segment, kv_cache_for
from tests.arch_parity import ARCH_DIR, rel_rms

LF = ARCH_DIR / "lfm2"


@pytest.fixture(scope="module")
def q8_path() -> str:
    p = LF / "model-q8_0.gguf"
    if not p.is_file():
        pytest.fail(f"missing fixture {p}")
    return str(p)


def test_description_and_cache_layout(q8_path):
    with minirt.load(q8_path, n_ctx=64) as llm:
        d = llm.model.desc
        conv = [isinstance(b.attn, ShortConv) for b in d.blocks]
        assert conv == [True, True, False, True, False, True]
        assert all(b.attn.taps == 3 for b, c in zip(d.blocks, conv, strict=True) if c)
        # conv rows: 2 rows of 128 (d / the attention layers' KV heads), no values
        assert d.kv_layers() == [(2, 128, 0), (2, 128, 0), (2, 64, 64), (2, 128, 0), (2, 64, 64), (2, 128, 0)]
        assert llm.kv_bytes_per_token == 4 * 256 * 2 + 2 * 2 * (64 + 64) * 2  # f16: conv rows + attention K/V


def _logits(m, ids):
    """Logits of every position of each id list, the lists run in one batch of segments."""
    caches = [kv_cache_for(m.cfg, 64) for _ in ids]
    out = m.forward(np.concatenate([np.asarray(x) for x in ids]),
                    [Segment(c, len(x), "all") for c, x in zip(caches, ids, strict=True)])
    return out, caches


def test_batched_and_stepwise_passes_agree(q8_path):
    """Two sequences in one pass, and one sequence token by token, give what each gets alone in one
    pass: each segment's convolution reads its own rows, across the start of the sequence too."""
    ref = np.load(LF / "ref.npz")
    a, b = ref["tokens"][0][:20], ref["tokens"][1][:13]
    with minirt.load(q8_path, n_ctx=64, backend="reference") as llm:
        m = llm.model
        alone = [_logits(m, [x])[0][0] for x in (a, b)]
        together, _ = _logits(m, [a, b])
        for got, want in zip(together, alone, strict=True):
            assert rel_rms(got, want) < 1e-5
        cache = kv_cache_for(m.cfg, 64)
        steps = [m.forward(np.array([t]), [Segment(cache, 1, "last")])[0].copy() for t in a]
        assert rel_rms(np.stack(steps), alone[0]) < 1e-4
        # two decode steps of different sequences in one batch
        c1, c2 = kv_cache_for(m.cfg, 64), kv_cache_for(m.cfg, 64)
        m.forward(a[:10], [Segment(c1, 10, "none")])
        m.forward(b[:5], [Segment(c2, 5, "none")])
        both = m.forward(np.array([a[10], b[5]]), [Segment(c1, 1, "last"), Segment(c2, 1, "last")])
        assert rel_rms(both[0], alone[0][10]) < 1e-4 and rel_rms(both[1], alone[1][5]) < 1e-4


@pytest.mark.parametrize("t", ["f16", "q8_0"])
def test_fused_decode_matches_the_per_op_path(q8_path, t, monkeypatch):
    """The native decode step's short convolution (rows stored in the K type, the taps before the new
    position read back from the cache, summed oldest first) gives the per-op path's logits over 20
    steps, with the same kernels (MINIRT_NATIVE_LAYERS=0: the per-op path)."""
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    ids = np.load(LF / "ref.npz")["tokens"][0]
    out = {}
    for fused in (True, False):
        monkeypatch.setenv("MINIRT_NATIVE_LAYERS", "1" if fused else "0")
        with minirt.load(q8_path, n_ctx=64, backend="native", cache_type_k=t, cache_type_v=t) as llm:
            m = llm.model
            assert (m.native_stack is not None) == fused
            cache = kv_cache_for(m.cfg, 64, t, t)
            rows = [m.forward(ids[:8], [Segment(cache, 8, "last")])[0].copy()]
            rows += [m.forward(np.array([x]), [Segment(cache, 1, "last")])[0].copy() for x in ids[8:28]]
            out[fused] = np.stack(rows)
    assert rel_rms(out[True], out[False]) < 1e-6


@pytest.mark.parametrize("t", ["f16", "q8_0", "f32"])
def test_prefix_cache_and_state_files(q8_path, tmp_path, t):
    st = tmp_path / "lfm2.state"
    prompt = list(range(10, 60))
    with minirt.load(q8_path, n_ctx=128, cache_type_k=t, cache_type_v=t) as m:
        first = m.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        # a prompt sharing only part of the cached one: the cache is cut back to the common prefix,
        # and the convolution rows before the cut are what the next position reads
        part = prompt[:30] + [7, 8, 9]
        partial = m.generate(part, max_tokens=4, temperature=0.0, ignore_eos=True)
        assert partial.usage["cached_tokens"] > 0
        saved = m.save_state(st)
        follow = saved + [11]
        want = m.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids
    with minirt.load(q8_path, n_ctx=128, cache_type_k=t, cache_type_v=t) as m2:
        uncached = m2.generate(part, max_tokens=4, temperature=0.0, ignore_eos=True)
        assert uncached.token_ids == partial.token_ids
        assert m2.load_state(st) == saved
        c = m2.generate(follow, max_tokens=5, temperature=0.0, ignore_eos=True)
        assert c.usage["cached_tokens"] == len(saved) and c.token_ids == want
    assert first.token_ids


def test_context_shift_moves_the_convolution_rows(q8_path):
    with minirt.load(q8_path, n_ctx=64, cache_type_k="f32", cache_type_v="f32") as llm:
        m = llm.model
        cache = kv_cache_for(m.cfg, 64, "f32", "f32")
        ids = np.load(LF / "ref.npz")["tokens"][2][:30]
        m.forward(ids, [Segment(cache, 30, "none")])
        before = {i: cache.read(i, 0, 30)[0] for i in (0, 1, 3, 5)}
        m.shift_cache(cache, n_keep=4, n_discard=10)
        assert cache.n_past == 20
        keep = np.r_[0:4, 14:30]
        for i, rows in before.items():
            np.testing.assert_array_equal(cache.read(i, 0, 20)[0], rows[:, keep])
        out = m.forward(ids[:1], [Segment(cache, 1, "last")])[0]
        assert np.isfinite(out).all()


def test_layer_stack_checks_what_c_will_trust(q8_path):
    """Shapes C reads through bare pointers are checked before: convolution taps that do not match
    n_embd, a layer reading the cache of a later layer or of a convolution layer."""
    import dataclasses

    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    with minirt.load(q8_path, n_ctx=64, backend="native") as llm:
        blocks = llm.model.desc.blocks
        index = [0 if b.attn.rope is not None else -1 for b in blocks]
        short = dataclasses.replace(blocks[0], attn=dataclasses.replace(blocks[0].attn,
                                                                        weight=blocks[0].attn.weight[:128]))
        with pytest.raises(minirt.InvalidRequestError, match="convolution taps"):
            native.LayerStack([short] + blocks[1:], index)
        for src in (4, 1):  # a later layer; a convolution layer
            bad = dataclasses.replace(blocks[2], attn=dataclasses.replace(blocks[2].attn, kv_source=src))
            with pytest.raises(minirt.InvalidRequestError, match="reads the KV cache of layer"):
                native.LayerStack(blocks[:2] + [bad] + blocks[3:], index)
