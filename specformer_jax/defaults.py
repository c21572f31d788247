"""The measured defaults, in one place: how many drafts a round makes when the user gives no number, how a hybrid
chooses and verifies, how many rounds a chunk runs and what `--draft-len auto` asks of a prediction. Each value names
the result file it was read from in `SOURCES` (or says that none is committed). The CLI's help texts, the docstring
of `DecodeOptions` and the decoding that applies the defaults (decoding/tuning/draft_len.py) all read them here.

A draft-length table maps pool sizes (the rows decoded at once: an int, or a `range` of them) to drafts per round;
a pool size it does not list decodes plainly (0). Tables are keyed by the kind of draft source: "specformer" (a
trained drafter), "ngram" (the n-gram lookup), "hybrid" (both, per row: `X+ngram`)."""

from __future__ import annotations

# Drafts per round by pool size on a CPU with its kernels (the target's packed layout; without them, XLA's matmuls,
# one draft). A round's arithmetic grows with its rows there, so the rounds that pay get shorter as the pool grows.
# A kind not listed here drafts as on an accelerator (draft_len.accelerator_draft_len).
CPU_DRAFT_LENS: dict[str, dict[int | range, int]] = {
    "specformer": {1: 3, 2: 2, 3: 2, range(4, 6): 1},
    "ngram": {1: 7, 2: 2},
    "hybrid": {1: 7, 2: 4},
}
# The default round by pool size on a CPU with its kernels where it verifies a budget (decoding/engine/budget.py):
# (drafts per row, positions per round over the pool: every live row's last token and the most valuable drafts).
# A pool size not listed here takes CPU_DRAFT_LENS, verified whole. The server takes both by its live rows.
CPU_VERIFY_BUDGETS: dict[str, dict[int | range, tuple[int, int]]] = {
    "specformer": {2: (4, 6), range(3, 5): (2, 8), range(6, 9): (2, 14)},  # 14: the kernel's register tile
}
# On a GPU or TPU: every trained slot of a SpecFormer drafter (a hybrid's too); a source without one (the n-gram
# lookup alone) drafts this many.
ACCELERATOR_NGRAM_DRAFTS = 4
# On a CPU with its kernels, drafts a hybrid's round verifies when none of its rows has n-gram drafts, by pool size;
# elsewhere as many as the SpecFormer drafter alone would (at least one). Its drafter drafts all its slots anyway,
# and at batch 1 up to 3 drafts cost no more than one.
HYBRID_CPU_MODEL_DRAFTS: dict[int | range, int] = {1: 3}
HYBRID_MIN_MATCH = 2  # a hybrid's row may take the n-gram drafts only when its last 2+ tokens recur earlier
# How often an n-gram draft is accepted given the drafts before it, by the length of the row's match (rows: 1..4
# tokens, the lookup's longest by default) and slot (1..8; later slots read the last): what a verify budget ranks
# n-gram drafts by and what a hybrid row weighs against its drafter's calibrated confidences.
NGRAM_ACCEPTANCE: tuple[tuple[float, ...], ...] = (
    (0.16, 0.53, 0.75, 0.65, 0.77, 0.83, 0.80, 0.70),
    (0.52, 0.71, 0.74, 0.79, 0.90, 0.85, 0.82, 0.90),
    (0.71, 0.74, 0.79, 0.90, 0.85, 0.83, 0.90, 0.79),
    (0.83, 0.85, 0.87, 0.86, 0.86, 0.86, 0.85, 0.86),
)
CHUNK_ROUNDS = 8  # rounds the device runs between two looks of the host (docs/decoding.md, "Chunks")
AUTO_MARGIN = 0.15  # `--draft-len auto` drafts only where a draft length is predicted this much faster than plain

_RESULTS = "benchmarks/results/"
_NGRAM_SETS = tuple(f"{_RESULTS}ngram_{name}_batch1_cpu_v7.json" for name in ("editing", "chat", "code"))
# Where each value above was measured: result files (paths from the repository's root), empty where none is committed.
SOURCES: dict[str, tuple[str, ...]] = {
    # batch 1: 3 and batch 2: 2 were v5's best (k = 2..4 within 0.04x at batch 1); with v14 at batch 1, k = 4 ran
    # 0.88x k = 3's tokens/s. With v14 at batch 3, 4, 5 and 8 (k = 1 / k = 2 against plain): 1.06x / 1.14x,
    # 1.14x / 1.01x, 1.14x / 1.12x, 0.92x / 0.77x; batch 6 and 7 were not measured and decode plainly. The table
    # checked by `specformer bench` at batch 1-5 and 8: 1.60x, 1.29x, 1.13x, 1.17x, 1.10x, plain.
    "CPU_DRAFT_LENS.specformer": (_RESULTS + "draft_len_cpu_v5.json", _RESULTS + "draft_len_cpu_v14_k34.json",
                                  _RESULTS + "draft_len_cpu_v14_b3458.json",
                                  _RESULTS + "bench_cpu_defaults_v14_pools.json"),
    # batch 1: a round of up to 3 drafts costs a plain step, 7 is the cheapest width a copied span can use
    # (ngram_widths), and each source at its default on the three prompt sets at batch 1 (with v7 as the
    # SpecFormer drafter); batch 2's lengths come from development sweeps on the six editing prompts of
    # benchmarks/ngram/editing-dev.jsonl that were not committed.
    "CPU_DRAFT_LENS.ngram": (_RESULTS + "ngram_widths_cpu.json", *_NGRAM_SETS),
    "CPU_DRAFT_LENS.hybrid": _NGRAM_SETS,
    # No measurement committed: no GPU or TPU was lent to the n-gram work.
    "ACCELERATOR_NGRAM_DRAFTS": (),
    # 2, 3 or 4 verified drafts: 1.57x, 1.57x and 1.54x plain decoding at batch 1 on the development prompts.
    "HYBRID_CPU_MODEL_DRAFTS": (_RESULTS + "hybrid_model_len_dev_cpu.json",),
    # Chosen on development sweeps on the six editing prompts that were not committed (accepted length 2.12 with 2,
    # 2.08 with 3, 1.90 with 1 at batch 1). Checked with the value rule on the benchmark sets at batch 1: 3 ran 1.74x,
    # 1.46x and 1.70x plain decoding on code, chat and editing, 2 1.74x, 1.43x and 1.66x, level within the noise.
    "HYBRID_MIN_MATCH": tuple(f"{_RESULTS}hybrid_min_match_b1_{name}_cpu.json" for name in ("code", "chat", "editing")),
    # Side by side with plain decoding on the chat prompts (4 alternating pairs each): at batch 4, 2 drafts a row
    # under a budget of 8 positions 1.32x, 3 under 10 1.22x, where the uniform default (k = 1, the same 8
    # positions) ran 1.10x; at batch 3, 2 under 8 1.24x (the uniform k = 2 ran 1.14x in draft_len_cpu_v14_b3458);
    # at batch 5 and 6 1.11x and 1.03x, no better than k = 1 and plain; at batch 2, 3 drafts under 8 ran 1.29x
    # against the uniform k = 2's 1.33x; at batch 8 budgets of 12 and 16 ran 0.99x and 0.91x, at batch 16 20 and
    # 24 ran 0.94x and 0.90x, so those decode plainly. Again with the kernel's 14-row tiles (tile14_sweep, 3 pairs
    # each): batch 8 under 12 and 14 positions 0.99x and 1.04x, batch 4 3 drafts under 12 1.22x, batch 16 under 28
    # 0.85x, batch 2 with 3 and 4 drafts 1.28x and 1.10x. Batch 6-8 with 2 drafts a row under 14 positions, as
    # streams of 32 and 64 requests (the pool full but for the last wave): at batch 5, 6, 7 and 8 1.10x, 1.06x,
    # 1.05x and 1.08x in one run; at batch 8 again 1.14x (32 requests) and 1.06x (64), where 18 and 22 positions
    # ran 0.99x and 1.03x and 3 drafts under 20 1.02x. So batch 6-8 verify 14 positions; batch 5 keeps k = 1 whole
    # (1.14x in draft_len_cpu_v14_b3458, no run of both side by side). The table checked by `specformer bench` at
    # batch 8 (16 requests): 1.06x, 1.02x and 1.19x on chat, code and editing; 1.11x on 64 chat requests.
    # Batch 2, 4 drafts a row under 6 positions (the uniform k = 2's count, the most valuable of 8 drafts) against
    # k = 2 whole, side by side in one run each (b2_budget_pairs): chat 1.42x, 1.41x, 1.45x against 1.29x, 1.38x,
    # 1.38x; editing 1.33x against 1.25x; code 1.46x against 1.52x (its speculative tokens/s 130 against 127); 3
    # drafts under 6 on chat 1.34x. Accepted length 1.84, 2.19, 1.93 against 1.79, 2.11, 1.89. A later full chat run
    # with it (bench_cpu_b2budget_chat) read 1.30x at batch 2, its other batches too below the run before it.
    "CPU_VERIFY_BUDGETS": tuple(_RESULTS + f"verify_budget_cpu_{name}.json" for name in (
        "k2_plus4", "k3_plus6", "k2_budget8_b356", "uniform_defaults", "k2_plus8",
        "auto_k2", "k2_plus4_b248",  # these two: a budget per round from measured costs did not beat the table
        "k2_14_b5678"))
    + tuple(f"{_RESULTS}tile14_sweep/{name}.json" for name in (
        "b8_k2_12", "b8_k2_14", "b8_k3_14", "b4_k2", "b4_k3_12", "b16_k2_28", "b2_k3", "b2_k4"))
    + tuple(f"{_RESULTS}b8_budget_sweep/{name}.json" for name in (
        "k2_14_n32", "k2_14_n64", "k2_18_n32", "k2_22_n32", "k3_20_n32"))
    + tuple(f"{_RESULTS}bench_cpu_budget14_{name}.json" for name in ("chat", "code", "editing"))
    + (_RESULTS + "time_split_cpu_b8_chat.json",)
    + tuple(f"{_RESULTS}b2_budget_pairs/dec02_{name}.json" for name in (
        "chat_k4_6_1", "chat_k4_6_2", "chat_k4_6_3", "chat_k2_whole_1", "chat_k2_whole_2", "chat_k2_whole_3",
        "chat_k3_6", "code_k4_6", "code_k2_whole", "editing_k4_6", "editing_k2_whole"))
    + (_RESULTS + "bench_cpu_b2budget_chat.json",),
    # Teacher-forced on development prompts (24 held-out chat, 16 editing), 3,502 points: slot 1 at match lengths
    # 1-4 accepted 16%, 52%, 71% and 83% of the time; 4 drafts at length 4 accept 2.67 on average.
    "NGRAM_ACCEPTANCE": (_RESULTS + "ngram_acceptance_dev.json",),
    # On a CPU: the rounds a larger R wastes after a request finished (tokens/s was noise there); GPU timings of R
    # are not committed.
    "CHUNK_ROUNDS": (_RESULTS + "chunk_rounds_cpu.json",),
    # What the margin costs on a CPU: auto predicted 1.12x for k = 1 and decoded plainly, where k = 1 then ran 1.20x
    # (that run's file, bench_cpu_quiet.json, has left the tree: git history keeps it). The H100 run that chose
    # k = 1 at batch 64 with a 5% margin (predicted 1.13x, measured 0.99x) kept no result file.
    "AUTO_MARGIN": (_RESULTS + "bench_cpu_auto_quiet.json",),
}


def for_pool(table: dict[int | range, int], pool_size: int, otherwise: int = 0) -> int:
    """The table's value for a pool of `pool_size` rows, `otherwise` where it lists none (0: plain decoding)."""
    for sizes, value in table.items():
        if pool_size in (sizes if isinstance(sizes, range) else (sizes,)):
            return value
    return otherwise


def pool_table_text(table: dict[int | range, int]) -> str:
    """A table in words: {1: 3, 2: 2, range(3, 5): 1} -> "3 at batch 1, 2 at batch 2, 1 at batch 3-4"."""
    return ", ".join(f"{value} at batch {_sizes(s)}" for s, value in table.items())


def _sizes(sizes: int | range) -> str:
    return f"{sizes.start}-{sizes.stop - 1}" if isinstance(sizes, range) else str(sizes)


def draft_len_defaults_text() -> str:
    """The default draft lengths in words, for help texts and docstrings."""
    cpu = "; ".join(f"{kind} {pool_table_text(table)}" for kind, table in CPU_DRAFT_LENS.items())
    budgets = "; ".join(f"{kind} " + ", ".join(f"{k} drafts a row with {budget} positions a round at batch "
                                               f"{_sizes(sizes)}" for sizes, (k, budget) in table.items())
                        for kind, table in CPU_VERIFY_BUDGETS.items())
    return (f"every trained slot on a GPU/TPU ({ACCELERATOR_NGRAM_DRAFTS} for ngram); on a CPU: {cpu}, plain decoding "
            "at other batch sizes; 1 on a CPU without its kernels (a bfloat16 model, a mesh)"
            + (f"; in place of those, generate, bench and serve verify a budget on a CPU: {budgets}"
               if budgets else ""))
