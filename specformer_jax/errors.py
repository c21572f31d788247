"""User-facing errors: anything raised as SpecformerError is printed as one line by the CLI."""


class SpecformerError(Exception):
    """Bad input from the user (path, config, prompt, option value), with a message that says what to fix."""
