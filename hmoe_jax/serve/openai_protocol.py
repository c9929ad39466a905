"""The OpenAI wire format `hmoe serve` speaks: request bodies (validated strictly: unknown
fields, wrong types and unsupported values are a 400 naming the field), the nested error
object, response and stream-chunk bodies, the chat template, and incremental detokenization
with stop strings. Plain data and text: no jax, no HTTP framework.

Field semantics follow the OpenAI API and vLLM's extensions where OpenAI has none
(`top_k`, `ignore_eos`, `return_token_ids`, `stream_options.continuous_usage_stats`,
`/tokenize`). Defaults as OpenAI documents them: temperature 1, top_p 1; max_tokens 16 for
completions, the rest of the context for chat (vLLM's choice). A checkpoint's
generation_config.json (`hmoe serve --generation-config auto`, io/generation_config.py)
replaces these defaults as vLLM does: its temperature / top_p / top_k, and its
max_new_tokens as max_tokens (cut to the rest of the context); a request field given wins.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hmoe_jax.io.generation_config import NO_DEFAULTS, GenerationDefaults
from hmoe_jax.model.sampling import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
MAX_STOP_STRINGS = 4  # OpenAI: "up to 4 sequences"


class ApiError(Exception):
    """An HTTP error with OpenAI's nested error body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request bodies


class _Strict(BaseModel):
    # strict: "1" is not a number, 1.0 is not an int, 0 is not a bool; no NaN / inf.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 = off
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM: token ids beside the text (prompt_token_ids, token_ids)
    user: str | None = None
    # Known to the OpenAI API but not implemented: accepted only at their neutral value.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


_UNSUPPORTED = {  # field -> its neutral value; anything else is a 400 naming the field
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": (None, {}),
    "echo": False,
    "logprobs": (None, False),
    "top_logprobs": None,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
    "parallel_tool_calls": None,
}


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """The validated request, or ApiError(400) naming the first bad field."""
    try:
        req = model.model_validate_json(body or b"")
    except ValidationError as e:
        errs = e.errors()
        # A union field fails once per member: report the deepest (most specific) failure.
        err = max(
            (x for x in errs if x["loc"][:1] == errs[0]["loc"][:1]),
            key=lambda x: (len(x["loc"]), x["type"] != "extra_forbidden"),
        )
        loc = ".".join(str(p) for p in err["loc"] if not _union_tag(p))
        if err["type"] == "json_invalid":
            raise ApiError(400, f"request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type":
            raise ApiError(400, "request body must be a JSON object") from None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown field {loc!r}", param=loc) from None
        if err["type"] == "missing":
            raise ApiError(400, f"missing required field {loc!r}", param=loc) from None
        raise ApiError(400, f"{loc}: {err['msg']} (got {err.get('input')!r})", param=loc or None) from None
    for name, neutral in _UNSUPPORTED.items():
        if name in req.model_fields_set and name in type(req).model_fields:
            v = getattr(req, name)
            if v not in (neutral if isinstance(neutral, tuple) else (neutral,)):
                raise ApiError(400, f"{name}={v!r} is not supported by this server", param=name)
    if getattr(req, "n", 1) != 1:
        raise ApiError(400, f"n={req.n} is not supported: only n=1", param="n")
    if getattr(req, "best_of", None) not in (None, 1):
        raise ApiError(400, f"best_of={req.best_of} is not supported: only 1", param="best_of")
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    stop = getattr(req, "stop", None)
    if isinstance(stop, list) and (len(stop) > MAX_STOP_STRINGS or any(not s for s in stop)):
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    if stop == "":
        raise ApiError(400, "stop: must not be empty", param="stop")
    if isinstance(getattr(req, "prompt", None), list) and not req.prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    return req


def _union_tag(p: Any) -> bool:
    """pydantic names the union member in an error's location ('str', 'list[int]'): not a field."""
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p)


def stop_strings(req: _SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def _pick(given: Any, default: Any, builtin: Any) -> Any:
    return given if given is not None else (default if default is not None else builtin)


def sampling_params(
    req: _SamplingFields, max_new_tokens: int, defaults: GenerationDefaults = NO_DEFAULTS
) -> SamplingParams:
    """A request field that is given wins; else generation_config.json's default; else OpenAI's."""
    temperature = float(_pick(req.temperature, defaults.temperature, 1.0))
    seed = req.seed if req.seed is not None else (secrets.randbelow(2**32) if temperature > 0 else 0)
    return SamplingParams(
        temperature=temperature,
        top_p=float(_pick(req.top_p, defaults.top_p, 1.0)),
        top_k=max(0, _pick(req.top_k, defaults.top_k, 0)),
        seed=int(seed),
        max_new_tokens=int(max_new_tokens),
        stop_ids=() if req.ignore_eos else None,
    ).validate()


def max_new_tokens(
    req: _SamplingFields,
    prompt_len: int,
    max_model_len: int,
    *,
    chat: bool,
    default_max_tokens: int | None = None,
) -> int:
    """The request's token budget, or ApiError(400) when prompt + budget exceed the context.
    Without max_tokens: chat runs to the end of the context (vLLM), completions 16 (OpenAI);
    `default_max_tokens` (generation_config.json's max_new_tokens) replaces both, and like
    them is cut to the room the context leaves, never an error."""
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
    where = "messages" if chat else "prompt"
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your {where} has "
            f"{prompt_len} tokens, which leaves no room for any completion.",
            param=where,
        )
    if asked is None:
        room = max_model_len - prompt_len
        if default_max_tokens is not None:
            return min(int(default_max_tokens), room)
        return room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    if prompt_len + asked > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the {where}, {asked} for the completion). "
            f"Please reduce the length of the {where} or the completion.",
            param=param,
        )
    return int(asked)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ApiError(400, f"{param}: token id {i} out of range [0, {vocab_size})", param=param)
    return list(ids)


# ---------------------------------------------------------------- chat template

# Used when the checkpoint has no chat template (the embedded tiny model): role-tagged turns.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplate:
    """The checkpoint's chat template (tokenizer_config.json `chat_template`, or a
    chat_template.jinja file, as transformers reads them) rendered with Jinja2 in a sandbox,
    as transformers' apply_chat_template does (trim_blocks, lstrip_blocks,
    add_generation_prompt, bos/eos tokens). A checkpoint template renders its own special
    tokens, so its text is encoded without adding them again; the fallback template's text
    goes through the tokenizer's plain encode (which adds the BOS)."""

    def __init__(self, checkpoint: str | Path | None, encode: Callable[[str], list[int]]):
        import jinja2.sandbox

        self.source, text, self._special = "default", DEFAULT_CHAT_TEMPLATE, {}
        self._encode = encode
        root = Path(checkpoint) if checkpoint is not None else None
        cfg_path = root / "tokenizer_config.json" if root else None
        cfg = json.loads(cfg_path.read_text()) if cfg_path and cfg_path.exists() else {}
        tpl = cfg.get("chat_template")
        if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
            tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
        if tpl is None and root and (root / "chat_template.jinja").exists():
            tpl = (root / "chat_template.jinja").read_text()
        if isinstance(tpl, str):
            self.source, text = "checkpoint", tpl
            for k in ("bos_token", "eos_token"):
                v = cfg.get(k)
                self._special[k] = v.get("content") if isinstance(v, dict) else (v or "")
            self._encode = _raw_encoder(root) or encode
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._tpl = env.from_string(text)

    def render(self, messages: Sequence[ChatMessage]) -> str:
        msgs = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages
        ]
        try:
            return self._tpl.render(messages=msgs, add_generation_prompt=True, **self._special)
        except Exception as e:  # noqa: BLE001 (a template's raise_exception or a Jinja error)
            raise ApiError(400, f"messages: the chat template refused them: {e}", param="messages") from None

    def encode(self, messages: Sequence[ChatMessage]) -> list[int]:
        return list(self._encode(self.render(messages)))


def _raise_template_error(msg: str) -> None:
    raise ValueError(msg)


def _raw_encoder(root: Path | None) -> Callable[[str], list[int]] | None:
    if root is None or not (root / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------- incremental text


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


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseBuilder:
    """Bodies of one request's response: the whole one, or its stream chunks."""

    def __init__(self, model: str, *, chat: bool, prompt_ids: list[int], return_token_ids: bool):
        self.model, self.chat, self.prompt_ids = model, chat, prompt_ids
        self.return_token_ids = return_token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, token_ids: list[int], finish_reason: str) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out = {
            **self._head(self.object),
            "choices": [choice],
            "usage": usage(len(self.prompt_ids), len(token_ids)),
        }
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            out["prompt_token_ids"] = list(self.prompt_ids)
        return out

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        *,
        role: bool = False,
        usage_now: dict[str, int] | None = None,
        with_usage: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if role else {"content": text}
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
        return {**head, "choices": [], "usage": usage(len(self.prompt_ids), completion_tokens)}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatTemplate",
    "CompletionRequest",
    "DetokenizeRequest",
    "ResponseBuilder",
    "TextStream",
    "TokenizeRequest",
    "parse_body",
]
