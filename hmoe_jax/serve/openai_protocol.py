"""The OpenAI wire format `hmoe serve` speaks: request bodies (validated strictly: unknown
fields, wrong types and unsupported values are a 400 naming the field), the nested error
object, the mapping of a request onto SamplingParams. Response bodies: openai_response.py;
the chat template: chat_template.py; incremental detokenization: textstream.py. Plain data
and text: no jax, no HTTP framework.

Field semantics follow the OpenAI API and vLLM's extensions where OpenAI has none
(`top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`,
`return_token_ids`, `stream_options.continuous_usage_stats`, `/tokenize`). Unknown top-level
fields are accepted and logged at WARNING, as vLLM does ("fields present in the request but
ignored"); nested objects stay strict. Defaults as OpenAI documents them: temperature 1, top_p 1; max_tokens 16 for
completions, the rest of the context for chat (vLLM's choice). A checkpoint's
generation_config.json (`hmoe serve --generation-config auto`, io/generation_config.py)
replaces these defaults as vLLM does: its temperature / top_p / top_k, and its
max_new_tokens as max_tokens (cut to the rest of the context); a request field given wins.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hmoe_jax.io.generation_config import NO_DEFAULTS, GenerationDefaults
from hmoe_jax.model.sampling import MAX_LOGPROBS, SamplingParams
from hmoe_jax.serve.openai_response import (  # noqa: F401 (re-exported: P.ResponseBuilder, ...)
    SSE_DONE,
    ResponseBuilder,
    new_id,
    sse,
    usage,
)
from hmoe_jax.serve.textstream import TextStream  # noqa: F401 (re-exported: P.TextStream)

log = logging.getLogger(__name__)
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


class _Body(_Strict):
    # A request body: unknown top-level fields are kept aside (model_extra), logged and
    # ignored, so clients written for vLLM / OpenAI that send extra fields still work.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _SamplingFields(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 = off
    min_p: float | None = Field(None, ge=0, le=1)  # vLLM
    seed: int | None = Field(None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM: stop ids besides the eos ids
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)  # vLLM: eos / stop ids masked until this many tokens
    presence_penalty: float | None = Field(None, ge=-2, le=2)  # None: generation_config's, else 0
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM (HF's)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    response_format: ResponseFormat | None = None
    return_token_ids: bool = False  # vLLM: token ids beside the text (prompt_token_ids, token_ids)
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, passed to the chat template
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: str  # a JSON object as a string, as OpenAI sends it


class ToolCall(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer

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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many calls it makes

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (a named tool_choice: only that one)."""
        if not self.tools:
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t["function"]["name"] == self.tool_choice.function.name]
        return tools

    def tools_on(self) -> bool:
        """Whether tool calls are parsed out of the output: tools given, tool_choice not none."""
        return bool(self.tools) and self.tool_choice != "none"


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


_UNSUPPORTED = {  # field -> its neutral value; anything else is a 400 naming the field
    "suffix": None,
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
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise ApiError(
            400, f"best_of={best_of} is not supported: only best_of == n ({req.n})", param="best_of"
        )
    if isinstance(req, ChatCompletionRequest):
        check_tools(req)
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if getattr(req, "stream_options", None) is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
    stop = getattr(req, "stop", None)
    if isinstance(stop, list) and (len(stop) > MAX_STOP_STRINGS or any(not s for s in stop)):
        raise ApiError(400, f"stop: at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    if stop == "":
        raise ApiError(400, "stop: must not be empty", param="stop")
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt, list) and isinstance(prompt[0], list):
        for i, p in enumerate(prompt):
            if not p:
                raise ApiError(400, f"prompt.{i}: must not be empty", param=f"prompt.{i}")
    if req.model_extra:
        log.warning("fields present in the request but ignored: %s", ", ".join(sorted(req.model_extra)))
    return req


def check_tools(req: ChatCompletionRequest) -> None:
    """Tool names unique; a named or required tool_choice has tools to choose from; tool
    calls only on assistant messages; each tool message answers an earlier call's id."""
    names: dict[str, int] = {}
    for i, t in enumerate(req.tools or []):
        if t.function.name in names:
            raise ApiError(
                400,
                f"tools.{i}: function name {t.function.name!r} already given by tools.{names[t.function.name]}",
                param=f"tools.{i}.function.name",
            )
        names[t.function.name] = i
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ApiError(
            400, f"tool_choice names {choice.function.name!r}, which is not among tools", param="tool_choice"
        )
    if choice == "required" and not names:
        raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
    call_ids: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise ApiError(
                400,
                f"messages.{i}: only assistant messages have tool_calls",
                param=f"messages.{i}.tool_calls",
            )
        for c in m.tool_calls or []:
            call_ids.add(c.id)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise ApiError(
                    400,
                    f"messages.{i}: a tool message needs tool_call_id",
                    param=f"messages.{i}.tool_call_id",
                )
            if m.tool_call_id not in call_ids:
                raise ApiError(
                    400,
                    f"messages.{i}: tool_call_id {m.tool_call_id!r} answers no earlier assistant tool call",
                    param=f"messages.{i}.tool_call_id",
                )
        elif m.tool_call_id is not None:
            raise ApiError(
                400, f"messages.{i}: only tool messages have tool_call_id", param=f"messages.{i}.tool_call_id"
            )


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
    req: _SamplingFields,
    max_new_tokens: int,
    defaults: GenerationDefaults = NO_DEFAULTS,
    *,
    vocab_size: int,
    eos_ids: Sequence[int] = (),
) -> SamplingParams:
    """One sample's parameters (seed: see sample_seeds). A request field that is given wins;
    else generation_config.json's default; else OpenAI's. stop_token_ids are added to the
    model's eos ids (vLLM), which ignore_eos drops."""
    temperature = float(_pick(req.temperature, defaults.temperature, 1.0))
    stop_ids: tuple[int, ...] | None = None  # the engine's default: the model's eos ids
    if req.stop_token_ids is not None or req.ignore_eos:
        extra = check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
        stop_ids = tuple(dict.fromkeys([*(() if req.ignore_eos else eos_ids), *extra]))
    if isinstance(req, CompletionRequest):
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    else:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    params = SamplingParams(
        temperature=temperature,
        top_p=float(_pick(req.top_p, defaults.top_p, 1.0)),
        top_k=max(0, _pick(req.top_k, defaults.top_k, 0)),
        seed=0,
        max_new_tokens=int(max_new_tokens),
        stop_ids=stop_ids,
        presence_penalty=float(_pick(req.presence_penalty, defaults.presence_penalty, 0.0)),
        frequency_penalty=float(_pick(req.frequency_penalty, defaults.frequency_penalty, 0.0)),
        repetition_penalty=float(_pick(req.repetition_penalty, defaults.repetition_penalty, 1.0)),
        logit_bias=parse_logit_bias(req.logit_bias, vocab_size),
        min_p=float(_pick(req.min_p, defaults.min_p, 0.0)),
        min_tokens=int(req.min_tokens),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured_output(req),
    )
    try:
        return params.validate()
    except ValueError as e:
        raise ApiError(400, str(e)) from None


def structured_output(req: _SamplingFields) -> tuple[str, str] | None:
    """SamplingParams.structured of response_format; ApiError(400) naming the field when it
    is malformed or its schema does not compile (llguidance's message)."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise ApiError(
            400,
            f"response_format.json_schema is only allowed with type 'json_schema', not {fmt.type!r}",
            param="response_format.json_schema",
        )
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        kind, spec, param = "json_object", "", "response_format"
    else:
        if fmt.json_schema is None:
            raise ApiError(
                400,
                "response_format type 'json_schema' needs json_schema",
                param="response_format.json_schema",
            )
        if fmt.json_schema.schema_ is None:
            raise ApiError(
                400, "response_format.json_schema needs schema", param="response_format.json_schema.schema"
            )
        kind, spec, param = (
            "json_schema",
            json.dumps(fmt.json_schema.schema_),
            "response_format.json_schema.schema",
        )
    try:
        from hmoe_jax.model.structured import check_schema

        check_schema(kind, spec)
    except ImportError:
        raise ApiError(
            400, "response_format json_object / json_schema needs llguidance (the serve extra)", param=param
        ) from None
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    return kind, spec


def sample_seeds(req: _SamplingFields, temperature: float, count: int) -> list[int]:
    """The seed of each of a prompt's `count` samples: sample j of a seeded request uses
    (seed + j) mod 2^32, so sample 0 draws what the same request with n=1 draws; without a
    seed each sample gets its own random seed (0 when greedy: the seed is not used)."""
    if req.seed is not None:
        return [(req.seed + j) % 2**32 for j in range(count)]
    return [secrets.randbelow(2**32) if temperature > 0 else 0 for _ in range(count)]


_TOKEN_ID = re.compile(r"-?[0-9]+")


def parse_logit_bias(raw: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (JSON keys are strings) -> ((id, bias), ...) sorted by id;
    a key that is not a decimal id, an id outside the vocabulary or a bias outside
    [-100, 100] is a 400 naming the key."""
    out = []
    for key, bias in (raw or {}).items():
        param = f"logit_bias.{key}"
        if not _TOKEN_ID.fullmatch(key):
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id", param=param)
        tok = int(key)
        if not 0 <= tok < vocab_size:
            raise ApiError(
                400, f"logit_bias: key {key!r}: token id out of range [0, {vocab_size})", param=param
            )
        if not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias: key {key!r}: bias {bias} outside [-100, 100]", param=param)
        out.append((tok, float(bias)))
    return tuple(sorted(out))


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


__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "ResponseBuilder",
    "TextStream",
    "TokenizeRequest",
    "parse_body",
]
