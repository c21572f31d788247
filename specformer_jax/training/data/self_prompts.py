"""Training prompts sampled from the target itself: its chat template up to the start of a user turn, then sampling.

An instruction-tuned model continues "<system turn><user turn start>" with a plausible user request (the idea of
Magpie, Xu et al. 2024). Answering those requests greedily gives drafter training data drawn from the model's own
chat distribution, in any number and without a dataset, where the built-in template prompts cover only the topics
written into them.

Output: a JSONL prompts file ({"prompt": text, "round": r} per line) that `specformer distill --prompts` reads. Each
round samples one batch; the file is rewritten atomically after every round, so an interrupted run keeps its rounds
and a rerun with the same arguments continues after the last one (round r always uses seed + r).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from specformer_jax.decoding.api import generate
from specformer_jax.errors import SpecformerError
from specformer_jax.files import read_text, write_atomic
from specformer_jax.modeling.loaded import LoadedTarget, checked_target
from specformer_jax.training.data.prompts import evaluation_prompts, is_evaluation_prompt, normalise_prompt

SENTINEL = "\x00specformer-user-turn\x00"
MIN_CHARS = 12
MAX_EMPTY_ROUNDS = 8  # rounds in a row that add nothing: the model does not write usable requests


def check_system(system: str | None) -> None:
    """Refuse a blank system message (None keeps the template's own)."""
    if system is not None and not system.strip():
        raise SpecformerError("the system message is empty: leave it out to keep the chat template's own")


def user_turn_prefix(model: LoadedTarget, system: str | None = None) -> list[int]:
    """Token ids of the chat template up to where the user's message would start.

    `system` replaces the template's default system message: the requests the model then writes are the ones it
    expects that assistant to get (a programming assistant is asked for code), which steers the data to a domain.
    """
    tok = model.tokenizer
    if tok is None or not tok.chat_template:
        raise SpecformerError(f"{model.source} has no chat template: it cannot be prompted for user requests")
    check_system(system)
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": SENTINEL})
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if SENTINEL not in text:
        raise SpecformerError(f"the chat template of {model.source} does not show the user's message")
    return tok.encode(text[: text.index(SENTINEL)], add_special_tokens=False)


def _usable(text: str, ids: list[int], eos_ids: tuple[int, ...]) -> bool:
    """A finished request (the model ended the turn) of some substance."""
    return bool(ids) and ids[-1] in eos_ids and len(text.strip()) >= MIN_CHARS


def read_rounds(path: Path) -> tuple[list[dict], int]:
    """(records, next round) of an earlier run's output file, or ([], 0)."""
    if path.exists() and not path.is_file():
        raise SpecformerError(f"output path {path} exists and is not a file")
    if not path.is_file():
        return [], 0
    records = []
    for n, line in enumerate(read_text(path, "output file").splitlines(), 1):
        try:
            rec = json.loads(line)
            records.append({"prompt": str(rec["prompt"]), "round": int(rec["round"])})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise SpecformerError(f"{path}:{n} is not a line written by sample-prompts; pick a new --out") from None
    return records, max((r["round"] for r in records), default=-1) + 1


def sample_prompts(
    model: LoadedTarget,
    num: int,
    out: str | Path,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_new_tokens: int = 96,
    batch_size: int = 256,
    system: str | None = None,
    progress: bool = True,
) -> list[str]:
    """Sample `num` distinct user requests from `model` into `out` (resuming an earlier run there); returns them.

    `system`: a system message in place of the template's default one (see `user_turn_prefix`).
    """
    checked_target(model)
    if num < 1:
        raise SpecformerError(f"number of prompts must be >= 1, got {num}")
    if not temperature > 0:  # greedy would write the same request every time
        raise SpecformerError(f"temperature must be > 0 to sample requests, got {temperature}")
    out = Path(out)
    records, round_ = read_rounds(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = user_turn_prefix(model, system)
    seen = {normalise_prompt(r["prompt"]) for r in records}
    evaluation = evaluation_prompts()
    empty = 0
    with tqdm(total=num, initial=min(len(records), num), unit="prompt", file=sys.stderr, disable=not progress) as bar:
        while len(records) < num:
            # A round needs no more rows than twice the requests still missing (a power of two, so few shapes
            # compile): `--num 2` samples 8 rows, not a whole batch. Row r's key depends on seed + round and r
            # only, so the rows sampled are the first ones a full batch would have sampled.
            rows = min(batch_size, max(8, 1 << (2 * (num - len(records)) - 1).bit_length()))
            result = generate(model, [prefix] * rows, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, seed=seed + round_, batch_size=rows, chat=False)
            added = 0
            for text, ids in zip(result.texts, result.token_ids):
                key = normalise_prompt(text)
                if len(records) < num and _usable(text, ids, model.eos_ids) and key not in seen \
                        and not is_evaluation_prompt(text, evaluation):
                    seen.add(key)
                    records.append({"prompt": text.strip(), "round": round_})
                    added += 1
            write_atomic(out, "".join(json.dumps(r) + "\n" for r in records))
            bar.update(added)
            round_ += 1
            empty = 0 if added else empty + 1
            if empty >= MAX_EMPTY_ROUNDS:
                raise SpecformerError(
                    f"{MAX_EMPTY_ROUNDS} rounds in a row gave no finished, new request "
                    f"({len(records)} of {num} so far, kept in {out}); try a larger --max-new-tokens"
                )
    return [r["prompt"] for r in records[:num]]
