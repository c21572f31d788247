"""Data files shipped with the package (the package reads nothing from a repository checkout)."""

from pathlib import Path

ASSETS = Path(__file__).resolve().parent
# The drafter trained for the default model, by name (`--drafter v14`, or "default"): the package ships one.
SHIPPED_DRAFTERS = {"v14": ASSETS / "drafter-smollm2-135m-instruct"}
DEFAULT_DRAFTER = SHIPPED_DRAFTERS["v14"]
# Earlier drafters, kept in the repository's history (history/drafters.tsv; v4 and v12 shipped before v14): a name of
# these is refused with the command that restores its directory (bash history/restore.sh NAME).
HISTORY_DRAFTERS = ("v4", "v5", "v6", "v7", "v8", "v9", "v10", "v11", "v12", "s12", "s13", "v5-cpu-2", "next-token")
BUILTIN_PROMPTS = ASSETS / "builtin-prompts.json"  # word lists and templates of the built-in training prompts
EVAL_PROMPTS = ASSETS / "eval-prompts.jsonl"  # the benchmark prompts drafters are measured on; never training data
CODE_PROMPTS = ASSETS / "code-prompts.jsonl"  # benchmark prompts asking for code
EDITING_PROMPTS = ASSETS / "editing-prompts.jsonl"  # benchmark prompts whose answers copy their input (n-gram drafts)
PROMPT_SETS = {"chat": EVAL_PROMPTS, "code": CODE_PROMPTS, "editing": EDITING_PROMPTS}  # never training data


def prompt_set(text: str) -> Path:
    """A prompt set shipped here, by name (PROMPT_SETS), else `text` as a file path."""
    return PROMPT_SETS.get(text) or Path(text)
