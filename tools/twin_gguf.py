"""The bench twin's weights as a llama.cpp GGUF, for e09's side-by-side with llama-server.

    python tools/twin_gguf.py --llama-cpp PATH/TO/llama.cpp --out build/twin/twin-q8_0.gguf

1. Writes the real-shape DeepSeek-V3 bench twin (hmoe_jax/io/bench_twin.py, seed 0: the same
   FP8 weights e06/e09 serve from their arena) in DeepSeek's HF layout (config.json +
   safetensors, e4m3 weights with weight_scale_inv, io/writer.py) next to the GGUF.
2. Writes a byte-level BPE tokenizer of the twin's vocabulary size (bpe_twin_tokenizer). The
   load is sent as token ids, so neither server tokenizes text; the vocabularies differ in
   the text an id decodes to, which the timing does not read (output tokens are counted
   from each server's usage).
3. Runs llama.cpp's own `convert_hf_to_gguf.py` on that directory (`--outtype q8_0` by
   default: 8 bits a weight, the byte count of our FP8 weights). The converter recognises a
   BPE tokenizer by hashing how it splits a test string; a vocabulary of words cannot match a
   known hash, so its pre-tokenizer is named "deepseek-v3" here (llama.cpp's DeepSeek-V3 split
   rules; irrelevant to id prompts). Only the tokenizer is rewritten when the weights exist.

The script does not build llama.cpp (docs/serve.md says how) and copies nothing from it: it
imports the converter from the source tree you point it at.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from pathlib import Path

PRE_TOKENIZER = "deepseek-v3"


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b as one printable unicode character (printable
    ASCII and Latin-1 map to themselves, the other 68 bytes to U+0100 upwards)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def bpe_twin_tokenizer(vocab_size: int) -> dict:
    """A valid byte-level BPE of exactly vocab_size ids for llama.cpp (which needs merges and
    a token for every byte): `<s>`, `</s>`, the 256 byte tokens, then two-letter ASCII
    tokens, each with its merge. The load is sent as ids, so only the vocabulary's size
    (the twin's lm_head) matters; all but the 128 non-ASCII byte tokens decode to ASCII, so
    llama-server streams almost every token as its own chunk (it holds back partial UTF-8)."""
    from hmoe_jax.io.bench_twin import word_tokenizer

    alphabet = byte_level_alphabet()
    letters = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pairs = [(x, y) for x in letters for y in letters][: vocab_size - 2 - len(alphabet)]
    if 2 + len(alphabet) + len(pairs) != vocab_size:
        raise SystemExit(f"twin_gguf: cannot make {vocab_size} ids from two-letter tokens")
    vocab = {"<s>": 0, "</s>": 1, **{t: 2 + i for i, t in enumerate(alphabet)}}
    vocab.update({x + y: len(vocab) + i for i, (x, y) in enumerate(pairs)})
    tok = word_tokenizer(2)  # its header and the two special tokens
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok["pre_tokenizer"] = tok["decoder"] = byte_level
    tok["model"] = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                    "vocab": vocab, "merges": [f"{x} {y}" for x, y in pairs]}  # fmt: skip
    return tok


def write_hf_twin(out_dir: Path) -> None:
    from hmoe_jax.io.bench_twin import bench_twin_config, fp8_twin_params
    from hmoe_jax.io.writer import save_checkpoint

    cfg = bench_twin_config()
    if not (out_dir / "config.json").exists():
        t0 = time.perf_counter()
        print(f"[twin_gguf] writing the bench twin (HF layout, FP8) to {out_dir}", flush=True)
        save_checkpoint(out_dir, cfg, fp8_twin_params(cfg), fp8=True, progress=True)
        print(f"[twin_gguf] written in {time.perf_counter() - t0:.0f} s", flush=True)
    # DeepSeek-V3's release config names its sigmoid router; ours leaves it implicit (the
    # deepseek_v3 model type always routes by sigmoid), and llama.cpp's converter, not told,
    # writes no gating function, which llama.cpp then reads as softmax: a different model
    conf = json.loads((out_dir / "config.json").read_text())
    conf.update(scoring_func="sigmoid", topk_method="noaux_tc")
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    (out_dir / "tokenizer.json").write_text(json.dumps(bpe_twin_tokenizer(cfg.vocab_size)))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": False, "model_max_length": cfg.max_position_embeddings,
    }))  # fmt: skip


def convert(llama_cpp: Path, hf_dir: Path, out: Path, outtype: str) -> None:
    script = llama_cpp / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"twin_gguf: {script} not found (--llama-cpp names llama.cpp's source tree)")
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import conversion.base as base  # llama.cpp's converter package, from the tree given

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    sys.argv = [str(script), str(hf_dir), "--outfile", str(out), "--outtype", outtype]
    runpy.run_path(str(script), run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    ap.add_argument("--out", type=Path, required=True, help="the GGUF to write")
    ap.add_argument("--outtype", default="q8_0", help="convert_hf_to_gguf.py --outtype (default q8_0)")
    args = ap.parse_args(argv)
    hf_dir = args.out.parent / "twin_hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    write_hf_twin(hf_dir)
    convert(args.llama_cpp.resolve(), hf_dir, args.out, args.outtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
