"""Chat templates: the GGUF's template, built-ins that match llama.cpp, sandboxing, validation."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import minirt
from minirt import gguf as mgguf
from minirt.chat import BUILTIN_TEMPLATES, ChatTemplate, choose_builtin
from minirt.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def qwen_file(qwen_path):
    with mgguf.open(qwen_path) as f:
        yield f


@pytest.fixture(scope="module")
def qwen_tok(qwen_file) -> Tokenizer:
    return Tokenizer.from_gguf(qwen_file)


@pytest.fixture(scope="module")
def qwen_tmpl(qwen_file, qwen_tok) -> ChatTemplate:
    return ChatTemplate.from_gguf(qwen_file, qwen_tok)


@pytest.fixture(scope="module")
def gemma_file(gemma_path):
    with mgguf.open(gemma_path) as f:
        yield f


@pytest.fixture(scope="module")
def gemma_tok(gemma_file) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_file)


# ---------------------------------------------------------------------------------------------
# the real models
# ---------------------------------------------------------------------------------------------

def test_qwen_template_from_gguf(qwen_tmpl):
    assert qwen_tmpl.name == "gguf"
    assert qwen_tmpl.render(FRANCE, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert not qwen_tmpl.render(FRANCE, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


def test_qwen_prompt_tokenizes_to_control_tokens(qwen_tmpl, qwen_tok):
    ids = qwen_tok.encode(qwen_tmpl.render(FRANCE), add_special=True, parse_special=True)
    assert ids[0] == qwen_tok.token_to_id("<|im_start|>") == 151644
    assert ids.count(151645) == 2 and ids[-3] == 151644 and qwen_tok.decode(ids[-2:]) == "assistant\n"


def test_qwen_template_with_tools_and_tool_calls(qwen_tmpl):
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo", "parameters": params}}]
    out = qwen_tmpl.render(FRANCE, tools=tools)
    assert "# Tools" in out and json.dumps(tools[0], ensure_ascii=False) in out  # HF tojson: plain JSON
    msgs = FRANCE + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C"},
    ]
    out = qwen_tmpl.render(msgs, tools=tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in out
    assert "<tool_response>\n18C\n</tool_response>" in out


def test_gemma_uses_builtin_like_llama_cpp(gemma_file, gemma_tok):
    tmpl = ChatTemplate.from_gguf(gemma_file, gemma_tok)
    assert tmpl.name == "gemma" and "tokenizer.chat_template" not in gemma_file.metadata
    assert tmpl.render(FRANCE) == ("<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n"
                                   "<start_of_turn>model\n")
    msgs = [{"role": "system", "content": " Answer briefly.\n"}, {"role": "user", "content": "Hi "},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of Peru?"}]
    assert tmpl.render(msgs) == (
        "<start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of Peru?<end_of_turn>\n<start_of_turn>model\n")
    ids = gemma_tok.encode(tmpl.render(FRANCE), add_special=True, parse_special=True)
    # <bos><start_of_turn>user ... <end_of_turn>\n<start_of_turn>model\n
    assert ids[:2] == [gemma_tok.bos_id, 105] and ids[-5] == 106 and ids[-3] == 105


# ---------------------------------------------------------------------------------------------
# built-ins, selection and overrides
# ---------------------------------------------------------------------------------------------

def test_builtin_renderings():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": " u1 "},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert ChatTemplate.builtin("chatml").render(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n u1 <|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n")
    assert ChatTemplate.builtin("llama3").render(msgs[:2]) == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "u1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ChatTemplate.builtin("llama2-sys-bos").render(msgs) == (
        "[INST] <<SYS>>\nS\n<</SYS>>\n\n u1  [/INST]a1</s><s>[INST] u2 [/INST]")
    assert ChatTemplate.builtin("llama2").render(msgs) == "[INST] S\n u1  [/INST]a1</s>[INST] u2 [/INST]"


def _llama_python() -> str | None:
    cand = os.environ.get("MINIRT_LLAMA_CPP_PYTHON") or str(REPO.parent / "llvenv" / "bin" / "python")
    if not Path(cand).is_file() or subprocess.run([cand, "-c", "import llama_cpp"], capture_output=True).returncode:
        return None
    return cand


_LLAMA_CHAT = r"""
import sys, json, ctypes, llama_cpp
out = []
for tmpl, conv, add in json.load(sys.stdin):
    msgs = (llama_cpp.llama_chat_message * len(conv))()
    keep = []
    for i, m in enumerate(conv):
        r, c = m["role"].encode(), m["content"].encode()
        keep += [r, c]
        msgs[i].role, msgs[i].content = r, c
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(tmpl.encode(), msgs, len(conv), add, buf, 1 << 16)
    out.append(buf.raw[:n].decode() if n >= 0 else None)
json.dump(out, sys.stdout)
"""


def test_builtins_match_llama_cpp():
    py = _llama_python()
    if py is None:
        pytest.skip("llama.cpp's Python binding not found (set MINIRT_LLAMA_CPP_PYTHON to a python with llama_cpp)")
    convs = [
        FRANCE,
        [{"role": "system", "content": "  Be terse.\n"}, {"role": "user", "content": " Hi \n"}],
        [{"role": "system", "content": "S1"}, {"role": "system", "content": "S2 "}, {"role": "user", "content": "u1"},
         {"role": "assistant", "content": " a1 "}, {"role": "user", "content": "u2"}],
        [{"role": "assistant", "content": "first"}, {"role": "system", "content": "late"}, {"role": "user",
                                                                                            "content": "q"}],
        [{"role": "tool", "content": "{}"}, {"role": "user", "content": "\t\v tabs\f"}],
    ]
    req = [(name, c, add) for name in BUILTIN_TEMPLATES for c in convs for add in (True, False)]
    res = subprocess.run([py, "-c", _LLAMA_CHAT], input=json.dumps(req), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for (name, conv, add), ref in zip(req, json.loads(res.stdout)):
        assert ChatTemplate.builtin(name).render(conv, add_generation_prompt=add) == ref, (name, conv, add)


class _FakeTok:
    vocab_type = "spm"
    bos_id = eos_id = unk_id = pad_id = None

    def __init__(self, *tokens: str) -> None:
        self._t = set(tokens)

    def token_to_id(self, t: str):
        return 1 if t in self._t else None


def test_builtin_choice():
    assert choose_builtin("gemma3", _FakeTok()) == "gemma"
    assert choose_builtin("qwen2", _FakeTok("<|im_start|>")) == "chatml"
    assert choose_builtin("llama", _FakeTok("<|start_header_id|>", "<|eot_id|>")) == "llama3"
    assert choose_builtin("llama", _FakeTok("<s>")) == "llama2-sys-bos"
    assert choose_builtin("phi2", None) == "chatml"


def test_overrides(qwen_file, qwen_tok):
    assert ChatTemplate.from_gguf(qwen_file, qwen_tok,
                                  override="gemma").render(FRANCE).startswith("<start_of_turn>user")
    custom = ChatTemplate.from_gguf(qwen_file, qwen_tok,
                                    override="{{ bos_token }}|{{ eos_token }}|{{ messages[0].content }}")
    assert custom.render(FRANCE) == "<|endoftext|>|<|im_end|>|What is the capital of France?"
    md = {**qwen_file.metadata, "tokenizer.chat_template.tool_use": "TOOLS {{ tools | length }}"}
    assert ChatTemplate.from_metadata(md, qwen_tok, override="tool_use").render(FRANCE, tools=[{}]) == "TOOLS 1"
    with pytest.raises(minirt.TemplateError, match="unknown chat template 'nonsense'"):
        ChatTemplate.from_gguf(qwen_file, qwen_tok, override="nonsense")
    with pytest.raises(minirt.TemplateError, match="does not compile"):
        ChatTemplate.from_gguf(qwen_file, qwen_tok, override="{% if %}")


def test_hf_conventions():
    t = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% endfor %}|{{ strftime_now('%Y') }}|{{ {'k': 'é'} | tojson }}|{{ extra_var }}"
        "|{{ add_generation_prompt }}|{{ tools is none }}", bos_token="<s>")
    year = time.strftime("%Y")
    out = t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], extra_var=7)
    assert out == f'a|{year}|{{"k": "é"}}|7|True|True'
    with pytest.raises(minirt.TemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render(FRANCE)


# ---------------------------------------------------------------------------------------------
# sandbox: internals, loops, output size
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source, match", [
    ("{{ messages.__class__ }}", "unsafe"),
    ("{{ raise_exception.__globals__ }}", "unsafe"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ messages[0]['__class__'] }}", "unsafe"),
    ("{{ messages._private }}", "unsafe"),
    ("{{ os.system('echo pwned') }}", "undefined"),
    ("{{ open('/etc/passwd').read() }}", "undefined"),
    ("{{ messages.append(1) }}", "unsafe"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
])
def test_sandbox_refuses_internals(source, match):
    with pytest.raises(minirt.TemplateError, match=match):
        ChatTemplate(source).render(FRANCE)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "{% for i in range(10**5) %}{% for j in range(10**5) %}{{ '' }}{% endfor %}{% endfor %}",
])
def test_endless_loops_time_out(source):
    tmpl = ChatTemplate(source, timeout_s=0.3)
    t = time.perf_counter()
    with pytest.raises(minirt.TemplateError, match="did not finish"):
        tmpl.render(FRANCE)
    assert time.perf_counter() - t < 3.0


@pytest.mark.parametrize("source", [
    "{{ 'x' * 10**9 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}"
    "{% set ns.s = t %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "{{ 'x'.center(10**9) }}", "{{ 'x' | center(10**9) }}", "{{ ('x' * 1000).replace('', 'y' * 100000) }}",
    "{{ '%999999999d' % 1 }}", "{{ '{:>999999999}'.format(1) }}", "{{ '{0:{1}}'.format('x', 10**9) }}",
    "{{ 10 ** 100000 }}", "{{ ('z' * 1000) | join('w' * 100000) }}",
])
def test_enormous_output_is_refused(source):
    t = time.perf_counter()
    with pytest.raises(minirt.TemplateError, match="too large"):
        ChatTemplate(source, timeout_s=5.0).render(FRANCE)
    assert time.perf_counter() - t < 2.0


def test_output_limit_scales_with_input(qwen_tmpl):
    long = [{"role": "user", "content": "word " * 300_000}]  # 1.5 M characters: over the base 1 Mi limit
    assert len(qwen_tmpl.render(long)) > 1_500_000
    with pytest.raises(minirt.TemplateError, match="too large"):
        ChatTemplate("{{ messages[0].content }}", max_output_chars=100).render(long)


def test_concurrent_renders(qwen_tmpl):
    expected = qwen_tmpl.render(FRANCE)
    results: list[str] = []

    def work():
        for _ in range(20):
            results.append(qwen_tmpl.render(FRANCE))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [expected] * 80


def test_render_is_fast(qwen_tmpl):
    t = time.perf_counter()
    for _ in range(50):
        qwen_tmpl.render(FRANCE * 4)
    assert (time.perf_counter() - t) / 50 < 0.05


# ---------------------------------------------------------------------------------------------
# message validation
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages, match", [
    (None, "must be a list"),
    ("hello", "must be a list"),
    ([["user", "hi"]], r"messages\[0\] must be an object"),
    ([{"content": "hi"}], r"messages\[0\].role"),
    ([{"role": 3, "content": "hi"}], r"messages\[0\].role"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be"),
    ([{"role": "user"}], r"messages\[0\].content is missing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only 'text' parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\].text"),
])
def test_bad_messages(qwen_tmpl, messages, match):
    with pytest.raises(minirt.InvalidRequestError, match=match):
        qwen_tmpl.render(messages)


def test_message_shapes_accepted(qwen_tmpl):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital "}, {"type": "text",
                                                                                             "text": "of France?"}]}]
    assert qwen_tmpl.render(parts) == qwen_tmpl.render(FRANCE)
    # an unknown role is refused before any template sees it
    with pytest.raises(minirt.InvalidRequestError, match="'narrator'"):
        ChatTemplate.builtin("chatml").render([{"role": "narrator", "content": "once"}])
    with pytest.raises(minirt.InvalidRequestError, match="empty"):
        ChatTemplate.builtin("chatml").render([])
    # a known role the template does not handle: the template's own raise_exception surfaces as TemplateError
    assert "<|im_start|>tool\nonce<|im_end|>" in ChatTemplate.builtin("chatml").render([{"role": "tool",
                                                                                         "content": "once"}])
    strict = ChatTemplate("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                          "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{% endfor %}")
    with pytest.raises(minirt.TemplateError, match="unknown role tool"):
        strict.render([{"role": "tool", "content": "once"}])
    with pytest.raises(minirt.InvalidRequestError, match="tools"):
        qwen_tmpl.render(FRANCE, tools="get_weather")
