"""The request API every front end shares (the in-process scheduler, the P/D coordinator,
the HTTP server, experiments, tests): submit a prompt with its sampling parameters, get a
RequestHandle, stream its tokens as they are produced, cancel it, read its timings.

    h = sched.submit(prompt_ids, SamplingParams(max_new_tokens=32))
    for tok in h:            # blocks until each token exists; raises RequestError on failure
        ...
    h.cancel()               # the backend frees the request's KV row within one step
    r = h.result()           # the finished Request: tokens, finish_reason, timings()

A Request is plain data written by one producer thread (the backend) and read by any
number of consumers; the handle's condition variable orders the two. Times are
time.perf_counter() seconds on the producing process's clock, or a simulated clock (the
policy code drives both, docs/serve.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Protocol

import numpy as np

from hmoe_jax.model.generate import check_prompt
from hmoe_jax.model.sampling import SamplingParams, TokenLogprob, check_logit_bias
from hmoe_jax.policies.core import check_fits

FINISH_REASONS = ("stop", "length", "cancelled", "error")
_ids = itertools.count()


class RequestError(RuntimeError):
    """The request ended with an error (bad input found late, a worker died, ...): the
    message names the cause; other requests are unaffected."""


@dataclasses.dataclass
class Request:
    prompt: np.ndarray  # [T] int32, validated
    params: SamplingParams
    submitted_s: float
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    started_s: float | None = None  # prefill began (queue time = started - submitted)
    first_token_s: float | None = None
    token_s: list[float] = dataclasses.field(default_factory=list)  # when each token was produced
    tokens: list[int] = dataclasses.field(default_factory=list)
    # with params.logprobs set: one entry per token in `tokens`, written before the token is
    # emitted; with params.prompt_logprobs set: one per prompt token (the first is None),
    # written before the first token is emitted
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    error: str | None = None
    schedule: str = ""  # the prefill path that ran it (cpu chunked / slp / dslp / ...)
    finished_s: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # backend facts (handover_s, ...)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def timings(self) -> dict[str, Any]:
        """queue_s, ttft_s (submit -> first token), tpot_s (mean gap between later tokens),
        itl_s (each gap), e2e_s."""
        t = self.token_s
        gaps = [b - a for a, b in zip(t, t[1:])]
        return {
            "queue_s": None if self.started_s is None else self.started_s - self.submitted_s,
            "ttft_s": None if self.first_token_s is None else self.first_token_s - self.submitted_s,
            "tpot_s": float(np.mean(gaps)) if gaps else None,
            "itl_s": gaps,
            "e2e_s": None if self.finished_s is None else self.finished_s - self.submitted_s,
            "prompt_tokens": int(self.prompt.size),
            "output_tokens": len(self.tokens),
        }


def new_request(
    cfg: Any, prompt_ids: Any, params: SamplingParams | None, max_len: int, now_s: float, whose: str
) -> Request:
    """A validated Request, as every backend's submit makes one: sampling values, token ids
    against cfg's vocabulary and context, prompt + max_new_tokens within `whose` KV row of
    max_len tokens (policies/core.check_fits); else ValueError naming the problem."""
    params = (params or SamplingParams()).validate()
    ids = check_prompt(cfg, prompt_ids, params.max_new_tokens)
    check_logit_bias(params, cfg.vocab_size)
    check_fits(int(ids.size), params.max_new_tokens, max_len, whose)
    return Request(ids, params, now_s)


class RequestHandle:
    """The consumer's side of one Request. Iterating yields token ids as they are produced
    (from the first, whenever iteration starts); it ends at the finish and raises
    RequestError if the request ended with an error."""

    def __init__(self, req: Request, cancel: Callable[[Request], None]):
        self.request = req
        self._cancel = cancel
        self._cv = threading.Condition()
        self._listeners: list[Callable[[], None]] = []

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def done(self) -> bool:
        return self.request.done

    # -------------------------------------------------------- producer side

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    def emit(self, token: int, t_s: float, logprob: TokenLogprob | None = None) -> None:
        r = self.request
        with self._cv:
            if r.done:
                return
            if r.first_token_s is None:
                r.first_token_s = t_s
            if logprob is not None:
                r.logprobs.append(logprob)
            r.tokens.append(int(token))
            r.token_s.append(t_s)
        self._notify()

    def finish(self, reason: str, t_s: float, error: str | None = None) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r} not in {FINISH_REASONS}")
        r = self.request
        with self._cv:
            if r.done:
                return
            r.finish_reason, r.error, r.finished_s = reason, error, t_s
        self._notify()

    # -------------------------------------------------------- consumer side

    def cancel(self) -> None:
        """Ask the backend to stop this request (no-op once finished)."""
        if not self.done:
            self._cancel(self.request)

    def wait(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.request.done, timeout)

    def result(self, timeout: float | None = None) -> Request:
        """The finished request (raises RequestError if it ended with an error, TimeoutError
        if it did not finish within `timeout` seconds)."""
        if not self.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.request.finish_reason == "error":
            raise RequestError(f"request {self.id}: {self.request.error}")
        return self.request

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """Token ids as they are produced; `timeout`: max seconds to wait for each one."""
        i = 0
        while True:
            with self._cv:
                ok = self._cv.wait_for(lambda i=i: len(self.request.tokens) > i or self.request.done, timeout)
                if not ok:
                    raise TimeoutError(f"request {self.id}: no token within {timeout} s")
                new = self.request.tokens[i:]
                done = self.request.done
            yield from new
            i += len(new)
            if done and i >= len(self.request.tokens):
                if self.request.finish_reason == "error":
                    raise RequestError(f"request {self.id}: {self.request.error}")
                return

    __iter__ = stream

    async def astream(self) -> AsyncIterator[int]:
        """stream() for asyncio code (the HTTP server): no thread blocks on the handle."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def listener() -> None:
            loop.call_soon_threadsafe(wake.set)

        with self._cv:
            self._listeners.append(listener)
        try:
            i = 0
            while True:
                with self._cv:
                    new = self.request.tokens[i:]
                    done = self.request.done
                    wake.clear()
                for tok in new:
                    yield tok
                i += len(new)
                if done and i >= len(self.request.tokens):
                    if self.request.finish_reason == "error":
                        raise RequestError(f"request {self.id}: {self.request.error}")
                    return
                if not new:
                    await wake.wait()
        finally:
            with self._cv:
                self._listeners.remove(listener)


class Backend(Protocol):
    """What the server and experiments drive: the in-process Scheduler (serve/scheduler.py)
    and the P/D Coordinator (serve/pd.py) both are one."""

    def submit(self, prompt_ids: Any, params: SamplingParams | None = None) -> RequestHandle: ...

    def submit_group(self, prompt_ids: Any, params_list: list[SamplingParams]) -> list[RequestHandle]:
        """One request per params on one prompt (n samples). The Scheduler prefills the prompt
        once and forks it (serve/scheduler.py); the P/D coordinator submits each on its own.
        Every handle is a request of its own (cancel, result)."""
        ...

    def close(self) -> None: ...
