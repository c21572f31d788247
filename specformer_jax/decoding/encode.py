"""Prompts as the model sees them: text (through the chat template unless chat=False) or token ids, checked and
encoded; and the prompts JSONL files that the CLI reads."""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Sequence

import numpy as np

from specformer_jax.checks import is_int
from specformer_jax.errors import SpecformerError
from specformer_jax.files import read_text
from specformer_jax.modeling.loaded import LoadedTarget

Prompt = str | Sequence[int]  # text (tokenized, chat template unless chat=False) or token ids used as they are


def checked_prompts(prompts) -> list:
    """The prompts as a list; a single prompt passed bare (a string, one list of ids, or a {"prompt": ...} record)
    is refused, not split, and so is a set (its order is arbitrary, so the results' would be too)."""
    if isinstance(prompts, (str, bytes, Mapping)) or (isinstance(prompts, (list, tuple)) and prompts
                                                        and isinstance(prompts[0], numbers.Integral)):
        raise SpecformerError("prompts must be a list of prompts (text or token-id lists): wrap a single prompt "
                              "as [prompt]")
    if isinstance(prompts, AbstractSet):
        raise SpecformerError("prompts must be a list of prompts, got a set: its order is arbitrary, so the "
                              "results' would be; pass a list")
    try:
        prompts = list(prompts)
    except TypeError:
        raise SpecformerError(f"prompts must be a list of prompts, got {type(prompts).__name__}") from None
    if not prompts:
        raise SpecformerError("no prompts given")
    return prompts


def encode_prompts(model: LoadedTarget, prompts: Sequence[Prompt], chat: bool = True) -> list[list[int]]:
    """Token ids for each prompt; text goes through the chat template unless chat=False."""
    out = []
    for i, p in enumerate(prompts):
        ids = _encoded_text(model, i, p, chat) if isinstance(p, str) else _token_ids(model, i, p)
        if not ids:
            raise SpecformerError(f"prompt {i} is empty")
        out.append(ids)
    return out


def check_fits(ids: list[list[int]], max_new_tokens: int, limit: int, limit_is: str) -> None:
    """Refuse a prompt that with max_new_tokens answer tokens needs more than `limit` positions; `limit_is` names
    the limit in the message ("cache positions but the cache holds")."""
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > limit:
            raise SpecformerError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                                  f"{len(p) + max_new_tokens} {limit_is} {limit}")


def _encoded_text(model: LoadedTarget, i: int, text: str, chat: bool) -> list[int]:
    tok = model.tokenizer
    if tok is None:
        raise SpecformerError(f"{model.source} has no tokenizer: give prompts as token ids (input_ids)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from "\ud800" in JSON: no tokenizer takes it
        raise SpecformerError(f"prompt {i} is not valid Unicode text: character {e.start} is a lone surrogate "
                              f"({text[e.start]!r})") from None
    if chat and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=not chat)


def _token_ids(model: LoadedTarget, i: int, prompt) -> list[int]:
    """A prompt given as token ids: a sequence (list, tuple, 1-D array) of integers inside the vocabulary."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer):
        ids = prompt.tolist()
    elif isinstance(prompt, (list, tuple)) and all(map(is_int, prompt)):
        ids = [int(t) for t in prompt]
    else:
        raise SpecformerError(f"prompt {i} must be text or a list of integer token ids, got {prompt!r:.60}")
    bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
    if bad:
        raise SpecformerError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (size {model.cfg.vocab_size})")
    return ids


def read_prompts_file(path: Path) -> list:
    """Prompts of a JSONL file: each line {"prompt": "..."} or {"input_ids": [...]}."""
    prompts = []
    for n, line in enumerate(read_text(path, "prompts file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecformerError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(rec, dict) and "prompt" in rec and "input_ids" in rec:
            raise SpecformerError(f'{path}:{n}: give "prompt" or "input_ids", not both')
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            prompts.append(rec["prompt"])
        elif isinstance(rec, dict) and isinstance(rec.get("input_ids"), list) and all(map(is_int, rec["input_ids"])):
            prompts.append(rec["input_ids"])
        else:
            raise SpecformerError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"input_ids": [ints]}}')
    if not prompts:
        raise SpecformerError(f"prompts file {path} has no prompts")
    return prompts
