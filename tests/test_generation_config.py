"""A checkpoint's generation_config.json as default sampling parameters (io/generation_config.py):
parsed against hand-written expectations (HF key meanings, do_sample=false is greedy, unused
keys named); `hmoe generate` on a checkpoint copy with the file: its defaults reach the
SamplingParams, an explicit flag wins, `--generation-config none` ignores the file, a
malformed file is one error line naming the file and the key; `hmoe serve`'s request path
(the HTTP app on a stub backend that records the SamplingParams it was given): the same."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time

import pytest
from fastapi.testclient import TestClient

from hmoe_jax.cli import main
from hmoe_jax.cli.app import build_parser
from hmoe_jax.cli.generate import sampling_params
from hmoe_jax.config import named_model_config
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.generation_config import NO_DEFAULTS, load_generation_config
from hmoe_jax.io.synthetic import synthetic_params
from hmoe_jax.io.tokenizer import ByteTokenizer
from hmoe_jax.io.writer import save_checkpoint

CFG = dataclasses.replace(
    named_model_config("deepseek_v3_tiny"),
    num_hidden_layers=2,
    first_k_dense_replace=1,
    max_position_embeddings=16,
    quant=None,
)
GEN = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 7,
    "max_new_tokens": 3,
    "do_sample": True,
    "repetition_penalty": 1.1,
    "min_p": 0.05,
    "length_penalty": 1.5,  # unsupported (beam search): ignored, and said so
    "bos_token_id": 0,  # metadata: neither applied nor reported
    "transformers_version": "4.46.3",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    save_checkpoint(d, CFG, synthetic_params(CFG, seed=1))
    return d


@pytest.fixture
def ckpt(base, tmp_path):
    """A copy of the checkpoint directory; the test writes its generation_config.json."""
    d = tmp_path / "copy"
    shutil.copytree(base, d)
    return d


def _write(d, obj):
    (d / "generation_config.json").write_text(obj if isinstance(obj, str) else json.dumps(obj))


# ---- parsing ---------------------------------------------------------------------------


def test_parse_applies_the_sampling_keys_and_names_the_ignored_ones(ckpt):
    _write(ckpt, GEN)
    d = load_generation_config(ckpt, "auto")
    assert (d.temperature, d.top_p, d.top_k, d.max_new_tokens) == (0.6, 0.95, 7, 3)
    assert (d.repetition_penalty, d.min_p, d.presence_penalty, d.frequency_penalty) == (1.1, 0.05, None, None)
    assert d.ignored == ("length_penalty",)
    assert d.source == ckpt / "generation_config.json"
    assert "ignored (unsupported): length_penalty" in d.describe() and "temperature=0.6" in d.describe()
    assert "repetition_penalty=1.1" in d.describe() and "min_p=0.05" in d.describe()
    _write(ckpt, {"presence_penalty": -0.5, "frequency_penalty": 2})
    d = load_generation_config(ckpt, "auto")
    assert (d.presence_penalty, d.frequency_penalty, d.repetition_penalty, d.min_p) == (-0.5, 2.0, None, None)
    assert load_generation_config(ckpt, "none") == NO_DEFAULTS
    assert load_generation_config(ckpt, None) == NO_DEFAULTS


def test_do_sample_false_is_greedy_and_a_missing_file_is_no_defaults(ckpt, tmp_path):
    assert load_generation_config(ckpt, "auto") == NO_DEFAULTS  # auto: no file, no defaults
    _write(ckpt, {"do_sample": False, "temperature": 0.7, "top_p": None})
    d = load_generation_config(ckpt, "auto")
    assert d.temperature == 0.0 and d.top_p is None
    _write(ckpt, {"do_sample": True})
    assert load_generation_config(ckpt, "auto").temperature == 1.0  # HF's sampling default
    with pytest.raises(
        CheckpointError, match=r"--generation-config .*/nowhere: .*generation_config.json not found"
    ):
        load_generation_config(ckpt, tmp_path / "nowhere")
    other = tmp_path / "other"
    other.mkdir()
    _write(other, {"top_k": 2})
    assert load_generation_config(ckpt, other).top_k == 2  # DIR: that folder's file


@pytest.mark.parametrize(
    "body,pattern",
    [
        ("{not json", r"generation_config.json: not readable JSON"),
        ("[1, 2]", r"generation_config.json: expected a JSON object, got list"),
        ({"temperature": "0.7"}, r"generation_config.json: 'temperature' must be a finite number, got '0.7'"),
        ({"temperature": -0.5}, r"'temperature' must be >= 0, got -0.5"),
        ({"top_p": 1.5}, r"generation_config.json: 'top_p' must be in \(0, 1\], got 1.5"),
        ({"top_p": True}, r"'top_p' must be a finite number, got True"),
        ({"top_k": 2.5}, r"generation_config.json: 'top_k' must be an integer, got 2.5"),
        ({"max_new_tokens": 0}, r"'max_new_tokens' must be >= 1, got 0"),
        ({"do_sample": "yes"}, r"'do_sample' must be true or false, got 'yes'"),
        ({"repetition_penalty": 0}, r"generation_config.json: 'repetition_penalty' must be > 0, got 0.0"),
        ({"min_p": 1.5}, r"'min_p' must be in \[0, 1\], got 1.5"),
        ({"presence_penalty": 3}, r"'presence_penalty' must be in \[-2, 2\], got 3.0"),
        ({"frequency_penalty": "1"}, r"'frequency_penalty' must be a finite number, got '1'"),
    ],
)
def test_a_malformed_file_names_the_file_and_key(ckpt, body, pattern):
    _write(ckpt, body)
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_generation_config(ckpt, "auto")
    assert str(ckpt / "generation_config.json") in str(e.value)


# ---- hmoe generate ---------------------------------------------------------------------


def _params(argv, gen_defaults, n_prompt=4, max_context=16):
    args = build_parser().parse_args(["generate", "--tokens", "1", *argv])
    return sampling_params(args, gen_defaults, n_prompt, max_context)


def test_generate_flags_win_over_the_file_and_none_restores_the_builtins(ckpt):
    _write(ckpt, GEN)
    d = load_generation_config(
        ckpt, build_parser().parse_args(["generate", "--tokens", "1"]).generation_config
    )
    p = _params([], d)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (0.6, 0.95, 7, 3)
    assert (p.repetition_penalty, p.min_p, p.presence_penalty, p.frequency_penalty) == (1.1, 0.05, 0.0, 0.0)
    p = _params(["--temperature", "0", "--top-p", "0.5", "--top-k", "0", "--max-new-tokens", "5"], d)
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (0.0, 0.5, 0, 5)
    p = _params([], load_generation_config(ckpt, "none"))
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (0.0, 1.0, 0, 32)
    assert (p.repetition_penalty, p.min_p) == (1.0, 0.0)
    # the file's max_new_tokens is cut to the room the context leaves (16 - 14 = 2)
    assert _params([], dataclasses.replace(d, max_new_tokens=50), n_prompt=14).max_new_tokens == 2


def test_generate_end_to_end_reports_the_files_defaults(ckpt, capsys):
    _write(ckpt, GEN)
    base = ["generate", "--checkpoint", str(ckpt), "--tokens", "5,6", "--no-warmup", "--json"]
    base += ["--schedule", "reference", "--ignore-eos"]
    assert main(base) == 0
    cap = capsys.readouterr()
    rec = json.loads(cap.out.strip().splitlines()[-1])
    assert (rec["temperature"], rec["top_p"], rec["top_k"], len(rec["tokens"])) == (0.6, 0.95, 7, 3)
    assert (
        "ignored (unsupported): length_penalty" in cap.err
        and "repetition_penalty=1.1" in cap.err
        and "generation_config.json" in cap.err
    )
    assert main([*base, "--quiet", "--generation-config", "none", "--max-new-tokens", "2"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rec["temperature"], rec["top_p"], rec["top_k"], len(rec["tokens"])) == (0.0, 1.0, 0, 2)


def test_generate_with_a_malformed_file_is_one_error_line(ckpt, capsys):
    _write(ckpt, {"top_p": 2})
    assert main(["generate", "--checkpoint", str(ckpt), "--tokens", "5", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "generation_config.json: 'top_p' must be in (0, 1], got 2.0" in err[0], err
    # `none` does not read it at all
    args = build_parser().parse_args(["serve", "--checkpoint", str(ckpt), "--generation-config", "none"])
    assert load_generation_config(ckpt, args.generation_config) == NO_DEFAULTS


# ---- hmoe serve (the request path) ------------------------------------------------------


class RecordingBackend:
    """Finishes every request at once, keeping the SamplingParams it was given."""

    def __init__(self):
        self.params = []

    def submit(self, prompt_ids, params=None):
        import numpy as np

        from hmoe_jax.serve.request import Request, RequestHandle

        self.params.append(params)
        h = RequestHandle(
            Request(np.asarray(prompt_ids, np.int32), params, time.perf_counter()), lambda r: None
        )
        threading.Thread(target=lambda: h.finish("length", time.perf_counter()), daemon=True).start()
        return h

    def close(self):
        pass


def _serve_params(gen, body, chat=False):
    from hmoe_jax.serve.chat_template import ChatTemplate
    from hmoe_jax.serve.http import ServeOptions, ServerState, create_app

    tok = ByteTokenizer(512)
    backend = RecordingBackend()
    opts = ServeOptions(model_name="m", root="/m", vocab_size=512, max_model_len=128, generation=gen)
    c = TestClient(create_app(ServerState(backend, tok, ChatTemplate(None, tok.encode), opts)))
    if chat:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
        )
    else:
        r = c.post("/v1/completions", json={"model": "m", "prompt": "hi", **body})
    assert r.status_code == 200, r.text
    return backend.params[-1], r.json()["usage"]["prompt_tokens"]


def test_serve_requests_take_the_files_defaults_and_their_own_fields_win(ckpt):
    _write(ckpt, dict(GEN, max_new_tokens=500))
    d = load_generation_config(ckpt, "auto")
    p, _ = _serve_params(d, {})
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 7)
    assert (p.repetition_penalty, p.min_p, p.presence_penalty, p.frequency_penalty) == (1.1, 0.05, 0.0, 0.0)
    own = {"repetition_penalty": 1.3, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.5}
    p, _ = _serve_params(d, own, chat=True)  # a request's own value wins, 0 included
    assert (p.repetition_penalty, p.min_p, p.presence_penalty, p.frequency_penalty) == (1.3, 0.0, 0.0, 0.5)
    pf = dataclasses.replace(d, presence_penalty=-0.5, frequency_penalty=1.5)
    p, _ = _serve_params(pf, {})
    assert (p.presence_penalty, p.frequency_penalty) == (-0.5, 1.5)
    p, _ = _serve_params(pf, {"presence_penalty": 0, "frequency_penalty": 0})
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    p, n_prompt = _serve_params(d, {}, chat=True)  # 500 is cut to the rest of the 128-token context
    assert p.max_new_tokens == 128 - n_prompt
    p, _ = _serve_params(d, {"temperature": 0, "top_p": 0.5, "top_k": -1, "max_tokens": 4})
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (0.0, 0.5, 0, 4)
    # none: OpenAI's defaults (temperature 1, top_p 1, completions 16, chat the rest of the context)
    p, _ = _serve_params(NO_DEFAULTS, {})
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (1.0, 1.0, 0, 16)
    assert (p.repetition_penalty, p.min_p, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0, 0.0)
    p, n_prompt = _serve_params(NO_DEFAULTS, {}, chat=True)
    assert p.max_new_tokens == 128 - n_prompt
    d3 = load_generation_config(ckpt, "auto")
    p, _ = _serve_params(dataclasses.replace(d3, max_new_tokens=3), {}, chat=True)
    assert p.max_new_tokens == 3
