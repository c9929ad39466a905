"""Tool calls in generated text, DeepSeek-V3's format (DeepSeek-V3 / R1 and the fallback chat
template; the format vLLM's `deepseek_v3` tool parser reads):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

become OpenAI's `tool_calls` ([{id, type, function: {name, arguments (a JSON string)}}]),
the text before the block the message's `content` (None when empty). Text whose block holds
no well-formed call, or a call whose arguments are not valid JSON, stays text: the client
gets what the model wrote rather than an error or a call made up from it (logged at INFO).

Streaming (ToolCallStream): text before the block streams as content; from the block's
first marker (or any text that could begin it) the text is held until the request ends
and then parsed as the whole response is, so a streamed answer and a whole one agree.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

log = logging.getLogger(__name__)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"

_CALL = re.compile(
    re.escape(CALL_BEGIN)
    + r"(?P<type>.*?)"
    + re.escape(TOOL_SEP)
    + r"(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
    + re.escape(CALL_END),
    re.DOTALL,
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content before the calls or None, tool_calls) when text holds a calls block of
    well-formed calls with JSON arguments; None (keep it as text) otherwise."""
    at = text.find(CALLS_BEGIN)
    if at < 0:
        return None
    calls = []
    for m in _CALL.finditer(text, at):
        name, args = m.group("name").strip(), m.group("args").strip()
        if not name:
            log.info("tool call without a function name: returned as text")
            return None
        try:
            json.loads(args)
        except ValueError as e:
            log.info("tool call %r: arguments are not valid JSON (%s): returned as text", name, e)
            return None
        calls.append({"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}})
    if not calls:
        log.info("a tool-calls block without a well-formed call: returned as text")
        return None
    return (text[:at] or None), calls


def _held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of text could begin marker (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Content deltas in; what to send out (module docstring). push -> content to send now;
    finish -> (content, tool_calls or None) for the end of the response."""

    def __init__(self) -> None:
        self._held = ""  # text not sent: a possible marker start, or the calls block and after
        self._in_block = False

    def push(self, delta: str) -> str:
        if self._in_block:
            self._held += delta
            return ""
        text = self._held + delta
        at = text.find(CALLS_BEGIN)
        if at >= 0:
            self._in_block, self._held = True, text[at:]
            return text[:at]
        n = _held_prefix(text, CALLS_BEGIN)
        self._held = text[len(text) - n :] if n else ""
        return text[: len(text) - n]

    def finish(self, delta: str = "") -> tuple[str, list[dict[str, Any]] | None]:
        text = self.push(delta)
        held, self._held = self._held, ""
        if not self._in_block:
            return text + held, None
        parsed = parse_tool_calls(held)
        if parsed is None:
            return text + held, None
        return text, parsed[1]


__all__ = ["ToolCallStream", "new_call_id", "parse_tool_calls"]
