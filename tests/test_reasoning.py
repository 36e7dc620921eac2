"""Reasoning kept apart from the answer: each format llama.cpp's --reasoning-format knows (model
output strings as llama.cpp's tests/test-chat.cpp records them), split whole and streamed; the
format and whether the prompt opened the thinking block, read from real templates; end to end
on a tiny model: ``reasoning_content`` (whole and as its own deltas), ``TokenEvent.part`` and
the thinking budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
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


# ------------------------------------------------------------------------------------------------
# a grammar with a model that thinks: the thinking is free, the grammar holds for the answer
# ------------------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def think_path(tmp_path_factory):
    """A tiny model whose vocabulary has <think> and </think> as single tokens (as Qwen3's has)."""
    p = tmp_path_factory.mktemp("reason-think") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=4, n_ctx=512, specials=("<think>", "</think>")))
    return p


def _valid(content: str) -> dict:
    import json

    obj = json.loads(content)
    assert set(obj) == {"city", "n"} and isinstance(obj["city"], str) and isinstance(obj["n"], int), obj
    return obj


def test_grammar_waits_for_a_thinking_block_the_prompt_opened(tiny_path):
    """DeepSeek-R1's prompt opens <think>: the first tokens are free thinking (closed here by the
    budget), then the answer follows the schema."""
    tmpl = (T / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text()
    with minirt.load(tiny_path, n_ctx=512, chat_template=tmpl) as llm:
        msgs = [{"role": "user", "content": "hi"}]
        for seed in range(4):
            c = llm.chat(msgs, max_tokens=400, temperature=1.0, seed=seed, thinking_budget=6, json_schema=SCHEMA)
            assert c.finish_reason == "stop", c.text
            _valid(c.content)
            thought = llm.detokenize(c.token_ids[:6]).strip()
            assert c.reasoning.strip() == thought  # unconstrained: free tokens, not the schema's
            # the same request without thinking room would have had to start with "{"
            assert c.text.split("</think>", 1)[1].lstrip().startswith("{")


def test_grammar_lets_the_model_open_a_thinking_block(think_path):
    """Qwen3's prompt leaves thinking to the model: the first token may be the grammar's or
    <think>; after </think> the schema holds. With thinking disabled (an empty block in the
    prompt) <think> is not allowed at all."""
    tmpl = (T / "Qwen-Qwen3-0.6B.jinja").read_text()
    with minirt.load(think_path, n_ctx=512, chat_template=tmpl) as llm:
        think, end = (llm.tokenize(t, add_special=False, parse_special=True) for t in ("<think>", "</think>"))
        assert len(think) == len(end) == 1
        msgs = [{"role": "user", "content": "hi"}]
        kw = dict(max_tokens=400, temperature=1.0, seed=3, json_schema=SCHEMA, thinking_budget=5)
        c = llm.chat(msgs, logit_bias={think[0]: 100.0}, **kw)  # push the model to open the block
        assert c.token_ids[0] == think[0] and end[0] in c.token_ids, c.text
        assert c.finish_reason == "stop" and c.reasoning and _valid(c.content)
        c = llm.chat(msgs, logit_bias={think[0]: -100.0}, **kw)  # no thinking: straight to the answer
        assert think[0] not in c.token_ids and not c.reasoning and _valid(c.content)
        c = llm.chat(msgs, logit_bias={think[0]: 100.0}, chat_template_kwargs={"enable_thinking": False}, **kw)
        assert think[0] not in c.token_ids and _valid(c.content)
        # streamed: the same split, as deltas
        deltas = [ch["choices"][0]["delta"] for ch in llm.create_chat_completion(
            msgs, stream=True, logit_bias={think[0]: 100.0}, **kw)]
        assert "".join(d.get("reasoning_content") or "" for d in deltas)
        _valid("".join(d.get("content") or "" for d in deltas))


def test_a_grammar_that_writes_the_block_itself_applies_throughout(think_path):
    """A grammar whose first token is <think> (Lark, by token id) is in charge of the whole output,
    as llama.cpp applies grammars: no free-text phase is added."""
    tmpl = (T / "Qwen-Qwen3-0.6B.jinja").read_text()
    with minirt.load(think_path, n_ctx=512, chat_template=tmpl) as llm:
        think, end = (llm.tokenize(t, add_special=False, parse_special=True)[0] for t in ("<think>", "</think>"))
        g = f'start: <[{think}]> /[a-z]{{5}}/ <[{end}]> /[A-Z]{{3}}/'
        c = llm.chat([{"role": "user", "content": "hi"}], max_tokens=60, temperature=1.0, seed=1, grammar=g)
        assert c.token_ids[0] == think and len(c.reasoning) == 5 and c.reasoning.islower(), c.text
        assert len(c.content) == 3 and c.content.isupper(), c.text


HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


@pytest.fixture(scope="module")
def harmony_path(tmp_path_factory):
    """A tiny model whose vocabulary has gpt-oss's harmony tokens as single tokens."""
    p = tmp_path_factory.mktemp("reason-harmony") / "tiny.gguf"
    write_tiny(p, TinySpec(n_layer=2, seed=4, n_ctx=2048, specials=HARMONY_SPECIALS))
    return p


def test_grammar_holds_for_gpt_oss_final_channel(harmony_path):
    """gpt-oss writes its analysis channel, then the final channel's header, then the answer: the
    grammar starts at the final message (as llama.cpp's gpt-oss grammar allows analysis first).
    The channels are scripted here with a logits processor (a random model would not write them)."""
    tmpl = (T / "openai-gpt-oss-120b.jinja").read_text()
    with minirt.load(harmony_path, n_ctx=512, chat_template=tmpl) as llm:
        tk = llm.tokenizer

        def ids(*parts: str) -> list[int]:
            # specials by id, text as byte tokens: the tiny SentencePiece vocabulary would add a
            # space prefix to each text piece (" analysis"), which gpt-oss's own tokenizer does not
            return [t for part in parts for t in ([tk.token_to_id(part)] if part.startswith("<|") else
                                                  [tk.token_to_id(f"<0x{b:02X}>") for b in part.encode()])]

        script = ids("<|channel|>", "analysis", "<|message|>", "hmm", "<|end|>", "<|start|>", "assistant",
                     "<|channel|>", "final", "<|message|>")
        for variant in ("plain", "constrain"):
            steps = list(script)
            if variant == "constrain":  # the header may name the content type, as gpt-oss writes it
                at = len(steps) - 1
                steps[at:at] = ids(" ", "<|constrain|>", "json")
            i = [0]

            def force(input_ids, scores, steps=steps, i=i):
                if i[0] < len(steps):
                    out = np.full_like(scores, -np.inf)
                    out[steps[i[0]]] = 0.0
                    i[0] += 1
                    return out
                return scores

            c = llm.chat([{"role": "user", "content": "hi"}], max_tokens=400, temperature=1.0, seed=5,
                         json_schema=SCHEMA, logits_processor=force)
            assert c.token_ids[:len(steps)] == steps, c.text
            assert c.finish_reason == "stop", c.text
            assert c.reasoning == "hmm"
            _valid(c.content)


def test_gpt_oss_forced_tool_call(harmony_path):
    """tool_choice "required" with gpt-oss: analysis messages may come first, then one commentary
    message to functions.NAME whose arguments follow the tool's schema (llama.cpp's gpt-oss grammar)."""
    import json

    tmpl = (T / "openai-gpt-oss-120b.jinja").read_text()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}}}]
    with minirt.load(harmony_path, n_ctx=2048, chat_template=tmpl) as llm:  # the tools prompt: ~600 byte tokens
        end = llm.tokenizer.token_to_id("<|end|>")
        # a random model would loop over analysis messages (the grammar allows any number, as
        # llama.cpp's does): ends of messages and the "c" of "commentary" made likelier
        bias = {end: 4.0, llm.tokenizer.token_to_id("<0x63>"): 3.0}
        for seed in range(4):
            c = llm.chat([{"role": "user", "content": "weather in Paris?"}], tools=tools, tool_choice="required",
                         max_tokens=400, temperature=1.0, seed=seed, logit_bias=bias)
            assert c.finish_reason == "stop" and [t.name for t in c.tool_calls] == ["get_weather"], c.text
            args = json.loads(c.tool_calls[0].arguments)
            assert set(args) == {"city"} and isinstance(args["city"], str)
        r = llm.create_chat_completion([{"role": "user", "content": "weather?"}], tools=tools,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=400, temperature=1.0, seed=9, logit_bias=bias)
        ch = r["choices"][0]
        assert ch["finish_reason"] == "tool_calls", ch
        assert ch["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert set(json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"])) == {"city"}
