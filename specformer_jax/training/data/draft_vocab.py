"""A reduced draft vocabulary: the V' tokens the drafter's head scores, chosen as the most frequent answer tokens of
its training data, and the share of answer tokens such a vocabulary covers.

Answers of a chat model use a small part of a large vocabulary, so a head over V' << V tokens drafts nearly as well
for a fraction of the drafter's largest matmul. Drafts stay exact to verify: greedy verification checks the drafted
token whatever vocabulary it came from, and sampled verification uses the distribution it was drawn from (zero
outside V'). See docs/training.md, "A reduced draft vocabulary".
"""

from __future__ import annotations

import numpy as np

from specformer_jax.errors import SpecformerError


def answer_token_counts(records: list[dict], vocab_size: int) -> np.ndarray:
    """int64[vocab_size]: how often each token occurs in the records' answers (input_ids after prompt_len)."""
    answers = [np.asarray(r["input_ids"][r["prompt_len"]:], np.int64) for r in records]
    return np.bincount(np.concatenate([np.zeros(0, np.int64), *answers]), minlength=vocab_size)


def draft_vocabulary(counts: np.ndarray, size: int) -> np.ndarray:
    """int32[size]: the `size` most frequent tokens by `counts` (answer_token_counts; ties: the lower id), in
    ascending id order. Tokens that never occur fill the rest by id, so the size is always `size`."""
    vocab_size = counts.shape[0]
    if size >= vocab_size:
        raise SpecformerError(f"draft_vocab_size {size} must be smaller than the target's vocabulary ({vocab_size} "
                              "tokens); leave it unset to draft over the whole vocabulary")
    order = np.lexsort((np.arange(vocab_size), -counts))  # count descending, then id ascending
    return np.sort(order[:size]).astype(np.int32)


def coverage(counts: np.ndarray, vocab: np.ndarray) -> float:
    """The share of the answer tokens counted in `counts` (answer_token_counts) that lie in `vocab` (0 when there
    are none)."""
    total = counts.sum()
    return float(counts[np.asarray(vocab)].sum() / total) if total else 0.0


def vocab_meta(counts: np.ndarray, vocab: np.ndarray, eval_counts: np.ndarray | None = None) -> dict:
    """What drafter.json records of a draft vocabulary: its size and the share of the training answers' tokens (and
    of the evaluation answers', or None) it covers."""
    return {"size": int(vocab.size), "coverage_train": round(coverage(counts, vocab), 4),
            "coverage_eval": None if eval_counts is None else round(coverage(eval_counts, vocab), 4)}
