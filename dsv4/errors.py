"""Errors the CLI reports as one line (`error: ...`, exit code 2) instead of a traceback."""


class UserError(Exception):
    """Something the user can fix: a bad argument, a missing or broken file, a config mismatch."""


class CheckpointError(UserError):
    """A checkpoint file or tensor is missing, broken, unsafe to open or does not match the config."""
