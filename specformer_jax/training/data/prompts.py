"""Built-in training prompts for self-distillation, generated offline and deterministically.

Where they come from: every template, topic, code snippet and word problem was written for this project (the word
lists and templates are the data file specformer_jax/assets/builtin-prompts.json; the word problems are below). No
evaluation set is used or copied (no HumanEval, MT-Bench, Alpaca-Eval, GSM8K, nor the package's own benchmark prompts,
specformer_jax/assets/eval-prompts.jsonl). Prompts that match a benchmark prompt are dropped (`builtin_prompts`) or
refused (`specformer_jax.training.data.distill`), so the drafter is never trained on what it is measured on.

Instruction templates are crossed with topic lists, with optional answer-style hints, to give a finite pool of about
8,600 prompts (chat, how-things-work and why questions, writing, rewriting and translation, code in several
languages, Python standard-library usage, SQL); math word problems with random numbers are mixed in and take over
when the pool runs out.
"""

from __future__ import annotations

import functools
import json
import math
import random

from specformer_jax.assets import BUILTIN_PROMPTS, PROMPT_SETS
from specformer_jax.decoding.encode import read_prompts_file
from specformer_jax.errors import SpecformerError


@functools.cache
def _words() -> dict:
    """The word lists and templates (topic_templates: template, name of its topic list, whether the styles apply).
    Texts of several lines are stored as lists of lines."""
    w = json.loads(BUILTIN_PROMPTS.read_text(encoding="utf-8"))
    text = lambda x: "\n".join(x) if isinstance(x, list) else x
    w["topic_templates"] = [{**t, "template": text(t["template"])} for t in w["topic_templates"]]
    w["snippets"] = [text(s) for s in w["snippets"]]
    w["buggy_code"] = [(task, text(code)) for task, code in w["buggy_code"]]
    return w


def _topic_prompts(w: dict) -> list[str]:
    out = []
    for t in w["topic_templates"]:
        for topic in w[t["topics"]]:
            for style in w["styles"] if t["styled"] else [""]:
                out.append(t["template"].format(topic) + style)
    return out


def _pool() -> list[str]:
    """Every template-topic combination, in a fixed order (the seed shuffles it)."""
    w = _words()
    pairs = [t.format(a, b) + style for t in w["pair_templates"] for a, b in w["pairs"] for style in w["styles"]]
    code = [t.format(lang=lang, task=task) for t in w["code_templates"] for lang in w["languages"]
            for task in w["code_tasks"]]
    lists = [t.format(n=n, x=x) for t in w["list_templates"] for n in range(3, 9) for x in w["listables"]]
    howtos = [t.format(lang=lang, op=op) for t in w["howto_templates"] for lang in w["languages"]
              for op in w["language_howtos"]]
    rewrites = [t.format(x) for t in w["rewrite_templates"] for x in w["sentences"]]
    return _topic_prompts(w) + pairs + code + lists + howtos + rewrites


def _ages(younger: int, gap: int) -> str:
    # The total is derived from the answer, so the problem always has a whole-number solution.
    return f"Anna is {gap} years older than Ben, and together they are {2 * younger + gap} years old. How old is each?"


def _class_size(boys: int, gap: int) -> str:
    return f"A class of {2 * boys + gap} students has {gap} more girls than boys. How many boys are there?"


# Math word problems: the text of the drawn numbers, and the range (inclusive) of each number, drawn in order. Each
# asks for the working, so answers have some length. Different numbers make different texts.
_WORD_PROBLEMS = [
    (lambda a, b: f"A train travels {a} km in {b} hours. What is its average speed?", [(60, 900), (2, 9)]),
    (lambda a, b: f"Pens cost {a} cents each. How many can I buy with ${b}, and how much change is left?",
     [(15, 95), (2, 40)]),
    (lambda a, b, c: f"A recipe needs {a} g of flour for {b} cookies. How much flour do {c} cookies need?",
     [(100, 500), (8, 24), (25, 90)]),
    (lambda a, b: f"A rectangular garden is {a} m by {b} m. What are its area and perimeter?", [(3, 40), (3, 40)]),
    (lambda a, b: f"I save ${a} a week. How many weeks until I have ${b}?", [(5, 120), (500, 5000)]),
    (lambda a, b: f"A jacket costs ${a} and is {b}% off. What is the sale price?", [(30, 400), (5, 60)]),
    (lambda a, b, c: f"${a} is invested at {b}% interest compounded yearly. What is it worth after {c} years?",
     [(500, 20000), (1, 9), (2, 15)]),
    (lambda a: f"What is the sum of all whole numbers from 1 to {a}?", [(20, 2000)]),
    (lambda a, b, c: f"A bag holds {a} red, {b} blue and {c} green marbles. What is the probability of drawing a "
     "blue one?", [(2, 15)] * 3),
    (_ages, [(4, 40), (2, 12)]),
    (lambda a, b: f"One pipe fills a tank in {a} hours, another in {b} hours. How long do both together take?",
     [(2, 12), (3, 15)]),
    (lambda a, b, c: f"A phone battery drops {a}% per hour. Starting at {b}%, when does it reach {c}%?",
     [(3, 20), (50, 100), (5, 20)]),
    (_class_size, [(5, 18), (1, 8)]),
    (lambda a, b: f"A car uses {a} litres of fuel per 100 km. How much fuel does a {b} km trip need?",
     [(4, 12), (50, 1200)]),
]


def _word_problem(rng: random.Random) -> str:
    """A math word problem with random numbers."""
    text, ranges = rng.choice(_WORD_PROBLEMS)
    return text(*[rng.randint(low, high) for low, high in ranges]) + " Show your working."


@functools.cache
def builtin_capacity() -> int:
    """How many distinct prompts the built-in lists can make: the pool's (evaluation prompts left out) and every
    word problem's."""
    evaluation = evaluation_prompts()
    pool = {p for p in _pool() if not is_evaluation_prompt(p, evaluation)}
    return len(pool) + sum(math.prod(high - low + 1 for low, high in ranges) for _, ranges in _WORD_PROBLEMS)


def normalise_prompt(prompt: str) -> str:
    # Case and spacing differences do not make an evaluation prompt a new prompt.
    return " ".join(prompt.split()).casefold()


@functools.cache
def evaluation_prompts() -> frozenset[str]:
    """Normalised text prompts of the benchmark prompt sets (specformer_jax/assets: chat, code, editing)."""
    return frozenset(normalise_prompt(p) for path in PROMPT_SETS.values() for p in read_prompts_file(path)
                     if isinstance(p, str))


def is_evaluation_prompt(prompt: str, evaluation: frozenset[str]) -> bool:
    return normalise_prompt(prompt) in evaluation


MATH_EVERY = 8
MAX_CONSECUTIVE_REPEATS = 10_000  # only word problems are left and they keep repeating


def builtin_prompts(num: int, seed: int = 0) -> list[str]:
    """`num` distinct training prompts, the same for the same seed; a shorter list is a prefix of a longer one."""
    if num < 0:
        raise SpecformerError(f"number of prompts must be >= 0, got {num}")
    if num > builtin_capacity():
        raise SpecformerError(f"cannot make {num:,} distinct built-in prompts: the built-in lists make "
                              f"{builtin_capacity():,}")
    rng = random.Random(seed)
    pool = _pool()
    rng.shuffle(pool)
    evaluation = evaluation_prompts()
    out: list[str] = []
    seen: set[str] = set()
    repeats = 0
    draws = 0
    while len(out) < num:
        draws += 1  # every MATH_EVERY-th draw is a word problem; the rest come from the shuffled pool
        p = _word_problem(rng) if draws % MATH_EVERY == 0 or not pool else pool.pop()
        if p in seen or is_evaluation_prompt(p, evaluation):
            repeats += 1
            if repeats > MAX_CONSECUTIVE_REPEATS:
                raise SpecformerError(f"cannot make {num} distinct built-in prompts; got {len(out)}")
            continue
        repeats = 0
        seen.add(p)
        out.append(p)
    return out
