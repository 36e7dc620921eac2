"""llama-server's native endpoints on minirt's server (/completion, /tokenize, /detokenize, /props,
/slots) and the Prometheus /metrics scrape.

Expected shapes are llama.cpp's (tools/server: ``server_task_result_cmpl_final::to_json_non_oaicompat``,
``server_task_result_cmpl_partial::to_json_non_oaicompat``, ``server_slot_stats::to_json``,
``server_slot::to_json``, ``get_res_props``, ``server_task_result_slot_save_load::to_json``); expected
values come from the runtime called directly; the metrics text is parsed with
``prometheus_client.parser``."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx", reason="the server tests need httpx (pip install 'minirt[server]')")
pytest.importorskip("starlette", reason="the server needs starlette (pip install 'minirt[server]')")
pytest.importorskip("uvicorn", reason="the server needs uvicorn (pip install 'minirt[server]')")

import minirt  # noqa: E402
from minirt.server import BackgroundServer, build_app  # noqa: E402
from tests.tiny_models import TinySpec, write_tiny  # noqa: E402

PROMPT = "the capital of France is"
N_CTX = 128
# llama.cpp server-task.cpp, to_json_non_oaicompat (final and partial results), server-common.cpp timings
FINAL_KEYS = {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
              "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
              "tokens_cached", "timings"}
PARTIAL_KEYS = {"index", "content", "tokens", "stop", "id_slot", "tokens_predicted", "tokens_evaluated"}
TIMINGS_KEYS = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    p = tmp_path_factory.mktemp("llama") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=5))
    m = minirt.load(str(p), n_ctx=N_CTX)
    yield m
    m.close()


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(llm, slot_dir):
    app = build_app(llm, model_id="tiny-alias", slot_save_path=str(slot_dir))
    with BackgroundServer(app) as srv:
        srv.state = app.state.minirt
        yield srv


def _sse_objects(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_completion_shape_and_values(server, llm):
    want = llm.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    r = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 6, "temperature": 0,
                                                     "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()
    assert set(d) == FINAL_KEYS and set(d["timings"]) == TIMINGS_KEYS
    assert d["content"] == want.text and d["tokens"] == want.token_ids and d["stop"] is True
    assert d["tokens_predicted"] == 6 and d["stop_type"] == "limit" and d["stopping_word"] == ""
    # llama-server tokenizes /completion prompts with BOS and special tokens parsed
    ids = llm.tokenizer.encode(PROMPT, add_special=True, parse_special=True)
    assert d["tokens_evaluated"] == len(ids) and d["prompt"] == llm.detokenize(ids)
    assert d["model"] == "tiny-alias" and d["generation_settings"]["n_predict"] == 6
    # a prompt given as token ids gives the same answer; so does a mixed prompt
    r2 = httpx.post(server.url + "/completion", json={"prompt": ids, "n_predict": 6, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60).json()
    assert r2["content"] == want.text
    mixed = [ids[0], PROMPT]  # BOS id, then text (no second BOS: it is not the first element)
    r3 = httpx.post(server.url + "/completion", json={"prompt": mixed, "n_predict": 6, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60).json()
    assert r3["content"] == want.text


def test_completion_stop_word_and_bad_fields(server, llm):
    full = llm.generate(PROMPT, max_tokens=8, temperature=0, ignore_eos=True).text
    word = full[3:6]
    r = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                                     "ignore_eos": True, "stop": [word]}, timeout=60).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == word and r["content"] == full[:full.index(word)]
    for body, param in (({"prompt": PROMPT, "n_predict": "x"}, "n_predict"), ({"prompt": PROMPT, "n_predict": 0},
                        "n_predict"), ({"n_predict": 3}, "prompt"), ({"prompt": [10**9]}, None)):
        e = httpx.post(server.url + "/completion", json=body, timeout=30)
        assert e.status_code == 400, (body, e.text)
        if param:
            assert e.json()["error"]["param"] == param


def test_completion_stream(server, llm):
    want = llm.generate(PROMPT, max_tokens=5, temperature=0, ignore_eos=True)
    r = httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 5, "temperature": 0,
                                                     "ignore_eos": True, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in r.text  # llama-server's native stream has no [DONE]
    objs = _sse_objects(r.text)
    parts, final = objs[:-1], objs[-1]
    assert all(set(o) == PARTIAL_KEYS and o["stop"] is False for o in parts)
    assert [o["tokens"][0] for o in parts] == want.token_ids
    assert [o["tokens_predicted"] for o in parts] == list(range(1, 6))
    assert "".join(o["content"] for o in parts) + final["content"] == want.text
    assert set(final) == FINAL_KEYS and final["stop"] is True and final["tokens_predicted"] == 5


def test_tokenize_detokenize(server, llm):
    text = "the capital of France is Paris."
    r = httpx.post(server.url + "/tokenize", json={"content": text}).json()
    assert r == {"tokens": llm.tokenizer.encode(text, add_special=False, parse_special=True)}
    r = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": True}).json()
    assert r["tokens"][0] == llm.tokenizer.bos_id
    p = httpx.post(server.url + "/tokenize", json={"content": "é the", "with_pieces": True}).json()["tokens"]
    for t in p:
        piece = llm.tokenizer.token_to_piece(t["id"])
        assert t["piece"] == (piece.decode() if isinstance(t["piece"], str) else list(piece))
    assert any(isinstance(t["piece"], list) for t in p)  # é is byte-fallback tokens: raw bytes, as llama.cpp
    ids = llm.tokenize(text, add_special=False)
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"content": llm.detokenize(ids)}
    assert httpx.post(server.url + "/detokenize", json={}).json() == {"content": ""}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [llm.n_vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.url + "/tokenize", json={"content": 5}).status_code == 400


def test_props_and_slots(server, llm):
    p = httpx.get(server.url + "/props").json()
    assert {"default_generation_settings", "total_slots", "model_alias", "model_path", "modalities",
            "chat_template", "bos_token", "eos_token", "build_info"} <= set(p)
    assert p["default_generation_settings"]["n_ctx"] == N_CTX and p["total_slots"] == llm.scheduler.n_parallel
    assert p["model_alias"] == "tiny-alias" and p["chat_template"] == llm.chat_template.source
    assert p["bos_token"] == "<s>" and p["eos_token"] == "</s>"
    s = httpx.get(server.url + "/slots").json()
    assert len(s) == llm.scheduler.n_parallel and [x["id"] for x in s] == list(range(len(s)))
    assert all({"id", "n_ctx", "speculative", "is_processing"} <= set(x) and not x["is_processing"] for x in s)


def test_slot_save_restore_erase(server, llm, slot_dir):
    httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0,
                                                 "ignore_eos": True}, timeout=60)
    r = httpx.post(server.url + "/slots/0?action=save", json={"filename": "conv.bin"}).json()
    assert set(r) == {"id_slot", "filename", "n_saved", "n_written", "timings"} and r["n_saved"] > 0
    assert (slot_dir / "conv.bin").stat().st_size == r["n_written"]
    e = httpx.post(server.url + "/slots/0?action=erase").json()
    assert e["id_slot"] == 0 and e["n_erased"] >= r["n_saved"] and llm.cache_pool.tokens() == 0
    r2 = httpx.post(server.url + "/slots/0?action=restore", json={"filename": "conv.bin"}).json()
    assert set(r2) == {"id_slot", "filename", "n_restored", "n_read", "timings"} and r2["n_restored"] == r["n_saved"]
    assert llm.cache_pool.tokens() == r["n_saved"]
    # the restored prefix is reused by the next request that starts with it
    hits = llm.cache_pool.hits
    httpx.post(server.url + "/completion", json={"prompt": PROMPT, "n_predict": 2}, timeout=60)
    assert llm.cache_pool.hits == hits + 1
    for name in ("../escape.bin", "/etc/passwd", "a/b.bin", ".hidden", "..", "", "x\x00y", 5):
        b = httpx.post(server.url + "/slots/0?action=save", json={"filename": name})
        assert b.status_code == 400 and b.json()["error"]["param"] == "filename", name
    assert not (slot_dir.parent / "escape.bin").exists()
    (slot_dir.parent / "outside.bin").write_bytes(b"x")
    (slot_dir / "link.bin").symlink_to(slot_dir.parent / "outside.bin")
    assert httpx.post(server.url + "/slots/0?action=restore", json={"filename": "link.bin"}).status_code == 400
    assert httpx.post(server.url + "/slots/0?action=restore", json={"filename": "nope.bin"}).status_code == 404
    assert httpx.post(server.url + "/slots/99?action=save", json={"filename": "a.bin"}).status_code == 400
    assert httpx.post(server.url + "/slots/0?action=fly", json={"filename": "a.bin"}).status_code == 400


def test_slot_actions_off_without_save_path(llm):
    with BackgroundServer(build_app(llm)) as srv:
        r = httpx.post(srv.url + "/slots/0?action=save", json={"filename": "a.bin"})
        assert r.status_code == 501


def test_metrics_scrape_parses(server, llm):
    parser = pytest.importorskip("prometheus_client.parser", reason="needs prometheus-client")
    before = _families(parser, httpx.get(server.url + "/metrics").text)
    n0 = _value(before, "minirt_generated_tokens", "minirt_generated_tokens_total")
    httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True},
               timeout=60)
    httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True,
                                                     "stream": True}, timeout=60)
    httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": "x"})
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = _families(parser, r.text)
    assert _value(fams, "minirt_generated_tokens", "minirt_generated_tokens_total") == n0 + 7
    assert _value(fams, "minirt_prompt_tokens", "minirt_prompt_tokens_total") > 0
    for name in ("minirt_time_to_first_token_seconds", "minirt_time_per_output_token_seconds"):
        assert fams[name].type == "histogram"
        count = [s for s in fams[name].samples if s.name == name + "_count"]
        assert count and count[0].value >= 2
    for name in ("minirt_queue_depth", "minirt_requests_running", "minirt_kv_cache_bytes_in_use"):
        assert fams[name].type == "gauge" and fams[name].samples[0].labels["model"] == "tiny-alias"
    # the idle prefix cache holds positions: KV bytes in use = those positions × bytes per position
    kv = fams["minirt_kv_cache_bytes_in_use"].samples[0].value
    assert kv == llm.cache_pool.tokens() * llm.kv_bytes_per_token
    errs = [s for s in fams["minirt_http_errors"].samples if s.name == "minirt_http_errors_total"]
    assert any(s.labels == {"endpoint": "/v1/completions", "status": "400"} for s in errs)


def _families(parser, text):
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def _value(fams, fam, sample):
    f = fams.get(fam)
    return sum(s.value for s in f.samples if s.name == sample) if f else 0.0
