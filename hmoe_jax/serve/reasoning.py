"""Reasoning text apart from the answer: `hmoe serve --reasoning-parser deepseek_r1` (vLLM's
flag and parser name). DeepSeek-R1 writes its reasoning, then `</think>`, then the answer;
its chat template ends the prompt with `<think>\\n`, so the output usually has no opening tag
(and when it has one, the tag is dropped). Everything up to `</think>` is
`reasoning_content`, the rest `content`; an output without `</think>` (cut by max_tokens,
say) is all reasoning, as vLLM's deepseek_r1 parser has it.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1",)


def check_parser(name: str | None) -> str | None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r}: known parsers are {', '.join(REASONING_PARSERS)}")
    return name


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; an empty part is None."""
    start = text.find(THINK_START)
    end = text.find(THINK_END)
    if start >= 0 and (end < 0 or start < end):
        text, end = (
            text[:start] + text[start + len(THINK_START) :],
            end - len(THINK_START) if end >= 0 else -1,
        )
    if end < 0:
        return text or None, None
    return text[:end] or None, text[end + len(THINK_END) :] or None


def _held(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Text deltas in, (reasoning delta, content delta) out. Text that could begin a marker
    is held until it cannot (so `</think>` split over tokens is never shown)."""

    def __init__(self) -> None:
        self._buf = ""
        self._seen_start = False  # an opening <think> already dropped (or passed)
        self._done = False  # </think> seen: the rest is content

    def push(self, delta: str) -> tuple[str, str]:
        if self._done:
            return "", delta
        text = self._buf + delta
        if not self._seen_start:
            at = text.find(THINK_START)
            end = text.find(THINK_END)
            if at >= 0 and (end < 0 or at < end):
                text, self._seen_start = text[:at] + text[at + len(THINK_START) :], True
        end = text.find(THINK_END)
        if end >= 0:
            self._done, self._buf = True, ""
            return text[:end], text[end + len(THINK_END) :]
        n = max(_held(text, THINK_END), 0 if self._seen_start else _held(text, THINK_START))
        self._buf = text[len(text) - n :] if n else ""
        return text[: len(text) - n], ""

    def finish(self, delta: str = "") -> tuple[str, str]:
        r, c = self.push(delta)
        held, self._buf = self._buf, ""
        return (r + held, c) if not self._done else (r, c + held)


__all__ = ["REASONING_PARSERS", "ReasoningStream", "check_parser", "split_reasoning"]
