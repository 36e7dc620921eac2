"""LoRA adapters (minirt.lora) on a tiny decoder: logits and greedy generation with an adapter equal the
float64 reference of the merged weights ``W + s·B·A`` (the layout llama.cpp's adapters use, written
here with gguf-py), the fused decode step is bypassed, and broken adapter files get typed errors.

jina-embeddings-v3's task adapters against jina's own model are in tests/test_embeddings.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import minirt
from minirt.errors import GGUFError, InvalidRequestError
from tests.tiny_models import TinySpec, reference_llama, write_tiny

RANK = 3
ALPHA = 6.0


def _write_adapter(path: Path, arch: str, tensors: dict[str, np.ndarray], general_type: str = "adapter") -> None:
    """An adapter GGUF in llama.cpp's layout holding ``tensors`` (``<weight>.lora_a`` / ``.lora_b``)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(general_type)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", ALPHA)
    w.add_string("adapter.lora.task_name", "test-task")
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _adapter(path: Path, spec: TinySpec, names: list[str], *, arch: str = "llama", seed: int = 7,
             drop: str | None = None, bad_shape: str | None = None, nan: bool = False,
             general_type: str = "adapter", extra: dict[str, np.ndarray] | None = None
             ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random factors for the weights ``names`` written by :func:`_write_adapter`; returns {name: (A, B)}
    as numpy arrays in minirt's order (token_embd flipped: A (n_vocab, r), B (n_embd, r))."""
    rng = np.random.default_rng(seed)
    out, tensors = {}, {}
    for name in names:
        W = spec.weights[name]
        if name == "token_embd.weight":
            a, b = rng.normal(0, 0.3, (W.shape[0], RANK)), rng.normal(0, 0.3, (W.shape[1], RANK))
        else:
            a, b = rng.normal(0, 0.3, (RANK, W.shape[1])), rng.normal(0, 0.3, (W.shape[0], RANK))
        a, b = a.astype(np.float32), b.astype(np.float32)
        if nan and name == names[-1]:
            a[0, 0] = np.nan
        if bad_shape == name:
            b = b[:-1]
        out[name] = (a, b)
        if drop != name + ".lora_a":
            tensors[name + ".lora_a"] = a
        if drop != name + ".lora_b":
            tensors[name + ".lora_b"] = b
    _write_adapter(path, arch, {**tensors, **(extra or {})}, general_type=general_type)
    return out


def _merged(spec: TinySpec, pairs: dict[str, tuple[np.ndarray, np.ndarray]], scale: float) -> TinySpec:
    """The spec whose weights are W + s·B·A (token embedding: E + s·A·Bᵀ), s = scale · alpha / rank."""
    s = scale * ALPHA / RANK
    m = TinySpec(**{k: v for k, v in spec.__dict__.items() if k != "weights"})
    m.weights = dict(spec.weights)
    for name, (a, b) in pairs.items():
        delta = a.astype(np.float64) @ b.T.astype(np.float64) if name == "token_embd.weight" else \
            b.astype(np.float64) @ a.astype(np.float64)
        m.weights[name] = spec.weights[name] + s * delta
    return m


NAMES = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.1.ffn_down.weight",
         "blk.1.attn_output.weight", "output.weight"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("lora")
    spec = write_tiny(d / "base.gguf", TinySpec(seed=3))
    pairs = _adapter(d / "adapter.gguf", spec, NAMES)
    return d, spec, pairs


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_logits_equal_the_merged_reference(tiny, scale: float) -> None:  # type: ignore[no-untyped-def]
    d, spec, pairs = tiny
    ids = [1, 5, 9, 14, 3, 22, 7, 11]
    lora = str(d / "adapter.gguf") if scale == 1.0 else (str(d / "adapter.gguf"), scale)
    with minirt.load(str(d / "base.gguf"), pull=False, lora=lora, cache_type_k="f32", cache_type_v="f32") as llm:
        got = llm.logits(ids)
        assert llm.lora_adapters[0].info()["task_name"] == "test-task"
    ref = reference_llama(_merged(spec, pairs, scale), ids)
    base = reference_llama(spec, ids)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 2e-3, err
    # the adapter matters: the base model's logits are far from these
    assert np.abs(base - ref).max() / np.abs(ref).max() > 50 * err


def test_scale_zero_is_the_base_model(tiny) -> None:  # type: ignore[no-untyped-def]
    d, spec, _ = tiny
    ids = [1, 4, 8, 15]
    with minirt.load(str(d / "base.gguf"), pull=False) as a, \
            minirt.load(str(d / "base.gguf"), pull=False, lora=[(str(d / "adapter.gguf"), 0.0)]) as b:
        np.testing.assert_allclose(a.logits(ids), b.logits(ids), rtol=1e-5, atol=1e-5)


def test_greedy_generation_follows_the_merged_reference(tiny) -> None:  # type: ignore[no-untyped-def]
    """Decode steps run layer by layer with the adapter (not the fused native step, which has none)."""
    d, spec, pairs = tiny
    prompt = [1, 6, 2 + 30, 17]
    with minirt.load(str(d / "base.gguf"), pull=False, lora=str(d / "adapter.gguf"),
                     cache_type_k="f32", cache_type_v="f32") as llm:
        assert llm.model.native_stack is None
        out = llm.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    seq = prompt + list(out.token_ids)
    ref = reference_llama(_merged(spec, pairs, 1.0), seq)
    for i, tok in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + i]
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > 1e-3:  # a decisive position: minirt's token is the reference's argmax
            assert tok == int(np.argmax(row)), (i, tok, int(np.argmax(row)))


def test_state_fingerprint_depends_on_the_adapter(tiny) -> None:  # type: ignore[no-untyped-def]
    d, _, _ = tiny
    with minirt.load(str(d / "base.gguf"), pull=False) as a, \
            minirt.load(str(d / "base.gguf"), pull=False, lora=str(d / "adapter.gguf")) as b, \
            minirt.load(str(d / "base.gguf"), pull=False, lora=[(str(d / "adapter.gguf"), 0.5)]) as c:
        assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3


@pytest.mark.parametrize("case", ["wrong_arch", "missing_half", "bad_shape", "nan", "not_adapter", "unknown_tensor",
                                  "stray_tensor", "model_file"])
def test_broken_adapters_are_refused(tiny, tmp_path, case: str) -> None:  # type: ignore[no-untyped-def]
    d, spec, _ = tiny
    p = tmp_path / "bad.gguf"
    names = ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"]
    want = {"wrong_arch": "model is 'llama'", "missing_half": "lacks its lora_b", "bad_shape": "do not fit",
            "nan": "NaN", "not_adapter": "not a LoRA adapter", "unknown_tensor": "not in the model",
            "stray_tensor": "neither a .lora_a", "model_file": "not a LoRA adapter"}[case]
    if case == "model_file":
        p = d / "base.gguf"
    elif case == "unknown_tensor":
        _adapter(p, spec, names, extra={"blk.9.attn_q.weight.lora_a": np.zeros((RANK, 64), np.float32),
                                        "blk.9.attn_q.weight.lora_b": np.zeros((64, RANK), np.float32)})
    else:
        _adapter(p, spec, names, arch="qwen2" if case == "wrong_arch" else "llama",
                 drop="blk.1.ffn_down.weight.lora_b" if case == "missing_half" else None,
                 bad_shape="blk.0.attn_q.weight" if case == "bad_shape" else None, nan=case == "nan",
                 general_type="model" if case == "not_adapter" else "adapter",
                 extra={"blk.0.attn_q.weight.extra": np.zeros(4, np.float32)} if case == "stray_tensor" else None)
    with pytest.raises(GGUFError, match=want):
        minirt.load(str(d / "base.gguf"), pull=False, lora=str(p))


def test_an_adapter_is_not_a_model(tiny) -> None:  # type: ignore[no-untyped-def]
    d, _, _ = tiny
    with pytest.raises(GGUFError, match="is a LoRA adapter, not a model"):
        minirt.load(str(d / "adapter.gguf"), pull=False)


@pytest.mark.parametrize("bad", [3, [("a.gguf", "x")], [("a.gguf", float("nan"))], [("a", 1.0, 2)], [b"a.gguf"]])
def test_bad_lora_arguments(tiny, bad) -> None:  # type: ignore[no-untyped-def]
    d, _, _ = tiny
    with pytest.raises(InvalidRequestError):
        minirt.load(str(d / "base.gguf"), pull=False, lora=bad)


def test_set_scales_equals_loading_with_them(tiny) -> None:  # type: ignore[no-untyped-def]
    """``set_lora_scales`` (llama-server's POST /lora-adapters): the logits of loading with that
    scale; unnamed adapters get 0 (the base model); the prefix cache and fingerprint follow."""
    d, _, _ = tiny
    ids = [1, 5, 9, 14, 3]
    with minirt.load(str(d / "base.gguf"), pull=False, lora=str(d / "adapter.gguf")) as llm, \
            minirt.load(str(d / "base.gguf"), pull=False, lora=[(str(d / "adapter.gguf"), 0.5)]) as half, \
            minirt.load(str(d / "base.gguf"), pull=False) as base:
        llm.generate(ids, max_tokens=2, temperature=0.0)  # leaves a cached prefix
        fp = llm.fingerprint()
        llm.set_lora_scales({0: 0.5})
        assert llm.cache_pool.tokens() == 0 and llm.fingerprint() == half.fingerprint() != fp
        np.testing.assert_allclose(llm.logits(ids), half.logits(ids), rtol=1e-5, atol=1e-5)
        llm.set_lora_scales({})
        np.testing.assert_allclose(llm.logits(ids), base.logits(ids), rtol=1e-5, atol=1e-5)
        assert llm.lora_adapters[0].info()["scale"] == 0.0
        for bad in ({1: 1.0}, {0: float("inf")}, {"0": 1.0}, [(0, 1.0)]):
            with pytest.raises(InvalidRequestError):
                llm.set_lora_scales(bad)  # type: ignore[arg-type]


def test_lora_adapters_routes(tiny) -> None:  # type: ignore[no-untyped-def]
    httpx = pytest.importorskip("httpx", reason="the server tests need httpx")
    pytest.importorskip("starlette", reason="the server needs starlette")
    from minirt.server import BackgroundServer, build_app

    d, _, _ = tiny
    ids = [1, 5, 9, 14, 3]
    with minirt.load(str(d / "base.gguf"), pull=False, lora=str(d / "adapter.gguf")) as llm, \
            minirt.load(str(d / "base.gguf"), pull=False) as base:
        want_base = base.generate(ids, max_tokens=4, temperature=0.0, ignore_eos=True).token_ids
        app = build_app(llm, model_id="tiny")
        with BackgroundServer(app) as srv:
            got = httpx.get(srv.url + "/lora-adapters", timeout=30).json()
            assert got == [{"id": 0, "path": str(d / "adapter.gguf"), "scale": 1.0, "task_name": "test-task",
                            "prompt_prefix": ""}]
            r = httpx.post(srv.url + "/lora-adapters", json=[{"id": 0, "scale": 0.0}], timeout=30)
            assert r.status_code == 200 and r.json() == {"success": True}
            assert httpx.get(srv.url + "/lora-adapters", timeout=30).json()[0]["scale"] == 0.0
            r = httpx.post(srv.url + "/completion", json={"prompt": ids, "n_predict": 4, "temperature": 0,
                                                          "ignore_eos": True}, timeout=60)
            assert r.json()["tokens"] == want_base
            for bad in ({"id": 0}, [{"id": 7, "scale": 1}], [{"id": [0], "scale": 1}], [3]):
                r = httpx.post(srv.url + "/lora-adapters", json=bad, timeout=30)
                assert r.status_code == 400, (bad, r.text)


def test_lora_on_expert_tensors_is_refused(tmp_path) -> None:
    """A mixture of experts runs in the backend as a whole (router, experts, shared expert): an adapter on
    its router is refused with a typed error, one on attention is taken."""
    from minirt.errors import UnsupportedArchitectureError

    src = Path(__file__).parent / "data" / "archs" / "qwen3moe" / "model-f16.gguf"
    if not src.exists():
        pytest.skip("no qwen3moe fixture")
    f = minirt.gguf.open(str(src))

    def adapter(path: Path, name: str) -> str:
        out, inp = f.tensors[name].shape
        _write_adapter(path, "qwen3moe", {name + ".lora_a": np.zeros((2, inp), np.float32),
                                          name + ".lora_b": np.zeros((out, 2), np.float32)})
        return str(path)

    with pytest.raises(UnsupportedArchitectureError, match="mixture-of-experts"):
        minirt.load(str(src), pull=False, lora=adapter(tmp_path / "a.gguf", "blk.0.ffn_gate_inp.weight"))
    with minirt.load(str(src), pull=False, lora=adapter(tmp_path / "b.gguf", "blk.0.attn_q.weight")) as llm:
        assert len(llm.lora_adapters) == 1
    f.close()
