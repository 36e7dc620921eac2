"""Every supported architecture on the CUDA backend under numba's CUDA simulator, against the CPU
reference backend on the same file.

The architecture fixtures (``tests/data/archs/<folder>/model-q8_0.gguf``, made by llama.cpp's
converter) have hidden size 256, far too slow for the simulator, which runs each CUDA thread as a
Python thread. Each one is shrunk first into a GGUF of the same architecture: every metadata key
and value (tokenizer included) is kept except the sizes (hidden 32, 2 query heads, GQA kept, head
size 16 with the same partial-rotary ratio, MLP width 64), and every tensor of the original is
written again under its own name with the shape those sizes imply and seeded random values
(Q8_0 for matrices, F32 for vectors).

Some descriptions have features the device forward has no kernel for (``CudaBackend._unsupported``):
the backend then returns None from ``forward`` and the host path runs the layers with per-op CUDA
matmuls. ``HOST_PATH`` lists those fixtures with the reason the backend logs; every other fixture
must run the whole forward on the device.

The simulator is set up by importing ``tests.test_cuda_sim`` (which must happen before
``numba.cuda`` is first imported); when that was too late in this process the tests run in a child
pytest process (``test_arch_suite_in_subprocess``).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

import minirt
from minirt.archs import Segment, build, supported
from minirt.forward import kv_cache_for
from minirt.kernels import ReferenceBackend
from minirt.kv_cache import KVCache
from tests.arch_parity import ARCH_DIR

# importing test_cuda_sim selects the simulator (minirt and gguf above do not import numba.cuda);
# _fast_thread_switching is its autouse fixture, imported so that it applies here too
from tests.test_cuda_sim import (  # noqa: F401
    FWD_TOL,
    IN_PROCESS,
    _fast_launch,
    _fast_thread_switching,
    _rel,
    in_sim,
)

D, H, DK, F = 32, 2, 16, 64  # the shrunk sizes: hidden, query heads, head size, MLP width
SG, SV, SK = 1, 2, 16  # Qwen3.5's delta-net: key heads, value heads, head size
E = 32  # per-layer input width (Gemma 4; a Q8_0 row needs 32)
N_CTX = 16

# fixture folder -> what CudaBackend._unsupported names for its description (host path with
# per-op CUDA matmuls); every other folder runs the whole forward on the device
HOST_PATH = {
    "apertus": "activation 'xielu'",
    "cohere2": "an output norm other than RMSNorm",
    "gemma4": "per-layer inputs or layers with different KV shapes",
    "falcon_h1": "attention and a Mamba-2 mixer side by side",
}


def _folders() -> list[str]:
    if not ARCH_DIR.is_dir():
        return []
    return sorted(p.name for p in ARCH_DIR.iterdir() if (p / "model-q8_0.gguf").is_file())


def _gguf_arch(folder: str) -> str:
    r = gguf.GGUFReader(ARCH_DIR / folder / "model-q8_0.gguf")
    return str(r.fields["general.architecture"].contents())


FOLDERS = _folders()


def _one_per_architecture() -> dict[str, str]:
    """GGUF architecture -> the fixture folder named after it (else the first one holding it): the
    simulator is slow, so variants of an architecture (llama_tied, mistral, phi3_short) are left to
    test_archs.py."""
    by_arch: dict[str, str] = {}
    for folder in FOLDERS:
        arch = _gguf_arch(folder)
        if arch not in by_arch or folder == arch.replace("-", "_"):
            by_arch[arch] = folder
    return by_arch


ARCH_FOLDERS = _one_per_architecture()


# ------------------------------------------------------------------------------------------------
# shrinking a fixture
# ------------------------------------------------------------------------------------------------
def _even(x: float) -> int:
    return max(2, 2 * round(x / 2))


def shrink_gguf(src: Path, dst: Path, seed: int = 0) -> None:
    """Write ``dst``: ``src``'s architecture, metadata and tensor names at the sizes D/H/DK/F, with
    seeded random weights. Raises ValueError for a tensor whose shape it cannot derive."""
    r = gguf.GGUFReader(src)
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    arch = str(fields["general.architecture"].contents())

    def orig(key: str, default=None):
        f = fields.get(f"{arch}.{key}")
        return default if f is None else f.contents()

    d0, h0 = int(orig("embedding_length")), int(orig("attention.head_count")) or 1  # 0: pure Mamba-2
    hkv0 = orig("attention.head_count_kv", h0)
    hkv0 = int(max(hkv0) if isinstance(hkv0, list) else hkv0)
    dk0 = int(orig("attention.key_length", d0 // h0))
    dk_swa0 = int(orig("attention.key_length_swa", dk0))
    n_layer = int(orig("block_count"))
    f0 = orig("feed_forward_length")
    f0 = int(next((x for x in f0 if x), 1) if isinstance(f0, list) else f0)  # Nemotron-H: 0 for mixer layers
    rope0 = orig("rope.dimension_count")
    hkv = max(1, H * hkv0 // h0)
    rope_dim = _even(DK * int(rope0) / dk0) if rope0 is not None else DK
    sizes = {"embedding_length": D, "attention.head_count": H, "attention.head_count_kv": hkv,
             "attention.key_length": DK, "attention.value_length": DK, "feed_forward_length": F,
             "rope.dimension_count": rope_dim, "expert_feed_forward_length": F,
             "expert_shared_feed_forward_length": F,
             # Gemma 4: its sliding layers get the same head size here (their RoPE the same ratio)
             "attention.key_length_swa": DK, "attention.value_length_swa": DK,
             "rope.dimension_count_swa": _even(DK * int(orig("rope.dimension_count_swa", dk_swa0)) / dk_swa0),
             "embedding_length_per_layer_input": E,
             "ssm.state_size": SK, "ssm.group_count": SG, "ssm.time_step_rank": SV, "ssm.inner_size": SV * SK}
    n_expert = int(orig("expert_count", 0))

    w = gguf.GGUFWriter(str(dst), arch)
    for key, f in fields.items():
        if key == "general.architecture":
            continue
        val = f.contents()
        short = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if short == "feed_forward_length" and isinstance(val, list):  # per layer (Gemma 4's double-wide MLPs)
            val = [F * (int(x) // f0) for x in val]
        elif short == "attention.head_count_kv" and isinstance(val, list):  # 0: LFM2's convolution layers
            val = [hkv if int(x) else 0 for x in val]
        elif short in sizes:
            val = [sizes[short]] * len(val) if isinstance(val, list) else sizes[short]
        sub = f.types[1] if f.types[0] == VT.ARRAY else None
        w.add_key_value(key, val, f.types[0], sub_type=sub)

    rng = np.random.default_rng(seed)
    tensors = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in r.tensors}  # numpy order
    q_rows, kv_rows = H * DK, hkv * DK
    conv_dim = 2 * SG * SK + SV * SK  # Qwen3.5's delta-net convolution channels
    # Mamba-2 (Granite 4.0-H, Nemotron-H, Falcon-H1, pure Mamba-2): SV heads of SK, SG groups of state SK; its
    # convolution has inner + 2 G N = the same number of channels
    mamba = arch in ("granitehybrid", "nemotron_h", "nemotron_h_moe", "falcon-h1", "mamba2")

    def shape_of(name: str, shape0: tuple[int, ...]) -> tuple[int, ...]:
        base = re.sub(r"^blk\.\d+\.", "", name)
        kind, _, part = base.rpartition(".")
        if base in ("ssm_a", "ssm_d"):  # −exp(A_log) and D per (value) head (names without ".weight")
            return (SV,)
        if not kind:  # Falcon-H1's ffn_norm: a name without ".weight"
            kind, part = base, "weight"
        if mamba and kind == "ssm_in":  # z, xBC, dt
            return (2 * SV * SK + 2 * SG * SK + SV, D)
        if mamba and kind == "ssm_norm":  # over the inner size
            return (SV * SK,)
        if kind == "ssm_conv1d" and part == "bias":
            return (conv_dim,)
        if kind in ("ssm_dt", "ssm_beta", "ssm_alpha"):
            return (SV,) if part == "bias" else (SV, D)
        if kind == "ssm_ba":  # Qwen3-Next: beta and alpha rows of every value head
            return (2 * SV, D)
        if kind == "ssm_conv1d":
            return (conv_dim, shape0[1])
        if kind == "ssm_norm":
            return (SK,)
        if kind == "ssm_out":
            return (D, SV * SK)
        if kind == "attn_gate":
            return (SV * SK, D)
        if kind == "attn_qkv" and (arch.startswith("qwen35") or arch == "qwen3next"):
            return (conv_dim, D)
        if kind == "attn_q" and shape0[0] == 2 * h0 * dk0:  # Qwen3.5: each head's query and output gate
            return (2 * q_rows, D)
        if kind in ("token_embd", "output"):
            return (shape0[0], D)
        if kind in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
            return (rope_dim // 2,)
        if kind in ("attn_q_norm", "attn_k_norm"):  # per head, or over the whole projection
            per_head = shape0[0] in (dk0, dk_swa0)
            return (DK,) if per_head else ((q_rows,) if kind == "attn_q_norm" else (kv_rows,))
        if kind == "per_layer_proj_norm":
            return (E,)
        if kind == "per_layer_token_embd":
            return (shape0[0], n_layer * E)
        if kind == "per_layer_model_proj":
            return (n_layer * E, D)
        if kind in ("inp_gate", "proj"):
            return (E, D) if kind == "inp_gate" else (D, E)
        if kind == "layer_output_scale":
            return (1,)
        if kind == "shortconv.conv":  # (d, taps)
            return (D, shape0[1])
        if kind in ("shortconv.in_proj", "shortconv.out_proj"):
            return (3 * D if kind.endswith("in_proj") else D, D)
        if kind.endswith("_norm"):
            return (D,)
        if kind == "attn_sinks":
            return (H,)
        if kind == "ffn_gate_inp_shexp":
            return (D,)
        if kind in ("ffn_gate_inp", "exp_probs_b"):  # the router (n_expert, D) and its biases
            return (n_expert,) if part == "bias" else (n_expert, D)
        if kind.endswith("_exps"):  # experts (n_expert, rows, cols) and their biases (n_expert, rows)
            rows = D if kind == "ffn_down_exps" else F * (2 if kind == "ffn_gate_up_exps" else 1)
            return (n_expert, rows) if part == "bias" else (n_expert, rows, F if kind == "ffn_down_exps" else D)
        if kind.endswith("_shexp") and orig("expert_shared_feed_forward_length") is not None:  # its width is F
            return (D, F) if kind == "ffn_down_shexp" else (F, D)
        kind = kind.removesuffix("_shexp")
        rows = {"attn_q": q_rows, "attn_k": kv_rows, "attn_v": kv_rows, "attn_qkv": q_rows + 2 * kv_rows,
                "attn_output": D, "ffn_gate": F * (shape0[0] // f0), "ffn_down": D}.get(kind)
        if kind == "ffn_up":  # F rows, or a fused gate+up of 2F
            rows = F * (shape0[0] // f0)
        if rows is None:
            raise ValueError(f"{src}: no rule for the shape of tensor {name!r} {shape0}")
        if part == "bias":
            return (rows,)
        cols = {"attn_output": q_rows, "ffn_down": F * (shape0[-1] // f0)}.get(kind, D)
        return (rows, cols)

    for name, shape0 in tensors.items():
        shape = shape_of(name, shape0)
        kind = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight").removesuffix(".bias")
        if "shortconv.conv." in name or "ssm_conv1d." in name:  # taps stay F32, as the converter writes them
            w.add_tensor(name, (rng.normal(size=shape) * 0.5).astype(np.float32))
        elif name.endswith(".ssm_a"):  # negative (a log decay rate)
            w.add_tensor(name, -rng.uniform(0.5, 2.0, shape).astype(np.float32))
        elif len(shape) == 3 or (len(shape) == 2 and "bias" not in name):
            arr = rng.normal(0.0, 1.0 if kind in ("token_embd", "output") else shape[-1] ** -0.5, shape)
            w.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            if kind.startswith("rope_"):
                arr = rng.uniform(1.0, 4.0, shape)  # frequency divisors: positive
            elif kind.endswith("_norm") or kind == "layer_output_scale":
                arr = 1.0 + 0.1 * rng.normal(size=shape)
            else:
                arr = 0.1 * rng.normal(size=shape)
            w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------
def test_every_supported_architecture_has_a_fixture():
    """The parity test below covers minirt.archs.supported() completely."""
    assert FOLDERS, f"no architecture fixtures under {ARCH_DIR}"
    # encoders (embedding / rerank models) have their fixtures under tests/data/embed and are
    # compared with transformers by tests/test_embeddings.py; this file covers the decoders on the
    # device, and the CUDA backend declines non-causal attention (per-op host path)
    import json

    encoders = {json.loads(m.read_text())["gguf"]["f16"]["metadata"]["general.architecture"]
                for m in (ARCH_DIR.parent / "embed").glob("*/meta.json")}
    missing = sorted(set(supported()) - set(ARCH_FOLDERS) - encoders)
    assert not missing, f"supported without a fixture under {ARCH_DIR}: {missing}"
    assert set(HOST_PATH) <= set(ARCH_FOLDERS.values()), sorted(set(HOST_PATH) - set(ARCH_FOLDERS.values()))


@pytest.mark.parametrize("arch,rope_dim,q_norm", [("phi3", 12, None), ("glm4", 8, None), ("olmo2", DK, (H * DK,))])
def test_shrunk_file_keeps_metadata_and_tensor_names(arch, rope_dim, q_norm, tmp_path):
    """The shrunk GGUF has the original's keys, tokenizer and tensor names; only sizes change, and
    ratios such as a partial rotary dimension (phi3 0.75, glm4 0.5) or a q norm over the whole
    projection (olmo2) are kept."""
    if arch not in ARCH_FOLDERS:
        pytest.fail(f"no {arch} fixture under {ARCH_DIR}")
    src = ARCH_DIR / ARCH_FOLDERS[arch] / "model-q8_0.gguf"
    dst = tmp_path / "small.gguf"
    shrink_gguf(src, dst)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    def keys(r):
        return {k for k in r.fields if not k.startswith("GGUF.")}

    assert keys(a) == keys(b)
    assert b.fields["tokenizer.ggml.tokens"].contents() == a.fields["tokenizer.ggml.tokens"].contents()
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    f = minirt.gguf.open(dst)
    m = build(f, ReferenceBackend(), N_CTX)
    c, attn = m.cfg, m.desc.blocks[0].attn
    assert (c.n_embd, c.n_head, c.n_head_kv, c.head_dim_k, c.n_ff) == (D, H, 1, DK, F)
    assert attn.rope.dim == rope_dim
    assert (attn.q_norm.weight.shape if attn.q_norm is not None else None) == q_norm
    f.close()


def _cache(m) -> KVCache:
    return kv_cache_for(m.cfg, N_CTX)


def _shrunk_pair(folder: str, tmp_path: Path):
    """(file, CUDA backend, CPU model, device model) over the shrunk fixture of ``folder``."""
    from minirt.kernels.cuda.backend import CudaBackend

    path = tmp_path / f"{folder}.gguf"
    shrink_gguf(ARCH_DIR / folder / "model-q8_0.gguf", path, seed=sum(map(ord, folder)))
    f = minirt.gguf.open(path)
    be = CudaBackend(f, allow_simulator=True, launch=_fast_launch())
    return f, be, build(f, ReferenceBackend(), N_CTX), build(f, be, N_CTX)


@in_sim
@pytest.mark.parametrize("arch", sorted(ARCH_FOLDERS))
def test_architecture_on_device_matches_cpu(arch, tmp_path, caplog):
    """Prefill (logits of every position) then two decode steps: the CUDA backend's logits match
    the reference backend's; the device forward runs unless HOST_PATH says why it cannot."""
    folder = ARCH_FOLDERS[arch]
    if arch not in supported():
        pytest.skip(f"architecture {arch!r} is not supported by minirt")
    f, be, cpu, dev = _shrunk_pair(folder, tmp_path)
    try:
        with caplog.at_level(logging.INFO, logger="minirt.kernels.cuda.backend"):
            plan = be._plan(dev)
        if folder in HOST_PATH:
            assert plan is None, f"{folder}: the device forward now runs; remove it from HOST_PATH"
            assert HOST_PATH[folder] in caplog.text, caplog.text
            # the host path's matmuls read device copies: every matrix (each expert a view of its
            # 3-D tensor's device copy) is in VRAM; a 1-D gate vector (qwen2moe's shared-expert
            # gate, (1, d)) stays on the host
            on_host = [lin.name for lin in dev.desc.linears() if be.weight(lin) is None
                       and len(f.tensors[lin.parent[0] if lin.parent else lin.name].shape) >= 2]
            assert not on_host, on_host[:5]
        else:
            assert plan is not None, f"{folder}: no device forward: {caplog.text}"
        ids = np.array([1, 17, 270, 5, 99], dtype=np.int64) % cpu.cfg.n_vocab
        cc, gc = _cache(cpu), _cache(dev)
        ref = cpu.forward(ids, [Segment(cc, len(ids), "all")])[0]
        got = dev.forward(ids, [Segment(gc, len(ids), "all")])[0]
        assert got.shape == ref.shape == (len(ids), cpu.cfg.n_vocab)
        assert _rel(got, ref) < FWD_TOL, (folder, "prefill", _rel(got, ref))
        for tok in (11, 260):
            ref = cpu.forward(np.array([tok]), [Segment(cc, 1, "last")])[0]
            got = dev.forward(np.array([tok]), [Segment(gc, 1, "last")])[0]
            assert _rel(got, ref) < FWD_TOL, (folder, "decode", _rel(got, ref))
            assert got.argmax() == ref.argmax(), folder
        assert gc.n_past == cc.n_past == len(ids) + 2
    finally:
        be.close()
        f.close()


@pytest.mark.skipif(IN_PROCESS, reason="the simulator tests ran in this process")
def test_arch_suite_in_subprocess():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1],
                       timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def _assert_state_close(got: KVCache, ref: KVCache, what: str) -> None:
    g, r = got.export_state(), ref.export_state()
    assert g.shape == r.shape and np.abs(g - r).max() <= 2e-3 * max(1.0, np.abs(r).max()), what


@in_sim
@pytest.mark.parametrize("folder", ["qwen35", "granitehybrid", "lfm2"])
def test_hybrid_state_on_device(folder, tmp_path, monkeypatch):
    """A hybrid model's per-sequence state on the device (the delta-net's / Mamba-2's recurrent state, LFM2's
    convolution rows) against the CPU pass on the same file: two prompts prefilled in one batch give what
    each gives alone; the snapshot a prefill leaves (the state before its last token) lets a conversation
    be truncated there and continued differently; export_state after device steps is the CPU's; a prefix
    copied to a fresh cache continues on the device; eviction under a VRAM budget brings the state back
    to the host first; a step that fails half-way leaves only the snapshot usable, as on the host path."""
    f, be, cpu, dev = _shrunk_pair(folder, tmp_path)
    try:
        assert be._plan(dev) is not None
        V = cpu.cfg.n_vocab
        pa, pb = np.array([1, 17, 270, 5, 99]) % V, np.array([3, 44, 8]) % V
        ca, cb = _cache(cpu), _cache(cpu)
        ref_a = cpu.forward(pa, [Segment(ca, 5, "last")])[0]
        ref_b = cpu.forward(pb, [Segment(cb, 3, "last")])[0]
        ga, gb = _cache(dev), _cache(dev)
        got_a, got_b = dev.forward(np.concatenate([pa, pb]), [Segment(ga, 5, "last"), Segment(gb, 3, "last")])
        assert _rel(got_a, ref_a) < FWD_TOL and _rel(got_b, ref_b) < FWD_TOL, folder
        stateful = ga.has_state
        assert ga.device_state == stateful  # the live state stays on the device after a step
        if stateful:
            assert ga._snap_pos == ca._snap_pos == 4
            for s_got, s_ref in zip(ga._snap, ca._snap):
                for x, y in zip(s_got or (), s_ref or ()):
                    assert np.abs(x - y).max() <= 2e-3 * max(1.0, np.abs(y).max()), folder
            _assert_state_close(ga, ca, folder)  # brings the device's live state back
            assert not ga.device_state
        for c in (ga, ca):  # continue from the state before the prompt's last token, differently
            c.truncate(4)
        ref = cpu.forward(np.array([11]), [Segment(ca, 1, "last")])[0]
        got = dev.forward(np.array([11]), [Segment(ga, 1, "last")])[0]
        assert _rel(got, ref) < FWD_TOL and got.argmax() == ref.argmax(), folder
        # a prefix copied on the host into a fresh cache continues on the device
        gc = _cache(dev)
        gc.copy_prefix_from(ga, 5)
        ref = cpu.forward(np.array([260]), [Segment(ca, 1, "last")])[0]
        got = dev.forward(np.array([260]), [Segment(gc, 1, "last")])[0]
        assert _rel(got, ref) < FWD_TOL, folder
        # eviction: a budget that holds one sequence; the evicted one's state and rows go to the host first
        be.kv_vram_bytes = be._mirrors[gc].nbytes
        dev.forward(np.array([7, 8]), [Segment(_cache(dev), 2, "none")])
        assert gc not in be._mirrors and not gc.device_state and gc.device_rows is None
        if stateful:
            _assert_state_close(gc, ca, folder)
        ref = cpu.forward(np.array([12]), [Segment(ca, 1, "last")])[0]
        got = dev.forward(np.array([12]), [Segment(gc, 1, "last")])[0]  # uploaded again
        assert _rel(got, ref) < FWD_TOL, folder
        if not stateful:
            return
        # a step that fails half-way: the state is unusable until the cache goes back to its snapshot
        be.kv_vram_bytes = 8 << 30
        real = be._launch

        def failing(kern, *a):
            if kern is be.k.delta_scan or kern is be.k.ssm_scan:
                raise RuntimeError("device fault")
            return real(kern, *a)

        monkeypatch.setattr(be, "_launch", failing)
        with pytest.raises(RuntimeError):
            dev.forward(np.array([5, 6, 7]), [Segment(gc, 3, "none")])
        monkeypatch.setattr(be, "_launch", real)
        with pytest.raises(ValueError, match="recurrent state"):
            dev.forward(np.array([5]), [Segment(gc, 1, "last")])
        n = gc.valid_prefix(gc.n_past)
        assert n == 0  # this cache's snapshot went with the prefix copy: it starts over
        gc.truncate(n)
        cc = _cache(cpu)
        ids = np.array([9, 10, 11]) % V
        ref = cpu.forward(ids, [Segment(cc, 3, "last")])[0]
        got = dev.forward(ids, [Segment(gc, 3, "last")])[0]
        assert _rel(got, ref) < FWD_TOL, folder
    finally:
        be.close()
        f.close()
