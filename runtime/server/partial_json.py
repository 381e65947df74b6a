"""Incremental parse of tool_choice "required"'s output (a JSON list of {"name", "parameters"} objects) while it
is generated, so that the chat stream can send each call's arguments as they come.

The arguments a finished response carries are `tool_parsers.dump_arguments(parameters)` of the parsed list
(`tools.parse_output`), not the generated text: `", "` and `": "` between items, strings re-escaped (`\\u00fc`
becomes `ü`, `\\/` becomes `/`, a lone surrogate stays an escape), numbers as Python writes them (`1E2` becomes
`100.0`). `RequiredCallsParser` writes that same text piece by piece from the text seen so far, and only what no
later character can change: a string's characters as each is decoded (a high surrogate waits for its pair), a
number or literal once the character after it is seen, a separator or bracket when it is read. A call's name is
known once its string is closed. Text that is not valid JSON stops the output (the finished response then has no
calls). Limitation: a key repeated inside the arguments (which json.loads resolves to the last value) cannot be
taken back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fxrewrite.runtime.server.tool_parsers import dump_arguments

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = {"true": "true", "false": "false", "null": "null"}
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WHITESPACE = frozenset(" \t\n\r")
_HEX = frozenset("0123456789abcdefABCDEF")


def canonical_char(c: str) -> str:
    """`c` as `dump_arguments` writes it inside a string (a lone surrogate as its escape)."""
    if c >= " " and c != '"' and c != "\\" and not "\ud800" <= c <= "\udfff":
        return c
    return dump_arguments(c)[1:-1]


def canonical_number(token: str) -> str | None:
    """A JSON number token as json.dumps writes what json.loads makes of it (None: not a JSON number)."""
    match = _NUMBER.fullmatch(token)
    if match is None:
        return None
    if not (match.group(1) or match.group(2)):
        return str(int(token))
    value = float(token)
    if value == float("inf"):
        return "Infinity"
    if value == float("-inf"):
        return "-Infinity"
    return repr(value)


@dataclass
class PartialCall:
    """One element of the list: its name once known, and the certain prefix of its canonical arguments."""

    name: str | None = None
    parts: list[str] = field(default_factory=list)
    has_parameters: bool = False
    frozen: bool = False
    """A second "parameters" key: nothing more is written (the finished response decides)."""

    @property
    def arguments(self) -> str:
        return "".join(self.parts)


@dataclass
class _Frame:
    kind: str  # "{" or "["
    captured: bool  # inside a call's parameters: written out
    expect: str  # "key0" (key or "}"), "key", "colon", "value0" (value or "]"), "value", "next"
    key: str | None = None


@dataclass
class _String:
    captured: bool
    role: str | None  # "key", "name" (a call's name) or None (a value)
    chars: list[str] = field(default_factory=list)
    escape: str | None = None  # None, "\\" (after a backslash), or "u" + the hex digits read
    high: str | None = None  # a high surrogate waiting for its low half


@dataclass
class _Scalar:
    captured: bool
    text: str


class RequiredCallsParser:
    """Feed it the generated text in pieces; `calls` holds what is known so far (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[PartialCall] = []
        self.bad = False
        self._frames: list[_Frame] = []
        self._done = False
        self._token: _String | _Scalar | None = None

    def feed(self, text: str) -> None:
        for ch in text:
            if self.bad:
                return
            self._char(ch)

    def _char(self, ch: str) -> None:
        token = self._token
        if isinstance(token, _String):
            self._string_char(token, ch)
            return
        if token is not None:
            number = token.text[0] in "-0123456789"
            if (ch in _NUMBER_CHARS) if number else ch.isalpha():
                token.text += ch
                return
            self._end_scalar(token, number)
            if self.bad:
                return
        if ch in _WHITESPACE:
            return
        self._structural(ch)

    def _out(self, text: str) -> None:
        call = self.calls[-1]
        if not call.frozen:
            call.parts.append(text)

    def _structural(self, ch: str) -> None:
        if not self._frames:
            if self._done:
                self.bad = True  # text after the list
            else:
                self._start_value(ch)
            return
        frame = self._frames[-1]
        if frame.expect in ("value0", "key0") and ch == ("]" if frame.kind == "[" else "}"):
            self._close(frame)
        elif frame.expect in ("value0", "value"):
            self._start_value(ch)
        elif frame.expect in ("key0", "key"):
            if ch != '"':
                self.bad = True
                return
            self._token = _String(frame.captured, "key")
            if frame.captured:
                self._out('"')
        elif frame.expect == "colon":
            self._separator(frame, ch, ":", ": ", "value")
        elif ch == ",":
            self._separator(frame, ch, ",", ", ", "key" if frame.kind == "{" else "value")
        elif ch == ("]" if frame.kind == "[" else "}"):
            self._close(frame)
        else:
            self.bad = True

    def _separator(self, frame: _Frame, ch: str, want: str, written: str, expect: str) -> None:
        if ch != want:
            self.bad = True
            return
        if frame.captured:
            self._out(written)
        frame.expect = expect

    def _close(self, frame: _Frame) -> None:
        self._frames.pop()
        if frame.captured:
            self._out("]" if frame.kind == "[" else "}")
        self._value_done()

    def _value_done(self) -> None:
        if self._frames:
            self._frames[-1].expect = "next"
        else:
            self._done = True

    def _start_value(self, ch: str) -> None:
        level = len(self._frames)  # 0: the list itself, 1: a call object, 2: a call object's value
        parent = self._frames[-1] if self._frames else None
        if (level == 0 and ch != "[") or (level == 1 and ch != "{"):
            self.bad = True
            return
        if level == 1:
            self.calls.append(PartialCall())
        parameters = level == 2 and parent.key == "parameters"
        if parameters:
            call = self.calls[-1]
            call.frozen = call.frozen or call.has_parameters
            call.has_parameters = True
        captured = parameters or (parent is not None and parent.captured)
        if ch in "[{":
            self._frames.append(_Frame(ch, captured, "value0" if ch == "[" else "key0"))
        elif ch == '"':
            self._token = _String(captured, "name" if level == 2 and parent.key == "name" else None)
        elif ch in "-0123456789" or ch.isalpha():
            self._token = _Scalar(captured, ch)
            return
        else:
            self.bad = True
            return
        if captured:
            self._out(ch)

    def _end_scalar(self, token: _Scalar, number: bool) -> None:
        self._token = None
        text = canonical_number(token.text) if number else _LITERALS.get(token.text)
        if text is None:
            self.bad = True
            return
        if token.captured:
            self._out(text)
        self._value_done()

    def _string_char(self, token: _String, ch: str) -> None:
        if token.escape is None:
            if ch == "\\":
                token.escape = "\\"
            elif ch == '"':
                self._end_string(token)
            elif ch < " ":
                self.bad = True  # json.loads refuses a raw control character in a string
            else:
                self._decoded(token, ch, from_escape=False)
        elif token.escape == "\\":
            if ch == "u":
                token.escape = "u"
            elif ch in _ESCAPES:
                token.escape = None
                self._decoded(token, _ESCAPES[ch], from_escape=False)
            else:
                self.bad = True
        elif ch not in _HEX:
            self.bad = True
        else:
            token.escape += ch
            if len(token.escape) == 5:
                code = int(token.escape[1:], 16)
                token.escape = None
                self._decoded(token, chr(code), from_escape=True)

    def _decoded(self, token: _String, c: str, from_escape: bool) -> None:
        """One decoded character of a string; json.loads pairs an escaped high surrogate with an escaped low
        one right after it, and keeps either alone otherwise."""
        if token.high is not None:
            high, token.high = token.high, None
            if from_escape and "\udc00" <= c <= "\udfff":
                pair = (ord(high) - 0xD800) * 0x400 + (ord(c) - 0xDC00) + 0x10000
                self._emit_char(token, chr(pair))
                return
            self._emit_char(token, high)
        if from_escape and "\ud800" <= c <= "\udbff":
            token.high = c
            return
        self._emit_char(token, c)

    def _emit_char(self, token: _String, c: str) -> None:
        if token.role is not None:
            token.chars.append(c)
        if token.captured:
            self._out(canonical_char(c))

    def _end_string(self, token: _String) -> None:
        if token.high is not None:
            self._emit_char(token, token.high)
            token.high = None
        self._token = None
        if token.captured:
            self._out('"')
        if token.role == "key":
            frame = self._frames[-1]
            frame.key, frame.expect = "".join(token.chars), "colon"
            return
        if token.role == "name":
            self.calls[-1].name = "".join(token.chars)
        self._value_done()
