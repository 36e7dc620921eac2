"""Reasoning kept apart from the answer: each format llama.cpp's --reasoning-format knows (model
output strings as llama.cpp's tests/test-chat.cpp records them), split whole and streamed; the
format and whether the prompt opened the thinking block, read from real templates; end to end
on a tiny model: ``reasoning_content`` (whole and as its own deltas), ``TokenEvent.part`` and
the thinking budget."""

from __future__ import annotations

from pathlib import Path

import pytest

import minirt
from minirt import reasoning as R
from minirt.chat import ChatTemplate
from tests.tiny_models import TinySpec, write_tiny

T = Path(__file__).parent / "data" / "templates"
CASES = [  # (format, starts inside, output, reasoning, content)
    ("think", False, "<think>I'm\nthinking</think>Hello, world!\nWhat's up?", "I'm\nthinking", "Hello, world!\nWhat's up?"),
    ("think", True, "I'm\nthinking</think>Hello, world!", "I'm\nthinking", "Hello, world!"),
    ("think", False, "Hello, world!", "", "Hello, world!"),
    ("think", False, "<think>still going", "still going", ""),
    ("mistral", False, "[THINK]I'm\nthinking[/THINK]Hello, world!", "I'm\nthinking", "Hello, world!"),
    ("command-r7b", False, "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hi<|END_RESPONSE|>",
     "I'm\nthinking", "<|START_RESPONSE|>Hi<|END_RESPONSE|>"),
    (R.HARMONY, False, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final"
                       "<|message|>Hello, world!", "I'm\nthinking", "<|start|>assistant<|channel|>final<|message|>Hello, world!"),
]


@pytest.mark.parametrize("fmt, inside, text, reasoning, content", CASES)
def test_split(fmt, inside, text, reasoning, content):
    assert R.split(text, fmt, inside) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 2, 5])
@pytest.mark.parametrize("fmt, inside, text, reasoning, content", CASES)
def test_split_streamed(fmt, inside, text, reasoning, content, step):
    s = R.Splitter(fmt, inside)
    pieces = []
    for i in range(0, len(text), step):
        pieces += s.feed(text[i:i + step])
    pieces += s.finish()
    assert "".join(t for p, t in pieces if p == "reasoning") == reasoning
    assert "".join(t for p, t in pieces if p == "content") == content


def test_gpt_oss_answer_is_its_final_channel():
    from minirt.generate import Completion

    c = Completion(CASES[-1][2], [], "stop", {}, {})
    R.ChatParser(R.HARMONY, False).apply(c)
    assert (c.reasoning, c.content) == ("I'm\nthinking", "Hello, world!")


@pytest.mark.parametrize("name, fmt", [
    ("Qwen-Qwen3-0.6B", "think"), ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "think"), ("GLM-4.6", "think"),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral"), ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "command-r7b"),
    ("openai-gpt-oss-120b", R.HARMONY), ("Qwen-Qwen2.5-7B-Instruct", None), ("meta-llama-Llama-3.1-8B-Instruct", None),
])
def test_format_from_real_templates(name, fmt):
    assert R.detect_format((T / f"{name}.jinja").read_text()) == fmt


def test_prompt_opening_the_thinking_block():
    msgs = [{"role": "user", "content": "Hi"}]
    r1 = ChatTemplate((T / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text(), bos_token="<s>")
    assert R.starts_inside("think", r1.render(msgs))
    qwen3 = ChatTemplate((T / "Qwen-Qwen3-0.6B.jinja").read_text())
    assert not R.starts_inside("think", qwen3.render(msgs))
    # enable_thinking=False: the template writes an empty, closed block
    assert not R.starts_inside("think", qwen3.render(msgs, enable_thinking=False))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("reason") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=4, n_ctx=512))
    return p


def test_reasoning_content_whole_streamed_and_event_parts(tiny_path):
    with minirt.load(tiny_path, n_ctx=512, chat_template=(T / "Qwen-Qwen3-0.6B.jinja").read_text()) as llm:
        kw = dict(max_tokens=60, temperature=1.0, seed=1, grammar='root ::= "<think>" [a-z]{6} "</think>" [A-Z]{4}')
        msgs = [{"role": "user", "content": "hi"}]
        r = llm.create_chat_completion(msgs, **kw)["choices"][0]["message"]
        assert len(r["reasoning_content"]) == 6 and r["reasoning_content"].islower()
        assert len(r["content"]) == 4 and r["content"].isupper()
        deltas = [c["choices"][0]["delta"] for c in llm.create_chat_completion(msgs, stream=True, **kw)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == r["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == r["content"]
        events = [e for e in llm.chat_stream(msgs, **kw) if e.token_id is not None]
        parts = [e.part for e in events]
        assert parts[0] == "reasoning" and parts[-1] == "content"
        assert "".join(e.text for e in events if e.part == "content") == r["content"]


def test_thinking_budget_closes_the_block(tiny_path):
    tmpl = (T / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text()
    with minirt.load(tiny_path, n_ctx=512, chat_template=tmpl) as llm:
        msgs = [{"role": "user", "content": "hi"}]
        c = llm.chat(msgs, max_tokens=30, temperature=1.0, seed=2, thinking_budget=5, ignore_eos=True)
        assert "</think>" in c.text
        end = llm.tokenize("</think>", add_special=False, parse_special=True)
        assert c.token_ids[5:5 + len(end)] == end  # forced right after 5 thinking tokens
        before = c.text.split("</think>")[0]
        assert c.reasoning == before and before.strip() == llm.detokenize(c.token_ids[:5]).strip()
        assert c.content == c.text.split("</think>", 1)[1].lstrip("\n")
        assert len(c.token_ids) == 30
        with pytest.raises(minirt.InvalidRequestError, match="thinking_budget"):
            llm.chat(msgs, max_tokens=3, thinking_budget=-1)


def test_gui_controller_folds_thinking_away(tiny_path):
    import queue

    from minirt.gui import StreamController

    class Ctl(StreamController):
        def __init__(self, llm):
            super().__init__(llm)
            self.q, self.shown, self.folded = queue.SimpleQueue(), [], []

        def _post(self, item):
            self.q.put(item)

        def _on_token(self, ev):
            self.shown.append(ev.text)

        def _on_thinking(self, ev):
            self.folded.append(ev.text)

    with minirt.load(tiny_path, n_ctx=512, chat_template=(T / "Qwen-Qwen3-0.6B.jinja").read_text()) as llm:
        kw = dict(max_tokens=60, temperature=1.0, seed=5, grammar='root ::= "<think>" [a-z]{6} "</think>" [A-Z]{4}')
        for show in (False, True):
            ctl = Ctl(llm)
            ctl.show_thinking = show
            ctl.start(messages=[{"role": "user", "content": "hi"}], **kw)
            while ctl.running:
                ctl._dispatch(ctl.q.get(timeout=60))
            c = ctl.completion
            if show:
                assert ctl.text == c.text and not ctl.folded
            else:
                assert (ctl.text, ctl.reasoning) == ("".join(ctl.shown), "".join(ctl.folded))
                assert ctl.text == c.content and c.reasoning in ctl.reasoning and "<think>" in ctl.reasoning


def test_reasoning_format_none_keeps_thinking_in_content(tiny_path):
    httpx = pytest.importorskip("httpx")
    from minirt.server import BackgroundServer, build_app

    with minirt.load(tiny_path, n_ctx=512, chat_template=(T / "Qwen-Qwen3-0.6B.jinja").read_text()) as llm, \
            BackgroundServer(build_app(llm)) as srv:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 1.0, "seed": 1,
                "grammar": 'root ::= "<think>" [a-z]{6} "</think>" [A-Z]{4}'}
        m = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert len(m["reasoning_content"]) == 6 and len(m["content"]) == 4
        m = httpx.post(srv.url + "/v1/chat/completions", json={**body, "reasoning_format": "none"},
                       timeout=60).json()["choices"][0]["message"]
        assert "reasoning_content" not in m and m["content"].startswith("<think>")
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "reasoning_format": "maybe"}, timeout=60)
        assert r.status_code == 400
