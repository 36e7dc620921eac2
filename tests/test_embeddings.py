"""Embeddings and reranking against transformers and llama.cpp (fixtures in tests/data/embed/, made by
tools/embed_fixtures/make_fixtures.py from tiny seeded HF models converted by llama.cpp's converter).

The bar: cosine >= 0.9999 to transformers' sentence-transformers-pooled vectors for F16 files; for the
quantized files, minirt's worst cosine must be no worse than llama.cpp's own on the same file (minus a
rounding margin). Rerankers: the score within 1e-3 (F16) or within llama.cpp's own error (quantized).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

import minirt
from minirt import embedding
from minirt.errors import ContextOverflowError, EmbeddingError, InvalidRequestError

DATA = Path(__file__).parent / "data" / "embed"
MODELS = sorted(p.name for p in DATA.iterdir() if (p / "ref.npz").exists()) if DATA.exists() else []
pytestmark = pytest.mark.skipif(not MODELS, reason="no embedding fixtures (tools/embed_fixtures/make_fixtures.py)")

_loaded: dict[tuple[str, str, str | None], minirt.Model] = {}


def load(name: str, qtype: str = "f16", pooling: str | None = None) -> minirt.Model:
    key = (name, qtype, pooling)
    if key not in _loaded:
        _loaded[key] = minirt.load(str(DATA / name / f"model-{qtype}.gguf"), embedding=True, pooling=pooling,
                                   pull=False)
    return _loaded[key]


def ref(name: str) -> tuple[dict[str, np.ndarray], dict]:
    z = dict(np.load(DATA / name / "ref.npz"))
    return z, json.loads((DATA / name / "meta.json").read_text())


def _seqs(z: dict[str, np.ndarray]) -> list[list[int]]:
    return [z[k].tolist() for k in sorted((k for k in z if k.startswith("tokens_")), key=lambda k: int(k[7:]))]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


CASES = []
for _name in MODELS:
    _meta = json.loads((DATA / _name / "meta.json").read_text())
    for _pool in _meta["poolings"]:
        for _q in _meta["gguf"]:
            CASES.append((_name, _pool, _q))


@pytest.mark.parametrize("name,pooling,qtype", CASES)
def test_against_transformers_and_llamacpp(name: str, pooling: str, qtype: str) -> None:
    z, meta = ref(name)
    seqs = _seqs(z)
    alt = pooling if pooling != meta["poolings"][0] else None
    m = load(name, qtype, alt)
    hf, cpp = z[f"hf_{pooling}"], z.get(f"llamacpp_{pooling}_{qtype}")
    if cpp is None:  # no llama.cpp reference for this file (see the fixture's meta.json): transformers only
        assert qtype == "f16"
        cpp = hf
    if pooling == "rank":
        got = embedding.pool(m, m.model.desc.pooling, embedding.hidden_states(m, seqs))[:, 0]
        err, cpp_err = np.abs(got - hf), np.abs(cpp - hf)
        bar = 1e-3 if qtype == "f16" else max(float(cpp_err.max()) * 1.5, 1e-3)
        assert err.max() <= bar, (err, cpp_err)
        return
    got = m.embed(seqs)  # all sequences in one call: batched into one forward pass
    assert got.shape == hf.shape
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    cos, cpp_cos = _cos(got, hf), _cos(cpp, hf)
    if qtype == "f16":
        assert cos.min() >= 0.9999, cos
    else:
        assert cos.min() >= min(cpp_cos.min(), 0.9999) - 2e-4, (cos, cpp_cos)


LORA_CASES = [(_name, _task, _q) for _name in MODELS
              for _task in json.loads((DATA / _name / "meta.json").read_text()).get("lora", {})
              for _q in json.loads((DATA / _name / "meta.json").read_text())["gguf"]]


@pytest.mark.parametrize("name,task,qtype", LORA_CASES)
def test_task_adapters_against_reference_and_llamacpp(name: str, task: str, qtype: str) -> None:
    """jina-embeddings-v3's task LoRA files (as the converter writes them) against jina's own model
    with that task's adapter: F16 within cosine 0.9999 (the adapter moves the vector further than
    that), quantized files no worse than llama.cpp with the same adapter."""
    z, meta = ref(name)
    seqs = _seqs(z)
    m = minirt.load(str(DATA / name / f"model-{qtype}.gguf"), embedding=True, pull=False,
                    lora=str(DATA / name / meta["lora"][task]["file"]))
    info = m.lora_adapters[0].info()
    assert info["task_name"] == task
    assert info["prompt_prefix"] == meta["hf_config"]["task_instructions"][task]
    got = m.embed(seqs)
    hf, cpp = z[f"hf_mean_lora_{task}"], z[f"llamacpp_mean_lora_{task}_{qtype}"]
    cos, cpp_cos = _cos(got, hf), _cos(cpp, hf)
    if qtype == "f16":
        assert cos.min() >= 0.9999, cos
        assert _cos(z["hf_mean"], hf).min() < 0.9999  # without the adapter the bar is missed
    else:
        assert cos.min() >= min(cpp_cos.min(), 0.9999) - 2e-4, (cos, cpp_cos)


@pytest.mark.parametrize("name", [n for n in MODELS if "rank" not in json.loads((DATA / n / "meta.json").read_text())
                                  ["poolings"]])
def test_batched_equals_one_by_one(name: str) -> None:
    z, _ = ref(name)
    m = load(name)
    seqs = _seqs(z)
    together = m.embed(seqs)
    alone = np.stack([m.embed(s)[0] for s in seqs])
    np.testing.assert_allclose(together, alone, atol=2e-5)


def test_concurrent_calls_share_forward_passes() -> None:
    """Sequences of concurrent embed calls are packed into shared passes (EmbedQueue): eight
    threads queued behind a held step lock take at most two passes (what the first leader took
    before the lock, then the rest together), and each gets what it gets alone."""
    import threading
    import time

    name = next((n for n in MODELS if n.startswith("bert")), None)
    if name is None:
        pytest.skip("no bert fixture")
    m = minirt.load(str(DATA / name / "model-f16.gguf"), embedding=True, pull=False)
    z, _ = ref(name)
    seqs = (_seqs(z) * 3)[:8]
    alone = [m.embed([s])[0] for s in seqs]
    q = m.embed_queue
    out: dict[int, np.ndarray] = {}
    before = q.passes
    taken: list[int] = []  # sizes of the groups the leaders took
    take = q._take
    q._take = lambda: (lambda g: (taken.append(len(g)), g)[1])(take())  # type: ignore[method-assign]
    with m._step_lock:  # nothing runs until every thread has queued
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, m.embed([seqs[i]])[0]))
                   for i in range(len(seqs))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(taken) + len(q._queue) < len(seqs) and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join(timeout=60)
    assert 1 <= q.passes - before <= 2, q.passes - before  # 8 calls, at most 2 passes
    for i, want in enumerate(alone):
        np.testing.assert_allclose(out[i], want, atol=2e-5)
    m.close()


def test_a_failed_pass_fails_its_calls_not_the_queue(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    name = next((n for n in MODELS if n.startswith("bert")), None)
    if name is None:
        pytest.skip("no bert fixture")
    m = minirt.load(str(DATA / name / "model-f16.gguf"), embedding=True, pull=False)
    good = m.embed("a b c")
    calls = {"n": 0}
    real = m.model.encode

    def flaky(*a, **k):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(*a, **k)

    monkeypatch.setattr(m.model, "encode", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        m.embed("a b c")
    np.testing.assert_allclose(m.embed("a b c"), good, atol=1e-6)  # the queue still serves
    m.close()


def _embed_model() -> minirt.Model:
    name = next((n for n in MODELS if n.startswith("bert")), None)
    if name is None:
        pytest.skip("no bert fixture")
    return load(name)


def test_text_input_normalize_dimensions() -> None:
    m = _embed_model()
    a = m.embed("hello world")
    assert a.shape == (1, m.model.cfg.n_embd) and a.dtype == np.float32
    raw = m.embed(["hello world"], normalize=False)
    np.testing.assert_allclose(a[0], raw[0] / np.linalg.norm(raw[0]), rtol=1e-5, atol=1e-7)
    d = m.embed("hello world", dimensions=64)
    want = raw[0, :64] / np.linalg.norm(raw[0, :64])
    np.testing.assert_allclose(d[0], want, rtol=1e-5, atol=1e-7)
    with pytest.raises(InvalidRequestError):
        m.embed("x", dimensions=0)
    with pytest.raises(InvalidRequestError):
        m.embed([])
    with pytest.raises(InvalidRequestError):
        m.embed([["a"]])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError):
        m.embed([m.n_vocab + 5])


def test_truncation() -> None:
    m = _embed_model()
    n = embedding.max_tokens(m)
    ids = [200] * (n + 10)
    with pytest.raises(ContextOverflowError):
        m.embed(ids, truncate=False)
    np.testing.assert_allclose(m.embed(ids), m.embed(ids[:n]), atol=1e-6)
    text = "ba " * (n + 10)
    assert m.embed(text).shape == (1, m.model.cfg.n_embd)  # cut, keeping the closing SEP


def test_encoder_refuses_generation_and_rerank() -> None:
    m = _embed_model()
    with pytest.raises(EmbeddingError):
        m.generate("hello", max_tokens=2)
    with pytest.raises(EmbeddingError):
        m.rerank("q", ["d"])


def test_rerank_api_and_pair_format() -> None:
    name = "xlmr_rerank" if "xlmr_rerank" in MODELS else None  # the XLM-R pair format
    if name is None:
        pytest.skip("no reranker fixture")
    m = load(name)
    tk = m.tokenizer
    ids = embedding.rerank_ids(m, "ab", "cd")
    q, d = tk.encode("ab", add_special=False), tk.encode("cd", add_special=False)
    # XLM-RoBERTa pair encoding: <s> q </s></s> d </s> (what llama.cpp's server and transformers form)
    assert ids == [tk.bos_id] + q + [tk.eos_id, tk.sep_id] + d + [tk.eos_id]
    s = m.rerank("ab", ["cd", "ef", "cd"])
    assert s.shape == (3,) and s[0] == pytest.approx(s[2], abs=1e-6)
    hs = embedding.hidden_states(m, [ids])
    assert s[0] == pytest.approx(float(embedding.pool(m, m.model.desc.pooling, hs)[0, 0]), abs=1e-5)
    with pytest.raises(EmbeddingError):
        m.embed("x")
    assert m.rerank("q", []).shape == (0,)


def test_generative_model_without_pooling() -> None:
    archs = Path(__file__).parent / "data" / "archs" / "llama" / "model-q8_0.gguf"
    if not archs.exists():
        pytest.skip("no llama fixture")
    with minirt.load(str(archs), pull=False, n_ctx=64) as m:
        with pytest.raises(EmbeddingError):
            m.embed("hi")
        m.close()
    with minirt.load(str(archs), pull=False, n_ctx=64, pooling="mean") as m:  # llama.cpp's --pooling mean
        v = m.embed([[1, 2, 3]])
        assert v.shape == (1, m.model.cfg.n_embd)


def test_create_embedding_shape() -> None:
    m = _embed_model()
    r = m.create_embedding(["a b", "c"], encoding_format="base64")
    assert r["object"] == "list" and len(r["data"]) == 2
    v = np.frombuffer(base64.b64decode(r["data"][1]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(v, m.embed("c")[0], atol=1e-6)
    assert r["usage"]["prompt_tokens"] == len(m.tokenize("a b")) + len(m.tokenize("c"))


# ----------------------------------------------------------------------------------------------
# server: /v1/embeddings (OpenAI shape, the official client) and /v1/rerank (llama.cpp's shape)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embed_server():  # type: ignore[no-untyped-def]
    pytest.importorskip("starlette", reason="the server tests need starlette (pip install 'minirt[server]')")
    from minirt.server import BackgroundServer, build_app

    with BackgroundServer(build_app(_embed_model())) as srv:
        yield srv


def test_openai_client_embeddings(embed_server) -> None:  # type: ignore[no-untyped-def]
    openai = pytest.importorskip("openai")
    from minirt.server import model_id_for

    m = _embed_model()
    mid = model_id_for(m)
    c = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.embeddings.create(model=mid, input=["a b", "c d e"])
    assert [d.index for d in r.data] == [0, 1]
    np.testing.assert_allclose(np.array(r.data[1].embedding), m.embed("c d e")[0], atol=1e-6)
    assert r.usage.prompt_tokens == len(m.tokenize("a b")) + len(m.tokenize("c d e"))
    # the client asks for base64 by default when numpy is there; float explicitly too
    r = c.embeddings.create(model=mid, input="a b",
                            encoding_format="float", dimensions=32)
    v = np.array(r.data[0].embedding)
    assert v.shape == (32,) and abs(np.linalg.norm(v) - 1) < 1e-5
    r = c.embeddings.create(model=mid, input=[[200, 201, 202], [203]])
    np.testing.assert_allclose(np.array(r.data[1].embedding), m.embed([203])[0], atol=1e-6)
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model=mid, input=[])


def test_http_routes(embed_server) -> None:  # type: ignore[no-untyped-def]
    import httpx

    for path in ("/v1/embeddings", "/embeddings"):
        r = httpx.post(embed_server.url + path, json={"input": "hello", "encoding_format": "base64"}, timeout=60)
        assert r.status_code == 200, r.text
        v = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
        assert v.shape == (_embed_model().model.cfg.n_embd,)
    r = httpx.post(embed_server.url + "/v1/embeddings", json={"input": "x", "encoding_format": "hex"}, timeout=60)
    assert r.status_code == 400 and "encoding_format" in r.json()["error"]["message"]
    n = embedding.max_tokens(_embed_model())
    r = httpx.post(embed_server.url + "/v1/embeddings", json={"input": [[200] * (n + 1)], "truncate": False},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(embed_server.url + "/v1/rerank", json={"query": "q", "documents": ["a"]}, timeout=60)
    assert r.status_code == 400  # not a reranker


def test_rerank_route() -> None:
    pytest.importorskip("starlette")
    import httpx

    from minirt.server import BackgroundServer, build_app

    name = "xlmr_rerank" if "xlmr_rerank" in MODELS else None  # the XLM-R pair format
    if name is None:
        pytest.skip("no reranker fixture")
    m = load(name)
    docs = ["ab cd", "ef", "gh ij kl"]
    want = m.rerank("ab", docs)
    with BackgroundServer(build_app(m)) as srv:
        for path in ("/v1/rerank", "/rerank"):
            r = httpx.post(srv.url + path, json={"query": "ab", "documents": docs, "top_n": 2,
                                                "return_documents": True}, timeout=60)
            assert r.status_code == 200, r.text
            res = r.json()["results"]
            order = np.argsort(-want)[:2].tolist()
            assert [x["index"] for x in res] == order
            assert res[0]["relevance_score"] == pytest.approx(float(want[order[0]]), abs=1e-6)
            assert res[0]["document"]["text"] == docs[order[0]]
        r = httpx.post(srv.url + "/v1/rerank", json={"query": "ab", "documents": "no"}, timeout=60)
        assert r.status_code == 400


def test_cli_embed_and_rerank(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import io

    from minirt import cli

    path = str(DATA / "bert" / "model-f16.gguf")
    assert cli.main(["embed", path, "a b", "c"]) == 0
    out = json.loads(capsys.readouterr().out)
    np.testing.assert_allclose(np.array(out["data"][1]["embedding"]), _embed_model().embed("c")[0], atol=1e-6)
    monkeypatch.setattr("sys.stdin", io.StringIO("a b\n\nc\n"))
    assert cli.main(["embed", path, "--dimensions", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["data"]) == 2 and len(out["data"][0]["embedding"]) == 8
    name = "xlmr_rerank" if "xlmr_rerank" in MODELS else None  # the XLM-R pair format
    if name is not None:
        assert cli.main(["embed", str(DATA / name / "model-f16.gguf"), "--rerank", "ab", "cd", "ef"]) == 0
        res = json.loads(capsys.readouterr().out)["results"]
        assert sorted(r["index"] for r in res) == [0, 1] and "document" in res[0]
    assert cli.main(["embed", str(DATA / "bert" / "model-f16.gguf"), "--rerank", "q", "d"]) == 2  # not a reranker


@pytest.mark.skipif("jina_bert_v3" not in MODELS, reason="no jina-bert-v3 fixture")
def test_cli_embed_with_task_adapter(capsys) -> None:  # type: ignore[no-untyped-def]
    from minirt import cli

    d = DATA / "jina_bert_v3"
    path, adapter = str(d / "model-f16.gguf"), str(d / "lora-retrieval.query.gguf")
    with_ad = minirt.load(path, embedding=True, pull=False, lora=adapter).embed("a b c")[0]
    base = load("jina_bert_v3").embed("a b c")[0]
    assert cli.main(["embed", path, "--lora", adapter, "a b c"]) == 0
    got = np.array(json.loads(capsys.readouterr().out)["data"][0]["embedding"])
    np.testing.assert_allclose(got, with_ad, atol=1e-6)
    assert cli.main(["embed", path, "--lora-scaled", adapter, "0", "a b c"]) == 0
    got = np.array(json.loads(capsys.readouterr().out)["data"][0]["embedding"])
    np.testing.assert_allclose(got, base, atol=1e-6)
    assert np.abs(with_ad - base).max() > 1e-3


def test_qwen3_reranker_uses_its_template() -> None:
    """A Qwen3 reranker (converted from the Qwen3-Reranker layout): the pair goes through the
    file's ``rerank`` chat template (instruction, query, document, empty thinking block), and the
    score is P(yes) of its two-label softmax, in [0, 1]."""
    if "qwen3_rerank" not in MODELS:
        pytest.skip("no Qwen3 reranker fixture")
    m = load("qwen3_rerank")
    tmpl = m.metadata["tokenizer.chat_template.rerank"]
    assert "{query}" in tmpl and "{document}" in tmpl
    ids = embedding.rerank_ids(m, "ab", "cd")
    assert m.detokenize(ids).endswith(tmpl.replace("{query}", "ab").replace("{document}", "cd")[-40:])
    s = m.rerank("ab", ["cd", "ef", "cd"])
    assert s.shape == (3,) and ((0 <= s) & (s <= 1)).all() and s[0] == pytest.approx(s[2], abs=1e-6)
    p = embedding.pool(m, m.model.desc.pooling, embedding.hidden_states(m, [ids]))[0]
    assert p.shape == (2,) and p.sum() == pytest.approx(1.0, abs=1e-5) and s[0] == pytest.approx(p[0], abs=1e-5)
