"""e08: the serving modes of e07 evaluated through lm-evaluation-harness against `hmoe serve`,
and the harness's log-likelihoods checked against an independent in-process forward.

Claim: `hmoe serve` is a faithful lm-eval backend: for every serving mode e07 compares (bf16
master, intact FP8, INT4 routed experts, fewer routed experts per token) the log-likelihoods
lm-eval's `local-completions` model gets over HTTP (token-id prompts, echo + logprobs) equal a
teacher-forced in-process forward (hmoe_jax.model.generate.teacher_forced_logits) on the same
token ids, within the tolerance bf16 serving allows; and the task metrics order the modes as
e07's perplexities do.

Modes (each a `hmoe serve` subprocess on the shipped model, default --precision bf16):
- bf16: hmoe_jax/assets/deepseek_v3_stdlib_bf16;
- fp8: hmoe_jax/assets/deepseek_v3_stdlib (block FP8; routed experts via the fused op when built);
- int4: the FP8 checkpoint with --experts-format int4 (INT4 g64 from the dequantized FP8
  experts; e07's `int4` quantizes the bf16 master instead, so the two differ by FP8's rounding);
- topk_reduced: the bf16 master with --hf-overrides '{"num_experts_per_tok": k-2}'.
Tasks (experiments/lm_eval_tasks/, local JSONL from e07's held-out files): hmoe_heldout_ppl
(loglikelihood_rolling), hmoe_nextline_mc (multiple choice, 4 options), hmoe_nextline_gen
(generate_until, --batch_size 8).

In-process reference: the same checkpoint loaded here, the mode's change applied here
(dataclasses.replace of the config, INT4 by quant/int4.py on the dequantized experts), f32
compute; token ids made as lm-eval makes them (tokenizer.json without special tokens; the
context's trailing whitespace moved into the continuation; rolling windows prefixed by BOS).

Tolerance: serving computes in bf16 activations (8 significant bits, relative rounding
2^-8); a log-prob is a logit minus a log-sum-exp, each carrying about 2^-8 x max|logit|, so
per token |harness - in-process| <= 2 * 2^-8 * max|logit| (max over the doc's positions),
summed over the scored tokens of a doc.

    python -m experiments.e08_lm_eval [--quick] [--modes bf16,fp8,int4,topk_reduced]   # an interpreter with lm-eval: pip install -e .[eval]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from experiments.common.record import REPO_ROOT, emit_record, parse_args

TASKS_DIR = REPO_ROOT / "experiments" / "lm_eval_tasks"
TASKS = ("hmoe_heldout_ppl", "hmoe_nextline_mc", "hmoe_nextline_gen")
BF16_REL = 2.0**-8
MODES = ("bf16", "fp8", "int4", "topk_reduced")


def log(msg: str) -> None:
    print(f"[e08 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- modes: server flags, reference


def mode_spec(mode: str, assets: Path, k: int) -> tuple[Path, list[str], str]:
    fp8, bf16 = assets / "deepseek_v3_stdlib", assets / "deepseek_v3_stdlib_bf16"
    return {
        "bf16": (bf16, [], "bf16 master"),
        "fp8": (fp8, [], "block FP8"),
        "int4": (fp8, ["--experts-format", "int4"], "FP8 + INT4 g64 routed experts (from FP8)"),
        "topk_reduced": (
            bf16,
            ["--hf-overrides", json.dumps({"num_experts_per_tok": max(1, k - 2)})],
            f"bf16, top-{max(1, k - 2)} of top-{k}",
        ),
    }[mode]


def reference_model(mode: str, ckpt: Path):
    """(cfg, params, expert_fn) built here without hmoe_jax.io.load_options, as the server's
    Engine would run them (expert_fn 'auto': the fused op for FP8 checkpoints when built)."""
    from hmoe_jax.engine.engine import expert_fn_named
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.model.params import ExpertsParams, MoEParams
    from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize_np
    from hmoe_jax.quant.int4 import quantize_int4_np

    cfg, params = load_checkpoint(ckpt, progress=False)
    if mode == "topk_reduced":
        cfg = dataclasses.replace(cfg, num_experts_per_tok=max(1, cfg.num_experts_per_tok - 2))
    if mode == "int4":

        def q(w):
            return quantize_int4_np(
                dequantize_np(w) if isinstance(w, Fp8Tensor) else np.asarray(w, np.float32), 64
            )

        layers = [
            ly.replace(
                ffn=ly.ffn.replace(
                    experts=ExpertsParams(
                        *(q(w) for w in (ly.ffn.experts.gate, ly.ffn.experts.up, ly.ffn.experts.down))
                    )
                )
            )
            if isinstance(ly.ffn, MoEParams)
            else ly
            for ly in params.layers
        ]
        params = params.replace(layers=tuple(layers))
    import jax

    return cfg, jax.device_put(params), expert_fn_named("auto", cfg)


def token_logprobs(model, ids: list[int]) -> tuple[np.ndarray, float]:
    """log p(ids[t] | ids[:t]) for t >= 1 (f64), and max |logit| over those positions."""
    from hmoe_jax.model.generate import teacher_forced_logits

    cfg, params, fn = model
    logits = np.asarray(teacher_forced_logits(params, cfg, ids, fn), np.float64)[:-1]
    m = logits.max(-1, keepdims=True)
    lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return lp[np.arange(len(ids) - 1), ids[1:]], float(np.abs(logits).max())


# ---------------------------------------------------------------- lm-eval's token ids, reproduced


class Tok:
    """tokenizer.json without special tokens: what lm-eval's huggingface backend sends."""

    def __init__(self, ckpt: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))

    def __call__(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids


def pair_ids(tok: Tok, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's _encode_pair (causal): trailing whitespace of the context moves into the
    continuation; the continuation's ids are the whole's after the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tok(context)
    return tok(context + continuation), len(ctx)


def scored(model, ids: list[int], ctxlen: int) -> tuple[float, float, int]:
    """(sum log p of ids[ctxlen:], tolerance, tokens scored)."""
    lp, amax = token_logprobs(model, ids)
    n = len(ids) - ctxlen
    return float(lp[ctxlen - 1 :].sum()), n * 2 * BF16_REL * amax, n


# ---------------------------------------------------------------- harness


def run_harness(url: str, model_name: str, ckpt: Path, task: str, limit: int, batch: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": model_name,
            "base_url": f"{url}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(ckpt),
            "max_retries": 1,
            "timeout": 600,
        },
        tasks=[task],
        batch_size=batch,
        limit=limit,
        log_samples=True,
        task_manager=TaskManager(include_path=str(TASKS_DIR)),
    )
    out["_s"] = time.perf_counter() - t0
    return out


def check_mc(model, tok: Tok, samples: list[dict]) -> dict:
    diffs, tols, ok, harness_acc, ref_acc = [], [], True, [], []
    for s in samples:
        doc = s["doc"]
        got = [float(r[0]) for r in s["filtered_resps"]]
        ref = []
        for i, choice in enumerate(doc["choices"]):
            ids, ctxlen = pair_ids(tok, doc["context"], choice)
            ll, tol, _ = scored(model, ids, ctxlen)
            ref.append(ll)
            diffs.append(got[i] - ll)
            tols.append(tol)
            ok &= abs(got[i] - ll) <= tol
        harness_acc.append(int(np.argmax(got)) == doc["label"])
        ref_acc.append(int(np.argmax(ref)) == doc["label"])
    d = np.abs(diffs)
    return {
        "docs": len(samples),
        "loglik_max_abs_diff": float(d.max()),
        "loglik_mean_abs_diff": float(d.mean()),
        "loglik_max_diff_over_tol": float((d / np.asarray(tols)).max()),
        "within_tol": bool(ok),
        "acc_harness_recomputed": float(np.mean(harness_acc)),
        "acc_inprocess": float(np.mean(ref_acc)),
    }


def check_ppl(model, tok: Tok, samples: list[dict], bos: int) -> dict:
    diffs, tols, ok, nll, n_tok, n_bytes = [], [], True, 0.0, 0, 0
    for s in samples:
        text = s["doc"]["text"]
        got = float(
            s["filtered_resps"][0]
            if not isinstance(s["filtered_resps"][0], list)
            else s["filtered_resps"][0][0]
        )
        ids = [bos, *tok(text)]
        ll, tol, n = scored(model, ids, 1)
        diffs.append(got - ll)
        tols.append(tol)
        ok &= abs(got - ll) <= tol
        nll -= ll
        n_tok += n
        n_bytes += len(text.encode())
    d = np.abs(diffs)
    return {
        "docs": len(samples),
        "loglik_max_abs_diff": float(d.max()),
        "loglik_mean_abs_diff_per_token": float(np.sum(d) / n_tok),
        "loglik_max_diff_over_tol": float((d / np.asarray(tols)).max()),
        "within_tol": bool(ok),
        "tokens": n_tok,
        "bits_per_byte_inprocess": nll / n_bytes / np.log(2),
        "token_ppl_inprocess": float(np.exp(nll / n_tok)),
    }


def metric(res: dict, task: str, name: str) -> float:
    r = res["results"][task]
    return float(next(v for k, v in r.items() if k.split(",")[0] == name))


def run_mode(mode: str, assets: Path, k: int, limits: dict[str, int]) -> dict:
    from experiments.e09_serving import Server, _env

    ckpt, flags, what = mode_spec(mode, assets, k)
    import re

    cmd = [sys.executable, "-m", "hmoe_jax.cli", "serve", "--checkpoint", str(ckpt), "--port", "0"]
    cmd += ["--max-num-seqs", "8", "--generation-config", "none", "--no-warmup", "--quiet", *flags]
    log(f"{mode}: starting hmoe serve {' '.join(flags)}")
    t0 = time.perf_counter()
    srv = Server(cmd, re.compile(r"listening on (http://\S+)"), _env(), timeout_s=900)
    row: dict = {"mode": mode, "what": what, "checkpoint": ckpt.name, "serve_flags": flags}
    try:
        log(f"{mode}: listening after {time.perf_counter() - t0:.0f} s")
        name = ckpt.name
        res = {}
        for task, batch in (("hmoe_heldout_ppl", 4), ("hmoe_nextline_mc", 4), ("hmoe_nextline_gen", 8)):
            log(f"{mode}: lm-eval {task} limit {limits[task]} batch {batch}")
            res[task] = run_harness(srv.url, name, ckpt, task, limits[task], batch)
            row[f"{task}_harness_s"] = res[task]["_s"]
    finally:
        rc = srv.stop()
        row["server_exit"] = rc
    log(f"{mode}: in-process reference")
    model = reference_model(mode, ckpt)
    tok = Tok(ckpt)
    bos = model[0].bos_token_id
    row["mc"] = check_mc(model, tok, res["hmoe_nextline_mc"]["samples"]["hmoe_nextline_mc"])
    row["ppl"] = check_ppl(model, tok, res["hmoe_heldout_ppl"]["samples"]["hmoe_heldout_ppl"], bos)
    row["mc"].update(
        acc=metric(res["hmoe_nextline_mc"], "hmoe_nextline_mc", "acc"),
        acc_norm=metric(res["hmoe_nextline_mc"], "hmoe_nextline_mc", "acc_norm"),
    )
    row["ppl"].update(
        word_perplexity=metric(res["hmoe_heldout_ppl"], "hmoe_heldout_ppl", "word_perplexity"),
        byte_perplexity=metric(res["hmoe_heldout_ppl"], "hmoe_heldout_ppl", "byte_perplexity"),
        bits_per_byte=metric(res["hmoe_heldout_ppl"], "hmoe_heldout_ppl", "bits_per_byte"),
    )
    row["ppl"]["bits_per_byte_diff"] = row["ppl"]["bits_per_byte"] - row["ppl"]["bits_per_byte_inprocess"]
    row["gen"] = {
        "docs": len(res["hmoe_nextline_gen"]["samples"]["hmoe_nextline_gen"]),
        "exact_match": metric(res["hmoe_nextline_gen"], "hmoe_nextline_gen", "exact_match"),
    }
    log(f"{mode}: {json.dumps({k: row[k] for k in ('mc', 'ppl', 'gen')})}")
    return row


def main(argv: list[str] | None = None) -> dict:
    modes = list(MODES)
    if argv is None:
        argv = sys.argv[1:]
    if "--modes" in argv:  # one mode per process: on a shared 2-core box the modes run side by side
        i = argv.index("--modes")
        modes = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2 :]
        bad = sorted(set(modes) - set(MODES))
        if bad:
            raise SystemExit(f"--modes: unknown mode(s) {bad}; expected a comma list of {MODES}")
    args = parse_args("e08_lm_eval", __doc__, argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise SystemExit("e08 needs lm-eval: pip install -e '.[eval]' (lm-eval[api]==0.4.13)") from None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from hmoe_jax.config import load_config
    from hmoe_jax.io.default_model import assets_dir

    assets = assets_dir()
    k = load_config(assets / "deepseek_v3_stdlib_bf16").num_experts_per_tok
    limits = (
        {"hmoe_heldout_ppl": 2, "hmoe_nextline_mc": 4, "hmoe_nextline_gen": 8}
        if args.quick
        else {"hmoe_heldout_ppl": 32, "hmoe_nextline_mc": 64, "hmoe_nextline_gen": 64}
    )
    rows = [run_mode(m, assets, k, limits) for m in modes]
    by = {r["mode"]: r for r in rows}
    summary: dict = {}
    for m, r in by.items():
        summary.update(
            {
                f"{m}_bits_per_byte": r["ppl"]["bits_per_byte"],
                f"{m}_bits_per_byte_inprocess": r["ppl"]["bits_per_byte_inprocess"],
                f"{m}_word_perplexity": r["ppl"]["word_perplexity"],
                f"{m}_mc_acc": r["mc"]["acc"],
                f"{m}_mc_acc_norm": r["mc"]["acc_norm"],
                f"{m}_mc_acc_inprocess": r["mc"]["acc_inprocess"],
                f"{m}_gen_exact_match": r["gen"]["exact_match"],
                f"{m}_mc_loglik_max_abs_diff": r["mc"]["loglik_max_abs_diff"],
                f"{m}_ppl_loglik_max_abs_diff": r["ppl"]["loglik_max_abs_diff"],
                f"{m}_max_diff_over_tol": max(
                    r["mc"]["loglik_max_diff_over_tol"], r["ppl"]["loglik_max_diff_over_tol"]
                ),
                f"{m}_within_tol": r["mc"]["within_tol"] and r["ppl"]["within_tol"],
            }
        )
    summary["all_within_tol"] = all(summary[f"{m}_within_tol"] for m in by)
    return emit_record(
        args,
        claim="lm-eval through hmoe serve matches the in-process forward within bf16 serving tolerance, every mode",
        paper_value=None,
        config={
            "tasks": list(TASKS),
            "limits": limits,
            "batch_size": {"hmoe_heldout_ppl": 4, "hmoe_nextline_mc": 4, "hmoe_nextline_gen": 8},
            "tolerance": "per token 2 * 2^-8 * max|logit|, summed over a doc's scored tokens",
            "lm_eval": __import__("lm_eval").__version__,
            "serve_precision": "bf16",
            "modes": modes,
        },
        rows=rows,
        summary=summary,
    )


if __name__ == "__main__":
    main()
