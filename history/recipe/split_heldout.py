"""The held-out evaluation set split into its chat part (the first 24 records: heldout-chat.jsonl) and its code part
(the last 16: the code prompts), each a packed directory `eval-drafter --data` reads:
`split_heldout.py OUT_DIR` writes OUT_DIR/heldout-chat and OUT_DIR/heldout-code (new or empty)."""

from __future__ import annotations

import sys
from pathlib import Path

from specformer_jax.training.data.dataset import read_distilled, read_manifest
from specformer_jax.training.data.packed import pack_records

HELDOUT = Path(__file__).parents[1] / "data" / "eval-heldout"
PARTS = {"chat": slice(0, 24), "code": slice(24, 40)}


def main() -> None:
    out = Path(sys.argv[1])
    records, manifest = read_distilled(HELDOUT), read_manifest(HELDOUT)
    for name, rows in PARTS.items():
        part = records[rows]
        pack_records(part, {**manifest, "num_prompts": len(part)}, out / f"heldout-{name}")


if __name__ == "__main__":
    main()
