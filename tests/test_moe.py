"""Mixture-of-experts pieces: the router against a per-token reference written independently, the
per-expert views of the 3-D tensors, which expert matrices a step reads, the fused gate+up layout,
attention sinks, and typed errors for inconsistent files. Whole-model parity with transformers
and llama.cpp is in test_archs.py (fixtures qwen2moe, qwen3moe, olmoe, granitemoe, gpt_oss)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import minirt
import minirt.gguf as mgguf
from minirt.archs import Segment, build, describe
from minirt.blocks import MLP, MoE, Router, attention, group_by_expert, route
from minirt.errors import GGUFError
from minirt.kernels import ReferenceBackend
from minirt.kv_cache import KVCache
from tests.arch_parity import ARCH_DIR, check_fused_decode

QWEN3MOE = ARCH_DIR / "qwen3moe" / "model-q8_0.gguf"


def _need(path: Path) -> None:
    if not path.is_file():
        pytest.fail(f"fixture {path} is missing (tools/arch_fixtures/make_fixtures.py makes it)")


# ------------------------------------------------------------------------------------------------
# router
# ------------------------------------------------------------------------------------------------
def _route_loop(logits: np.ndarray, gating: str, k: int, norm: bool, scale: float, bias) -> tuple[list, list]:
    """Per token, with Python floats: probabilities, choose by (prob + bias) descending, weight."""
    ids, ws = [], []
    for row in logits.astype(np.float64):
        if gating == "softmax":
            m = max(row)
            e = [math.exp(v - m) for v in row]
            p = [v / sum(e) for v in e]
        elif gating == "sigmoid":
            p = [1 / (1 + math.exp(-v)) for v in row]
        else:
            p = list(row)
        score = [p[i] + (0.0 if bias is None else float(bias[i])) for i in range(len(p))]
        chosen = sorted(range(len(p)), key=lambda i: (-score[i], i))[:k]
        w = [p[i] for i in chosen]
        if gating == "softmax_topk":
            m = max(w)
            e = [math.exp(v - m) for v in w]
            w = [v / sum(e) for v in e]
        if norm:
            s = sum(w)
            w = [v / s for v in w]
        ids.append(chosen)
        ws.append([v * scale for v in w])
    return ids, ws


@pytest.mark.parametrize("gating", ["softmax", "sigmoid", "softmax_topk"])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("biased", [False, True])
def test_route_matches_per_token_reference(gating, norm, biased):
    rng = np.random.default_rng(7)
    E, k = 16, 4
    logits = rng.normal(0, 2, (23, E)).astype(np.float32)
    bias = rng.normal(0, 0.5, E).astype(np.float32) if biased else None
    r = Router(gate=None, n_used=k, gating=gating, norm_topk=norm, scale=2.5, selection_bias=bias)
    ids, w = route(logits, r)
    ref_ids, ref_w = _route_loop(logits, gating, k, norm, 2.5, bias)
    assert ids.tolist() == ref_ids
    np.testing.assert_allclose(w, np.array(ref_w), rtol=2e-6, atol=1e-7)


def test_group_by_expert_covers_every_choice_once():
    rng = np.random.default_rng(3)
    ids = np.stack([rng.permutation(8)[:3] for _ in range(11)])
    seen = set()
    for e, rows, slot in group_by_expert(ids, 8):
        assert np.all(ids[rows, slot] == e) and np.all(np.diff(rows) > 0)
        seen |= {(int(t), int(s)) for t, s in zip(rows, slot)}
    assert seen == {(t, s) for t in range(11) for s in range(3)}


def test_attention_sinks_match_a_softmax_with_an_extra_logit():
    """Sinks join each softmax's denominator only: the same as a softmax over the scores plus one
    extra key whose value is zero."""
    rng = np.random.default_rng(5)
    n, H, Hkv, D, L = 3, 4, 2, 8, 7
    q = rng.normal(size=(n, H, D)).astype(np.float32)
    k = rng.normal(size=(Hkv, L, D)).astype(np.float32)
    v = rng.normal(size=(Hkv, L, D)).astype(np.float32)
    sinks = rng.normal(size=H).astype(np.float32)
    got = attention(q, k, v, L - n, 0.3, 0, 0.0, sinks).reshape(n, H, D)
    for t in range(n):
        for h in range(H):
            s = [0.3 * float(q[t, h] @ k[h // 2, j]) for j in range(L - n + t + 1)]
            m = max(s + [float(sinks[h])])
            e = [math.exp(x - m) for x in s]
            den = sum(e) + math.exp(float(sinks[h]) - m)
            want = sum(e[j] / den * v[h // 2, j] for j in range(len(s)))
            np.testing.assert_allclose(got[t, h], want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# experts as views of the 3-D tensors
# ------------------------------------------------------------------------------------------------
def test_expert_views_are_zero_copy_slices():
    _need(QWEN3MOE)
    with mgguf.open(QWEN3MOE) as f:
        m = describe(f).blocks[0].mlp
        assert isinstance(m, MoE) and m.n_expert == 4 and m.router.n_used == 2 and m.router.norm_topk
        t = f.tensors["blk.0.ffn_up_exps.weight"]
        base = t.data.__array_interface__["data"][0]
        for e, lin in enumerate(m.up):
            assert (lin.out_features, lin.in_features) == (256, 256)
            assert lin.w.__array_interface__["data"][0] == base + e * 256 * t.row_bytes
            assert np.shares_memory(lin.w, t.data) and lin.parent == (t.name, e * 256)


class _Recorder(ReferenceBackend):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def matmul(self, x, lin):
        self.calls.append((lin.name, x.shape[0]))
        return super().matmul(x, lin)


def test_each_chosen_expert_runs_once_over_its_tokens():
    """A prefill runs each chosen expert once with all the tokens that chose it; a decode step reads
    exactly the chosen experts (n_used per layer) and no other expert matrix."""
    _need(QWEN3MOE)
    with mgguf.open(QWEN3MOE) as f:
        be = _Recorder()
        m = build(f, be, 32)
        c = m.cfg
        cache = KVCache(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, 32)
        ids = np.array([3, 77, 200, 41, 9, 300], dtype=np.int64)
        m.forward(ids, [Segment(cache, len(ids), "last")])
        ups = [(n, t) for n, t in be.calls if ".ffn_up_exps" in n]
        assert len({n for n, _ in ups}) == len(ups), "an expert ran twice in one prefill"
        assert sum(t for _, t in ups) == len(ids) * 2 * c.n_layer  # every (token, choice) once
        be.calls.clear()
        m.forward(np.array([5]), [Segment(cache, 1, "last")])
        for layer in range(c.n_layer):
            for kind in ("gate", "up", "down"):
                names = [n for n, _ in be.calls if n.startswith(f"blk.{layer}.ffn_{kind}_exps")]
                assert len(names) == 2, (layer, kind, names)


# ------------------------------------------------------------------------------------------------
# rewritten files
# ------------------------------------------------------------------------------------------------
def _rewrite(src: Path, dst: Path, meta: dict | None = None, tensors=None) -> None:
    """Copy a GGUF with metadata values replaced (``meta``: key -> value, None drops it) and its
    tensor list passed through ``tensors(list of (name, raw array, type)) -> list``."""
    import gguf

    r = gguf.GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    meta = meta or {}
    for key, fld in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
            continue
        sub = fld.types[1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, fld.contents(), fld.types[0], sub_type=sub)
    for key, val in meta.items():
        if val is not None:
            (w.add_bool if isinstance(val, bool) else w.add_uint32)(key, val)
    ts = [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors]
    for name, data, qt in (tensors(ts) if tensors else ts):
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_fused_gate_up_experts_give_the_same_logits(tmp_path):
    """``ffn_gate_up_exps`` (each expert's gate rows then its up rows, as convert_hf_to_gguf.py
    --fuse-gate-up-exps writes it) describes the same model as separate gate and up tensors."""
    _need(QWEN3MOE)

    def fuse(ts):
        by = {n: (d, q) for n, d, q in ts}
        out = []
        for n, d, q in ts:
            if ".ffn_up_exps." in n:
                continue
            if ".ffn_gate_exps." in n:
                up, _ = by[n.replace("gate_exps", "up_exps")]
                out.append((n.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate([d, up], axis=1), q))
            else:
                out.append((n, d, q))
        return out

    fused = tmp_path / "fused.gguf"
    _rewrite(QWEN3MOE, fused, tensors=fuse)
    ids = [1, 50, 120, 7, 300, 33]
    with minirt.load(str(QWEN3MOE), n_ctx=16, backend="native", device="cpu") as a, \
            minirt.load(str(fused), n_ctx=16, backend="native", device="cpu") as b:
        assert "blk.0.ffn_gate_up_exps.weight" in b.model.file.tensors
        np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_leading_dense_blocks_use_the_dense_mlp(tmp_path):
    """``leading_dense_block_count`` = 1: layer 0 is the dense ``ffn_gate/up/down`` MLP. Its tensors
    here are expert 3's matrices, so the layer equals the MoE with expert 3 alone at weight 1."""
    _need(QWEN3MOE)

    def dense(ts):
        out = list(ts)
        for n, d, q in ts:
            if n.startswith("blk.0.ffn_") and n.endswith("_exps.weight"):
                out.append((n.replace("_exps", ""), np.ascontiguousarray(d[3]), q))
        return out

    path = tmp_path / "dense.gguf"
    _rewrite(QWEN3MOE, path, meta={"qwen3moe.leading_dense_block_count": 1,
                                   "qwen3moe.feed_forward_length": 256}, tensors=dense)
    with mgguf.open(path) as f:
        desc = describe(f)
        assert isinstance(desc.blocks[0].mlp, MLP) and isinstance(desc.blocks[1].mlp, MoE)
        moe = describe(mgguf.open(QWEN3MOE)).blocks[0].mlp
        x = np.random.default_rng(0).normal(size=(5, 256)).astype(np.float32)
        be = ReferenceBackend()
        mlp = desc.blocks[0].mlp
        got = be.matmul(be.act_mul(be.matmul(x, mlp.gate), be.matmul(x, mlp.up), "silu"), mlp.down)
        want = be.matmul(be.act_mul(be.matmul(x, moe.gate[3]), be.matmul(x, moe.up[3]), "silu"), moe.down[3])
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("meta,tensor_drop,match", [
    ({"qwen3moe.expert_used_count": 9}, None, "expert_used_count"),
    ({"qwen3moe.expert_count": None}, None, "expert_count"),
    ({"qwen3moe.expert_count": 3}, None, "ffn_gate_inp"),
    ({}, "blk.1.ffn_down_exps.weight", "ffn_down_exps"),
])
def test_inconsistent_moe_files_raise_typed_errors(tmp_path, meta, tensor_drop, match):
    _need(QWEN3MOE)
    path = tmp_path / "bad.gguf"
    _rewrite(QWEN3MOE, path, meta=meta, tensors=lambda ts: [t for t in ts if t[0] != tensor_drop])
    with mgguf.open(path) as f, pytest.raises(GGUFError, match=match):
        describe(f)


# ------------------------------------------------------------------------------------------------
# the native experts kernel (mr_moe_experts)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("folder", ["qwen3moe", "gpt_oss", "olmoe"])
def test_native_experts_match_the_per_op_loop_and_skip_unchosen_experts(folder):
    """``mr_moe_experts`` gives the per-op loop's result (same matmul kernels, same order), and
    never reads an expert no token chose: those experts' bytes are NaN here."""
    from minirt.kernels import NativeBackend, native
    from minirt.kernels.base import Backend

    if not native.available():
        pytest.skip("native kernels unavailable")
    path = ARCH_DIR / folder / "model-f16.gguf"
    _need(path)
    with mgguf.open(path) as f:
        m = describe(f).blocks[1].mlp
        be = NativeBackend()
        try:
            native.ExpertSet(m)
        except minirt.BackendError as e:
            pytest.skip(str(e))  # an extension built before mr_moe_experts
        x = np.random.default_rng(1).normal(size=(9, m.down[0].out_features)).astype(np.float32)
        ids, w = route(be.matmul(x, m.router.gate) + (m.router.gate.bias if m.router.gate.bias is not None else 0),
                       m.router)
        ref = Backend.moe_experts(be, x, m, ids, w)
        got = be.moe_experts(x, m, ids, w)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        unused = sorted(set(range(m.n_expert)) - set(ids.reshape(-1).tolist()))
        if not unused:
            ids, w = ids[:1], w[:1]  # one token: the others' experts are unchosen
            x = x[:1]
            ref = Backend.moe_experts(be, x, m, ids, w)
            unused = sorted(set(range(m.n_expert)) - set(ids.reshape(-1).tolist()))
        for e in unused:
            for lins in (m.gate, m.up, m.down):
                if lins is not None:
                    lins[e].w = np.full_like(lins[e].w, 0xFF)  # F16 NaN in every element
        got = NativeBackend().moe_experts(x, m, ids, w)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_fused_step_checks_experts_beside_a_dense_mlp():
    """Gemma 4's experts beside a dense MLP in the fused step: a router scale or per-expert scale of the wrong
    length and a norm C does not compute are refused before C sees a pointer (typed errors, no crash)."""
    import copy

    from minirt.blocks import Norm, ParallelMoE
    from minirt.errors import BackendError, InvalidRequestError
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    with minirt.load(str(ARCH_DIR / "gemma4moe" / "model-q8_0.gguf"), n_ctx=64, backend="native") as llm:
        blocks, m = llm.model.desc.blocks, llm.model
        keys = [r.key() for r in m.ropes]
        index = [keys.index(b.attn.rope.key()) if b.attn.rope is not None else -1 for b in blocks]
        i = next(j for j, b in enumerate(blocks) if isinstance(b.mlp, ParallelMoE))
        native.LayerStack(blocks, index)  # as loaded: accepted

        def stack(mutate):
            bs = list(blocks)
            bs[i] = copy.deepcopy(blocks[i])
            mutate(bs[i].mlp)
            native.LayerStack(bs, index)

        with pytest.raises(InvalidRequestError, match="router scale"):
            stack(lambda p: setattr(p, "router_scale", p.router_scale[:-1]))
        with pytest.raises(InvalidRequestError, match="expert scale"):
            stack(lambda p: setattr(p, "expert_scale", np.ones(p.moe.n_expert + 1, np.float32)))
        with pytest.raises(InvalidRequestError, match="post_2 norm weight"):
            stack(lambda p: setattr(p.post_2, "weight", p.post_2.weight[:3]))
        with pytest.raises(BackendError, match="beside a dense MLP"):
            stack(lambda p: setattr(p, "router_norm", Norm(np.ones(blocks[i].attn.wo.out_features, np.float32),
                                                           p.router_norm.eps)))


@pytest.mark.parametrize("folder", ["qwen3moe", "qwen2moe", "olmoe", "granitemoe", "lfm2moe", "nemotron_h_moe",
                                    "granitehybrid", "gemma4moe"])
def test_fused_decode_step_runs_the_experts(folder):
    """Mixtures of experts decode in the fused native step (``mr_decode_layers`` with ``mr_layer.moe``: router,
    routing in C, the chosen experts' rows only, shared expert and its gate): softmax (qwen3moe, olmoe,
    granitemoe) and sigmoid routing with a selection bias (lfm2moe, nemotron_h_moe: also squared-ReLU experts
    and shared expert, scaled weights), gated shared experts (qwen2moe), Mamba-2 layers around them
    (granitehybrid), Gemma 4's experts beside a dense MLP (``mr_layer.moe_beside``: own norms, a router reading
    the scaled RMS-normed residual, per-expert output scales); two sequences step together and match the
    per-op reference (routers here are decisive, so both pick the same experts)."""
    from minirt.kernels import native

    if not native.available():
        pytest.skip("native kernels unavailable")
    path = str(ARCH_DIR / folder / "model-q8_0.gguf")
    ref = np.load(ARCH_DIR / folder / "ref.npz")
    with minirt.load(path, n_ctx=64, backend="native") as fused, \
            minirt.load(path, n_ctx=64, backend="reference") as per_op:
        check_fused_decode(fused.model, per_op.model, ref["tokens"][0][:14], ref["tokens"][1][:9], steps=6)
