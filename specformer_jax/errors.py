"""SpecformerError: bad input from the user. The CLI prints it as one line and exits with status 2; checks.py holds
the checks that raise it for values."""


class SpecformerError(Exception):
    """Bad input from the user (path, config, prompt, option value), with a message that says what to fix."""
