"""Data files shipped with the package (the package reads nothing from a repository checkout)."""

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
# The drafters trained for the default model, by name (`--drafter v4`); "default" is the newest, the one measured best
# (the default, the one it replaced, and v4, the last trained from scratch; earlier ones live in benchmarks/).
SHIPPED_DRAFTERS = {"v14": ASSETS / "drafter-smollm2-135m-instruct",
                    "v12": ASSETS / "drafter-smollm2-135m-instruct-v12",
                    "v4": ASSETS / "drafter-smollm2-135m-instruct-v4"}
DEFAULT_DRAFTER = SHIPPED_DRAFTERS["v14"]
BUILTIN_PROMPTS = ASSETS / "builtin-prompts.json"  # word lists and templates of the built-in training prompts
EVAL_PROMPTS = ASSETS / "eval-prompts.jsonl"  # the benchmark prompts drafters are measured on; never training data
CODE_PROMPTS = ASSETS / "code-prompts.jsonl"  # benchmark prompts asking for code
EDITING_PROMPTS = ASSETS / "editing-prompts.jsonl"  # benchmark prompts whose answers copy their input (n-gram drafts)
PROMPT_SETS = {"chat": EVAL_PROMPTS, "code": CODE_PROMPTS, "editing": EDITING_PROMPTS}  # never training data


def prompt_set(text: str) -> Path:
    """A prompt set shipped here, by name (PROMPT_SETS), else `text` as a file path."""
    return PROMPT_SETS.get(text) or Path(text)
