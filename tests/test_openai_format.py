"""OpenAI-shaped dicts: one chunk builder serves the Python API's streams and the HTTP server's."""

from __future__ import annotations

import pytest

import minirt
from minirt import openai_format as fmt
from minirt.generate import TokenEvent
from tests.tiny_models import TinySpec, write_tiny

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    p = tmp_path_factory.mktemp("fmt") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=11))
    m = minirt.load(str(p), n_ctx=128)
    yield m
    m.close()


def test_usage_always_has_prompt_tokens_details(llm):
    c = llm.generate(PROMPT, max_tokens=3, temperature=0.0)
    u = fmt.usage_dict(c)
    assert u["prompt_tokens_details"] == {"cached_tokens": int(c.usage.get("cached_tokens", 0))}
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # the same prompt again comes from the prefix cache, and the dict says so
    again = llm.create_completion(PROMPT, max_tokens=3, temperature=0.0)["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] > 0
    assert {k: again[k] for k in ("prompt_tokens", "completion_tokens")} == \
        {k: u[k] for k in ("prompt_tokens", "completion_tokens")}


def test_streamed_completion_logprobs_and_offsets(llm):
    d = llm.create_completion(PROMPT, max_tokens=5, temperature=0.0, logprobs=2)
    chunks = list(llm.create_completion(PROMPT, max_tokens=5, temperature=0.0, logprobs=2, stream=True))
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == d["choices"][0]["text"]
    lps = [ch["choices"][0]["logprobs"] for ch in chunks if ch["choices"][0]["logprobs"]]
    want = d["choices"][0]["logprobs"]["token_logprobs"]
    assert [x for lp in lps for x in lp["token_logprobs"]] == pytest.approx(want)
    offsets = [lp["text_offset"][0] for lp in lps]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(len(lp["top_logprobs"][0]) <= 2 for lp in lps)
    assert chunks[-1]["choices"][0]["finish_reason"] == d["choices"][0]["finish_reason"]


def test_builder_options_shape_every_chunk(llm):
    b = fmt.ChunkBuilder(llm, "chat", "id-1", 7, "served-name", include_usage=True, extra={"system_fingerprint": "x"})
    first = b.first()
    mid = b.event(TokenEvent(token_id=5, text="hi", finish_reason=None, logprob=None))
    end = b.event(TokenEvent(token_id=None, text="", finish_reason="stop", logprob=None))
    for ch in first + mid + end:
        assert (ch["id"], ch["created"], ch["model"], ch["system_fingerprint"]) == ("id-1", 7, "served-name", "x")
        assert ch["usage"] is None and ch["object"] == "chat.completion.chunk"
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert mid[0]["choices"][0]["delta"] == {"content": "hi"} and end[-1]["choices"][0]["finish_reason"] == "stop"
    c = llm.generate(PROMPT, max_tokens=2, temperature=0.0)
    last = b.usage(c)
    assert last["choices"] == [] and last["usage"] == fmt.usage_dict(c)
    with pytest.raises(ValueError, match="kind"):
        fmt.ChunkBuilder(llm, "embeddings", "id", 0)
