"""Draft sources bound to a target, kept for the next call (`BOUND`).

A source's `bind` (draft_source.py) derives from the target's parameters what drafting reads: for a SpecFormer
drafter, its weights packed for the CPU kernels and the target's head cut to its draft vocabulary (tens of ms on a
CPU). A call that decodes with the same drafter and the same target weights as an earlier one takes the earlier
binding. Sources and targets match by the identity of their arrays, and their small arrays (a calibration table,
made anew for each call) by value. Their large arrays are held weakly: once the drafter or the target is dropped,
or the target's layout converted in place, the binding is dropped with it. A binding that holds the drafter's own
weights (where `bind` packs none of them: off the CPU kernels) is not kept, since it would keep them alive; there
binding costs little (the head alone).
"""

from __future__ import annotations

import itertools
import weakref

import jax
import numpy as np

from specformer_jax.decoding.engine.plan import DecodePlan

SMALL = 1 << 16  # arrays of up to this many elements match by value


class BoundSources:
    """The `capacity` most recently used bindings (one by default: a binding also holds some of its target's arrays,
    the final norm and the embedding, and copies of the drafter's weights)."""

    def __init__(self, capacity: int = 1):
        self.capacity = capacity
        self._entries: list[_Binding] = []
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, source, plan: DecodePlan, params):
        """source.bind(plan, params), or what an earlier call bound for the same arrays."""
        mine, treedef = jax.tree.flatten(source)
        arrays = mine + jax.tree.leaves(params)
        key = (treedef, plan.cfg, len(mine))
        entry = next((e for e in self._entries if e.matches(key, arrays)), None)
        if entry is None:
            bound = source.bind(plan, params)
            held = {id(x) for x in jax.tree.leaves(bound)}
            if any(id(x) in held for x in mine if _large(x)):
                return bound  # it holds the source's own weights: kept, it would keep a dropped drafter alive
            entry = _Binding(next(self._tokens), key, arrays, bound, self._drop)
        # lists are replaced, never changed in place: a finalizer may drop an entry at any allocation
        others = [e for e in self._entries if e is not entry]
        cut = max(len(others) + 1 - self.capacity, 0)
        for old in others[:cut]:
            old.release()
        self._entries = others[cut:] + [entry]
        return entry.bound

    def _drop(self, token: int) -> None:
        for e in self._entries:
            if e.token == token:
                e.release()
        self._entries = [e for e in self._entries if e.token != token]


class _Binding:
    def __init__(self, token: int, key, arrays: list, bound, drop):
        self.token, self.key, self.bound = token, key, bound
        self.held = [weakref.ref(x) if _large(x) else np.asarray(x) for x in arrays]
        # one per large array: whichever dies first calls drop(token)
        self.finalizers = [weakref.finalize(x, drop, token) for x in arrays if _large(x)]

    def release(self) -> None:
        """Detach the finalizers of a binding that leaves the cache, so that arrays living on (a target decoded
        with many drafters) do not gather one per binding they were ever part of."""
        for f in self.finalizers:
            f.detach()

    def matches(self, key, arrays: list) -> bool:
        return key == self.key and len(arrays) == len(self.held) and all(map(_same, self.held, arrays))


def _large(x) -> bool:
    return np.size(x) > SMALL


def _same(held, x) -> bool:
    if isinstance(held, weakref.ref):
        return held() is x
    return not _large(x) and np.asarray(x).dtype == held.dtype and np.array_equal(held, np.asarray(x))


BOUND = BoundSources()
