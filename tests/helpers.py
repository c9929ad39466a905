"""Helpers shared by several test files (a test module never imports another test module).

- model configs: a configs/models twin with overrides, and the widened tiny MoE of the SLP
  memory tests;
- numerics: a max-error check relative to the reference's scale;
- engines: the engine configuration that must reproduce the reference rollout;
- `hmoe serve` in a subprocess and its independent in-process reference.

The HF torch reference (tests/hf_ref.py) and the kernels' raw-call helpers
(tests/kernel_helpers.py) are helper modules of their own: they import torch / the built
extension, which most tests do not need.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from hmoe_jax.config import ModelConfig, named_model_config
from hmoe_jax.plan.system import SystemSpec

# ---------------------------------------------------------------- model configs


def model_config(name: str = "deepseek_v3_tiny", **overrides) -> ModelConfig:
    """configs/models/<name>.json with overrides, quantization as the file says (FP8 for the
    tiny twins). tests/hf_ref.py's tiny_config is the unquantized variant the HF parity
    tests use."""
    return dataclasses.replace(named_model_config(name), **overrides)


def wide_moe_config(num_hidden_layers: int = 4) -> ModelConfig:
    """deepseek_v3_tiny widened to 64 experts of 3 x 512 x 512 per MoE layer (hidden 512, 4
    expert groups, top-2 groups), the first layer dense: big enough that a second host copy
    of its experts shows in RSS."""
    return model_config(
        n_routed_experts=64,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=512,
        hidden_size=512,
        num_hidden_layers=num_hidden_layers,
        first_k_dense_replace=1,
    )


# ---------------------------------------------------------------- numerics


def assert_close(got, ref, what: str, rel_tol: float = 1e-5) -> None:
    """max |got - ref| within rel_tol of max |ref| (f32 results of differently associated
    sums: the distributed ops against their single-device reference)."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    assert err <= rel_tol * scale, f"{what}: max |err| {err:.3g} > {rel_tol} * max|ref| {scale:.3g}"


# ---------------------------------------------------------------- engines

# auto picks slp/dslp from 8 tokens (so a 12-token prompt exercises them); cpu chunks by 8
INVARIANT_SYSTEM = SystemSpec(
    auto_slp_min_tokens=8, auto_dslp_min_tokens=8, cpu_prefill_chunk_tokens=8, slp_experts_per_slot=4
)


def reference_engine(params, cfg, devices: int, **options):
    """An engine that must reproduce the reference rollout: the f32 policy, experts_ref on
    the host (the FFI op rounds activations to bf16: its own tests cover it), the
    INVARIANT_SYSTEM thresholds that make a short prompt exercise every schedule."""
    from hmoe_jax.engine.engine import Engine

    system = dataclasses.replace(INVARIANT_SYSTEM, num_accelerators=devices)
    return Engine(params, cfg, devices=devices, system=system, expert_fn="ref", precision="f32", **options)


# ---------------------------------------------------------------- `hmoe serve` in a subprocess

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1088  # room for the 1000-token prompts of the bench agreement run
MAX_NUM_SEQS = 4
MAX_IN_FLIGHT = 6
MODEL = "hmoe-test"  # --served-model-name: the tests do not depend on which default model ships
TEXT = "Hybrid MoE"
# Token-id prompts of one length (the server's warm-up length): one compiled prefill shape.
PROMPTS = [[40 + 7 * k + j for j in range(8)] for k in range(4)]


@dataclasses.dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def metrics(self) -> dict[str, float]:
        from hmoe_jax.serve.metrics import parse_metrics

        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=30).text)


def start_server(
    log: Path, *extra: str, timeout_s: float = 600, env: dict | None = None, warm: bool = False
) -> Server:
    """`hmoe serve` on a free port, ready (/health 200). warm=False (the default) starts it
    with --no-warmup: a test compiles the few shapes it uses on its first requests instead of
    every decode batch x KV bucket and prefill chunk shape warm-up compiles (~35 s more per
    start on 2 cores); tests/test_serve_warm.py checks warm-up itself."""
    cmd = [sys.executable, "-m", "hmoe_jax.cli", "serve", "--port", "0", "--quiet"]
    if not warm and "--no-warmup" not in extra:
        cmd.append("--no-warmup")
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS)]
    # Greedy by default, as `solo` (the reference) is: the shipped model's generation_config.json
    # would make requests without a temperature sample (a later --generation-config in extra wins).
    cmd += ["--max-in-flight", str(MAX_IN_FLIGHT), "--served-model-name", MODEL]
    cmd += ["--generation-config", "none", *extra]
    f = open(log, "w")  # noqa: SIM115 (the server writes it for its whole life)
    # The shipped default (its BPE tokens carry several characters: a token can hold the
    # text before a stop string AND the stop string, which the SSE path must still send).
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://\S+)", log.read_text())
        if m:
            # bound: warm-up still runs; /health answers 503 {"status": "warming"} until done
            while httpx.get(f"{m.group(1)}/health", timeout=30).status_code != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            card = httpx.get(f"{m.group(1)}/v1/models", timeout=30).json()["data"][0]
            CHECKPOINT.setdefault("root", card["root"])  # the reference loads what the server serves
            return Server(m.group(1), proc, log)
        if proc.poll() is not None:
            pytest.fail(f"hmoe serve exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"hmoe serve did not listen within {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop_server(s: Server) -> None:
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(60)
        except subprocess.TimeoutExpired:
            s.proc.kill()


# ---------------------------------------------------------------- the independent reference


CHECKPOINT: dict[str, str] = {}


@functools.cache
def reference():
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.tokenizer import load_tokenizer
    from hmoe_jax.serve.chat_template import ChatTemplate

    ckpt = Path(CHECKPOINT["root"])
    cfg, params = load_checkpoint(ckpt, progress=False)
    eng = Engine(
        params, cfg, devices=1, max_batch=MAX_NUM_SEQS, max_len=MAX_MODEL_LEN
    )  # the server's options
    tok = load_tokenizer(ckpt, cfg.vocab_size)
    return eng, tok, ChatTemplate(ckpt, tok.encode)


@functools.cache
def solo(ids: tuple[int, ...], n: int, ignore_eos: bool = False, temperature: float = 0.0, seed: int = 0):
    from hmoe_jax.model.sampling import SamplingParams

    eng, _, _ = reference()
    sp = SamplingParams(temperature=temperature, seed=seed)
    return eng.generate(list(ids), n, schedule="cpu", stop_ids=() if ignore_eos else None, sampling=sp).tokens


def ids_of(text: str | list[int]) -> tuple[int, ...]:
    return tuple(text) if isinstance(text, list) else tuple(reference()[1].encode(text))


def chat_ids(content: str) -> tuple[int, ...]:
    from hmoe_jax.serve.openai_protocol import ChatMessage

    return tuple(reference()[2].encode([ChatMessage(role="user", content=content)]))


def text_of(tokens) -> str:
    return reference()[1].decode(list(tokens))


def client(server: Server):
    """The unmodified openai client on the server (only base_url set)."""
    import openai  # here: only the server tests need it

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)


GOOD = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}


def gpu_policy(form: str = "interpret"):
    """The bf16 policy engine.precision_for builds on a GPU, with the kernels in Pallas
    interpret mode ("interpret") or their jittable `_ref` twins ("ref": the same activation
    quantisation, f32 dots of the dequantised operands; fast on CPU)."""
    from hmoe_jax.kernels import fp8_gemm as F
    from hmoe_jax.model.precision import policy

    if form == "ref":
        return policy(
            "bf16",
            cpu=False,
            accel_fp8_matmul=F.fp8_linear_ref,
            accel_fp8_grouped_matmul=F.fp8_grouped_linear_ref,
            accel_fp8_head_matmul=F.fp8_head_linear_ref,
        )
    p = functools.partial
    return policy(
        "bf16",
        cpu=False,
        accel_fp8_matmul=p(F.fp8_linear, interpret=True),
        accel_fp8_grouped_matmul=p(F.fp8_grouped_linear, interpret=True),
        accel_fp8_head_matmul=p(F.fp8_head_linear, interpret=True),
    )


@functools.cache
def tiny_random_model():
    """(cfg, params, prompt): deepseek_v3_tiny with random weights (seed 11) and a 12-token
    prompt, shared by the sampler and fork tests (one set of compiled programs)."""
    from hmoe_jax.runtime.synthetic import random_params

    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=11)
    prompt = [int(t) for t in np.random.default_rng(5).integers(2, cfg.vocab_size, 12)]
    return cfg, params, prompt
