"""`hmoe serve`'s life cycle, each test on a server of its own (issue 14): SIGTERM drains the
streams in flight and exits 0; the --pd backend (slow: two worker processes) serves the same
tokens. Helpers and the independent reference: tests/helpers.py."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.helpers import GOOD, MODEL, PROMPTS, client, ids_of, solo, start_server, stop_server


def test_sigterm_drains_in_flight_streams_then_exits(tmp_path):
    s = start_server(tmp_path / "serve.log")
    ids = ids_of(PROMPTS[1])
    ref = solo(ids, 40, True)
    results: dict[int, list[int]] = {}

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            started = [asyncio.Event(), asyncio.Event()]

            async def one(k):
                body = {**GOOD, "prompt": PROMPTS[1], "max_tokens": 40, "ignore_eos": True, "stream": True,
                        "return_token_ids": True}  # fmt: skip
                toks, done = [], False
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data:"):
                            toks += json.loads(line[5:])["choices"][0]["token_ids"]
                            started[k].set()
                results[k] = toks if done else None

            tasks = [asyncio.create_task(one(k)) for k in range(2)]
            await asyncio.gather(*(e.wait() for e in started))
            s.proc.send_signal(signal.SIGTERM)  # both streams are mid-flight
            await asyncio.gather(*tasks)

    t0 = time.monotonic()
    asyncio.run(main())
    assert results == {0: ref, 1: ref}
    rc = s.proc.wait(60)
    assert rc == 0, s.log.read_text()[-2000:]
    assert "drained and stopped" in s.log.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/health", timeout=2)
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_pd_backend_serves_the_same_tokens(tmp_path):
    """--pd: the same API on the P/D coordinator (a prefill and a decode worker process)."""
    s = start_server(tmp_path / "pd.log", "--pd")
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        extra = {"ignore_eos": True, "return_token_ids": True}
        r = client(s).completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0, extra_body=extra
        )
        assert r.choices[0].model_extra["token_ids"] == solo(ids_of(PROMPTS[2]), 10, True)
    finally:
        stop_server(s)
    assert s.proc.returncode == 0, s.log.read_text()[-2000:]
