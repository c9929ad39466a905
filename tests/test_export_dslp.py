"""Issue 25 item 8 for dslp: its per-rank pieces (parallel/prefill.py attn_fn = the
context-parallel expanded attention of parallel/attention.py, ffn_fn with the SmallEP MoE
and dense, embed_fn, last_logits_fn) under the bf16 policy as engine.precision_for builds
it on a GPU (the Pallas FP8 GEMMs, interpret=False: their real Triton lowering), exported
for platforms=("cuda",) with 2 ranks' sharding, at the tiny model's shapes and at one real
DeepSeek-V3 layer (4,096 tokens, abstract ShapeDtypeStructs, no weights).

The mesh: an AbstractMesh of 2 abstract CUDA devices, also set as the context mesh (under
jax 0.10.2 a concrete mesh of 2 CPU stand-in devices lowers the same module, but it cannot
be combined with kernels.fp8_gemm.cuda_lowering_target, whose abstract context mesh jax
>= 0.11 needs to lower Triton calls on a CPU box; the abstract CUDA mesh serves both).

Read from the exported StableHLO (tests/hlo_read.py: functions expanded by their calls,
static-trip loops multiplied out, per-rank shapes inside the shard_map): only allowlisted
custom calls; the FP8 weights enter Triton calls as f8E4M3FN; attention dots are bf16 x
bf16 -> f32; collectives carry bf16 payloads; and at real shapes the Triton FLOPs are the
plan's args.fp8_flops and the bf16 dots the rest of its flops (schedules/dslp.py), the
collectives' bytes its args.comm."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from hmoe_jax.config import named_model_config
from hmoe_jax.kernels import fp8_gemm as F
from hmoe_jax.measure import compile_probe as C
from hmoe_jax.model.precision import policy
from hmoe_jax.parallel.mesh import AXIS
from hmoe_jax.parallel.prefill import attn_fn, embed_fn, ffn_fn, grouped_expert_fn, last_logits_fn
from hmoe_jax.plan import costs
from hmoe_jax.plan.dist import ZigzagLayout
from hmoe_jax.plan.system import load_system
from hmoe_jax.quant.fp8 import FP8_DTYPE
from hmoe_jax.schedules.cpu import shared_fp8_flops
from hmoe_jax.schedules.registry import get_schedule
from tests.hlo_read import TRITON, collective_bytes, flops, ops

SDS = jax.ShapeDtypeStruct
RANKS = 2
ALLOWED_CUSTOM_CALLS = {TRITON}  # Pallas' Triton kernels; cuBLAS / cuDNN are chosen after export
CPU_ONLY = re.compile(r"hmoe|lapack|ducc|cpu", re.IGNORECASE)
GPU = policy(
    "bf16",
    cpu=False,
    accel_fp8_matmul=F.fp8_linear,
    accel_fp8_grouped_matmul=F.fp8_grouped_linear,
    accel_fp8_head_matmul=F.fp8_head_linear,
)
BF16_DOT = ("bf16", "bf16", "f32")
TINY, V3 = named_model_config("deepseek_v3_tiny"), named_model_config("deepseek_v3")
PAPER = "paper_epyc9355_rtx5090"
PAIR_BLOCK = 8192  # (token, expert) pairs per block of grouped_expert_fn (parallel/prefill.py)
# Auto like the engine's concrete Mesh (parallel/mesh.py); jax 0.11's AbstractMesh defaults to Explicit.
MESH = AbstractMesh(
    (RANKS,),
    (AXIS,),
    axis_types=(AxisType.Auto,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda"),
)


def _placed(tree, spec):
    sh = NamedSharding(MESH, spec)
    return jax.tree.map(lambda a: SDS(a.shape, a.dtype, sharding=sh), tree)


def _export(fn, *args):
    with jax.sharding.use_abstract_mesh(MESH):
        exp = jax.export.export(
            fn,
            platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)],
        )(*args)
    text = exp.mlir_module()
    assert exp.platforms == ("cuda",) and exp.nr_devices == RANKS
    calls = set(re.findall(r"custom_call\s*@([\w.$-]+)", text))
    assert not {c for c in calls if CPU_ONLY.search(c)}, calls
    assert calls <= ALLOWED_CUSTOM_CALLS, calls - ALLOWED_CUSTOM_CALLS
    return ops(text)


@functools.cache
def dslp_pieces(cfg, tokens: int) -> dict:
    """name -> the counted ops of the exported piece, built as runtime/dist_exec.py builds
    them (the plan's walk block and head groups; FP8 experts as uint8 views, P(AXIS))."""
    lay = ZigzagLayout.for_sequence(tokens, RANKS)
    h = SDS((1, lay.padded_len, cfg.hidden_size), jnp.bfloat16, sharding=NamedSharding(MESH, P(None, AXIS)))
    moe_layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    dense_layer = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i))
    layer = _placed(C.abstract_layer(cfg, moe_layer, GPU), P())
    groups = costs.cp_head_groups(cfg, lay.padded_len, 2)
    out = {"attention": _export(attn_fn(MESH, cfg, lay, GPU, costs.cp_block(lay.chunk), groups), layer, h)}
    as_bytes = lambda a: SDS(a.shape, jnp.uint8) if a.dtype == FP8_DTYPE else a  # noqa: E731
    experts = _placed(jax.tree.map(as_bytes, C.abstract_experts(cfg, cfg.n_routed_experts)), P(AXIS))
    expert_fn = grouped_expert_fn(GPU)
    out["moe"] = _export(ffn_fn(MESH, cfg, True, "smallep", expert_fn, None, GPU), layer, experts, h)
    dense = _placed(C.abstract_layer(cfg, dense_layer, GPU), P())
    out["dense_ffn"] = _export(ffn_fn(MESH, cfg, False, "smallep", expert_fn, None, GPU), dense, None, h)
    table = _placed(SDS((cfg.vocab_size, cfg.hidden_size), jnp.bfloat16), P())
    tok = SDS((1, lay.padded_len), jnp.int32, sharding=NamedSharding(MESH, P(None, AXIS)))
    out["embed"] = _export(embed_fn(MESH, GPU), table, tok)
    rank, local = lay.owner_of_last
    norm = _placed(SDS((cfg.hidden_size,), jnp.float32), P())
    head = _placed(SDS((cfg.vocab_size, cfg.hidden_size), jnp.bfloat16), P())
    out["final"] = _export(last_logits_fn(cfg, rank * lay.local_len + local, GPU), norm, head, h)
    return out


def _kinds(counted, kind):
    return {k[1] for k in counted if k[0] == kind}


def _structure(pieces: dict) -> None:
    """What every size must show: FP8 kernels with e4m3 operands, bf16 activation dots,
    bf16 collective payloads, no ragged_dot."""
    for name, counted in pieces.items():
        assert not any(k[0] == "ragged_dot" for k in counted), name
        for kind in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "collective_permute"):
            assert all(dt == "bf16" for sig in _kinds(counted, kind) for _, dt in sig), (name, kind)
        assert all(k[1][1] == ("f8E4M3FN", "f8E4M3FN") for k in counted if k[0] == "triton"), name
    att, moe, dense = pieces["attention"], pieces["moe"], pieces["dense_ffn"]
    for name in ("attention", "moe", "dense_ffn"):
        assert flops(pieces[name], "triton") > 0, name
    assert _kinds(att, "dot") == {BF16_DOT}  # scores, P.V, kv_a (N = 576: no 128-row tile)
    assert collective_bytes(att, "all_gather") > 0 and _kinds(att, "reduce_scatter") == set()
    # SmallEP: the hidden states gathered and the partial sums scattered back, both bf16;
    # the router is the one f32 dot (as HF), every expert GEMM an FP8 kernel
    assert collective_bytes(moe, "all_gather") > 0 and collective_bytes(moe, "reduce_scatter") > 0
    assert _kinds(moe, "dot") == {("f32", "f32", "f32")}
    assert not any(k[0] == "dot" for k in dense) and not any(k[0] == "all_gather" for k in dense)
    assert not pieces["embed"] and _kinds(pieces["final"], "dot") == {BF16_DOT}


def test_tiny_dslp_pieces_export_for_cuda_with_fp8_kernels_and_bf16_payloads():
    """Also the check that the Pallas FP8 GEMM lowers inside jax.shard_map (check_vma on):
    its out_shape carries the operands' varying mesh axes (kernels/fp8_gemm._out_type);
    without them tracing the attention piece fails."""
    _structure(dslp_pieces(TINY, 64))


def _wire_bytes(counted, kind: str) -> int:
    """Bytes a collective puts on the links over all ranks (plan/dist.py's convention), from
    its per-rank operands: an all_gather sends its shard to the N-1 others from every rank,
    a reduce_scatter N-1 of its N shards."""
    per_rank = collective_bytes(counted, kind)
    return {"all_gather": RANKS * (RANKS - 1), "reduce_scatter": RANKS - 1}[kind] * per_rank


@pytest.fixture(scope="module")
def v3_plan_ops():
    tokens = 4096
    plan = get_schedule("dslp").plan(V3, load_system(PAPER, RANKS), tokens, devices=RANKS)
    assert plan.meta["compute_dtype"] == "bf16"
    first = {}
    for op in plan.ops:
        first.setdefault(op.kind, op)
    return tokens, plan, first


def test_v3_dslp_layer_runs_what_the_plan_prices(v3_plan_ops):
    """One real DeepSeek-V3 layer of each kind at 4,096 tokens on 2 ranks: the exported
    Triton FLOPs are the plan op's fp8_flops and the bf16 / f32 dots the rest of its flops
    (exact: every row count is a multiple of the kernels' row tile), and the collectives
    move the bytes of the op's args.comm (per rank, times the 2 ranks). The routed experts'
    grouped kernel has a data-dependent amount of work (a static grid whose tiles past the
    routed groups exit): its per-row FLOPs are the plan's per pair, and its grid is pinned
    to the worst case, which bounds the plan's rows from above (docs/dslp.md: the gap)."""
    tokens, plan, first = v3_plan_ops
    pieces = dslp_pieces(V3, tokens)
    _structure(pieces)
    t_pad = plan.meta["padded_tokens"]

    att, op = pieces["attention"], first["dslp_attn"]
    assert flops(att, "triton") == op.args["fp8_flops"] > 0
    # q_a, q_b, kv_b, o_proj run in FP8 (one head group at this length: whole weights)
    assert {k[1][0] for k in att if k[0] == "triton"} == {
        (1536, 7168),
        (24576, 1536),
        (32768, 512),
        (7168, 16384),
    }
    assert flops(att, "dot") == flops(att, "dot", BF16_DOT) == op.flops - op.args["fp8_flops"]
    assert _wire_bytes(att, "all_gather") == op.args["comm"]["all_gather_bytes"] > 0

    moe, op = pieces["moe"], first["dslp_moe"]
    fp8 = op.args["fp8_flops"]
    assert flops(moe, "dot") == costs.router_flops(V3, t_pad) == op.flops - fp8
    for kind in ("all_gather", "reduce_scatter"):
        assert _wire_bytes(moe, kind) == op.args["comm"][f"{kind}_bytes"] > 0, kind
    # the shared expert: plain FP8 kernels over the rank's own tokens, exactly as priced
    shared = sum(n * k[2] for k, n in moe.items() if k[0] == "triton" and len(k[1][0]) == 2)
    assert shared == shared_fp8_flops(V3, t_pad // RANKS)
    # the routed experts: the grouped kernel over blocks of PAIR_BLOCK (token, expert) pairs
    # (grouped_experts_fn's lax.map); its grid is static, sized for the worst case (every
    # pair of the block local, each local expert's group padded by one 64-row tile), and
    # skips the tiles past the groups at run time. Per row it does one expert's SwiGLU
    # (what the plan prices per pair); its grid bounds the rows the plan prices from above.
    grouped = {k: n for k, n in moe.items() if k[0] == "triton" and len(k[1][0]) == 3}
    e_local, d, inter = V3.n_routed_experts // RANKS, V3.hidden_size, V3.moe_intermediate_size
    assert {k[1][0] for k in grouped} == {(e_local, inter, d), (e_local, d, inter)}
    blocks = t_pad * V3.num_experts_per_tok // PAIR_BLOCK
    grid_rows = blocks * (PAIR_BLOCK + e_local * 64)
    assert sum(n * k[2] for k, n in grouped.items()) == costs.expert_flops(V3, grid_rows)
    priced_rows = t_pad * V3.num_experts_per_tok // RANKS
    assert fp8 - shared == costs.expert_flops(V3, priced_rows) and priced_rows < grid_rows

    dense, op = pieces["dense_ffn"], first["dslp_ffn"]
    assert flops(dense, "triton") == op.args["fp8_flops"] == op.flops
    i = V3.intermediate_size
    assert {k[1][0] for k in dense if k[0] == "triton"} == {(i, V3.hidden_size), (V3.hidden_size, i)}

    assert flops(pieces["final"], "dot") == first["dslp_final"].flops  # the last token's logits
