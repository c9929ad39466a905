"""The chat template: a checkpoint's Jinja template (or ours, for a checkpoint without one)
rendered as transformers' apply_chat_template does, tools and tool calls included.

The fallback template (the embedded tiny model has none) writes tool calls and tool outputs
in DeepSeek-V3's format, the one serve/tool_parser.py reads back, so a tool round trip
works on the tiny model as on DeepSeek-V3 / R1 / Kimi-K2's released templates.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hmoe_jax.serve import openai_protocol as P
from hmoe_jax.serve.openai_protocol import ChatMessage
from hmoe_jax.serve.tool_parser import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    OUTPUT_BEGIN,
    OUTPUT_END,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    TOOL_SEP,
)

# Used when the checkpoint has no chat template (the embedded tiny model): role-tagged
# turns; tools as one JSON line each; an assistant's tool calls and the tool outputs in
# DeepSeek-V3's markers (a run of tool messages shares one outputs block).
DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.previtem is not defined or loop.previtem['role'] != 'tool' %}"
    + OUTPUTS_BEGIN
    + "{% endif %}"
    + OUTPUT_BEGIN
    + "{{ m['content'] }}"
    + OUTPUT_END
    + "{% if loop.nextitem is not defined or loop.nextitem['role'] != 'tool' %}"
    + OUTPUTS_END
    + "{{ '\\n' }}{% endif %}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}"
    + CALLS_BEGIN
    + "{% for c in m['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    + CALL_BEGIN
    + "{{ c['type'] }}"
    + TOOL_SEP
    + "{{ c['function']['name'] }}\n```json\n"
    "{{ c['function']['arguments'] }}\n```" + CALL_END + "{% endfor %}" + CALLS_END + "{% endif %}"
    "{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def message_dict(m: ChatMessage) -> dict[str, Any]:
    """A message as a template sees it (transformers' convention): content a string (None
    for an assistant turn that only calls tools), tool_calls / tool_call_id as given."""
    out: dict[str, Any] = {
        "role": m.role,
        "content": None if (m.content is None and m.tool_calls) else m.text(),
    }
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


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

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt text, with `tools` (OpenAI function tools as dicts) passed to the
        template as transformers' apply_chat_template does; messages carry `tool_calls`
        (arguments a JSON string) and `tool_call_id` as the client gave them."""
        msgs = [message_dict(m) for m in messages]
        extra = {"tools": list(tools)} if tools else {}
        try:
            return self._tpl.render(messages=msgs, add_generation_prompt=True, **extra, **self._special)
        except Exception as e:  # noqa: BLE001 (a template's raise_exception or a Jinja error)
            raise P.ApiError(
                400, f"messages: the chat template refused them: {e}", param="messages"
            ) from None

    def encode(
        self, messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        return list(self._encode(self.render(messages, tools)))


def _raise_template_error(msg: str) -> None:
    raise ValueError(msg)


def _raw_encoder(root: Path | None) -> Callable[[str], list[int]] | None:
    if root is None or not (root / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplate", "message_dict"]
