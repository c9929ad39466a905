"""Training of the shipped model with optax, through the repo's own model blocks.

The forward is `hmoe_jax.model.model`'s `embed -> attention_block -> ffn_block -> final_logits`
(the same math as `forward`, which tests/test_train.py checks), so the trained weights run
unchanged in `forward`, the engine and the FFI kernels. Routed experts run densely through
`experts_dense` (experts_ref's exact sum as two big matmuls; every expert on every token, 4x
the routed FLOPs of top-4 of 16); a thin ExpertFn wrapper also counts tokens per expert, which
drives DeepSeek-V3's auxiliary-loss-free balancing: after every step each MoE layer's
`e_score_correction_bias` moves by `gamma * sign(mean load - load_e)` (overloaded experts
down, underloaded up). The bias only changes selection, so its gradient is exactly zero;
the optimizer never touches it (no weight decay on 1-D leaves).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hmoe_jax.config import ModelConfig
from hmoe_jax.io.names import build_params, expected_tensors
from hmoe_jax.model.model import attention_block, embed, ffn_block, final_logits
from hmoe_jax.model.moe import combine_matrix
from hmoe_jax.model.params import ModelParams, MoEParams
from hmoe_jax.train.data import sample_windows
from hmoe_jax.train.recipe import Recipe


def init_params(cfg: ModelConfig, seed: int, std: float) -> ModelParams:
    """f32 params: matrices N(0, std) (output projections std / sqrt(2 L), GPT-2 style),
    norms 1, router bias 0. One RNG per tensor, seeded by (seed, index in name order)."""
    specs = expected_tensors(cfg)
    index = {s.name: i for i, s in enumerate(specs)}
    shapes = {s.name: s.shape for s in specs}
    resid_std = std / math.sqrt(2 * cfg.num_hidden_layers)

    def get(name: str) -> np.ndarray:
        shape = shapes[name]
        if name.endswith("e_score_correction_bias"):
            return np.zeros(shape, np.float32)
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        r = np.random.default_rng([seed, index[name]])
        s = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        return (s * r.standard_normal(shape)).astype(np.float32)

    return jax.tree_util.tree_map(jnp.asarray, build_params(cfg, get))


def experts_dense(x: jax.Array, ids: jax.Array, weights: jax.Array, experts) -> jax.Array:
    """experts_ref's sum, computed as two big matmuls for training: the combine weight
    scales each expert's hidden units before ONE [T, E*I] x [E*I, D] down projection, so the
    [T, E, D] per-expert outputs (64 MB at 4096 tokens, and their gradient) never exist.
    Equal to experts_ref up to f32 summation order (tests/test_train.py)."""
    e, i, d = experts.gate.shape
    x = x.astype(jnp.float32)  # [T, D]
    c = combine_matrix(ids, weights, e)  # [T, E]
    g = (x @ experts.gate.reshape(e * i, d).T).reshape(-1, e, i)  # [T, E, I]
    u = (x @ experts.up.reshape(e * i, d).T).reshape(-1, e, i)
    hid = jax.nn.silu(g) * u * c[:, :, None]  # [T, E, I]
    down = jnp.transpose(experts.down, (0, 2, 1)).reshape(e * i, d)  # [E*I, D]
    return hid.reshape(-1, e * i) @ down


def counting_expert_fn(loads: list, expert_fn: Callable = experts_dense) -> Callable:
    """expert_fn that also appends the layer's tokens-per-expert [E] to `loads` (traced)."""

    def fn(x, ids, weights, experts):
        e = experts.gate.shape[0]
        loads.append(jnp.zeros((e,), jnp.float32).at[ids.reshape(-1)].add(1.0))
        return expert_fn(x, ids, weights, experts)

    return fn


def logits_and_loads(params: ModelParams, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [B, T] -> (logits [B, T, V] f32, tokens per expert [n_moe_layers, E])."""
    b, t = tokens.shape
    loads: list = []
    fn = counting_expert_fn(loads)
    h = embed(params, tokens)
    lat = jnp.zeros((b, t, cfg.kv_lora_rank), jnp.float32)
    rope = jnp.zeros((b, t, cfg.qk_rope_head_dim), jnp.float32)
    for layer in params.layers:
        h, _, _ = attention_block(layer, cfg, h, lat, rope, jnp.int32(0))
        h = ffn_block(layer, cfg, h, fn)
    loads_arr = jnp.stack(loads) if loads else jnp.zeros((0, cfg.n_routed_experts))
    return final_logits(params, cfg, h), loads_arr


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross entropy in nats: logits [B, T, V], targets [B, T]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _decay_mask(params: ModelParams) -> Any:
    return jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)


def make_optimizer(rc: Recipe) -> optax.GradientTransformation:
    sched = make_lr(rc)
    return optax.chain(
        optax.clip_by_global_norm(rc.grad_clip),
        optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=rc.weight_decay, mask=_decay_mask),
    )


def update_bias(params: ModelParams, loads: jax.Array, gamma: float) -> ModelParams:
    """DeepSeek-V3 aux-loss-free balancing: b_e += gamma * sign(mean load - load_e)."""
    layers, j = [], 0
    for layer in params.layers:
        if isinstance(layer.ffn, MoEParams):
            ld = loads[j]
            bias = layer.ffn.router_bias + gamma * jnp.sign(ld.mean() - ld)
            layer = layer.replace(ffn=layer.ffn.replace(router_bias=bias))
            j += 1
        layers.append(layer)
    return params.replace(layers=tuple(layers))


def make_step(cfg: ModelConfig, rc: Recipe, opt: optax.GradientTransformation):
    def loss_fn(params, batch):
        logits, loads = logits_and_loads(params, cfg, batch[:, :-1])
        return next_token_loss(logits, batch[:, 1:]), loads

    @jax.jit
    def step(params, opt_state, batch):
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = update_bias(params, loads, rc.bias_update_speed)
        return params, opt_state, loss, loads, optax.tree.norm(grads)

    return step


def make_eval(cfg: ModelConfig):
    @jax.jit
    def ev(params, batch):
        logits, loads = logits_and_loads(params, cfg, batch[:, :-1])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])
        return nll.sum(), loads

    return ev


def evaluate(ev, params: ModelParams, windows: np.ndarray, batch: int) -> tuple[float, np.ndarray]:
    """(mean held-out nats per token, tokens per expert [n_moe, E]) over fixed windows."""
    tot, n, loads = 0.0, 0, None
    for i in range(0, len(windows) - batch + 1, batch):
        s, ld = ev(params, jnp.asarray(windows[i : i + batch]))
        tot += float(s)
        n += batch * (windows.shape[1] - 1)
        loads = np.asarray(ld) if loads is None else loads + np.asarray(ld)
    return tot / n, loads


def balance(loads: np.ndarray) -> list[float]:
    """max / mean tokens per expert, per MoE layer (1.0 = perfectly balanced)."""
    return [float(ld.max() / ld.mean()) for ld in np.asarray(loads)]


def zero_bias(params: ModelParams) -> ModelParams:
    layers = [
        ly.replace(ffn=ly.ffn.replace(router_bias=jnp.zeros_like(ly.ffn.router_bias)))
        if isinstance(ly.ffn, MoEParams)
        else ly
        for ly in params.layers
    ]
    return params.replace(layers=tuple(layers))


@dataclasses.dataclass
class TrainResult:
    params: ModelParams
    curve: list[dict]  # one point per eval: train loss (mean since the last), held-out, balance
    step_losses: list[float]  # train loss of every step
    final_train_loss: float
    final_heldout_loss: float
    heldout_balance: list[float]
    heldout_balance_zero_bias: list[float]
    train_s: float
    compile_s: float


def train(
    cfg: ModelConfig,
    rc: Recipe,
    train_stream: np.ndarray,
    eval_win: np.ndarray,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    stop_after: int | None = None,
) -> TrainResult:
    """Train from scratch. stop_after: run only the first N steps of the rc.steps schedule
    (a prefix of the full run, step for step: the cheap reproduction check)."""
    params = init_params(cfg, rc.seed, rc.init_std)
    opt = make_optimizer(rc)
    opt_state = opt.init(params)
    step, ev = make_step(cfg, rc, opt), make_eval(cfg)
    rng = np.random.default_rng([rc.seed, 1])
    curve: list[dict] = []
    t_start = time.perf_counter()
    compile_s = 0.0
    window: list[float] = []
    step_losses: list[float] = []
    n_steps = rc.steps if stop_after is None else min(rc.steps, stop_after)
    for i in range(n_steps):
        batch = jnp.asarray(sample_windows(train_stream, rng, rc.batch, rc.seq_len))
        t0 = time.perf_counter()
        params, opt_state, loss, loads, gnorm = step(params, opt_state, batch)
        loss = float(loss)
        if i == 0:
            compile_s = time.perf_counter() - t0
        if not math.isfinite(loss):
            raise FloatingPointError(f"step {i}: loss is {loss}")
        window.append(loss)
        step_losses.append(loss)
        last = i == n_steps - 1
        if (i + 1) % rc.eval_every == 0 or last or i == 0:
            hl, eloads = evaluate(ev, params, eval_win, rc.batch)
            el = time.perf_counter() - t_start
            rate = (i + 1) * rc.tokens_per_step / max(el - compile_s, 1e-9)
            eta = (rc.steps - i - 1) * rc.tokens_per_step / rate
            bal = balance(np.asarray(loads))
            curve.append(
                {
                    "step": i + 1,
                    "tokens": (i + 1) * rc.tokens_per_step,
                    "train_loss": float(np.mean(window)),
                    "heldout_loss": hl,
                    "lr": float(make_lr(rc)(i)),
                    "grad_norm": float(gnorm),
                    "train_max_over_mean_load": bal,
                    "heldout_max_over_mean_load": balance(eloads),
                    "elapsed_s": el,
                }
            )
            log(
                f"step {i + 1:5d}/{rc.steps}  train {np.mean(window):.4f}  held-out {hl:.4f}  "
                f"max/mean load {max(bal):.2f}  {rate:,.0f} tok/s  {el:.0f} s elapsed, ~{eta:.0f} s left"
            )
            window = []
    train_s = time.perf_counter() - t_start
    hl, eloads = evaluate(ev, params, eval_win, rc.batch)
    _, zloads = evaluate(ev, zero_bias(params), eval_win, rc.batch)
    return TrainResult(
        params=params,
        curve=curve,
        step_losses=step_losses,
        final_train_loss=curve[-1]["train_loss"],
        final_heldout_loss=hl,
        heldout_balance=balance(eloads),
        heldout_balance_zero_bias=balance(zloads),
        train_s=train_s,
        compile_s=compile_s,
    )


def make_lr(rc: Recipe):
    """Linear warmup, cosine decay to min_lr_frac * lr at the last step."""
    warmup = min(rc.warmup_steps, max(1, rc.steps // 10))
    return optax.warmup_cosine_decay_schedule(0.0, rc.lr, warmup, rc.steps, rc.lr * rc.min_lr_frac)
