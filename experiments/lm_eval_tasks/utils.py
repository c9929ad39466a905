"""Dataset loaders of the hmoe lm-eval tasks (custom_dataset in the YAML files): the local
JSONL files under data/, found beside this file whatever the working directory."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str, limit: int | None = None):
    import datasets

    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:limit])})


def load_ppl(**_kwargs):
    return _load("hmoe_heldout_ppl")


def load_mc(**_kwargs):
    return _load("hmoe_nextline_mc")


def load_gen(**_kwargs):
    return _load("hmoe_nextline_gen")
