"""Reasoning kept apart from the answer: the formats llama.cpp's ``--reasoning-format`` knows.

``<think>…</think>`` (DeepSeek R1, Qwen3, QwQ, GLM, Kimi, SmolLM3, Granite, MiniMax), Mistral's
``[THINK]…[/THINK]``, Command R7B's ``<|START_THINKING|>…<|END_THINKING|>`` and gpt-oss's
``analysis`` channel. The format is read from the chat template's source; whether the output
starts inside the thinking block is read from the rendered prompt (DeepSeek R1 and Qwen3 open
``<think>`` in the generation prompt, so the model writes only ``…</think>answer``).

:class:`Splitter` turns text deltas into ``(part, text)`` pieces, ``part`` being "reasoning" or
"content", holding back text that may be the start of a marker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

HARMONY = "gpt-oss"
TAGS = {"think": ("<think>", "</think>"), "mistral": ("[THINK]", "[/THINK]"),
        "command-r7b": ("<|START_THINKING|>", "<|END_THINKING|>")}


def detect_format(template_source: str) -> str | None:
    """The reasoning format of a template's model, or None when it has none."""
    s = template_source or ""
    if "<|channel|>" in s:
        return HARMONY
    if "[THINK]" in s:
        return "mistral"
    if "<|START_THINKING|>" in s:
        return "command-r7b"
    if "<think>" in s or "</think>" in s:
        return "think"
    return None


def starts_inside(fmt: str | None, prompt: str) -> bool:
    """Whether the output begins inside the thinking block (the prompt opened it)."""
    if fmt not in TAGS:
        return False
    start, end = TAGS[fmt]
    tail = prompt.rstrip()
    return tail.endswith(start) and not tail.endswith(end)


def may_open(fmt: str | None, prompt: str) -> bool:
    """Whether the output may still begin a thinking block: the format has one and the prompt
    neither opened it nor closed one at its end (an empty block when thinking is disabled)."""
    if fmt not in TAGS:
        return False
    start, end = TAGS[fmt]
    tail = prompt.rstrip()
    return not tail.endswith(start) and not tail.endswith(end)


def end_marker(fmt: str | None) -> str | None:
    """The text that closes the thinking block (forced when the thinking budget runs out)."""
    if fmt in TAGS:
        return TAGS[fmt][1]
    if fmt == HARMONY:
        return "<|end|><|start|>assistant<|channel|>final<|message|>"
    return None


def split(text: str, fmt: str | None, inside: bool = False) -> tuple[str, str]:
    """``(reasoning, content)`` of a finished output."""
    s = Splitter(fmt, inside)
    parts = s.feed(text) + s.finish()
    return ("".join(t for p, t in parts if p == "reasoning"), "".join(t for p, t in parts if p == "content"))


@dataclass
class Splitter:
    """Incremental split of an output into reasoning and content."""

    fmt: str | None
    inside: bool = False

    def __post_init__(self) -> None:
        self.buf = ""
        self.thinking = self.inside
        self.seen_start = self.inside

    def _take(self, pattern: str, markers: tuple[str, ...], part: str, final: bool,
              out: list[tuple[str, str]]) -> bool:
        """Emit the buffer as ``part`` up to ``pattern`` (holding back a possible marker start);
        True when the pattern was found (the buffer then starts after it)."""
        m = re.search(pattern, self.buf)
        if m is None:
            keep = 0 if final else _partial(self.buf, markers)
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            if text:
                out.append((part, text))
            return False
        if m.start():
            out.append((part, self.buf[:m.start()]))
        self.buf = self.buf[m.end():]
        return True

    # the harmony format has headers before every message: the analysis channel is the thinking
    def _harmony(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            if self.thinking:
                if not self._take(r"<\|(?:end|call|return)\|>", ("<|end|>", "<|call|>", "<|return|>"),
                                  "reasoning", final, out):
                    return out
                self.thinking = False
            else:
                if not self._take(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>",
                                  ("<|start|>assistant<|channel|>analysis<|message|>",
                                   "<|channel|>analysis<|message|>"),
                                  "content", final, out):
                    return out
                self.thinking = True

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, str]]:
        """Pieces ``(part, text)`` that are known after ``delta``."""
        self.buf += delta
        if self.fmt is None:
            out, self.buf = ([("content", self.buf)] if self.buf else []), ""
            return out
        if self.fmt == HARMONY:
            return self._harmony(final)
        start, end = TAGS[self.fmt]
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.thinking:
                k = self.buf.find(end)
                if k < 0:
                    keep = 0 if final else _partial(self.buf, (end,))
                    if len(self.buf) > keep:
                        out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                if k:
                    out.append(("reasoning", self.buf[:k]))
                self.buf = self.buf[k + len(end):].lstrip("\n")
                self.thinking = False
                continue
            if self.seen_start:  # one thinking block per answer: the rest is content
                out.append(("content", self.buf))
                self.buf = ""
                break
            lead = self.buf.lstrip()
            if lead.startswith(start):
                self.buf = lead[len(start):].lstrip("\n")
                self.thinking = self.seen_start = True
                continue
            if not final and start.startswith(lead):
                break  # may still become the opening marker
            self.seen_start = True  # the answer starts without thinking
        return out

    def finish(self) -> list[tuple[str, str]]:
        out = self.feed("", final=True)
        if self.buf:
            out.append(("reasoning" if self.thinking else "content", self.buf))
            self.buf = ""
        return out


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    keep = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), keep, -1):
            if text.endswith(m[:k]):
                keep = k
                break
    return keep


class ChatParser:
    """A chat's output parser: reasoning (this module) first, then tool calls
    (:class:`minirt.tools.ToolPlan`) in what remains. ``apply(completion)`` fills its
    ``reasoning``, ``content`` and ``tool_calls``; :meth:`stream` does it incrementally."""

    def __init__(self, fmt: str | None, inside: bool, plan: Any = None) -> None:
        self.fmt, self.inside, self.plan = fmt, inside, plan
        self.budget: int | None = None  # thinking_budget: tokens of thinking before the block is closed
        self.end_ids: list[int] = []  # the tokens that close it
        # the opening marker's token when the answer may still open a thinking block (a grammar
        # then also allows it as the first token); None when it is not one token or the prompt
        # already closed the block (enable_thinking=False renders an empty one)
        self.open_id: int | None = None

    def _tools(self) -> Any:
        from .tools import ToolStream

        if self.plan is not None:
            return self.plan.stream()
        # gpt-oss's answer lies in its final channel, between headers, even without tools
        return ToolStream("gpt-oss") if self.fmt == HARMONY else None

    def apply(self, c: Any) -> None:
        reasoning, content = split(c.text, self.fmt, self.inside)
        c.reasoning = reasoning if self.fmt is not None else None
        if self.plan is not None:
            c.content, c.tool_calls = self.plan.parse(content)
        elif self.fmt == HARMONY:
            from .tools import parse_gpt_oss

            c.content = parse_gpt_oss(content)[0]
        else:
            c.content = content

    def stream(self) -> ChatStream:
        return ChatStream(Splitter(self.fmt, self.inside), self._tools(), self.plan is not None)


class ChatStream:
    """``feed(delta)`` / ``finish()`` → ``(reasoning delta, content delta, completed tool calls)``."""

    def __init__(self, splitter: Splitter, tools: Any, keep_calls: bool) -> None:
        self.splitter, self.tools, self.keep_calls = splitter, tools, keep_calls

    def _route(self, pieces: list[tuple[str, str]], final: bool) -> tuple[str, str, list[Any]]:
        reasoning = "".join(t for p, t in pieces if p == "reasoning")
        content = "".join(t for p, t in pieces if p == "content")
        calls: list[Any] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if final:
                more, last = self.tools.finish()
                content, calls = content + more, calls + last
            if not self.keep_calls:
                calls = []  # no tools were offered (gpt-oss: only its headers are parsed)
        return reasoning, content, calls

    def feed(self, delta: str) -> tuple[str, str, list[Any]]:
        return self._route(self.splitter.feed(delta), False)

    def finish(self) -> tuple[str, str, list[Any]]:
        return self._route(self.splitter.finish(), True)
