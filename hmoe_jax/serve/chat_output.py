"""A chat choice's generated text as the message the client gets: with a reasoning parser
(serve/reasoning.py) the reasoning goes to `reasoning_content`; with tools on (the request
has tools, tool_choice is not "none") a DeepSeek-V3 tool-calls block becomes `tool_calls`
(serve/tool_parser.py). Reasoning is split off first, so a call written inside the
reasoning is not made. Whole (`whole`) or as stream deltas (`push` / `finish`)."""

from __future__ import annotations

from typing import Any

from hmoe_jax.serve.reasoning import ReasoningStream, split_reasoning
from hmoe_jax.serve.tool_parser import ToolCallStream, parse_tool_calls


class ChatOutput:
    def __init__(self, *, reasoning: str | None, tools: bool):
        self._reasoning = ReasoningStream() if reasoning else None
        self._tools = ToolCallStream() if tools else None
        self.called = False  # tool calls were made: finish_reason "tool_calls"

    def whole(self, text: str) -> dict[str, Any]:
        """The message fields (content, reasoning_content, tool_calls) of the whole text."""
        msg: dict[str, Any] = {}
        content: str | None = text
        if self._reasoning is not None:
            msg["reasoning_content"], content = split_reasoning(text)
        if self._tools is not None and content:
            parsed = parse_tool_calls(content)
            if parsed is not None:
                content, calls = parsed
                msg["tool_calls"] = calls
                self.called = True
        return {"content": content, **msg}

    def push(self, delta: str) -> list[dict[str, Any]]:
        """The stream deltas to send for this much more text (possibly none: held)."""
        r, c = self._reasoning.push(delta) if self._reasoning is not None else ("", delta)
        if self._tools is not None:
            c = self._tools.push(c)
        return _parts(r, c)

    def finish(self, delta: str) -> list[dict[str, Any]]:
        """The last deltas: held text, and the tool calls (one delta each, OpenAI's index)."""
        r, c = self._reasoning.finish(delta) if self._reasoning is not None else ("", delta)
        calls = None
        if self._tools is not None:
            c, calls = self._tools.finish(c)
        out = _parts(r, c)
        for k, call in enumerate(calls or []):
            out.append({"tool_calls": [{"index": k, **call}]})
        self.called = bool(calls)
        return out


def _parts(reasoning: str, content: str) -> list[dict[str, Any]]:
    out = []
    if reasoning:
        out.append({"reasoning_content": reasoning})
    if content:
        out.append({"content": content})
    return out


__all__ = ["ChatOutput"]
