"""`hmoe serve`: load the model, start the request backend, serve the OpenAI-compatible app
(serve/http.py) with uvicorn until SIGINT / SIGTERM, then drain and exit 0.

Backend: the in-process Scheduler (one Engine, a policy from hmoe_jax.policies) by default,
or with --pd the P/D coordinator (a prefill and a decode worker process on one shared host
copy of the weights), driven by the same policies: --policy (default fcfs there; one the
workers cannot run, like paper, is refused with what it asks for) and --policy-option;
--devices N gives each worker N/2 accelerators; --system and --expert-fn reach both
workers' engines. The port is bound once the model is loaded; warm-up then runs on a
background thread and /health answers 503 {"status": "warming"} until it is done (requests
sent meanwhile queue behind it); the line `hmoe serve: listening on http://H:P` on stderr
says the port is bound (with --port 0 it names the port the OS chose), `warmed up in S s`
that it is ready. --compile-cache: the persistent compilation cache (configure_compile_cache).

Shutdown: the first SIGINT / SIGTERM stops accepting connections, answers new requests on
open connections with 503, lets every accepted request (streams included) finish for up to
--drain-timeout seconds, then closes the backend and exits 0; a second SIGINT forces exit.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
from hmoe_jax.serve.reasoning import check_parser


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, which re-raises the signal after a graceful shutdown (the process
    then dies of it); this one returns, so `hmoe serve` exits 0 after draining."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.hmoe_state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.hmoe_state.draining = True
        super().handle_exit(sig, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        for srv in getattr(self, "servers", []):
            for sock in srv.sockets:
                host, port = sock.getsockname()[:2]
                print(f"hmoe serve: listening on http://{host}:{port}", file=sys.stderr, flush=True)


def _policy_options(items: list[str]) -> dict[str, Any]:
    from hmoe_jax.io.errors import InputError

    out: dict[str, Any] = {}
    for it in items:
        key, sep, val = it.partition("=")
        if not sep or not key:
            raise InputError(f"--policy-option: expected KEY=VALUE, got {it!r}")
        for conv in (int, float):
            try:
                out[key] = conv(val)
                break
            except ValueError:
                continue
        else:
            out[key] = val
    return out


def _policy(args: argparse.Namespace) -> Any:
    """The Policy --policy / --policy-option name (default: paper in process, fcfs with
    --pd), built here so a bad option, or a policy P/D cannot run, is refused before any
    backend starts."""
    from hmoe_jax.io.errors import InputError
    from hmoe_jax.policies.base import PolicyError
    from hmoe_jax.policies.core import check_pd_policy
    from hmoe_jax.policies.registry import DEFAULT_POLICY, get_policy

    name = args.policy or ("fcfs" if args.pd else DEFAULT_POLICY)
    opts = _policy_options(args.policy_option)
    try:
        policy = get_policy(name, **opts)
        if args.pd:
            check_pd_policy(policy)
            if "decode_cap" not in opts and "decode_cap" in policy.defaults:
                # the decode worker batches --max-num-seqs sequences, as before policies drove P/D
                policy = get_policy(name, **opts, decode_cap=args.max_num_seqs)
    except PolicyError as e:
        raise InputError(f"--policy {name}: {e}") from None
    cap = policy.options.get("decode_cap")
    if args.pd and cap is not None and int(cap) > args.max_num_seqs:
        raise InputError(
            f"--policy-option decode_cap={cap} with --pd exceeds --max-num-seqs {args.max_num_seqs}"
        )
    return policy


def grammar_compiler(run: Any):
    """response_format json_object / json_schema's grammar side for the run's tokenizer, or
    None (such requests then a 400) when llguidance (the serve extra) is missing."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return None
    from hmoe_jax.model.structured import GrammarCompiler

    return GrammarCompiler.for_tokenizer(run.tokenizer, run.cfg.vocab_size, run.cfg.eos_ids)


def _pd_devices(devices: int | None) -> int:
    """--devices with --pd: the accelerators of both workers together, split evenly."""
    from hmoe_jax.io.errors import InputError

    if devices is None:
        return 1
    if devices < 2 or devices % 2:
        raise InputError(
            f"--devices {devices} with --pd: the prefill and the decode worker each own half of the "
            "accelerators, so give an even number >= 2"
        )
    return devices // 2


def guard_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ServeOptions of the request guard (serve/guard.py) from --api-key (or $HMOE_API_KEY),
    --max-request-bytes, --upload-timeout-s, --allowed-hosts (default: the names of the bound --host) and
    --allowed-origins; a bad value is an InputError naming its flag."""
    from hmoe_jax.io.errors import InputError
    from hmoe_jax.serve.guard import (
        DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_UPLOAD_TIMEOUT_S,
        default_allowed_hosts,
        parse_allowed_hosts,
    )

    key = getattr(args, "api_key", None)
    if key is None:
        key = os.environ.get("HMOE_API_KEY") or None  # empty: no key
    elif not key:
        raise InputError("--api-key must not be empty (leave it out to serve without a key)")
    size = getattr(args, "max_request_bytes", None)
    size = DEFAULT_MAX_REQUEST_BYTES if size is None else size
    if size < 1:
        raise InputError(f"--max-request-bytes must be >= 1, got {size}")
    upload_s = getattr(args, "upload_timeout_s", None)
    upload_s = DEFAULT_UPLOAD_TIMEOUT_S if upload_s is None else upload_s
    if not upload_s > 0:
        raise InputError(f"--upload-timeout-s must be > 0, got {upload_s}")
    hosts_arg = getattr(args, "allowed_hosts", None)
    try:
        hosts = parse_allowed_hosts(hosts_arg) if hosts_arg is not None else default_allowed_hosts(args.host)
    except ValueError as e:
        raise InputError(str(e)) from None
    origins = tuple(o.strip() for o in (getattr(args, "allowed_origins", None) or "").split(",") if o.strip())
    return dict(
        api_key=key,
        max_request_bytes=size,
        upload_timeout_s=float(upload_s),
        allowed_hosts=hosts,
        allowed_origins=origins,
    )


def build_state(args: argparse.Namespace, run: Any) -> tuple[ServerState, Callable[[], None]]:
    """The app state (backend included) for parsed `hmoe serve` args and a cli.Run, and the
    function that closes the backend (and its engine)."""
    from hmoe_jax.io.errors import InputError
    from hmoe_jax.plan.buckets import cache_len

    guard = guard_options(args)  # a bad flag is refused before any backend starts
    try:
        reasoning_parser = check_parser(getattr(args, "reasoning_parser", None))
    except ValueError as e:
        raise InputError(str(e)) from None
    max_len = args.max_model_len or min(4096, run.max_context)
    if not 1 <= max_len <= run.max_context:
        raise InputError(f"--max-model-len {max_len} must be in [1, {run.max_context}] (the context)")
    engine_opts = dict(
        precision=args.precision,
        max_batch=args.max_num_seqs,
        max_len=max_len,
        require_gpu=getattr(args, "require_gpu", False),
    )
    policy = _policy(args)
    probes: dict[str, Any] = {}
    trace = None
    if getattr(args, "trace", None) is not None:
        from hmoe_jax.plan.trace import TraceRecorder

        trace = TraceRecorder()
    if args.pd:
        from hmoe_jax.serve.pd import PDCoordinator

        per_worker = _pd_devices(args.devices)
        if args.system:  # the workers' auto thresholds, as the in-process engine's: each
            from hmoe_jax.plan.system import load_system  # worker plans for the devices it has

            engine_opts["system"] = load_system(args.system, per_worker)
        engine_opts["expert_fn"] = args.expert_fn
        backend = PDCoordinator(
            run.checkpoint,
            policy,
            engine=engine_opts,
            prefill_devices=per_worker,
            decode_devices=per_worker,
            warm_up=not args.no_warmup,  # each worker warms itself (pd_worker.warm_up)
        ).wait_ready()
        probes.update(healthy=lambda: backend.healthy, worker_restarts=backend.restarts)
        max_model_len = cache_len(max_len)
        close = backend.close
    else:
        from hmoe_jax.engine.engine import Engine
        from hmoe_jax.plan.system import SystemSpec, load_system
        from hmoe_jax.serve.scheduler import Scheduler

        devices = args.devices or 1
        system = load_system(args.system, devices) if args.system else SystemSpec(num_accelerators=devices)
        eng = Engine(
            run.host_params, run.cfg, devices=devices, system=system, expert_fn=args.expert_fn, **engine_opts
        )
        eng.grammars = grammar_compiler(run)
        backend = Scheduler(eng, policy, trace=trace, trace_engine=bool(getattr(args, "trace_engine", False)))
        backend.start()
        pool = eng.pool
        probes.update(
            healthy=lambda: backend.healthy,
            kv_usage=lambda: pool.in_use / pool.rows,
            iterations=lambda: backend.iterations,
        )
        max_model_len = eng.max_len

        def close() -> None:
            backend.close()
            eng.close()  # its staging rings

    name = args.served_model_name or (run.checkpoint.name if args.checkpoint else run.model.split(" (")[0])
    opts = ServeOptions(
        model_name=name,
        root=str(run.checkpoint),
        vocab_size=run.cfg.vocab_size,
        max_model_len=min(max_model_len, run.max_context),
        max_in_flight=args.max_in_flight or 8 * args.max_num_seqs,
        **guard,
        generation=run.generation,
        eos_ids=run.cfg.eos_ids,
        reasoning_parser=reasoning_parser,
    )
    chat = ChatTemplate(run.checkpoint, run.tokenizer.encode)
    return ServerState(backend, run.tokenizer, chat, opts, trace=trace, **probes), close


def warm_up(backend: Any, vocab_size: int, max_batch: int | None = None) -> float:
    """On the in-process scheduler first, Scheduler.warm_up: a full prefill chunk (the
    largest prefill call, first), every decode batch size up to the policy's decode cap (and
    max_batch) compiled, the decode arms the policy compares measured; then one short
    request end to end. No client pays for a compile or a measurement. Returns seconds."""
    from hmoe_jax.model.sampling import SamplingParams

    t0 = time.perf_counter()
    if hasattr(backend, "run_exclusive"):
        cap = backend.policy.options.get("decode_cap", max_batch)
        cap = min(int(cap or 1), int(max_batch or cap or 1))
        backend.warm_up_info = backend.run_exclusive(lambda: backend.warm_up(cap))
    h = backend.submit([min(5, vocab_size - 1)] * 8, SamplingParams(max_new_tokens=2, stop_ids=()))
    h.result(timeout=600)
    return time.perf_counter() - t0


def log_to_stderr(level: str) -> None:
    """Our loggers (hmoe_jax.*: a P/D worker's death and restart) to stderr at --log-level,
    with level and time, beside uvicorn's lines; once per process."""
    root = logging.getLogger("hmoe_jax")
    if not any(getattr(h, "_hmoe_serve", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        h._hmoe_serve = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(level.upper())


def start_warm_up(
    state: ServerState, vocab_size: int, max_batch: int | None, *, t_start_s: float | None = None
) -> threading.Thread:
    """Warm up on a background thread while the port is already bound: /health answers 503
    {"status": "warming"} until it is done, then 200 (a load balancer or a client waits for
    that); requests that arrive meanwhile queue behind it. Logs the warm-up time (and, given
    t_start_s on the perf_counter clock, the time since the process started)."""
    state.warming = True

    def work() -> None:
        try:
            secs = warm_up(state.backend, vocab_size, max_batch)
        except BaseException as ex:  # noqa: BLE001 (serve anyway: the first requests compile)
            print(f"hmoe serve: warm-up failed: {type(ex).__name__}: {ex}", file=sys.stderr, flush=True)
            state.warming = False
            return
        state.warming = False
        info = getattr(state.backend, "warm_up_info", None) or {}
        arms = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in info.get("arms", {}).items())
        detail = ""
        if info:
            detail = f" (decode batch 1..{info['batches']} compiled; arms {arms or 'none measured'}"
            if info.get("prefill_prompts"):
                detail += f"; prefill chunk shapes {info['prefill_prompts']} (tokens, padded)"
            detail += ")"
        since = f"; ready {time.perf_counter() - t_start_s:.1f} s after start" if t_start_s else ""
        print(f"hmoe serve: warmed up in {secs:.1f} s{detail}{since}", file=sys.stderr, flush=True)

    t = threading.Thread(target=work, name="hmoe-warm-up", daemon=True)
    t.start()
    return t


def configure_compile_cache(value: str | None) -> str | None:
    """--compile-cache: the JAX persistent compilation cache directory (default
    <hmoe cache>/xla, as `hmoe generate` uses; 'none' disables it). Every compiled program
    is kept, small CPU ones included (the thresholds are lowered to zero), so a restarted
    server, and its P/D workers (they inherit the setting through the environment), load
    them instead of compiling. Returns the directory in use (None: disabled)."""
    import jax

    from hmoe_jax.io.cache import cache_root

    if value is not None and value.strip().lower() == "none":
        jax.config.update("jax_enable_compilation_cache", False)
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        return None
    path = str(Path(value).expanduser()) if value else str(cache_root() / "xla")
    settings = {
        "jax_enable_compilation_cache": True,
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    for k, v in settings.items():
        jax.config.update(k, v)
        os.environ[k.upper()] = str(v).lower() if isinstance(v, bool) else str(v)
    return path


def serve(args: argparse.Namespace, run: Any) -> int:
    """`hmoe serve` for parsed args and the cli.Run of the model: until a signal, then 0."""
    from hmoe_jax.io.errors import InputError

    log_to_stderr(args.log_level)
    if args.max_num_seqs < 1:
        raise InputError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise InputError(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    # The event loop (HTTP) and the scheduler thread share the GIL: hand it over every 1 ms
    # rather than 5 ms, so a token waits less between being produced and being sent.
    sys.setswitchinterval(0.001)
    state, close = build_state(args, run)
    t_start_s = getattr(args, "t_start_s", None)
    if state.opt.allowed_hosts is None and args.allowed_hosts is None and not args.quiet:
        print(
            f"hmoe serve: bound to {args.host}, every Host header is answered; "
            "--allowed-hosts names the ones to answer (DNS rebinding)",
            file=sys.stderr,
            flush=True,
        )
    try:
        if not args.no_warmup:
            start_warm_up(state, run.cfg.vocab_size, args.max_num_seqs, t_start_s=t_start_s)
        config = uvicorn.Config(
            create_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout,
            lifespan="off",
            access_log=args.log_level in ("info", "debug", "trace"),
        )
        _GracefulServer(config, state).run()
    finally:
        close()
        if state.trace is not None:
            # the Perfetto file counts from the first slice: keep where that is on the
            # perf_counter clock, so the trace lines up with other processes' times
            state.trace.meta["t0_ns"] = min((s["start_ns"] for s in state.trace.slices), default=0)
            state.trace.write(args.trace)
            print(f"hmoe serve: trace written to {args.trace}", file=sys.stderr, flush=True)
    print("hmoe serve: drained and stopped", file=sys.stderr, flush=True)
    return 0


__all__ = [
    "build_state",
    "configure_compile_cache",
    "guard_options",
    "log_to_stderr",
    "serve",
    "start_warm_up",
    "warm_up",
]
