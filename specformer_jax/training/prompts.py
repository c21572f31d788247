"""Built-in training prompts for self-distillation, generated offline and deterministically.

Where they come from: every template, topic, code snippet and word problem was written for this project (the word
lists and templates are the data file specformer_jax/assets/builtin-prompts.json; the word problems are below). No
evaluation set is used or copied (no HumanEval, MT-Bench, Alpaca-Eval, GSM8K, nor the package's own benchmark prompts,
specformer_jax/assets/eval-prompts.jsonl). Prompts that match a benchmark prompt are dropped (`builtin_prompts`) or
refused (`specformer_jax.training.distill`), so the drafter is never trained on what it is measured on.

Instruction templates are crossed with topic lists, with optional answer-style hints, to give a finite pool of about
8,600 prompts (chat, how-things-work and why questions, writing, rewriting and translation, code in several
languages, Python standard-library usage, SQL); math word problems with random numbers are mixed in and take over
when the pool runs out.
"""

from __future__ import annotations

import functools
import json
import random

from specformer_jax.assets import BUILTIN_PROMPTS, EVAL_PROMPTS
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


def _word_problem(rng: random.Random) -> str:
    """A math word problem with random numbers; each asks for the working, so answers have some length."""
    r = rng.randint
    problems = [
        lambda: f"A train travels {r(60, 900)} km in {r(2, 9)} hours. What is its average speed?",
        lambda: f"Pens cost {r(15, 95)} cents each. How many can I buy with ${r(2, 40)}, and how much change is left?",
        lambda: f"A recipe needs {r(100, 500)} g of flour for {r(8, 24)} cookies. "
        f"How much flour do {r(25, 90)} cookies need?",
        lambda: f"A rectangular garden is {r(3, 40)} m by {r(3, 40)} m. What are its area and perimeter?",
        lambda: f"I save ${r(5, 120)} a week. How many weeks until I have ${r(500, 5000)}?",
        lambda: f"A jacket costs ${r(30, 400)} and is {r(5, 60)}% off. What is the sale price?",
        lambda: f"${r(500, 20000)} is invested at {r(1, 9)}% interest compounded yearly. "
        f"What is it worth after {r(2, 15)} years?",
        lambda: f"What is the sum of all whole numbers from 1 to {r(20, 2000)}?",
        lambda: f"A bag holds {r(2, 15)} red, {r(2, 15)} blue and {r(2, 15)} green marbles. "
        "What is the probability of drawing a blue one?",
        lambda: _ages(r(4, 40), r(2, 12)),
        lambda: f"One pipe fills a tank in {r(2, 12)} hours, another in {r(3, 15)} hours. "
        "How long do both together take?",
        lambda: f"A phone battery drops {r(3, 20)}% per hour. "
        f"Starting at {r(50, 100)}%, when does it reach {r(5, 20)}%?",
        lambda: _class_size(r(5, 18), r(1, 8)),
        lambda: f"A car uses {r(4, 12)} litres of fuel per 100 km. How much fuel does a {r(50, 1200)} km trip need?",
    ]
    return rng.choice(problems)() + " Show your working."


def normalise_prompt(prompt: str) -> str:
    # Case and spacing differences do not make an evaluation prompt a new prompt.
    return " ".join(prompt.split()).casefold()


@functools.cache
def evaluation_prompts() -> frozenset[str]:
    """Normalised text prompts of the benchmark prompts (specformer_jax/assets/eval-prompts.jsonl)."""
    return frozenset(normalise_prompt(p) for p in read_prompts_file(EVAL_PROMPTS) if isinstance(p, str))


def is_evaluation_prompt(prompt: str, evaluation: frozenset[str]) -> bool:
    return normalise_prompt(prompt) in evaluation


MATH_EVERY = 8
MAX_CONSECUTIVE_REPEATS = 10_000  # only word problems are left and they keep repeating


def builtin_prompts(num: int, seed: int = 0) -> list[str]:
    """`num` distinct training prompts, the same for the same seed; a shorter list is a prefix of a longer one."""
    if num < 0:
        raise SpecformerError(f"number of prompts must be >= 0, got {num}")
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
