"""The two worker processes of intra-node prefill/decode disaggregation (serve/pd.py runs
them): each owns its accelerator(s), maps the ONE shared host weight arena (io/arena.py:
MAP_SHARED, read-only) and builds its own Engine on it, then serves the coordinator over a
pipe with plain tuples.

    prefill worker  ("prefill", rid, prompt, params, segment, schedule)
                    -> ("first", rid, token, t_s, finish_reason | None, HandoverMeta | None, info,
                        logprob, prompt_logprobs)
    decode worker   ("adopt", rid, prompt, params, first_token, HandoverMeta)
                    -> ("adopted", rid, info), then per step
                       ("tokens", [(rid, tok, t_s, reason, logprob)])
                    ("cancel", rid) frees the row at once (a no-op for an unknown rid)
    both            ("stats",) -> ("stats", {...}); ("stop",); a failed request -> ("error", rid, msg)

logprob is the token's TokenLogprob when params.logprobs asked for it, else None;
prompt_logprobs the prefill's list (None unless params.prompt_logprobs asked). Both workers
compute them from their own raw logits (model/sampling.py token_logprobs), as the in-process
scheduler does.

The prefill worker runs one prompt at a time (the coordinator sends the next after "first");
its KV goes into a shm segment named by the coordinator (kvshm.export_prefix) and its own
pool row is freed at once. The decode worker batches every adopted sequence into one decode
step per iteration (continuous batching) and reads the pipe between steps, so a cancel or a
new sequence waits at most one step.

Devices are chosen before jax starts: CUDA_VISIBLE_DEVICES for real GPUs (each worker its
own), else host + N stand-in CPU devices (jax_num_cpu_devices) in this process only; both
workers then call the same Engine code, so the pair runs unchanged on GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs (pickled to the spawned process). gpu_ids: the GPUs it owns
    (None: stand-in CPU devices); engine: Engine keyword options (precision, max_batch,
    max_len, expert_fn, link_gbps, ...); touch: read every host weight page once the engine
    holds it (measurements of page sharing need every page resident)."""

    role: str  # "prefill" | "decode"
    arena: str
    devices: int = 1
    gpu_ids: tuple[int, ...] | None = None
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    touch: bool = False
    warm: bool = True  # compile what the role runs before reporting ready (warm_up)


def _configure_devices(spec: WorkerSpec) -> None:
    from hmoe_jax.runtime.host_heap import retain_freed_host_memory

    retain_freed_host_memory()  # a serving process: freed host buffers are reused (before jax starts)
    if spec.gpu_ids is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_ids)
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        from hmoe_jax.runtime.placement import configure_stand_ins

        configure_stand_ins(spec.devices)


def _share_report(eng: Any, arena_data: str, touch: bool) -> dict[str, Any]:
    """Which of the engine's host weight bytes are views into the arena map (zero-copy),
    and, with touch, fault every page of them in (a sum per leaf: the reads are real)."""
    import jax

    target = os.path.realpath(arena_data)
    spans = []  # this process's address ranges that map the arena file
    with open("/proc/self/maps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 6 and head[5] == target:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                spans.append((lo, hi))
    total = shared = 0
    checksum = 0
    for leaf in jax.tree_util.tree_leaves(eng.weights.host):
        a = np.asarray(leaf)
        total += a.nbytes
        if any(lo <= a.ctypes.data < hi for lo, hi in spans):
            shared += a.nbytes
        if touch:
            checksum += int(a.reshape(-1).view(np.uint8)[::4096].sum(dtype=np.uint64))  # a byte a page
    return {"host_weight_bytes": total, "arena_view_bytes": shared, "checksum": checksum}


def main(spec: WorkerSpec, conn: Any) -> None:
    """The worker process's entry point."""
    try:
        _configure_devices(spec)
        t0 = time.perf_counter()
        from hmoe_jax.engine.engine import Engine
        from hmoe_jax.io.arena import DATA_NAME, load_arena

        cfg, params = load_arena(spec.arena, progress=False)
        eng = Engine(params, cfg, devices=spec.devices, **spec.engine)
        global _COMPILES
        from hmoe_jax.serve.servetrace import CompileListener

        _COMPILES = CompileListener().install()
        t_warm = time.perf_counter()
        if spec.warm:
            warm_up(eng, spec.role)
        info = {
            "warm_up_s": time.perf_counter() - t_warm,
            "warm_up_compiles": _COMPILES.compiles,
            "role": spec.role,
            "pid": os.getpid(),
            "devices": [str(d) for d in eng.placement.accelerators],
            "load_s": time.perf_counter() - t0,
            "max_batch": eng.max_batch,
            "max_len": eng.max_len,
            **_share_report(eng, os.path.join(spec.arena, DATA_NAME), spec.touch),
        }
    except BaseException as ex:  # noqa: BLE001 (report why the worker cannot start, then exit)
        conn.send(("fatal", f"{spec.role} worker failed to start: {type(ex).__name__}: {ex}"))
        return
    conn.send(("ready", info))
    loop = _prefill_loop if spec.role == "prefill" else _decode_loop
    try:
        loop(eng, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the coordinator went away
        pass


_COMPILES: Any = None  # this worker's CompileListener (backend compiles since it started)

# The prompt length of the server's warm-up request (http_server.warm_up): its prefill shape
WARM_PROMPT_TOKENS = 8


def warm_up(eng: Any, role: str) -> None:
    """Before the worker says it is ready (at start and after a restart): compile what its
    role runs for the first request, so no client waits for it. Prefill: a short prompt's
    prefill, first token and KV export. Decode: the KV import of that prefix, then the decode
    step of every batch size 1..max_batch on scratch rows. With the persistent compilation
    cache (hmoe serve --compile-cache, inherited through the environment) a restarted worker
    loads these programs instead of compiling them."""
    from hmoe_jax.model.sampling import SamplingParams
    from hmoe_jax.serve import kvshm

    params = SamplingParams(max_new_tokens=eng.max_len - WARM_PROMPT_TOKENS, stop_ids=())
    name = kvshm.segment_name(f"warm{os.getpid()}", 0)
    if role == "prefill":
        seq = eng.start([1] * WARM_PROMPT_TOKENS, params)
        try:
            kvshm.export_prefix(eng.pool, seq.row, seq.prompt.size, name)
        finally:
            eng.cancel(seq)
            kvshm.discard(name)
        return
    seqs = [eng.admit([1] * WARM_PROMPT_TOKENS, params) for _ in range(len(eng.pool.free_rows))]
    try:
        if seqs:  # the adopt path: a prefix exported and imported (as a handover does)
            meta = kvshm.export_prefix(eng.pool, seqs[0].row, WARM_PROMPT_TOKENS, name)
            kvshm.import_prefix(eng.pool, seqs[0].row, meta)
        for s in seqs:
            s.pos, s.tokens = WARM_PROMPT_TOKENS, [1]
        from hmoe_jax.serve.scheduler_warmup import decode_kv_buckets

        for b in range(1, min(len(seqs), eng.max_batch) + 1):
            for kv in decode_kv_buckets(eng.max_len):  # attention compiles per KV prefix bucket
                for s in seqs[:b]:
                    s.pos, s.tokens = max(kv - 1, WARM_PROMPT_TOKENS), [1]
                eng.step(seqs[:b])
    finally:
        for s in seqs:
            eng.cancel(s)
        kvshm.discard(name)


def _stats(eng: Any) -> dict[str, Any]:
    compiles = _COMPILES.compiles if _COMPILES is not None else None
    return {
        "free_rows": len(eng.pool.free_rows),
        "rows": eng.pool.rows,
        "pid": os.getpid(),
        "compiles": compiles,
    }


def _err(ex: BaseException) -> str:
    return f"{type(ex).__name__}: {ex}"


def _last_logprob(seq: Any) -> Any:
    """The newest token's TokenLogprob, None when the request did not ask. The engine appends
    one per token it samples; an adopted sequence's list starts empty (its first token came
    from the prefill worker), so the newest entry is the last token's either way."""
    if seq.params.logprobs is None:
        return None
    if not seq.logprobs or seq.logprobs[-1].token != seq.tokens[-1]:
        raise RuntimeError(f"logprobs: no entry for the newest token {seq.tokens[-1]}")
    return seq.logprobs[-1]


def _prefill_loop(eng: Any, conn: Any) -> None:
    from hmoe_jax.serve import kvshm

    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "stats":
            conn.send(("stats", _stats(eng)))
            continue
        _, rid, prompt, params, segment, schedule = msg
        t0 = time.perf_counter()
        try:
            seq = eng.start(prompt, params, schedule=schedule)
        except Exception as ex:  # noqa: BLE001 (this request fails, the worker goes on)
            conn.send(("error", rid, _err(ex)))
            continue
        t_first = time.perf_counter()
        info = {"started_s": t0, "prefill_s": seq.prefill_s, "schedule": seq.schedule}
        lps = (_last_logprob(seq), seq.prompt_logprobs)
        if seq.done:  # the first token ended it (stop id or max_new_tokens=1): no handover
            conn.send(("first", rid, seq.tokens[0], t_first, seq.finish_reason, None, info, *lps))
            continue
        try:
            meta = kvshm.export_prefix(eng.pool, seq.row, seq.prompt.size, segment)
        except Exception as ex:  # noqa: BLE001
            conn.send(("error", rid, f"KV export failed: {_err(ex)}"))
            continue
        finally:
            eng.cancel(seq)  # the KV lives in the segment now: free this worker's row
        conn.send(("first", rid, seq.tokens[0], t_first, None, meta, info, *lps))


def _decode_loop(eng: Any, conn: Any) -> None:
    from hmoe_jax.serve import kvshm

    active: dict[int, Any] = {}
    while True:
        wait: float | None = 0.0 if active else None
        while conn.poll(wait):
            msg = conn.recv()
            wait = 0.0
            kind = msg[0]
            if kind == "stop":
                return
            if kind == "stats":
                conn.send(("stats", {**_stats(eng), "active": len(active)}))
            elif kind == "cancel":
                seq = active.pop(msg[1], None)
                if seq is not None:
                    eng.cancel(seq)
            elif kind == "adopt":
                _, rid, prompt, params, first, meta = msg
                t0 = time.perf_counter()
                try:
                    seq = eng.admit(prompt, params)
                except Exception as ex:  # noqa: BLE001
                    kvshm.discard(meta.name)
                    conn.send(("error", rid, f"decode worker cannot take the request: {_err(ex)}"))
                    continue
                try:
                    nbytes = kvshm.import_prefix(eng.pool, seq.row, meta)
                except Exception as ex:  # noqa: BLE001
                    eng.pool.free(seq.row)
                    conn.send(("error", rid, f"KV import failed: {_err(ex)}"))
                    continue
                seq.pos, seq.tokens = int(seq.prompt.size), [int(first)]
                active[rid] = seq
                t1 = time.perf_counter()
                conn.send(("adopted", rid, {"import_s": t1 - t0, "kv_bytes": nbytes, "adopted_s": t1}))
        if not active:
            continue
        rids = list(active)
        try:
            eng.step([active[r] for r in rids])
        except Exception as ex:  # noqa: BLE001 (the step failed: its requests end, the worker goes on)
            why = f"decode step failed: {_err(ex)}\n{traceback.format_exc(limit=3)}"
            for r in rids:
                eng.cancel(active.pop(r))
                conn.send(("error", r, why))
            continue
        t = time.perf_counter()
        out = []
        for r in rids:
            seq = active[r]
            out.append((r, seq.tokens[-1], t, seq.finish_reason if seq.done else None, _last_logprob(seq)))
            if seq.done:
                del active[r]
        conn.send(("tokens", out))


if __name__ == "__main__":
    # python -m hmoe_jax.serve.pd_worker FD: the coordinator's end of a socketpair is FD;
    # the spec comes as its first message (a subprocess, not multiprocessing's spawn, so
    # the user's __main__ is never re-imported and each worker gets its own environment).
    import sys
    from multiprocessing.connection import Connection

    _conn = Connection(int(sys.argv[1]))
    main(_conn.recv(), _conn)
