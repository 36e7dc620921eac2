"""The CUDA backend on a real GPU: every kernel at the real models' sizes against numpy, the device
forward pass against the CPU backend and llama.cpp's greedy references on both real models, CUDA
graph replay against eager launches, and the VRAM budget.

Skipped, with the reason, where no usable GPU (or numba-cuda) is present. Real models come from
``$MINIRT_QWEN_GGUF`` / ``$MINIRT_GEMMA_GGUF`` or the registry's cache (never pulled here).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from minirt.kernels import cuda as cuda_pkg

pytestmark = pytest.mark.gpu

if not cuda_pkg.available():
    pytest.skip(f"no usable GPU: {cuda_pkg.unavailable_reason()}", allow_module_level=True)

import minirt  # noqa: E402
from minirt.archs.base import Segment, build  # noqa: E402
from minirt.kernels import get_backend  # noqa: E402
from minirt.kernels.cuda import selfcheck  # noqa: E402
from minirt.kernels.cuda.backend import CudaBackend  # noqa: E402
from minirt.kv_cache import KVCache  # noqa: E402
from tests.conftest import MODEL_NAMES, reference_jsonl  # noqa: E402

ENV = {"qwen": "MINIRT_QWEN_GGUF", "gemma": "MINIRT_GEMMA_GGUF"}


def _model_path(key: str) -> Path:
    p = os.environ.get(ENV[key])
    if p:
        return Path(p)
    from minirt import registry

    try:
        return registry.resolve(MODEL_NAMES[key], pull_missing=False)
    except minirt.MinirtError as e:
        pytest.skip(f"{key} model not available ({e}); set {ENV[key]}")


@pytest.fixture(scope="module")
def bare_backend():
    be = CudaBackend(None)
    yield be
    be.close()


def test_kernels_at_real_sizes(bare_backend):
    res = selfcheck.run_all(bare_backend, np.random.default_rng(0), real=True)
    bad = [str(c) for c in res if not c.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q6_K", "Q8_0"])
def test_numba_gemm_without_cublas(qtype):
    """The tiled quantized GEMM used when CuPy is missing, at a prefill-like size."""
    be = CudaBackend(None, use_cupy=False)
    try:
        c = selfcheck.check_matmul(be, qtype, 896, 1024 if qtype.endswith("_K") else 896, 77,
                                   np.random.default_rng(1), "gemm")
        assert c.ok, str(c)
    finally:
        be.close()


@pytest.fixture(scope="module", params=["qwen", "gemma"])
def pair(request):
    key = request.param
    f = minirt.gguf.open(_model_path(key))
    be = CudaBackend(f)
    cpu = build(f, get_backend())
    dev = build(f, be)
    yield key, cpu, dev, be
    be.close()
    f.close()


def _cache(m, n=256):
    c = m.cfg
    return KVCache(c.n_layer, c.n_head_kv, c.head_dim_k, c.head_dim_v, n)


def _greedy(fwd, m, prompt, n):
    c = _cache(m, len(prompt) + n + 1)
    lg = fwd(np.asarray(prompt), [Segment(c, len(prompt), "last")])[0]
    out = []
    for _ in range(n):
        t = int(np.argmax(lg))
        out.append(t)
        lg = fwd(np.array([t]), [Segment(c, 1, "last")])[0]
    return out


def test_prompt_logits_match_cpu(pair):
    key, cpu, dev, be = pair
    for rec in reference_jsonl(key, "greedy")[:4]:
        ids = rec["prompt_ids"]
        ref = cpu.forward(np.asarray(ids), [Segment(_cache(cpu), len(ids), "all")])[0]
        got = be.forward(dev, np.asarray(ids), [Segment(_cache(dev), len(ids), "all")])[0]
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 2e-2, f"{key}: relative logits error {err:.2e} for {rec['prompt']!r}"
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_greedy_parity_with_llama_cpp_references(pair):
    """First 16 greedy tokens identical to llama.cpp's for >= 90% of the reference prompts."""
    key, cpu, dev, be = pair
    recs = reference_jsonl(key, "greedy")
    same = 0
    for rec in recs:
        want = rec["greedy_ids"][:16]
        got = _greedy(lambda t, s: be.forward(dev, t, s), dev, rec["prompt_ids"], len(want))
        same += got == want
    assert same >= 0.9 * len(recs), f"{key}: {same}/{len(recs)} prompts match"


def test_graph_replay_equals_eager_decode(pair):
    key, cpu, dev, be = pair
    if not be.use_graphs:
        pytest.skip("CUDA graphs unavailable (CuPy missing)")
    eager = CudaBackend(dev.file, use_graphs=False)
    try:
        dev2 = build(dev.file, eager)
        prompt = reference_jsonl(key, "greedy")[0]["prompt_ids"]
        a = _greedy(lambda t, s: be.forward(dev, t, s), dev, prompt, 12)
        b = _greedy(lambda t, s: eager.forward(dev2, t, s), dev2, prompt, 12)
        assert a == b
        c1, c2 = _cache(dev), _cache(dev2)
        for t in [prompt] + [[x] for x in a]:
            l1 = be.forward(dev, np.asarray(t), [Segment(c1, len(t), "last")])[0]
            l2 = eager.forward(dev2, np.asarray(t), [Segment(c2, len(t), "last")])[0]
        assert np.array_equal(l1, l2)
    finally:
        eager.close()


def test_vram_within_gguf_size_plus_kv(pair):
    key, cpu, dev, be = pair
    c = _cache(dev, 1024)
    be.forward(dev, np.arange(512) % 1000 + 10, [Segment(c, 512, "last")])
    for t in range(8):
        be.forward(dev, np.array([100 + t]), [Segment(c, 1, "last")])
    v = be.vram_bytes()
    size = os.path.getsize(dev.file.path)
    assert v["weights"] <= size
    assert v["total"] <= 1.10 * (size + v["kv"]), v  # the target: GGUF size + KV cache + 10%


def test_load_device_cuda_generates_reference_text():
    path = _model_path("qwen")
    rec = reference_jsonl("qwen", "greedy")[0]
    with minirt.load(str(path), device="cuda", n_ctx=512) as llm:
        assert llm.backend.name == "cuda"
        out = llm.generate(rec["prompt_ids"], max_tokens=16, temperature=0.0)
        assert out.token_ids == rec["greedy_ids"][:16]
