"""Checks on chat messages shared by `LLM.chat` and the server's /v1/chat/completions."""

from __future__ import annotations

from fxrewrite.errors import UserInputError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""The roles OpenAI's Chat Completions API accepts (any other is a 400 there)."""


def check_role(role: object, where: str | None = "message") -> str:
    """`role` if it is one of `CHAT_ROLES`; UserInputError naming it and the accepted roles otherwise,
    after `where` (None: no prefix, when the caller's error already says where, as pydantic's loc does)."""
    if role not in CHAT_ROLES:
        prefix = f"{where}: " if where else ""
        raise UserInputError(f"{prefix}role {role!r} is not one of {', '.join(map(repr, CHAT_ROLES))}")
    return role
