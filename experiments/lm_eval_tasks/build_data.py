"""Build the local JSONL data of the hmoe lm-eval tasks (experiments/lm_eval_tasks/*.yaml)
from the held-out text e07 scores: the stdlib files `hmoe_jax.train.data.load_corpus` holds
out of training (heldout_per_mille from the shipped model's train_record.json). No hub
downloads; deterministic (sorted files, seeded choices), so re-running on the same Python
reproduces the committed files byte for byte.

- hmoe_heldout_ppl.jsonl: {"text"}: the head of held-out files cut at a line end
  (loglikelihood_rolling: word_perplexity, byte_perplexity, bits_per_byte);
- hmoe_nextline_mc.jsonl: {"context", "choices", "label"}: CONTEXT_LINES lines of a held-out
  file, the true next line and 3 lines drawn from other held-out files (acc, acc_norm);
- hmoe_nextline_gen.jsonl: {"context", "target"}: the same kind of context, the true next
  line to generate (generate_until "\\n", exact_match).

    python -m experiments.lm_eval_tasks.build_data [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
CONTEXT_LINES = 8
PPL_DOCS, PPL_CHARS = 32, 1200  # ~400 tokens per doc: one rolling window, well inside the context
MC_DOCS, GEN_DOCS = 64, 64
MIN_LINE_CHARS, MAX_LINE_CHARS = 12, 60  # lines worth predicting; short enough for 32 new tokens


def heldout_files() -> list[tuple[str, str]]:
    from hmoe_jax.io.default_model import assets_dir
    from hmoe_jax.train import data

    rec = json.loads((assets_dir() / "deepseek_v3_stdlib" / "train_record.json").read_text())
    corpus = data.load_corpus(heldout_per_mille=rec["recipe"]["heldout_per_mille"])
    return sorted(corpus.heldout)


def _good(line: str) -> bool:
    s = line.strip()
    return MIN_LINE_CHARS <= len(line) <= MAX_LINE_CHARS and bool(s) and not s.startswith("#")


def ppl_docs(files: list[tuple[str, str]]) -> list[dict]:
    step = max(1, len(files) // PPL_DOCS)
    out = []
    for rel, text in files[::step][:PPL_DOCS]:
        head = text[:PPL_CHARS]
        head = head[: head.rfind("\n") + 1] or head
        out.append({"file": rel, "text": head})
    return out


def nextline_points(files: list[tuple[str, str]], n: int, rng: random.Random) -> list[tuple[int, int]]:
    """n (file index, line index) pairs whose line is _good and has CONTEXT_LINES before it."""
    cands = [
        (fi, li)
        for fi, (_, text) in enumerate(files)
        for li, line in enumerate(text.split("\n"))
        if li >= CONTEXT_LINES and _good(line)
    ]
    return sorted(rng.sample(cands, n))


def nextline_docs(files: list[tuple[str, str]], n: int, rng: random.Random, choices: bool) -> list[dict]:
    lines = [text.split("\n") for _, text in files]
    pool = [(fi, line) for fi, ls in enumerate(lines) for line in ls if _good(line)]
    out = []
    for fi, li in nextline_points(files, n, rng):
        context = "\n".join(lines[fi][li - CONTEXT_LINES : li]) + "\n"
        gold = lines[fi][li]
        doc = {"file": files[fi][0], "line": li, "context": context}
        if choices:
            wrong: list[str] = []
            while len(wrong) < 3:
                ofi, line = rng.choice(pool)
                if ofi != fi and line != gold and line not in wrong:
                    wrong.append(line)
            opts = [gold, *wrong]
            rng.shuffle(opts)
            doc.update(choices=opts, label=opts.index(gold))
        else:
            doc["target"] = gold
        out.append(doc)
    return out


def build(out_dir: Path) -> dict[str, int]:
    files = heldout_files()
    sets = {
        "hmoe_heldout_ppl": ppl_docs(files),
        "hmoe_nextline_mc": nextline_docs(files, MC_DOCS, random.Random(SEED), choices=True),
        "hmoe_nextline_gen": nextline_docs(files, GEN_DOCS, random.Random(SEED + 1), choices=False),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in sets.items():
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r, sort_keys=True) + "\n")
    meta = {"python": sys.version.split()[0], "heldout_files": len(files), "seed": SEED}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return {k: len(v) for k, v in sets.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE / "data")
    print(build(p.parse_args().out), file=sys.stderr)


if __name__ == "__main__":
    main()
