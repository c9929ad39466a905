"""Log-probabilities in OpenAI's two wire formats, from the engine's TokenLogprob entries
(model/sampling.py: the chosen token's log-probability and the k most likely).

  completions: {"tokens": [str], "token_logprobs": [float | null],
                "top_logprobs": [{token_str: lp} | null], "text_offset": [int]}
               top_logprobs holds the chosen token and the k most likely (vLLM: so that
               logprobs=0 still reports the chosen token); null where the position has no
               entry (the first prompt token under `echo`).
  chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
               "logprob", "bytes"}]}]}, top_logprobs the k most likely.

A token's string is the tokenizer's decode of that one id, as vLLM shows it; an id that is
part of a UTF-8 character decodes to U+FFFD, and `bytes` is that string's UTF-8 (vLLM's
choice). Log-probabilities below -9999 (-inf included) are reported as -9999, as vLLM does:
JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hmoe_jax.model.sampling import TokenLogprob

MIN_LOGPROB = -9999.0


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


class LogprobFormatter:
    """Token strings (decoded once per id) and the two formats."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._strings: dict[int, str] = {}

    def token(self, tid: int) -> str:
        s = self._strings.get(tid)
        if s is None:
            s = self._strings[tid] = self._decode([int(tid)])
        return s

    def completion(
        self, ids: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int
    ) -> tuple[dict[str, Any], int]:
        """The completions object for these tokens, their text offsets starting at `offset`
        (characters before them in the choice's text); also the offset after them."""
        _check(ids, entries)
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, e in zip(ids, entries):
            s = self.token(tid)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if e is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(_lp(e.logprob))
            top = {s: _lp(e.logprob)}
            for t, lp in e.top:
                top.setdefault(self.token(t), _lp(lp))
            tops.append(top)
        obj = {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
        return obj, offset

    def chat(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> list[dict[str, Any]]:
        """The chat `content` list for these tokens."""
        _check(ids, entries)
        out = []
        for tid, e in zip(ids, entries):
            s = self.token(tid)
            if e is None:
                raise ValueError(f"logprobs: no entry for the chat token {tid}")
            top = [self._chat_entry(self.token(t), lp) for t, lp in e.top]
            out.append({**self._chat_entry(s, e.logprob), "top_logprobs": top})
        return out

    @staticmethod
    def _chat_entry(s: str, lp: float) -> dict[str, Any]:
        return {"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8"))}


def _check(ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> None:
    """A backend that reports fewer entries than tokens (or other tokens) is a bug: say so
    rather than misalign the response."""
    if len(ids) != len(entries):
        raise ValueError(f"logprobs: {len(entries)} entries for {len(ids)} tokens")
    for tid, e in zip(ids, entries):
        if e is not None and e.token != tid:
            raise ValueError(f"logprobs: the entry for token {tid} is for token {e.token}")


__all__ = ["LogprobFormatter", "MIN_LOGPROB"]
