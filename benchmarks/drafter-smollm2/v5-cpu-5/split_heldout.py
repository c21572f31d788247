"""The held-out evaluation set split into its chat part (the first 24 records: heldout-chat.jsonl) and its code part
(the last 16: the code prompts), each a packed directory `eval-drafter --data` reads:
`split_heldout.py OUT_DIR` writes OUT_DIR/heldout-chat and OUT_DIR/heldout-code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HELDOUT = Path(__file__).parents[1] / "v5-cpu" / "eval-heldout"
PARTS = {"chat": range(0, 24), "code": range(24, 40)}


def main() -> None:
    out = Path(sys.argv[1])
    shard = np.load(HELDOUT / "shard-00000.npz")
    manifest = json.loads((HELDOUT / "manifest.json").read_text())
    starts = np.concatenate([[0], np.cumsum(shard["lengths"])])
    for name, rows in PARTS.items():
        rows = list(rows)
        part = out / f"heldout-{name}"
        part.mkdir(parents=True, exist_ok=True)
        tokens = np.concatenate([shard["tokens"][starts[i]:starts[i + 1]] for i in rows])
        np.savez_compressed(part / "shard-00000.npz", tokens=tokens, lengths=shard["lengths"][rows],
                            prompt_len=shard["prompt_len"][rows], index=np.arange(len(rows)))
        (part / "manifest.json").write_text(json.dumps({**manifest, "num_prompts": len(rows)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
