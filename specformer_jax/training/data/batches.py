"""Batches of distilled records: a grain input pipeline of padded sequences with answer-only label masks, sharded
per host, and the fixed evaluation batches."""

from __future__ import annotations

import grain
import numpy as np


def _example(record: dict, seq_len: int) -> dict:
    """tokens int32[seq_len] (0-padded) and label_mask int32[seq_len]: 1 on answer tokens (the target's own output)."""
    ids = np.asarray(record["input_ids"][:seq_len], np.int32)
    tokens = np.zeros(seq_len, np.int32)
    tokens[: len(ids)] = ids
    mask = np.zeros(seq_len, np.int32)
    mask[record["prompt_len"] : len(ids)] = 1
    return {"tokens": tokens, "label_mask": mask}


class _ToExample(grain.transforms.Map):
    def __init__(self, seq_len: int, states=None):
        self.seq_len, self.states = seq_len, states

    def map(self, record):
        example = _example(record, self.seq_len)
        if self.states is not None:  # the target's states from the cache (the record's place in the data)
            example["states"] = self.states.rows(record["position"], self.seq_len)
        return example


def training_batches(records: list[dict], *, seq_len: int, batch_size: int, steps: int, seed: int,
                     process_index: int = 0, process_count: int = 1, states=None) -> grain.IterDataset:
    """Shuffled (anew each epoch), repeated for `steps`, this host's share of every global batch. states: a
    StateCache (state_cache.py) of the records, whose "position" says where each lies in it: every example also
    holds "states", the target's states there."""
    if batch_size % process_count:
        raise ValueError(f"batch_size {batch_size} is not divisible by {process_count} processes")
    per_host = batch_size // process_count
    epochs = -(-steps * batch_size // max(len(records), 1)) + 1
    ds = grain.MapDataset.source(records).repeat(epochs).seed(seed).shuffle()
    ds = ds[process_index::process_count].map(_ToExample(seq_len, states)).batch(per_host, drop_remainder=True)
    return ds.to_iter_dataset()


def eval_batches(records: list[dict], *, seq_len: int, batch_size: int, num_batches: int) -> list[dict]:
    """A fixed list of evaluation batches (same every time, so eval curves are comparable). The last batch is filled
    with all-padding rows (label_mask 0), which count for nothing."""
    examples = [_example(r, seq_len) for r in records[: batch_size * num_batches]]
    if not examples:
        return []
    blank = {"tokens": np.zeros(seq_len, np.int32), "label_mask": np.zeros(seq_len, np.int32)}
    examples += [blank] * (-len(examples) % batch_size)
    return [
        {k: np.stack([e[k] for e in examples[i : i + batch_size]]) for k in blank}
        for i in range(0, len(examples), batch_size)
    ]
