"""Chat tools and reasoning, in process on the stub backend with the unmodified `openai`
client: a DeepSeek-V3 tool-call block emitted as byte-token ids comes back as `tool_calls`
(whole and streamed), the follow-up turn renders the call and its output in DeepSeek-V3's
markers, bad JSON and tool_choice "none" stay text, bad tool fields are 400s, and
`--reasoning-parser deepseek_r1` splits `</think>`. Expected values are written out by hand."""

from __future__ import annotations

import json
import logging

import openai
import pytest
from fastapi.testclient import TestClient

from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
from hmoe_jax.serve.reasoning import ReasoningStream, split_reasoning
from hmoe_jax.serve.tool_parser import ToolCallStream
from tests.serve_stub import TOK, StubBackend, ids

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALLS = (
    "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Tōkyō"}\n```<｜tool▁call▁end｜>\n'
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>"
)
USER = [{"role": "user", "content": "weather in Tokyo?"}]


def client_for(script, **kw):
    b = StubBackend(ids(script))
    opts = ServeOptions(model_name="stub", root="/stub", vocab_size=512, max_model_len=2048, **kw)
    tc = TestClient(create_app(ServerState(b, TOK, ChatTemplate(None, TOK.encode), opts)))
    return (
        openai.OpenAI(base_url="http://testserver/v1", api_key="EMPTY", http_client=tc, max_retries=0),
        b,
        tc,
    )


def prompt_text(b: StubBackend) -> str:
    return TOK.decode([int(t) for t in b.submitted[-1].prompt])


def test_tool_calls_round_trip_through_the_template():
    client, b, _ = client_for(CALLS)
    r = client.chat.completions.create(model="stub", messages=USER, tools=[WEATHER, TIME], temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    calls = ch.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Tōkyō"}
    assert json.loads(calls[1].function.arguments) == {}
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert calls[0].id != calls[1].id
    first_prompt = prompt_text(b)
    assert '"name": "get_weather"' in first_prompt and "<|tools|>" in first_prompt

    history = USER + [
        ch.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"},
    ]
    client.chat.completions.create(model="stub", messages=history, tools=[WEATHER, TIME], temperature=0)
    assert prompt_text(b).endswith(
        "<|user|>\nweather in Tokyo?\n"
        "<|assistant|>\nLet me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Tōkyō"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\n"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜><｜tool▁outputs▁end｜>\n"
        "<|assistant|>\n"
    )


def test_streamed_tool_calls_assemble_to_the_same_calls():
    client, _, _ = client_for(CALLS)
    with client.beta.chat.completions.stream(
        model="stub", messages=USER, tools=[WEATHER, TIME], temperature=0
    ) as s:
        for _ in s:
            pass
        final = s.get_final_completion()
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
        ("get_weather", {"city": "Tōkyō"}),
        ("get_time", {}),
    ]
    # no marker text leaked into the streamed content
    chunks = list(client.chat.completions.create(model="stub", messages=USER, tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me check."


def test_tool_call_stream_holds_a_split_marker():
    s = ToolCallStream()
    out = "".join(s.push(ch) for ch in CALLS)  # one character at a time
    text, calls = s.finish()
    assert out + text == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    s = ToolCallStream()
    assert s.push("a <｜tool") == "a "  # could begin the marker: held
    assert s.finish(" x") == ("<｜tool x", None)  # it did not


def test_invalid_json_arguments_fall_back_to_text(caplog):
    bad = CALLS.replace('{"city": "Tōkyō"}', '{"city": Tokyo}')
    client, _, _ = client_for(bad)
    with caplog.at_level(logging.INFO, logger="hmoe_jax.serve.tool_parser"):
        r = client.chat.completions.create(model="stub", messages=USER, tools=[WEATHER, TIME])
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == bad
    assert r.choices[0].finish_reason == "length"  # the stub's end, not tool_calls
    assert "not valid JSON" in caplog.text
    chunks = list(
        client.chat.completions.create(model="stub", messages=USER, tools=[WEATHER, TIME], stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == bad
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


@pytest.mark.parametrize("tools", [None, "none"])
def test_no_tools_or_tool_choice_none_returns_raw_text(tools):
    client, _, _ = client_for(CALLS)
    kw = {"tools": [WEATHER, TIME], "tool_choice": "none"} if tools else {}
    r = client.chat.completions.create(model="stub", messages=USER, **kw)
    assert r.choices[0].message.content == CALLS and r.choices[0].message.tool_calls is None


def test_named_tool_choice_gives_the_template_only_that_tool():
    client, b, _ = client_for(CALLS)
    client.chat.completions.create(
        model="stub",
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    p = prompt_text(b)
    assert '"name": "get_time"' in p and "get_weather" not in p


BAD = [
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "already given"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "nope",
    ),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name", ""),
    (
        {"messages": USER + [{"role": "tool", "tool_call_id": "call_x", "content": "hi"}]},
        "messages.1.tool_call_id",
        "no earlier",
    ),
    (
        {"messages": USER + [{"role": "tool", "content": "hi"}]},
        "messages.1.tool_call_id",
        "needs tool_call_id",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "q",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ]
        },
        "messages.0.tool_calls",
        "only assistant",
    ),
]


@pytest.mark.parametrize("extra,param,words", BAD)
def test_bad_tool_fields_are_400_naming_the_field(extra, param, words):
    _, _, tc = client_for("x")
    r = tc.post("/v1/chat/completions", json={"model": "stub", "messages": USER, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


# ---------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    "text,reasoning,content",
    [
        ("I think.</think>The answer.", "I think.", "The answer."),
        ("<think>I think.</think>The answer.", "I think.", "The answer."),
        ("still thinking", "still thinking", None),
        ("</think>direct", None, "direct"),
    ],
)
def test_reasoning_content_whole_and_streamed(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    client, _, _ = client_for(text, reasoning_parser="deepseek_r1")
    m = client.chat.completions.create(model="stub", messages=USER).choices[0].message
    assert (getattr(m, "reasoning_content", None), m.content) == (reasoning, content)
    chunks = list(client.chat.completions.create(model="stub", messages=USER, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    got_r = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    got_c = "".join(d.content or "" for d in deltas)
    assert (got_r, got_c) == (reasoning or "", content or "")


def test_reasoning_stream_holds_a_split_end_tag():
    s = ReasoningStream()
    parts = [s.push(ch) for ch in "<think>ab</think>cd"]
    r, c = s.finish()
    assert "".join(p[0] for p in parts) + r == "ab"
    assert "".join(p[1] for p in parts) + c == "cd"


def test_reasoning_then_tool_calls():
    client, _, _ = client_for("hmm</think>" + CALLS, reasoning_parser="deepseek_r1")
    m = client.chat.completions.create(model="stub", messages=USER, tools=[WEATHER, TIME]).choices[0]
    assert m.finish_reason == "tool_calls"
    assert m.message.reasoning_content == "hmm" and m.message.content == "Let me check."
    assert [c.function.name for c in m.message.tool_calls] == ["get_weather", "get_time"]


def test_reasoning_parser_off_by_default():
    client, _, _ = client_for("a</think>b")
    m = client.chat.completions.create(model="stub", messages=USER).choices[0].message
    assert m.content == "a</think>b" and getattr(m, "reasoning_content", None) is None
