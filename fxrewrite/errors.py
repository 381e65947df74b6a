"""Error types for bad input from a user (a flag, a config value, a prompt, a model path).

The command line shows these as one line (`fxrewrite <command>: error: ...`); every other exception
is a bug or an environment failure and keeps its traceback. They subclass the builtin a caller
would catch (ValueError, TypeError, FileNotFoundError), so `except ValueError` still works and the
HTTP server still answers 400.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """A value the user gave is wrong; the message names the value and what was expected."""


class UserTypeError(UserInputError, TypeError):
    """A value the user gave has the wrong type."""


class UserFileNotFoundError(UserInputError, FileNotFoundError):
    """A path the user gave does not exist (or holds no model)."""


__all__ = ["UserInputError", "UserTypeError", "UserFileNotFoundError"]
