"""A request's text becomes token ids here, in the order that keeps one large body from
freezing the server: cheap refusals first, then tokenization and templating on worker
threads, never on the event loop.

1. Admission (ServerState.check_room: 429 / 503) before anything is tokenized.
2. The prompt's length in characters against the context: a text of C characters encodes
   to at least C / max_token_chars tokens (io/tokenizer.py), so a prompt that cannot fit is
   a 400 before one character is tokenized (a 4 MB prompt to a 2,048-token model: at once,
   instead of ~40 s of tokenizing on 2 cores).
3. The chat template and the tokenizer on a small thread pool. The tokenizer releases the
   GIL while it encodes (HFTokenizer.encode), so the event loop keeps streaming other
   requests' tokens and answering /health meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hmoe_jax.serve.openai_protocol import ApiError

# Two threads: one long prompt does not queue every short one behind it, and tokenizing
# never takes more than two cores from the engine.
TOKENIZE_THREADS = 2


def _text_chars(messages: Sequence[Any]) -> int:
    return sum(len(m.text()) + len(m.name or "") for m in messages)


class Ingest:
    """Prompt text -> ids for the routes (module docstring)."""

    def __init__(self, tokenizer: Any, chat: Any, max_model_len: int, threads: int = TOKENIZE_THREADS):
        self.tokenizer, self.chat, self.max_model_len = tokenizer, chat, max_model_len
        self.max_token_chars: int | None = getattr(tokenizer, "max_token_chars", None)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="hmoe-tokenize")

    def check_chars(self, n_chars: int, where: str) -> None:
        """ApiError(400) when a text of n_chars characters cannot fit the context whatever
        its tokens (at least n_chars / max_token_chars of them)."""
        k = self.max_token_chars
        if k is None or n_chars <= k * self.max_model_len:
            return
        raise ApiError(
            400,
            f"This model's maximum context length is {self.max_model_len} tokens. However, your {where} "
            f"has {n_chars} characters, which is at least {-(-n_chars // k)} tokens (a token of this "
            f"tokenizer covers at most {k} characters): refused before tokenizing.",
            param=where,
        )

    async def encode(self, text: str, where: str = "prompt", *, fit: bool = True) -> list[int]:
        """fit=False (/tokenize: counting a prompt is not serving it): no context check."""
        if fit:
            self.check_chars(len(text), where)
        return await self._run(self.tokenizer.encode, text)

    async def encode_many(self, texts: Sequence[str], where: str = "prompt") -> list[list[int]]:
        for i, t in enumerate(texts):
            self.check_chars(len(t), f"{where}.{i}" if len(texts) > 1 else where)
        return list(await asyncio.gather(*(self._run(self.tokenizer.encode, t) for t in texts)))

    async def encode_chat(
        self, messages: Sequence[Any], *, fit: bool = True, tools: Sequence[Any] | None = None
    ) -> list[int]:
        # the template only adds text, so the messages' own characters are a lower bound
        if fit:
            self.check_chars(_text_chars(messages), "messages")
        return await self._run(lambda _: self.chat.encode(messages, tools), None)

    async def _run(self, fn: Any, arg: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["Ingest", "TOKENIZE_THREADS"]
