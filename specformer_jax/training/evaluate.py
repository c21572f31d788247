"""Teacher-forced drafter evaluation on distilled data: per-slot top-1 accuracy and expected accepted length.

Expected accepted length = 1 + the mean, over answer positions whose K look-ahead tokens are all answer tokens, of the
number of leading slots whose argmax equals the target's own next tokens. With greedy self-distilled data this is
what greedy speculative decoding would accept per round (bonus token included), if rounds started at every position.
Decoding accepted length replays decoding on the same text instead (rounds start where the last one stopped; see
loss.replay_rounds): on greedy self-distilled data it equals the mean accepted length that greedy speculative decoding
of those prompts reports, and it is the lower of the two.
"""

from __future__ import annotations

import jax
import numpy as np
from tqdm import tqdm

from specformer_jax.checks import POSITIVE_INT, integer
from specformer_jax.errors import SpecformerError
from specformer_jax.modeling import calibration
from specformer_jax.modeling.loaded import LoadedDrafter, LoadedTarget, check_drafter_fits, checked_target
from specformer_jax.training.data.batches import eval_batches
from specformer_jax.training.data.dataset import check_scorable, check_token_ids
from specformer_jax.training.data.draft_vocab import answer_token_counts, coverage
from specformer_jax.training.loss import drafter_loss, metrics_from_sums


def evaluate_drafter(target: LoadedTarget, drafter: LoadedDrafter, records: list[dict], *, seq_len: int = 512,
                     batch_size: int = 8, progress: bool = False, draft_len: int | None = None) -> dict:
    """Per-slot accuracy and loss, both accepted lengths and the per-slot acceptance over `records`
    (read_distilled's), at most `seq_len` tokens of each. draft_len: score the first k slots only, as decoding with
    k drafts (default: all)."""
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) and "input_ids" in r
                                                              for r in records):
        raise SpecformerError("records must be a non-empty list of distilled records (read_distilled(DIR))")
    seq_len, batch_size = integer(2).check("seq_len", seq_len), POSITIVE_INT.check("batch_size", batch_size)
    check_drafter_fits(drafter, checked_target(target, "target").cfg)
    k = drafter.cfg.num_slots if draft_len is None else integer(1, drafter.cfg.num_slots).check("draft_len", draft_len)
    check_token_ids(records, target.cfg.vocab_size)
    check_scorable(records, seq_len, k)
    batches = eval_batches(records, seq_len=seq_len, batch_size=batch_size, num_batches=-(-len(records) // batch_size))
    step = jax.jit(lambda p, tp, tok, mask: drafter_loss(p, tp, tok, mask, target_cfg=target.cfg,
                                                        drafter_cfg=drafter.cfg, replay=True, draft_len=k)[1])
    total = None
    for b in tqdm(batches, desc="eval", disable=not progress):
        sums = step(drafter.params, target.params, b["tokens"], b["label_mask"])
        total = sums if total is None else jax.tree.map(lambda a, c: a + c, total, sums)
    m = metrics_from_sums(total)
    return {
        "num_sequences": len(records),
        "num_slots": k,
        "loss_per_slot": np.asarray(m["loss_per_slot"]).round(4).tolist(),
        "accuracy_per_slot": np.asarray(m["accuracy_per_slot"]).round(4).tolist(),
        "acceptance_rate_per_slot": np.asarray(m["acceptance_rate_per_slot"]).round(4).tolist(),
        "expected_accepted_length": round(float(m["expected_accepted_length"]), 4),
        "decoding_accepted_length": round(float(m["decoding_accepted_length"]), 4),
        "scored_positions": int(total["positions"]),
    } | _calibration(total) | _vocab_coverage(drafter, records, target.cfg.vocab_size)


def _calibration(total: dict) -> dict:
    """The drafter's confidence against acceptance, per slot given the slots before it (modeling/calibration.py):
    the bins decoding's verify budget fits its table to, and each slot's calibration error before that fit."""
    bins = calibration.measured(total["calib_count"], total["calib_accepted"], total["calib_confidence"])
    return {"calibration": bins, "calibration_error_per_slot": calibration.calibration_error(bins)}


def _vocab_coverage(drafter: LoadedDrafter, records: list[dict], vocab_size: int) -> dict:
    """{"draft_vocab_coverage": the share of the records' answer tokens (whole, not cut to seq_len) in the drafter's
    draft vocabulary} (a drafter with one), else {}."""
    vocab = drafter.params.vocab
    if vocab is None:
        return {}
    return {"draft_vocab_coverage": round(coverage(answer_token_counts(records, vocab_size), np.asarray(vocab)), 4)}
