"""Errors the CLI reports as one line (`error: ...`, exit code 2) instead of a traceback."""


class UserError(Exception):
    """Something the user can fix: a bad argument, a missing or broken file, a config mismatch."""
