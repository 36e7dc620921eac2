"""The decoder on tiny random GGUFs against an independent float64 forward pass.

Covers the `llama` architecture (no real model on PyPI), llama3 RoPE frequency factors, linear
RoPE scaling, tied output, Q/K/V biases with NEOX RoPE (`qwen2`), quantized weights, batched and
chunked prefill vs token-by-token decode, and the context shift.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import minirt
from minirt.archs.base import Segment
from minirt.kv_cache import KVCache
from tests.tiny_models import TinySpec, reference_llama, write_tiny

CASES = {
    "llama-f32": TinySpec(),
    "llama-q8_0": TinySpec(qtype=QT.Q8_0, seed=1),
    "llama3-freqs-linear-tied": TinySpec(freq_factors=True, rope_scale=2.0, tied=True, seed=2, n_head_kv=1),
    "qwen2-bias": TinySpec(arch="qwen2", bias=True, seed=3),
    "llama-f16-mha": TinySpec(qtype=QT.F16, n_head_kv=4, seed=4),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    spec = CASES[request.param]
    spec = TinySpec(**{**spec.__dict__, "weights": {}})
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    write_tiny(path, spec)
    llm = minirt.load(str(path), n_ctx=64)
    yield request.param, spec, llm
    llm.close()


def _ids(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 290, n - 1).tolist()


def test_logits_match_float64_reference(tiny):
    name, spec, llm = tiny
    ids = _ids(23)
    ref = reference_llama(spec, ids, neox=spec.arch == "qwen2")
    got = llm.logits(ids)
    assert got.shape == (len(ids), llm.n_vocab) and got.dtype == np.float32
    err = np.abs(got - ref).max() / np.abs(ref).max()
    # float32 everywhere; quantized activations (if a backend uses them) stay within 2e-3
    assert err < 2e-3, f"{name}: relative error {err:.2e}"
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_incremental_decode_equals_full_forward(tiny):
    """Prefill in small chunks then one token at a time gives the same logits as one batch."""
    _, _, llm = tiny
    ids = _ids(19, seed=5)
    full = llm.logits(ids)
    cache = llm._new_cache(64)
    rows = []
    for chunk in (ids[:7], ids[7:12], *[[t] for t in ids[12:]]):
        out = llm.model.forward(np.array(chunk), [Segment(cache, len(chunk), "all")])[0]
        rows.append(out)
    inc = np.concatenate(rows)
    np.testing.assert_allclose(inc, full, rtol=0, atol=2e-3 * np.abs(full).max())
    assert cache.n_past == len(ids)


def test_batched_sequences_are_independent(tiny):
    """Two sequences in one forward pass get exactly what each gets alone."""
    _, _, llm = tiny
    a, b = _ids(9, seed=6), _ids(5, seed=7)
    ca, cb = llm._new_cache(32), llm._new_cache(32)
    la, lb = llm.model.forward(np.array(a + b), [Segment(ca, len(a), "all"), Segment(cb, len(b), "last")])
    np.testing.assert_allclose(la, llm.logits(a), atol=1e-3 * np.abs(la).max())
    np.testing.assert_allclose(lb, llm.logits(b)[-1], atol=1e-3 * np.abs(lb).max())


def test_greedy_generation_follows_reference(tiny):
    name, spec, llm = tiny
    prompt = _ids(6, seed=8)
    c = llm.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert c.finish_reason == "length" and len(c.token_ids) == 8
    seq = list(prompt)
    for t in c.token_ids:  # each token is the argmax of the float64 model over the sequence so far
        ref = reference_llama(spec, seq, neox=spec.arch == "qwen2")[-1]
        top2 = np.sort(ref)[-2:]
        if top2[1] - top2[0] > 1e-2 * np.abs(ref).max():  # skip near-ties
            assert t == int(ref.argmax()), f"{name}: token {t} vs reference {int(ref.argmax())}"
        seq.append(t)


def test_context_shift_rotates_keys_exactly(tiny):
    """After a shift, layer-0 keys/values equal those computed fresh at the new positions."""
    _, spec, llm = tiny
    ids = _ids(20, seed=9)
    c = llm.model.cfg
    new_cache = lambda: KVCache(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, 32)  # noqa: E731 f32: exact
    cache = new_cache()
    llm.model.forward(np.array(ids), [Segment(cache, len(ids), "none")])
    cache.tokens[:20] = ids
    llm.model.shift_cache(cache, n_keep=2, n_discard=5)
    assert cache.n_past == 15
    kept = ids[:2] + ids[7:]
    assert cache.token_ids().tolist() == kept
    fresh = new_cache()
    llm.model.forward(np.array(kept), [Segment(fresh, len(kept), "none")])
    k0, v0 = cache.layer(0)
    fk, fv = fresh.layer(0)
    np.testing.assert_allclose(k0[:, :15], fk[:, :15], atol=1e-4 * np.abs(fk[:, :15]).max())
    np.testing.assert_allclose(v0[:, :15], fv[:, :15], atol=1e-6 * np.abs(fv[:, :15]).max() + 1e-7)


def test_context_full_stop_or_shift(tiny):
    _, _, llm = tiny
    prompt = _ids(50, seed=10)
    c = llm.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
    assert c.finish_reason == "length" and len(c.token_ids) == 64 - 50
    c2 = llm.generate(prompt, max_tokens=40, temperature=0.0, ignore_eos=True, context_overflow="shift")
    assert c2.finish_reason == "length" and len(c2.token_ids) == 40
    assert c2.token_ids[:14] == c.token_ids[:14]
    with pytest.raises(minirt.ContextOverflowError):
        llm.generate(_ids(64), max_tokens=1)


def test_unsupported_architecture(tmp_path):
    spec = TinySpec(arch="mamba")
    p = tmp_path / "mamba.gguf"
    write_tiny(p, spec)
    with pytest.raises(minirt.UnsupportedArchitectureError) as e:
        minirt.load(str(p))
    msg = str(e.value)
    assert "'mamba'" in msg and "llama" in msg and "qwen2" in msg and "gemma3" in msg
