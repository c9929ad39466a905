"""Reading an exported StableHLO module (jax.export(...).mlir_module()) for the CUDA export
tests: how many times each dot, Triton kernel call, custom call and collective runs, with
loops counted. Private functions are expanded by their call counts; a stablehlo.while
whose condition is `counter < constant` with the counter starting at a constant (what
lax.scan / lax.fori_loop with static bounds lower to) multiplies its body by the trip
count; any other loop is an error (its count is not known from the module alone)."""

from __future__ import annotations

import functools
import math
import re
from collections import Counter

TRITON = "__gpu$xla.gpu.triton"
COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "collective_permute")

_TYPE = re.compile(r"tensor<([0-9x]*)x?([a-zA-Z0-9]+)>")
_CONST = re.compile(r"(%[\w#]+) = stablehlo\.constant dense<(-?\d+)> : tensor<i(?:32|64)>")


def types(sig: str) -> list[tuple[tuple[int, ...], str]]:
    out = []
    for dims, dt in _TYPE.findall(sig):
        shape = tuple(int(d) for d in dims.split("x") if d) if dims else ()
        out.append((shape, dt))
    return out


def functions(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = re.search(r"func\.func (?:public |private )?@([\w$.]+)\(", line)
        if m:
            name = m.group(1)
            funcs[name] = []
        elif name is not None:
            funcs[name].append(line)
    return funcs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _trip_count(while_line: str, cond: list[str], consts: dict[str, int]) -> int:
    """`counter < bound` with both the bound and the counter's start constants."""
    cmp = next((ln for ln in cond if "stablehlo.compare" in ln), None)
    m = cmp and re.search(r"compare\s+LT, (%iterArg[\w]*), (%[\w#]+)", cmp)
    if not m or m.group(2) not in consts:
        raise AssertionError(f"a loop without a static trip count: {while_line.strip()[:200]} / {cond}")
    start = re.search(re.escape(m.group(1)) + r" = (%[\w#]+)[,)]", while_line)
    if not start or start.group(1) not in consts:
        raise AssertionError(f"a loop counter without a constant start: {while_line.strip()[:200]}")
    return max(0, consts[m.group(2)] - consts[start.group(1)])


def _record(out: Counter, line: str, mult: int) -> None:
    if "stablehlo.dot_general" in line:
        lhs_c = [int(i) for i in re.search(r"contracting_dims = \[([\d, ]*)\]", line).group(1).split(",")]
        (a, ta), (_, tb), (res, tr) = types(line[line.rindex(": (") :])[:3]
        out[("dot", (ta, tb, tr), 2 * math.prod(res) * math.prod(a[i] for i in lhs_c))] += mult
    elif "custom_call @" in line:
        target = re.search(r"custom_call @([\w$.]+)", line).group(1)
        sig = types(line[line.rindex(": (") :])
        if target == TRITON:
            fp8_in = tuple(dt for _, dt in sig[:-1] if dt == "f8E4M3FN")
            w = [s for s, dt in sig[:-1] if dt == "f8E4M3FN"][-1]  # operands: x_q, scales, weight, scales
            (m_pad, n), _ = sig[-1]
            out[("triton", (w, fp8_in), 2 * m_pad * n * w[-1])] += mult
        else:
            out[("custom_call", target, 0)] += mult
    elif "ragged_dot" in line:
        out[("ragged_dot", "", 0)] += mult


def ops(text: str) -> Counter:
    """(kind, details, flops of one) -> how many times it runs per device (inside a
    shard_map the shapes are the per-rank ones). kind: dot (details: operand and result
    dtypes), triton ((weight shape, the f8 operands' dtypes)), custom_call (target),
    ragged_dot, and the collectives (details: the operands' (shape, dtype); flops 0)."""
    funcs = functions(text)

    @functools.cache
    def expand(fn: str) -> Counter:
        out: Counter = Counter()
        lines = funcs[fn]
        consts: dict[str, int] = {}
        loops: list[tuple[int, int]] = []  # (indent of the while, trip count) of open bodies
        pending = None  # a collective whose operand types follow its region
        i = 0
        while i < len(lines):
            line = lines[i]
            mult = math.prod(t for _, t in loops)
            c = _CONST.search(line)
            if c:
                consts[c.group(1)] = int(c.group(2))
            if loops and _indent(line) == loops[-1][0] and line.strip().startswith("}"):
                loops.pop()
                i += 1
                continue
            if "stablehlo.while" in line:
                ind, cond, j = _indent(line), [], i + 1
                while not (_indent(lines[j]) == ind and lines[j].strip().startswith("} do {")):
                    cond.append(lines[j])
                    j += 1
                loops.append((ind, _trip_count(line, cond, consts)))
                i = j + 1
                continue
            coll = re.search(r'"stablehlo\.(' + "|".join(COLLECTIVES) + r')"', line)
            if coll:
                if ": (" in line:
                    sig = types(line[line.rindex(": (") :])
                    out[(coll.group(1), tuple(sig[:-1]), 0)] += mult
                else:  # a reduction region follows; the types come on its closing line
                    pending = (coll.group(1), _indent(line), mult)
                i += 1
                continue
            if pending and _indent(line) == pending[1] and line.strip().startswith("}) : ("):
                sig = types(line[line.rindex(": (") :])
                out[(pending[0], tuple(sig[:-1]), 0)] += pending[2]
                pending = None
                i += 1
                continue
            call = re.search(r"(?:^|\s)(?:func\.)?call @([\w$.]+)\(", line)
            if call and call.group(1) in funcs:
                for k, n in expand(call.group(1)).items():
                    out[k] += n * mult
            else:
                _record(out, line, mult)
            i += 1
        return out

    return expand("main")


def flops(counted: Counter, kind: str, dtypes=None) -> int:
    return sum(n * k[2] for k, n in counted.items() if k[0] == kind and (dtypes is None or k[1] == dtypes))


def collective_bytes(counted: Counter, kind: str) -> int:
    """Bytes of `kind`'s operands per device, summed over its runs."""
    size = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "ui32": 4, "f8E4M3FN": 1, "ui8": 1, "i8": 1}
    return sum(
        n * sum(math.prod(shape) * size[dt] for shape, dt in k[1]) for k, n in counted.items() if k[0] == kind
    )
