"""How likely a drafter's draft is to be accepted, given its confidence: the calibration a verify budget ranks and
sizes rounds by (decoding/engine/budget.py).

A draft's confidence is the drafter's top probability at its slot. Measured teacher-forced (`specformer
eval-drafter`), slot i's drafts are binned by confidence among the positions where slots 1..i-1 were all accepted,
and each bin counts how many of them were accepted too: the chance of slot i given the chain before it, which is
what the product along a row needs. The fit is monotone (pool-adjacent-violators over the bins, weighted by their
counts) and is read on a fixed grid of confidences, so decoding interpolates a static table [k, GRID].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BINS = 20  # confidence bins of the measurement, equal widths over [0, 1]
GRID = 21  # confidences the fitted table is read at: 0, 0.05, ..., 1


def confidence_bins(confidence: jax.Array) -> jax.Array:
    """int32[...]: each confidence's bin, 0..BINS-1."""
    return jnp.clip((confidence * BINS).astype(jnp.int32), 0, BINS - 1)


def monotone(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to y in the w-weighted squared sense (pool-adjacent-violators)."""
    blocks: list[list[float]] = []  # [mean, weight, size]
    for v, n in zip(y, w):
        blocks.append([float(v), float(n), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2, s2 = blocks.pop()
            m1, n1, s1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / max(n1 + n2, 1e-12), n1 + n2, s1 + s2])
    return np.concatenate([np.full(s, m) for m, _, s in blocks]) if blocks else np.zeros(0)


def fit_table(calibration: dict) -> np.ndarray:
    """float32[k, GRID]: each slot's acceptance at the grid's confidences, from a measurement's bins
    (`measured`'s "count", "accepted", "confidence_sum", each [k][BINS]). A slot with no measured position keeps its
    confidences as they are."""
    count = np.asarray(calibration["count"], np.float64)
    accepted, conf = np.asarray(calibration["accepted"]), np.asarray(calibration["confidence_sum"])
    grid = np.linspace(0.0, 1.0, GRID)
    rows = []
    for n, a, c in zip(count, accepted, conf):
        seen = n > 0
        if not seen.any():
            rows.append(grid)
            continue
        x, y = c[seen] / n[seen], monotone(a[seen] / n[seen], n[seen])
        rows.append(np.interp(grid, x, y))
    return np.asarray(rows, np.float32)


def drafter_table(meta: dict, num_slots: int) -> np.ndarray | None:
    """The fitted table of a drafter whose eval (drafter.json's "eval", `eval-drafter --save`) measured its
    calibration over all its slots, else None."""
    bins = (meta.get("eval") or {}).get("calibration")
    try:
        table = fit_table(bins)
    except (TypeError, KeyError, ValueError):
        return None
    return table if table.shape == (num_slots, GRID) else None


def calibrated(confidence: jax.Array, table: jax.Array | None) -> jax.Array:
    """float32[B, k]: each slot's confidence [B, k] read through its row of the table [K, GRID] (K >= k), linearly
    between grid points; None: the confidences as they are."""
    if table is None:
        return confidence
    k = confidence.shape[1]
    x = jnp.clip(confidence, 0.0, 1.0) * (GRID - 1)
    lo = jnp.minimum(x.astype(jnp.int32), GRID - 2)
    slot = jnp.arange(k)[None, :]
    left, right = table[slot, lo], table[slot, lo + 1]
    return left + (x - lo) * (right - left)


def calibration_error(calibration: dict) -> list[float]:
    """Per slot, the count-weighted mean |confidence - acceptance| over the bins (expected calibration error)."""
    count = np.asarray(calibration["count"], np.float64)
    gap = np.abs(np.asarray(calibration["confidence_sum"]) - np.asarray(calibration["accepted"]))
    return [round(float(g.sum() / max(n.sum(), 1.0)), 4) for g, n in zip(gap, count)]


def measured(count, accepted, confidence_sum) -> dict:
    """A measurement's bins as the drafter's eval records them (lists [k][BINS])."""
    as_list = lambda a: np.asarray(a).round(4).tolist()
    return {"bins": BINS, "count": as_list(count), "accepted": as_list(accepted),
            "confidence_sum": as_list(confidence_sum)}
