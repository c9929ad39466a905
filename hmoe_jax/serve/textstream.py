"""Incremental detokenization with stop strings: token ids in, text deltas out (the HTTP
layer's streamed text; openai_protocol re-exports it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    """Token ids in, text deltas out, as they become safe to show: a delta never ends in a
    partial UTF-8 character (decoded text ending in U+FFFD waits for the next token, as
    TGI / vLLM do), and with stop strings the last max(len(stop)) - 1 characters are held
    back until they cannot start a stop string. When a stop string appears, the text is cut
    before it and `stopped` is set (the caller then cancels the request)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode, self.stop = decode, list(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self._prefix = self._read = 0  # TGI's prefix / read offsets into ids
        self.text = ""  # decoded complete text so far (cut at a stop string)
        self._sent = 0  # characters of text already returned
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the request (a trailing partial character
        included, as U+FFFD)."""
        if not self.stopped:
            before = self._decode(self.ids[self._prefix : self._read])
            self.text += self._decode(self.ids[self._prefix :])[len(before) :]
            self._prefix = self._read = len(self.ids)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stop and not self.stopped:
            start = max(0, self._sent - self._hold)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True
        end = len(self.text) if (final or self.stopped) else max(self._sent, len(self.text) - self._hold)
        out, self._sent = self.text[self._sent : end], end
        return out


__all__ = ["TextStream"]
