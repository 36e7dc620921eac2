"""Key / query balance of block-quantized K caches (minirt.kv_balance): exact in float, smaller
quantization error, the same in the per-op path, the fused native decode step and state files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import minirt
from minirt import kv_balance
from minirt.archs.base import Segment
from minirt.kv_cache import KVCache
from tests.test_kv_types import SPEC
from tests.tiny_models import TinySpec, write_tiny

REF = Path(__file__).resolve().parent / "data" / "reference"


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


@pytest.fixture(scope="module")
def skewed_path(tmp_path_factory):
    """A tiny model whose K channels are up to 8x larger or smaller than usual and the matching Q
    channels inversely so (the same scores as a plain model, a harder one to quantize)."""
    path = tmp_path_factory.mktemp("kvb") / "skewed.gguf"
    write_tiny(path, TinySpec(**{**SPEC.__dict__, "weights": {}, "bias": True, "qk_skew": 8.0}))
    return str(path)


def _load(path, t, monkeypatch, balance=True, **kw):
    monkeypatch.setenv("MINIRT_KV_BALANCE", "1" if balance else "0")
    return minirt.load(path, cache_type_k=t, cache_type_v=t, **kw)


def test_factors_are_bounded_powers_of_two_made_alike_on_every_load(skewed_path, monkeypatch):
    """The factors are powers of two within 2^±MAX_LOG2, one (Hkv, Dk) array per layer, the same on
    every load (state files and prefix caches rely on it); none for f16 / f32 caches or when disabled."""
    got = []
    for _ in range(2):
        with _load(skewed_path, "q8_0", monkeypatch, n_ctx=64) as m:
            sc = m.model.cfg.kv_scales
            assert sc is not None and len(sc) == SPEC.n_layer
            for s in sc:
                e = np.log2(s)
                assert s.shape == (SPEC.n_head_kv, SPEC.n_embd // SPEC.n_head) and s.dtype == np.float32
                assert np.array_equal(e, np.round(e)) and np.abs(e).max() <= kv_balance.MAX_LOG2
                assert e.max() - e.min() >= 3  # the skew is seen
            got.append(sc)
    assert all(np.array_equal(a, b) for a, b in zip(*got))
    with _load(skewed_path, "f16", monkeypatch, n_ctx=64) as m:
        assert m.model.cfg.kv_scales is None
    with _load(skewed_path, "q8_0", monkeypatch, balance=False, n_ctx=64) as m:
        assert m.model.cfg.kv_scales is None and m._new_cache(8).key_scales is None


def test_factors_are_kept_per_model_file_and_checked(skewed_path, monkeypatch, tmp_path):
    """The factors go to $MINIRT_HOME/kv_balance/ once; a later load reads them back (no measuring
    pass); a damaged, foreign-shaped or out-of-range file is measured anew and rewritten."""
    monkeypatch.setenv("MINIRT_HOME", str(tmp_path))
    with _load(skewed_path, "q4_0", monkeypatch, n_ctx=64) as m:
        want = m.model.cfg.kv_scales
    files = list((tmp_path / "kv_balance").glob("*.npy"))
    assert len(files) == 1
    calls = []
    real = kv_balance.measure
    monkeypatch.setattr(kv_balance, "measure", lambda model, *a: calls.append(1) or real(model, *a))
    with _load(skewed_path, "q4_0", monkeypatch, n_ctx=64) as m:
        assert calls == [] and all(np.array_equal(a, b) for a, b in zip(m.model.cfg.kv_scales, want))
    good = files[0].read_bytes()
    e = np.load(files[0])
    for bad in (b"not an npy file", b"\x93NUMPY" + bytes(1 << 20), np.full_like(e, 9), e[:, :, :-1]):
        if isinstance(bad, bytes):
            files[0].write_bytes(bad)
        else:
            np.save(files[0], bad)
        calls.clear()
        with _load(skewed_path, "q4_0", monkeypatch, n_ctx=64) as m:
            assert calls == [1] and all(np.array_equal(a, b) for a, b in zip(m.model.cfg.kv_scales, want))
        assert files[0].read_bytes() == good


def test_factors_follow_the_measured_energies():
    """A channel whose keys are 16x (energy 256x) the others' and whose queries are alike gets a factor
    of 1/4 relative to them (fourth root of the energy ratio); always-zero channels stay finite."""
    ek = np.ones((1, 8))
    ek[0, 0] = 256.0
    ek[0, 7] = 0.0
    eq = np.ones((1, 8))
    eq[0, 7] = 0.0
    (s,) = kv_balance.scales_from({0: (ek, eq)}, 1)
    e = np.log2(s[0])
    assert np.all(np.isfinite(s)) and e[0] - e[1] == -2 and np.all(e[1:7] == e[1])


def test_scaled_cache_is_exact_attention(monkeypatch):
    """With key scales, the queries the cache gives attention (rotate_queries) dotted with the stored
    keys (dequantized) are the scores q·k up to the quantization error, and read() gives the plain keys
    back; the balanced cache's score error is several times smaller when channel sizes are uneven."""
    rng = np.random.default_rng(4)
    Hkv, H, D, n = 1, 2, 64, 200
    g = 8.0 ** rng.uniform(-1, 1, D)
    k = (rng.standard_normal((Hkv, n, D)) * g).astype(np.float32)
    q = (rng.standard_normal((5, H, D)) / g).astype(np.float32)
    ek, eq = (k.astype(np.float64) ** 2).mean(1), (q.astype(np.float64) ** 2).mean(0).reshape(Hkv, -1, D).sum(1)
    (sc,) = kv_balance.scales_from({0: (ek, eq)}, 1)
    exact = np.einsum("thd,nd->thn", q, k[0])
    errs = {}
    for name, scales in (("balanced", [sc]), ("plain", None)):
        c = KVCache(1, Hkv, D, D, n, type_k="q4_0", type_v="q8_0", key_scales=scales)
        c.store(0, 0, k, np.zeros_like(k))
        from minirt.kv_cache import dequantize_rows

        stored = dequantize_rows(c.layer(0)[0], c.kt)
        got = np.einsum("thd,nd->thn", c.rotate_queries(0, q), stored[0])
        errs[name] = _rel(got, exact)
        assert _rel(c.read(0, 0, n)[0], k) < 0.2
    assert errs["balanced"] < 0.5 * errs["plain"], errs


def test_balance_shrinks_the_error_of_quantized_caches(skewed_path, monkeypatch):
    """Teacher-forced logits of q8_0 / q4_0 caches against the f32 cache: balanced several times closer."""
    ids = np.random.default_rng(3).integers(3, 290, 60).tolist()
    with _load(skewed_path, "f32", monkeypatch, n_ctx=64) as m:
        ref = m.logits(ids)
    for t in ("q8_0", "q4_0"):
        err = {}
        for bal in (True, False):
            with _load(skewed_path, t, monkeypatch, balance=bal, n_ctx=64) as m:
                err[bal] = _rel(m.logits(ids), ref)
        assert err[True] < 0.5 * err[False], (t, err)


def test_balance_on_qwen_reference_prompts(qwen_path, monkeypatch):
    """Qwen2.5's keys (K bias up to 145, outlier channels): a q8_0 cache's logits on reference prompts
    (llama.cpp's greedy continuations fed back) are at least 2x closer to the f32 cache's balanced,
    and its argmax agrees at least as often."""
    recs = [json.loads(x) for x in (REF / "qwen2.5-coder-0.5b.greedy.jsonl").read_text().splitlines() if x.strip()]
    prompts = [(len(r["prompt_ids"]), r["prompt_ids"] + r["greedy_ids"]) for r in recs[:3]]

    def run(t, bal):
        with _load(str(qwen_path), t, monkeypatch, balance=bal, n_ctx=512) as m:
            return np.concatenate([m.logits(p)[n - 1:-1] for n, p in prompts])

    ref = run("f32", True)
    bal, plain = run("q8_0", True), run("q8_0", False)
    assert _rel(bal, ref) < 0.5 * _rel(plain, ref), (_rel(bal, ref), _rel(plain, ref))
    agree = [np.mean(x.argmax(-1) == ref.argmax(-1)) for x in (bal, plain)]
    assert agree[0] >= agree[1], agree


def _decode(m, ids, n_prefill):
    cache = m._new_cache(64)
    rows = [m.model.forward(np.array(ids[:n_prefill]), [Segment(cache, n_prefill, "last")])[0]]
    rows += [m.model.forward(np.array([tok]), [Segment(cache, 1, "last")])[0] for tok in ids[n_prefill:]]
    return np.stack(rows), cache


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_fused_decode_scales_as_the_per_op_path(nat, skewed_path, monkeypatch, t):
    """The native decode step scales keys and queries as KVCache.store / rotate_queries do: decode
    steps on top of a prefill agree with the per-op backend's, and a step without the scales (native
    stack told none while the cache has them) is far off."""
    ids = [1] + np.random.default_rng(7).integers(3, 290, 30).tolist()
    with _load(skewed_path, t, monkeypatch, n_ctx=64, backend="reference") as m:
        ref, _ = _decode(m, ids, 20)
    with _load(skewed_path, t, monkeypatch, n_ctx=64, backend="native") as m:
        assert m.model.native_stack is not None and m.model.cfg.kv_scales is not None
        got, cache = _decode(m, ids, 20)
        good = _rel(got, ref)
        assert good < 2e-3
        m.model.native_stack.set_key_scales(None)  # the mutation: steps store and query unscaled
        try:
            bad, _ = _decode(m, ids, 20)
        finally:
            m.model.native_stack.set_key_scales(m.model.cfg.kv_scales)
    assert _rel(bad[1:], ref[1:]) > 20 * good


def test_state_files_carry_the_scales(skewed_path, monkeypatch, tmp_path):
    """A balanced q8_0 state: reloaded alike it is the same rows; into an unbalanced q8_0 model or an
    f32 one it converts to the same plain keys; a tampered exponent or a header that does not match
    the members is a StateError."""
    st = tmp_path / "s.state"
    with _load(skewed_path, "q8_0", monkeypatch, n_ctx=96) as m:
        m.generate("the capital of France is", max_tokens=6, temperature=0.0, ignore_eos=True)
        saved = m.save_state(st)
        c = m.cache_pool.most_recent()
        rows = c.export(len(saved))
        plain = [c.read(i, 0, len(saved)) for i in range(SPEC.n_layer)]
    with _load(skewed_path, "q8_0", monkeypatch, n_ctx=96) as m2:
        assert m2.load_state(st) == saved
        c2 = m2.cache_pool.most_recent()
        for a, b in zip(c2.export(len(saved)), rows):
            np.testing.assert_array_equal(a, b)
    with _load(skewed_path, "f32", monkeypatch, n_ctx=96) as m32:
        assert m32.load_state(st) == saved
        c32 = m32.cache_pool.most_recent()
        for i in range(SPEC.n_layer):
            np.testing.assert_array_equal(c32.k[i, :, :len(saved)], plain[i][0])
    with _load(skewed_path, "q8_0", monkeypatch, balance=False, n_ctx=96) as mu:
        assert mu.load_state(st) == saved
        cu = mu.cache_pool.most_recent()
        for i in range(SPEC.n_layer):
            k = cu.read(i, 0, len(saved))[0]
            assert _rel(k, plain[i][0]) < 0.05
    # tampering
    import zipfile

    with np.load(st) as z:
        members = {n: z[n] for n in z.files}
    header = json.loads(str(members["header"][()]))
    bad_exp = dict(members, kscale=np.full_like(members["kscale"], 7))
    no_member = {n: a for n, a in members.items() if n != "kscale"}
    flag_off = dict(members, header=np.array(json.dumps({**header, "kv_key_scales": False})))
    for i, arrays in enumerate((bad_exp, no_member, flag_off)):
        p = tmp_path / f"bad{i}.state"
        with open(p, "wb") as fh:  # (a path without .npz would get one)
            np.savez(fh, **arrays)
        assert zipfile.is_zipfile(p)
        with _load(skewed_path, "q8_0", monkeypatch, n_ctx=96) as m3, pytest.raises(minirt.StateError):
            m3.load_state(p)
