"""Mamba-2 hybrids beyond their logits (those are in tests/test_archs.py): the selective scan against its
definition and in C, the recurrent state each sequence keeps beside its KV cache (convolution inputs and the
SSM state), and what the runtime does with it — batching, token-by-token decode, the prefix cache, state
files, context shift (refused) — and how Nemotron-H's one-sublayer-per-layer files become blocks.

Fixtures (``tests/data/archs``, made by llama.cpp's converter from random transformers models):
``granitehybrid`` (mamba, mamba, attention, mamba; 8 heads of 64, 2 groups, state 32; experts + shared
expert), ``granitehybrid_dense`` (attention, then 3 Mamba-2 layers of 16 heads of 32, 1 group, state 64;
dense MLP), ``nemotron_h`` (layers M - M * - M M -: Mamba-2, relu² MLP, attention) and ``nemotron_h_moe``
(M E M * E M E: relu² experts with a sigmoid router and a shared expert)."""

from __future__ import annotations

import numpy as np
import pytest

import minirt
from minirt.blocks import Mamba2, ssm_scan
from minirt.forward import Segment, kv_cache_for
from tests.arch_parity import (
    ARCH_DIR,
    check_fused_decode,
    check_recurrent_passes,
    check_recurrent_prefix_cache,
    rel_rms,
)

GD = ARCH_DIR / "granitehybrid"


@pytest.fixture(scope="module")
def q8_path() -> str:
    p = GD / "model-q8_0.gguf"
    if not p.is_file():
        pytest.fail(f"missing fixture {p}")
    return str(p)


def _rewrite(src, dst, fields=None, extra_tensors=None, patch=None) -> None:
    """A copy of the GGUF ``src`` at ``dst`` with some metadata values replaced (``fields``: key → value,
    same type), tensors added (``extra_tensors``: name → float32 array) or patched (``patch``: name → fn)."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, (fields or {}).get(key, f.contents()), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if patch and t.name in patch:
            data = patch[t.name](data).astype(data.dtype)
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_description_and_cache_layout(q8_path):
    with minirt.load(q8_path, n_ctx=64) as llm:
        d = llm.model.desc
        assert [isinstance(b.attn, Mamba2) for b in d.blocks] == [True, True, False, True]
        m = d.blocks[0].attn
        assert (m.n_head, m.head_dim, m.d_state, m.n_group, m.taps) == (8, 64, 32, 2, 4)
        assert m.conv_bias is not None and m.conv_dim == 512 + 2 * 2 * 32
        assert m.state_shapes == ((3, 640), (8, 64, 32))
        a = d.blocks[2].attn
        assert a.rope is None and a.scale == pytest.approx(1 / 64)  # Granite 4.0-H: no positions
        assert d.embed_scale == 12.0 and d.logit_scale == pytest.approx(0.25)
        assert d.blocks[0].residual_scale == pytest.approx(0.22)
        assert d.kv_layers() == [None, None, (2, 64, 64), None]
        # a state (3 layers: conv 3 x 640 + 8 x 64 x 32, float32) and its snapshot, in positions of 512 bytes
        assert llm.state_positions == -(-2 * 4 * 3 * (3 * 640 + 8 * 64 * 32) // 512)
        assert llm.model.native_stack is not None  # decode steps (experts included) run in the fused step
    with minirt.load(str(ARCH_DIR / "granitehybrid_dense" / "model-q8_0.gguf"), n_ctx=64) as llm:
        d = llm.model.desc
        assert [isinstance(b.attn, Mamba2) for b in d.blocks] == [False, True, True, True]
        assert not hasattr(d.blocks[1].mlp, "router")  # no experts: the dense SwiGLU MLP


def test_ssm_scan_against_the_definition():
    """The vectorised scan against its definition written out per head with plain loops (float64)."""
    rng = np.random.default_rng(0)
    n, H, P, N, G = 6, 4, 5, 3, 2
    x = rng.standard_normal((n, H, P), dtype=np.float32)
    dt = rng.uniform(0.01, 1.0, (n, H)).astype(np.float32)
    a = -rng.uniform(0.5, 4.0, H).astype(np.float32)
    B, C = rng.standard_normal((n, G, N), dtype=np.float32), rng.standard_normal((n, G, N), dtype=np.float32)
    S0 = rng.standard_normal((H, P, N), dtype=np.float32)
    S = S0.copy()
    got = ssm_scan(S, x, dt, a, B, C)
    want = np.zeros((n, H, P))
    for h in range(H):
        g = h // (H // G)
        s = S0[h].astype(np.float64)
        for t in range(n):
            s = np.exp(dt[t, h] * a[h]) * s + np.outer(dt[t, h] * x[t, h], B[t, g])
            want[t, h] = s @ C[t, g]
        np.testing.assert_allclose(S[h], s, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_native_ssm_scan_matches_numpy_and_checks_shapes():
    """The C kernel gives the numpy scan's outputs and state (one head per thread item); shapes C would
    read through bare pointers are refused before the call."""
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    rng = np.random.default_rng(1)
    n, H, P, N, G = 9, 6, 64, 40, 3
    x = rng.standard_normal((n, H, P), dtype=np.float32)
    dt = rng.uniform(0.01, 1.0, (n, H)).astype(np.float32)
    a = -rng.uniform(0.5, 4.0, H).astype(np.float32)
    B, C = rng.standard_normal((n, G, N), dtype=np.float32), rng.standard_normal((n, G, N), dtype=np.float32)
    S0 = rng.standard_normal((H, P, N), dtype=np.float32) * np.float32(0.1)
    S1 = S0.copy()
    want = ssm_scan(S1, x, dt, a, B, C)
    for isa in native.supported_isas():  # the row kernel is compiled per ISA; N = 40: 16-lane blocks and a remainder
        S2 = S0.copy()
        got = native.ssm_scan(S2, x, dt, a, B, C, threads=2, isa=isa)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=isa)
        np.testing.assert_allclose(S2, S1, rtol=2e-5, atol=2e-5, err_msg=isa)
    with pytest.raises(minirt.InvalidRequestError, match="do not match"):
        native.ssm_scan(S2, x[:, :4].copy(), dt, a, B, C)
    with pytest.raises(minirt.InvalidRequestError, match="do not match"):  # 6 heads, 4 groups
        native.ssm_scan(S2, x, dt, a, rng.standard_normal((n, 4, N), dtype=np.float32),
                        rng.standard_normal((n, 4, N), dtype=np.float32))
    with pytest.raises(minirt.InvalidRequestError, match="dt"):
        native.ssm_scan(S2, x, dt[:-1], a, B, C)
    with pytest.raises(minirt.InvalidRequestError, match="float32"):
        native.ssm_scan(S2, x.astype(np.float64), dt, a, B, C)
    with pytest.raises(minirt.InvalidRequestError, match="overlap"):  # x read from the state being written
        native.ssm_scan(S2, S2.reshape(-1)[:n * H * P].reshape(n, H, P), dt, a, B, C)


def test_native_causal_conv_matches_numpy_and_checks_shapes():
    """The C convolution (channels in chunks of 256 per thread item; 600 = two chunks and a remainder)
    gives the numpy one's output, with and without bias; wrong shapes are refused before the call."""
    from minirt.blocks import causal_conv
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    rng = np.random.default_rng(2)
    n, c, taps = 7, 600, 4
    rows = rng.standard_normal((taps - 1 + n, c), dtype=np.float32)
    w = rng.standard_normal((c, taps), dtype=np.float32)
    bias = rng.standard_normal(c, dtype=np.float32)
    for b in (None, bias):
        np.testing.assert_allclose(native.causal_conv(rows, w, b, threads=2), causal_conv(rows, w, b),
                                   rtol=1e-5, atol=1e-5)
    assert native.causal_conv(rows[:taps - 1], w).shape == (0, c)
    with pytest.raises(minirt.InvalidRequestError, match="do not fit"):
        native.causal_conv(rows[:, :10].copy(), w)
    with pytest.raises(minirt.InvalidRequestError, match="do not fit"):
        native.causal_conv(rows[:taps - 2], w)
    with pytest.raises(minirt.InvalidRequestError, match="bias"):
        native.causal_conv(rows, w, bias[:5])


@pytest.mark.parametrize("arch", ["granitehybrid", "granitehybrid_dense", "bamba", "falcon_h1", "nemotron_h", "mamba2"])
@pytest.mark.parametrize("backend", ["reference", "native"])
def test_batched_and_stepwise_passes_agree(arch, backend):
    """Batches, token-by-token decode and split prefills continue each sequence from its own state
    (``check_recurrent_passes``); Nemotron-H has blocks without feed-forward too, pure Mamba-2 nothing else."""
    ref = np.load(ARCH_DIR / arch / "ref.npz")
    tol = 1e-4 if backend == "reference" else 5e-4  # native: other matmul kernels per batch size
    with minirt.load(str(ARCH_DIR / arch / "model-q8_0.gguf"), n_ctx=64, backend=backend) as llm:
        check_recurrent_passes(llm.model, ref["tokens"][0][:20], ref["tokens"][1][:13], tol)


def test_native_and_reference_backends_agree(q8_path):
    ref = np.load(GD / "ref.npz")
    toks = ref["tokens"][0][:24]
    got = {}
    for backend in ("reference", "native"):
        with minirt.load(q8_path, n_ctx=64, backend=backend) as llm:
            m = llm.model
            got[backend] = m.forward(toks, [Segment(kv_cache_for(m.cfg, 64), len(toks), "all")])[0]
    assert rel_rms(got["native"], got["reference"]) < 5e-4


# falcon_h1: KV rows and a state in one layer; mamba2: a state and no KV rows at all
@pytest.mark.parametrize("arch", ["granitehybrid", "falcon_h1", "mamba2"])
def test_prefix_cache_state_files_and_batching(arch, tmp_path):
    check_recurrent_prefix_cache(str(ARCH_DIR / arch / "model-q8_0.gguf"), tmp_path / "gh.state")


@pytest.mark.parametrize("arch", ["granitehybrid", "falcon_h1", "mamba2"])
def test_context_shift_is_refused_with_a_clear_error(arch):
    q8_path = str(ARCH_DIR / arch / "model-q8_0.gguf")
    with minirt.load(q8_path, n_ctx=32) as m:
        with pytest.raises(minirt.ContextOverflowError, match="recurrent"):
            m.generate(list(range(10, 30)), max_tokens=40, temperature=0.0, ignore_eos=True,
                       context_overflow="shift")
        r = m.generate(list(range(10, 30)), max_tokens=40, temperature=0.0, ignore_eos=True)
        assert r.finish_reason == "length" and len(r.token_ids) == 12


@pytest.mark.parametrize("name, patch, match", [
    ("ssm_a", lambda v: np.abs(v) + 0.1, "ssm_a"),  # A must be −exp(A_log)
])
def test_broken_mamba_tensors_are_refused(tmp_path, name, patch, match):
    """A file whose Mamba-2 tensors break the layer's invariants gets a GGUFError naming the tensor."""
    dst = tmp_path / "bad.gguf"
    _rewrite(GD / "model-f16.gguf", dst, patch={f"blk.0.{name}": patch})
    with pytest.raises(minirt.GGUFError, match=match):
        minirt.load(str(dst), n_ctx=32)


# -- Nemotron-H -------------------------------------------------------------------------------------------
ND = ARCH_DIR / "nemotron_h"


def test_nemotron_layers_become_blocks():
    """A mixer layer and the feed-forward layer after it make one block; a mixer followed by a mixer is a
    block without feed-forward (the KV cache and recurrent state follow the blocks)."""
    from minirt.blocks import MLP, Attention, MoE

    with minirt.load(str(ND / "model-q8_0.gguf"), n_ctx=64) as llm:  # M - M * - M M -
        d = llm.model.desc
        kinds = [(type(b.attn).__name__, None if b.mlp is None else type(b.mlp).__name__) for b in d.blocks]
        assert kinds == [("Mamba2", "MLP"), ("Mamba2", None), ("Attention", "MLP"), ("Mamba2", None),
                         ("Mamba2", "MLP")]
        m = d.blocks[0].mlp
        assert isinstance(m, MLP) and m.gate is None and m.act == "relu2"
        a = d.blocks[2].attn
        assert isinstance(a, Attention) and a.rope is None
        assert d.kv_layers() == [None, None, (2, 64, 64), None, None]
        assert d.blocks[1].attn_norm is not None and d.blocks[1].ffn_norm is None
    with minirt.load(str(ARCH_DIR / "nemotron_h_moe" / "model-q8_0.gguf"), n_ctx=64) as llm:  # M E M * E M E
        d = llm.model.desc
        assert [b.mlp is None for b in d.blocks] == [False, True, False, False]
        m = d.blocks[0].mlp
        assert isinstance(m, MoE) and m.gate is None and m.act == "relu2"
        r = m.router
        assert (r.gating, r.norm_topk, r.n_used) == ("sigmoid", True, 2) and r.scale == pytest.approx(2.5)
        assert r.selection_bias is not None
        assert m.shared is not None and m.shared.gate is None and m.shared.act == "relu2"


def test_nemotron_native_relu2_experts_match_the_per_op_loop():
    """The native experts call (``mr_moe_experts``, squared ReLU without gate) gives the per-op loop's output."""
    from minirt.kernels import native
    from minirt.kernels.base import Backend

    if not native.available():
        pytest.skip("native kernels unavailable")
    with minirt.load(str(ARCH_DIR / "nemotron_h_moe" / "model-q8_0.gguf"), n_ctx=64, backend="native") as llm:
        be, m = llm.model.backend, llm.model.desc.blocks[0].mlp
        rng = np.random.default_rng(3)
        x = rng.standard_normal((5, 256), dtype=np.float32)
        ids = np.array([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]], dtype=np.int64)
        w = rng.uniform(0.1, 1.0, (5, 2)).astype(np.float32)
        got = be.moe_experts(x, m, ids, w)
        assert be._expert_sets[id(m)][1] is not None  # the native call ran
        want = Backend.moe_experts(be, x, m, ids, w)
        assert rel_rms(got, want) < 1e-3


def test_nemotron_layouts_it_cannot_run_are_refused(tmp_path):
    """A feed-forward layer after another feed-forward gets UnsupportedArchitectureError naming what is
    missing; latent expert projections without their width (``moe_latent_size``) a GGUFError naming the key."""
    import gguf

    src = ND / "model-f16.gguf"
    ff = [int(v) for v in gguf.GGUFReader(src).fields["nemotron_h.feed_forward_length"].contents()]
    ff[2] = ff[1]  # layer 2 (a Mamba-2 layer) declared a feed-forward, after layer 1's
    dst = tmp_path / "ffn2.gguf"
    _rewrite(src, dst, fields={"nemotron_h.feed_forward_length": ff})
    with pytest.raises(minirt.UnsupportedArchitectureError, match="feed-forward layer that does not follow"):
        minirt.load(str(dst), n_ctx=32)
    dst = tmp_path / "latent.gguf"
    _rewrite(ARCH_DIR / "nemotron_h_moe" / "model-f16.gguf", dst,
             extra_tensors={"blk.1.ffn_latent_down.weight": np.zeros((64, 256), np.float32)})
    with pytest.raises(minirt.GGUFError, match="moe_latent_size"):
        minirt.load(str(dst), n_ctx=32)


# -- Falcon-H1 ---------------------------------------------------------------------------------------------
def test_falcon_h1_layers_run_attention_and_mamba_side_by_side():
    """Every layer is a ParallelMixer: its cache has the attention's rows and the Mamba-2 state; the pre-FFN
    norm stored without its ``.weight`` suffix is read; no SSM norm where the file has none."""
    from minirt.blocks import ParallelMixer

    with minirt.load(str(ARCH_DIR / "falcon_h1" / "model-q8_0.gguf"), n_ctx=64) as llm:
        d = llm.model.desc
        assert all(isinstance(b.attn, ParallelMixer) for b in d.blocks) and len(d.blocks) == 3
        m = d.blocks[0].attn
        assert m.attn.rope is not None and m.attn.rope.neox and m.ssm.norm is None
        assert m.ssm.state_shapes == ((3, 512 + 2 * 2 * 32), (8, 64, 32))
        assert d.kv_layers() == [(2, 64, 64)] * 3 and all(s is not None for s in d.recurrent_states())
        assert d.blocks[0].ffn_norm is not None
        assert llm.model.native_stack is not None  # decode: attention and Mamba-2 in the fused step (mixer 4)


# -- the fused native decode step -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["granitehybrid_dense", "nemotron_h", "falcon_h1"])
def test_fused_decode_step_runs_mamba2_layers_and_matches_per_op(arch):
    """Dense Mamba-2 hybrids (Nemotron-H's blocks without feed-forward too, Falcon-H1's attention and Mamba-2
    side by side) decode in the fused native step (``mr_decode_layers``, mixers 2 and 4): two sequences at
    different positions step together and match the per-op reference backend step by step, states included."""
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    path = str(ARCH_DIR / arch / "model-q8_0.gguf")
    ref = np.load(ARCH_DIR / arch / "ref.npz")
    with minirt.load(path, n_ctx=64, backend="native") as fused, \
            minirt.load(path, n_ctx=64, backend="reference") as per_op:
        check_fused_decode(fused.model, per_op.model, ref["tokens"][0][:14], ref["tokens"][1][:9], steps=6)


def test_fused_decode_step_checks_the_states_it_is_given():
    """States C would write through bare pointers are checked first: missing, of another shape or dtype."""
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    with minirt.load(str(ARCH_DIR / "granitehybrid_dense" / "model-q8_0.gguf"), n_ctx=64, backend="native") as llm:
        m = llm.model
        stack, c = m.native_stack, kv_cache_for(m.cfg, 64)
        x = np.zeros((1, m.cfg.n_embd), np.float32)
        good = [c.state(i) if sh is not None else None for i, sh in enumerate(c.recurrent)]
        with pytest.raises(minirt.InvalidRequestError, match="recurrent states"):
            stack.run(x, [(c.k, c.v, 0, c.types)], [])
        bad = list(good)
        bad[1] = (good[1][0][:-1].copy(), good[1][1])
        with pytest.raises(minirt.InvalidRequestError, match="layer 1: state 0"):
            stack.run(x, [(c.k, c.v, 0, c.types, bad)], [])
        bad[1] = (good[1][0], good[1][1].astype(np.float64))
        with pytest.raises(minirt.InvalidRequestError, match="layer 1: state 1"):
            stack.run(x, [(c.k, c.v, 0, c.types, bad)], [])
