"""A scripted stub backend for the HTTP app's in-process tests (no model): a byte
tokenizer and a backend that emits a fixed token script on a thread."""

from __future__ import annotations

import threading
import time

from hmoe_jax.io.tokenizer import ByteTokenizer
from hmoe_jax.serve.request import Request, RequestHandle

TOK = ByteTokenizer(512)


def ids(text: str) -> list[int]:
    return TOK.encode(text)[1:]  # no BOS


class StubBackend:
    """Emits a fixed token script on a thread (1 ms apart); can fail after k tokens."""

    def __init__(self, script: list[int], fail_after: int | None = None):
        self.script, self.fail_after = script, fail_after
        self.cancelled: list[int] = []

    def submit(self, prompt_ids, params=None):
        import numpy as np

        req = Request(np.asarray(prompt_ids, np.int32), params, time.perf_counter())
        h = RequestHandle(req, lambda r: self.cancelled.append(r.id))

        def run():
            req.started_s = time.perf_counter()
            for i, t in enumerate(self.script[: params.max_new_tokens]):
                if self.fail_after is not None and i == self.fail_after:
                    h.finish("error", time.perf_counter(), "worker died")
                    return
                if req.id in self.cancelled:
                    h.finish("cancelled", time.perf_counter())
                    return
                time.sleep(0.001)
                h.emit(t, time.perf_counter())
            h.finish("length", time.perf_counter())

        threading.Thread(target=run, daemon=True).start()
        return h

    def close(self):
        pass
