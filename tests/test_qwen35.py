"""Qwen3.5's gated delta-net layers beyond their logits (those are in tests/test_archs.py): the
recurrent state each sequence keeps beside its KV cache (convolution inputs and the delta-rule
state), and what the runtime does with it — batching several sequences in one pass, token-by-token
decode, the prefix cache (the live state and the snapshot before a prompt's last token), state
files, the KV budget, a failed step, context shift (refused).

The fixture (``tests/data/archs/qwen35``, made by llama.cpp's converter from a random transformers
Qwen3.5): 4 layers linear, linear, full, linear; hidden 256, 2 key heads / 4 value heads of 32,
4 convolution taps, GQA 4/2 gated attention."""

from __future__ import annotations

import numpy as np
import pytest

import minirt
from minirt.blocks import GatedDeltaNet, delta_rule
from minirt.forward import Segment, kv_cache_for
from tests.arch_parity import (
    ARCH_DIR,
    check_fused_decode,
    check_recurrent_passes,
    check_recurrent_prefix_cache,
    rel_rms,
)

QD = ARCH_DIR / "qwen35"


@pytest.fixture(scope="module")
def q8_path() -> str:
    p = QD / "model-q8_0.gguf"
    if not p.is_file():
        pytest.fail(f"missing fixture {p}")
    return str(p)


def test_description_and_cache_layout(q8_path):
    with minirt.load(q8_path, n_ctx=64) as llm:
        d = llm.model.desc
        rec = [isinstance(b.attn, GatedDeltaNet) for b in d.blocks]
        assert rec == [True, True, False, True]
        g = d.blocks[0].attn
        assert (g.n_k_heads, g.n_v_heads, g.head_dim_k, g.head_dim_v, g.taps) == (2, 4, 32, 32, 4)
        assert g.state_shapes == ((3, 2 * 2 * 32 + 4 * 32), (4, 32, 32))
        assert d.blocks[2].attn.out_gate and d.blocks[2].attn.rope.dim == 16
        # only the attention layer has rows per position (f16 K and V of 2 heads of 64)
        assert d.kv_layers() == [None, None, (2, 64, 64), None]
        assert llm.kv_bytes_per_token == 2 * 2 * 64 * 2
        # a state (3 layers: conv 3 x 256 + 4 x 32 x 32, float32) and its snapshot, in positions of 512 bytes
        assert llm.state_positions == -(-2 * 4 * 3 * (3 * 256 + 4 * 32 * 32) // 512)
        assert llm.model.native_stack is not None  # decode steps run in the fused native step


def test_delta_rule_against_the_definition():
    """The vectorised delta rule against its definition written out per head with plain loops."""
    rng = np.random.default_rng(0)
    n, H, Dk, Dv = 5, 3, 4, 6
    q, k = rng.standard_normal((n, H, Dk), dtype=np.float32), rng.standard_normal((n, H, Dk), dtype=np.float32)
    v = rng.standard_normal((n, H, Dv), dtype=np.float32)
    decay, beta = rng.uniform(0.5, 1.0, (n, H)).astype(np.float32), rng.uniform(0, 1, (n, H)).astype(np.float32)
    S0 = rng.standard_normal((H, Dk, Dv), dtype=np.float32)
    S = S0.copy()
    got = delta_rule(S, q, k, v, decay, beta)
    want = np.zeros((n, H, Dv))
    for h in range(H):
        s = S0[h].astype(np.float64)
        for t in range(n):
            s = decay[t, h] * s
            err = v[t, h] - s.T @ k[t, h]
            s = s + np.outer(k[t, h], beta[t, h] * err)
            want[t, h] = s.T @ q[t, h]
        np.testing.assert_allclose(S[h], s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "native"])
def test_batched_and_stepwise_passes_agree(q8_path, backend):
    """Batches, token-by-token decode and split prefills continue each sequence from its own state
    (``check_recurrent_passes``). Native: batches of other sizes take other matmul kernels (from 11 tokens the
    integer GEMM), equal up to float32 summation order, which this random model amplifies to ~1e-4."""
    ref = np.load(QD / "ref.npz")
    tol = 1e-4 if backend == "reference" else 5e-4
    with minirt.load(q8_path, n_ctx=64, backend=backend) as llm:
        check_recurrent_passes(llm.model, ref["tokens"][0][:20], ref["tokens"][1][:13], tol)


def test_prefix_cache_state_files_and_batching(q8_path, tmp_path):
    check_recurrent_prefix_cache(q8_path, tmp_path / "q35.state")


def test_state_file_checks(q8_path, tmp_path):
    """A state file of this model without its recurrent state, or with a non-finite one, is refused."""
    import zipfile

    st = tmp_path / "q35.state"
    with minirt.load(q8_path, n_ctx=64) as m:
        m.generate(list(range(10, 30)), max_tokens=2, temperature=0.0, ignore_eos=True)
        m.save_state(st)
        with zipfile.ZipFile(st) as z:
            members = {n: z.read(n) for n in z.namelist()}
        assert "rstate.npy" in members
        bad = tmp_path / "bad.state"
        with zipfile.ZipFile(bad, "w") as z:
            for n, data in members.items():
                if n != "rstate.npy":
                    z.writestr(n, data)
        with pytest.raises(minirt.StateError, match="rstate"):
            m.load_state(bad)
        import io
        arr = np.load(io.BytesIO(members["rstate.npy"]))
        arr[3] = np.nan
        buf = io.BytesIO()
        np.save(buf, arr)
        with zipfile.ZipFile(bad, "w") as z:
            for n, data in members.items():
                z.writestr(n, buf.getvalue() if n == "rstate.npy" else data)
        with pytest.raises(minirt.StateError, match="finite|rstate"):
            m.load_state(bad)


def test_failed_step_leaves_only_the_snapshot(q8_path, monkeypatch):
    """A forward step that raises midway (after some layers updated their state) marks the live state
    unusable: the cache is not continued from it, only from the snapshot or from position 0."""
    with minirt.load(q8_path, n_ctx=64, backend="reference") as llm:
        m = llm.model
        cache = kv_cache_for(m.cfg, 64)
        ids = np.arange(10, 30)
        m.forward(ids, [Segment(cache, 20, "last")])
        orig = m.mlp
        calls = []

        def boom(b, h):
            calls.append(1)
            if len(calls) == 2:  # after layer 0's and 1's delta-net state moved on
                raise RuntimeError("injected")
            return orig(b, h)

        monkeypatch.setattr(m, "mlp", boom)
        with pytest.raises(RuntimeError, match="injected"):
            m.forward(np.array([5]), [Segment(cache, 1, "last")])
        monkeypatch.setattr(m, "mlp", orig)
        assert cache.n_past == 20
        with pytest.raises(ValueError, match="step failed"):
            cache.state(0)
        assert cache.valid_prefix(20) == 19  # the snapshot before the prompt's last token
        cache.truncate(19)
        out = m.forward(ids[19:], [Segment(cache, 1, "last")])[0]
        fresh = kv_cache_for(m.cfg, 64)
        want = m.forward(ids, [Segment(fresh, 20, "last")])[0]
        assert rel_rms(out, want) < 1e-5


def test_context_shift_is_refused_with_a_clear_error(q8_path):
    with minirt.load(q8_path, n_ctx=32) as m:
        with pytest.raises(minirt.ContextOverflowError, match="recurrent"):
            m.generate(list(range(10, 30)), max_tokens=40, temperature=0.0, ignore_eos=True,
                       context_overflow="shift")
        # with the default ("stop") the request ends at the context's end
        r = m.generate(list(range(10, 30)), max_tokens=40, temperature=0.0, ignore_eos=True)
        assert r.finish_reason == "length" and len(r.token_ids) == 12


def test_native_delta_rule_matches_numpy_and_checks_shapes():
    """The C kernel gives the numpy rule's outputs and state (one value head per thread item), as close to a
    float64 evaluation as numpy's float32 one (the kernel's loops are compiled per ISA: fused multiply-adds
    round differently); shapes C would read through bare pointers are refused before the call."""
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    rng = np.random.default_rng(1)
    n, H, Dk, Dv = 9, 5, 32, 48
    q, k = rng.standard_normal((n, H, Dk), dtype=np.float32), rng.standard_normal((n, H, Dk), dtype=np.float32)
    v = rng.standard_normal((n, H, Dv), dtype=np.float32)
    decay, beta = rng.uniform(0.5, 1.0, (n, H)).astype(np.float32), rng.uniform(0, 1, (n, H)).astype(np.float32)
    S0 = rng.standard_normal((H, Dk, Dv), dtype=np.float32) * np.float32(0.1)
    S1, S2 = S0.copy(), S0.copy()
    want = delta_rule(S1, q, k, v, decay, beta)
    got = native.delta_rule(S2, q, k, v, decay, beta, threads=2)
    S64 = S0.astype(np.float64)
    exact = delta_rule(S64, *(a.astype(np.float64) for a in (q, k, v, decay, beta)))

    def rel(a, b):
        return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))

    assert rel(got, exact) <= 1.5 * rel(want, exact), (rel(got, exact), rel(want, exact))
    assert rel(S2, S64) <= 1.5 * rel(S1, S64), (rel(S2, S64), rel(S1, S64))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(S2, S1, rtol=1e-3, atol=1e-3)
    with pytest.raises(minirt.InvalidRequestError, match="do not match"):
        native.delta_rule(S2, q[:, :4].copy(), k, v, decay, beta)
    with pytest.raises(minirt.InvalidRequestError, match="decay"):
        native.delta_rule(S2, q, k, v, decay[:-1], beta)
    with pytest.raises(minirt.InvalidRequestError, match="float32"):
        native.delta_rule(S2, q.astype(np.float64), k, v, decay, beta)
    with pytest.raises(minirt.InvalidRequestError, match="overlap"):  # q read from the state being written
        native.delta_rule(S2, S2.reshape(-1)[:n * H * Dk].reshape(n, H, Dk), k, v, decay, beta)


@pytest.mark.parametrize("layout", ["qwen35", "qwen3next"])
def test_fused_decode_step_runs_delta_net_and_gated_attention(layout):
    """The fused native decode step (``mr_decode_layers`` mixer 3 and gated attention) against the per-op
    reference, two sequences at different positions stepping together, states compared. Qwen3-Next's layout
    (value heads grouped by key head, fused beta / alpha rows) comes from its fixture, whose mixture of experts
    the fused step does not take: here its blocks get Qwen3.5's dense MLPs (same widths) in both backends."""
    from minirt import gguf as mgguf
    from minirt.archs import describe
    from minirt.forward import Transformer
    from minirt.kernels import NativeBackend, ReferenceBackend, native

    if not native.available():
        pytest.skip("native kernels unavailable")
    ref = np.load(QD / "ref.npz")
    f = mgguf.open(ARCH_DIR / layout / "model-q8_0.gguf")
    dense = mgguf.open(QD / "model-q8_0.gguf")
    try:
        models = []
        for be in (NativeBackend(), ReferenceBackend()):
            desc = describe(f, 64)
            if layout == "qwen3next":
                mlps = [blk.mlp for blk in describe(dense, 64).blocks]
                for i, blk in enumerate(desc.blocks):
                    blk.mlp = mlps[i % len(mlps)]
            models.append(Transformer(desc, be, file=f))
        check_fused_decode(*models, ref["tokens"][0][:12], ref["tokens"][1][:7])
    finally:
        f.close()
        dense.close()
