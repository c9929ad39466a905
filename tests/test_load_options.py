"""--hf-overrides and --experts-format (hmoe_jax/io/load_options.py, cli/run.py): bad input
is refused by name; an override / INT4 experts change the loaded model exactly as an
independent in-process construction (dataclasses.replace / quantize_int4_np) does."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hmoe_jax.cli.app import build_parser
from hmoe_jax.cli.run import build_run
from hmoe_jax.io.default_model import assets_dir
from hmoe_jax.io.errors import InputError
from hmoe_jax.io.load_options import apply_hf_overrides, parse_hf_overrides

BF16 = assets_dir() / "deepseek_v3_stdlib_bf16"
IDS = [0, 40, 41, 42, 43, 44, 45, 46]


def _run(*flags: str):
    args = build_parser().parse_args(
        ["logits", "--checkpoint", str(BF16), "--quiet", "--tokens", "1", "--out", "x.npy", *flags]
    )
    return build_run(args)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("{num_experts_per_tok: 2}", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('"x"', "expected a JSON object"),
    ],
)
def test_bad_json(text, needle):
    with pytest.raises(InputError, match=needle):
        parse_hf_overrides(text)


@pytest.mark.parametrize(
    "ov, needle",
    [
        ({"num_experts_per_token": 2}, "num_experts_per_token"),  # a typo: unknown key, named
        ({"torch_dtype": "float32"}, "torch_dtype"),  # ignored by the loader: no effect, refused
        ({"hidden_size": 128}, "hidden_size"),  # would not match the weights
        ({"num_experts_per_tok": 99}, "num_experts_per_tok"),  # more than the groups hold
    ],
)
def test_bad_override_named(ov, needle):
    from hmoe_jax.config import load_config

    with pytest.raises(InputError, match=needle):
        apply_hf_overrides(load_config(BF16), BF16, ov)


def test_bad_flag_through_build_run():
    with pytest.raises(InputError, match="bogus"):
        _run("--hf-overrides", json.dumps({"bogus": 1}))


def _forward(cfg, params, fn=None):
    import jax

    from hmoe_jax.model.generate import teacher_forced_logits
    from hmoe_jax.model.moe import experts_ref

    return np.asarray(teacher_forced_logits(jax.device_put(params), cfg, IDS, fn or experts_ref), np.float64)


def test_topk_override_changes_logits_as_reference():
    from hmoe_jax.io.loader import load_checkpoint

    cfg, params = load_checkpoint(BF16, progress=False)
    k = cfg.num_experts_per_tok
    run = _run("--hf-overrides", json.dumps({"num_experts_per_tok": k - 2}))
    assert run.cfg.num_experts_per_tok == k - 2
    assert run.cfg == dataclasses.replace(cfg, num_experts_per_tok=k - 2)
    got = np.asarray(_forward(run.cfg, run.host_params, run.expert_fn))
    ref = _forward(dataclasses.replace(cfg, num_experts_per_tok=k - 2), params)
    default = _forward(cfg, params)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    assert np.abs(got - default).max() > 0.05, "top-k override did not change the logits"


def test_int4_experts_as_reference():
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.model.params import ExpertsParams, MoEParams
    from hmoe_jax.quant.int4 import Int4Tensor, quantize_int4_np

    cfg, params = load_checkpoint(BF16, progress=False)
    run = _run("--experts-format", "int4")
    moe = [ly.ffn for ly in run.host_params.layers if isinstance(ly.ffn, MoEParams)]
    assert moe and all(isinstance(m.experts.gate, Int4Tensor) and m.experts.gate.group == 64 for m in moe)
    layers = [
        ly.replace(
            ffn=ly.ffn.replace(
                experts=ExpertsParams(
                    *(
                        quantize_int4_np(np.asarray(w, np.float32), 64)
                        for w in (ly.ffn.experts.gate, ly.ffn.experts.up, ly.ffn.experts.down)
                    )
                )
            )
        )
        if isinstance(ly.ffn, MoEParams)
        else ly
        for ly in params.layers
    ]
    ref = _forward(cfg, params.replace(layers=tuple(layers)))
    got = _forward(run.cfg, run.host_params)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
    assert np.abs(got - _forward(cfg, params)).max() > 1e-3, "INT4 experts left the logits unchanged"


def test_pd_refuses_load_options(capsys):
    from hmoe_jax.cli.app import main

    rc = main(["serve", "--pd", "--quiet", "--experts-format", "int4"])
    assert rc != 0
    assert "--pd" in capsys.readouterr().err
