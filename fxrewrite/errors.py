"""Error types for bad input from a user (a flag, a config value, a prompt, a model path).

The command line shows these as one line (`fxrewrite <command>: error: ...`); every other exception
is a bug or an environment failure and keeps its traceback. They subclass the builtin a caller
would catch (ValueError, TypeError, FileNotFoundError), so `except ValueError` still works and the
HTTP server still answers 400.
"""

from __future__ import annotations

import re
from numbers import Integral


class UserInputError(ValueError):
    """A value the user gave is wrong; the message names the value and what was expected."""


class UserTypeError(UserInputError, TypeError):
    """A value the user gave has the wrong type."""


class UserFileNotFoundError(UserInputError, FileNotFoundError):
    """A path the user gave does not exist (or holds no model)."""


class UnsupportedModelError(UserInputError, NotImplementedError):
    """The model the user chose cannot be served here (its layers or attention are ones the engine does not
    compute); the message names the model and why. A NotImplementedError too, as such refusals always were."""


class FusedAwayError(AttributeError, UserInputError):
    """An attribute of a child that `fxrewrite.optimize` fused into another (``q_proj`` into ``qkv_proj``): what
    code reaching for it (PEFT wrapping it in a LoRA layer) gets. An AttributeError, so `hasattr` stays False, and a
    ValueError, as PEFT's own refusal of an unsupported target is."""


__all__ = ["UserInputError", "UserTypeError", "UserFileNotFoundError", "UnsupportedModelError", "FusedAwayError",
           "check_unicode"]


def check_unicode(text: str, where: str) -> str:
    """`text` unchanged when it is valid Unicode; UserInputError naming `where` when it holds a lone UTF-16
    surrogate (U+D800..U+DFFF without its pair: what a JSON "\\ud800" escape or a broken decode gives), which no
    tokenizer can encode."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise UserInputError(f"{where}: character {found.start()} is a lone UTF-16 surrogate "
                             f"(U+{ord(found.group()):04X}), not valid Unicode (a surrogate pair must be written as "
                             "one character, or as both escapes)")
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


def is_integer(value: object) -> bool:
    """An integer (Python's or numpy's) that is not a bool: what a token id or a count must be (True is 1 to
    Python, but a bool where an id belongs is a caller's bug)."""
    return isinstance(value, Integral) and not isinstance(value, bool)
