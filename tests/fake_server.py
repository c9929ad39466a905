"""A scripted OpenAI-compatible streaming server with known delays, to check a load
generator's timing (tests/test_bench_serve.py): every completion request is answered with
chunks sent at fixed offsets from the request's arrival (absolute deadlines, so sleeps do
not add up), then a usage chunk and [DONE]. GET /log returns, per request, its arrival and
each chunk's send time (time.perf_counter, CLOCK_MONOTONIC on Linux: comparable across
processes on one host).

    python tests/fake_server.py --port 0 --ttft-s 0.05 --itl-s 0.02,0.005,0.04
    # prints "fake: listening on http://127.0.0.1:PORT"

Keep-alive as servers do it: --keep-alive-s S closes a connection idle for S seconds between
requests (cpp-httplib, llama-server's HTTP layer, closes after 5 s); --drop-reused N closes
the first N requests that arrive on a reused connection without answering (the race a
pooled client loses when the server's keep-alive ends just as it sends: "Server
disconnected without sending a response"). GET /dropped returns {"dropped": n}.

Plain asyncio HTTP/1.1 (chunked responses, keep-alive): no framework in the timing path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any


class FakeServer:
    def __init__(
        self,
        ttft_s: float,
        itl_s: list[float],
        model: str = "fake",
        chat_role_chunk: bool = True,
        keep_alive_s: float | None = None,
        drop_reused: int = 0,
    ):
        self.ttft_s, self.itl_s, self.model = ttft_s, itl_s, model
        self.chat_role_chunk = chat_role_chunk
        self.keep_alive_s, self.drop_reused, self.dropped = keep_alive_s, drop_reused, 0
        self.log: list[dict[str, Any]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                wait = self.keep_alive_s if served else None
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
                except TimeoutError:
                    return  # idle past the keep-alive: close, as the server would
                arrival = time.perf_counter()
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "POST" and served and self.dropped < self.drop_reused:
                    self.dropped += 1
                    return  # closed without a response, as in the keep-alive race
                served += 1
                if method == "GET":
                    obj = {"object": "list", "data": [{"id": self.model, "object": "model", "root": "fake"}]}
                    if path == "/dropped":
                        obj = {"dropped": self.dropped}
                    await self._json(writer, obj if path in ("/v1/models", "/dropped") else self.log)
                    continue
                await self._stream(writer, json.loads(body), arrival, chat=path.endswith("chat/completions"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _json(self, writer: asyncio.StreamWriter, obj: Any) -> None:
        b = json.dumps(obj).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(b)
        )
        writer.write(b)
        await writer.drain()

    async def _stream(
        self, writer: asyncio.StreamWriter, req: dict[str, Any], arrival: float, chat: bool
    ) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        rec: dict[str, Any] = {"arrival_s": arrival, "send_s": []}
        self.log.append(rec)
        n = 1 + len(self.itl_s)
        n = min(n, int(req.get("max_tokens") or req.get("max_completion_tokens") or n))
        due = arrival + self.ttft_s
        if chat and self.chat_role_chunk:  # an empty role chunk first, as vLLM sends it: not a token
            await self._send(
                writer, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            )
        for i in range(n):
            await _until(due)
            c = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            c.update({"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "})
            await self._send(writer, {"choices": [c]})
            rec["send_s"].append(time.perf_counter())
            if i < len(self.itl_s):
                due += self.itl_s[i]
        usage = {"prompt_tokens": len(req.get("prompt") or []), "completion_tokens": n, "total_tokens": n}
        await self._send(writer, {"choices": [], "usage": usage})
        await self._frame(writer, b"data: [DONE]\n\n")
        await self._frame(writer, b"")

    async def _send(self, writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
        await self._frame(writer, f"data: {json.dumps(obj)}\n\n".encode())

    @staticmethod
    async def _frame(writer: asyncio.StreamWriter, b: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(b), b))
        await writer.drain()


async def _until(t_s: float, spin_s: float = 0.001) -> None:
    """Sleep until perf_counter() >= t_s: asyncio.sleep to within spin_s, then spin (a timer
    wake-up on a busy host is late by up to a millisecond or more; a spin is not)."""
    if (left := t_s - time.perf_counter() - spin_s) > 0:
        await asyncio.sleep(left)
    while time.perf_counter() < t_s:
        pass


async def _main(args: argparse.Namespace) -> None:
    itl = [float(x) for x in args.itl_s.split(",") if x.strip()]
    fake = FakeServer(args.ttft_s, itl, keep_alive_s=args.keep_alive_s, drop_reused=args.drop_reused)
    server = await asyncio.start_server(fake.handle, args.host, args.port)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"fake: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python tests/fake_server.py")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttft-s", type=float, default=0.05)
    ap.add_argument("--itl-s", default="0.02,0.005,0.04,0.01")
    ap.add_argument("--keep-alive-s", type=float, default=None, help="close connections idle this long")
    ap.add_argument(
        "--drop-reused", type=int, default=0, help="drop this many requests on reused connections"
    )
    asyncio.run(_main(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
