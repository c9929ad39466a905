"""Response and stream-chunk bodies of the OpenAI wire format (whole responses, SSE chunks,
usage): plain data, no HTTP framework. Request bodies and their validation: openai_protocol.py."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Bodies of one request's response, whole or as stream chunks. Its choices are
    prompts x n: choice i answers prompt i // n (vLLM's order). Usage counts each prompt's
    tokens once and every choice's completion tokens."""

    def __init__(
        self, model: str, *, chat: bool, prompts: Sequence[Sequence[int]], n: int = 1, return_token_ids: bool
    ):
        self.model, self.chat, self.n = model, chat, n
        self.prompts = [list(p) for p in prompts]
        self.prompt_tokens = sum(len(p) for p in self.prompts)
        self.return_token_ids = return_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return usage(self.prompt_tokens, completion_tokens)

    def choice(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str,
        logprobs: Any = None,
        message: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of the whole response; `logprobs` already in its wire format; chat:
        `message` (content / reasoning_content / tool_calls) replaces {"content": text}."""
        out: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            out["message"] = {"role": "assistant", **(message if message is not None else {"content": text})}
        else:
            out["text"] = text
        if self.return_token_ids:
            out["token_ids"] = list(token_ids)
            if not self.chat:  # vLLM: each completions choice names its prompt's ids
                out["prompt_token_ids"] = self.prompts[index // self.n]
        return out

    def full(self, choices: list[dict[str, Any]], completion_tokens: int) -> dict[str, Any]:
        out = {**self._head(self.object), "choices": sorted(choices, key=lambda c: c["index"])}
        out["usage"] = self.usage(completion_tokens)
        if self.return_token_ids and len(self.prompts) == 1:
            out["prompt_token_ids"] = self.prompts[0]
        return out

    def chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        *,
        role: bool = False,
        logprobs: Any = None,
        usage_now: dict[str, int] | None = None,
        with_usage: bool = False,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk; chat: `delta` (reasoning_content / tool_calls) replaces {"content": text}."""
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            body = delta if delta is not None else {"content": text}
            choice["delta"] = {"role": "assistant", **body} if role else body
        else:
            choice["text"] = text
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if with_usage:
            out["usage"] = usage_now
        return out

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(completion_tokens)}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


__all__ = ["SSE_DONE", "ResponseBuilder", "new_id", "sse", "usage"]
