"""The n-gram lookup (decoding/ngram.py) against a plain-Python reference, on random and hand-made histories."""

import jax.numpy as jnp
import numpy as np
import pytest

from specformer_jax.decoding.drafts.ngram import NgramDrafts, TokenHistory, lookup
from specformer_jax.errors import SpecformerError


def reference(hist: list[int], k: int, max_n: int, min_n: int) -> tuple[list[int], int]:
    """The longest suffix (max_n down to min_n) that occurs earlier, its latest occurrence, the k tokens after it
    (repeating from the occurrence once they reach the end); no match: the last token k times (or 0s if empty)."""
    L = len(hist)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for end in range(L - 2, n - 2, -1):
            if hist[end - n + 1: end + 1] == hist[L - n:]:
                period = L - 1 - end
                return [hist[end + 1 + j % period] for j in range(k)], n
    return [hist[-1] if hist else 0] * k, 0


def run(histories: list[list[int]], k: int, max_n: int, min_n: int, width: int | None = None):
    width = width or max(map(len, histories), default=1) + 3
    tokens = np.full((len(histories), width), 7, np.int32)  # past each row's length: junk, never read
    for b, h in enumerate(histories):
        tokens[b, : len(h)] = h
    lengths = jnp.asarray([len(h) for h in histories], jnp.int32)
    drafts, n = lookup(TokenHistory(jnp.asarray(tokens), lengths), k, max_n, min_n)
    return np.asarray(drafts).tolist(), np.asarray(n).tolist()


@pytest.mark.parametrize("max_n,min_n,k", [(4, 1, 4), (3, 2, 8), (1, 1, 3), (5, 3, 2)])
def test_random_histories_match_the_reference(max_n, min_n, k):
    """Rows of different lengths over a small alphabet, so n-grams repeat often and matches of every length occur."""
    rng = np.random.default_rng(max_n * 10 + k)
    histories = [rng.integers(0, 4 if b % 2 else 12, rng.integers(0, 40)).tolist() for b in range(64)]
    drafts, n = run(histories, k, max_n, min_n)
    want = [reference(h, k, max_n, min_n) for h in histories]
    assert n == [w[1] for w in want]
    assert drafts == [w[0] for w in want]
    assert 0 < sum(x > 0 for x in n) < len(n)  # some rows match, some do not


def test_hand_made_cases():
    cases = {
        (5, 6, 7, 1, 2, 3, 5, 6): ([7, 1, 2, 3], 2),  # "5 6" recurs: what followed it
        (1, 2, 9, 1, 2, 8, 1, 2): ([8, 1, 2, 8], 2),  # the latest occurrence wins; its continuation reaches the end
        (4, 4, 4): ([4, 4, 4, 4], 2),  # a loop: the continuation repeats
        (3, 1, 2, 3): ([1, 2, 3, 1], 1),
        (9,): ([9, 9, 9, 9], 0),  # one token: nothing earlier
        (): ([0, 0, 0, 0], 0),  # empty
        (1, 2, 3, 4): ([4, 4, 4, 4], 0),  # no repeat
    }
    drafts, n = run([list(h) for h in cases], 4, 4, 1)
    assert list(zip(drafts, n)) == list(cases.values())


def test_a_longer_match_beats_a_later_shorter_one():
    h = [1, 2, 3, 50, 9, 3, 60, 1, 2, 3]  # "3" alone recurs later (-> 60), "1 2 3" earlier (-> 50)
    assert run([h], 2, 3, 1) == ([[50, 9]], [3])
    assert run([h], 2, 1, 1) == ([[60, 1]], [1])
    assert run([h], 2, 3, 4 - 1) == ([[50, 9]], [3])


def test_history_grows_by_what_rows_kept():
    """grow writes each row's first num_new next tokens after its length; the rest of the round is not kept."""
    hist = TokenHistory(jnp.zeros((2, 8), jnp.int32), jnp.asarray([2, 0], jnp.int32))
    hist = hist.grow(jnp.asarray([3, 1], jnp.int32), jnp.asarray([[5, 6, 7, 99], [8, 99, 99, 99]], jnp.int32))
    assert np.asarray(hist.lengths).tolist() == [5, 1]
    assert np.asarray(hist.tokens).tolist() == [[0, 0, 5, 6, 7, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]]


def test_settings_are_checked():  # the strings that name them: test_drafter_names.py
    assert NgramDrafts() == NgramDrafts(4, 1)
    for max_n, min_n in ((2, 5), (3, 0), (65, 1)):
        with pytest.raises(SpecformerError):
            NgramDrafts(max_n=max_n, min_n=min_n)
