"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a chat reply's text -> (reasoning, content).

The reasoning is the text between `<think>` and `</think>`; the content is what follows `</think>`.
- `qwen3`: the model may write `<think>` itself (it is removed). Without `</think>` in the output the whole
  output is content (a template with enable_thinking=False puts an empty think block in the prompt).
- `deepseek_r1`: the chat template ends the prompt with `<think>`, so the output starts in the reasoning (a
  `<think>` the model writes anyway is removed). Without `</think>` the whole output is reasoning, content None.

Streaming (`ReasoningStream`) splits text that arrives in pieces: a tail that may begin a tag is held back until
the next piece (or the end) says what it is. A stream decides as the text comes, so it sends what the finished
parse would, except where the parse needs the end: under `qwen3`, text after a leading `<think>` streams as
reasoning even if `</think>` never comes (the finished parse calls it content), and text without a leading
`<think>` streams as content even if a `</think>` comes later (as vLLM's streams).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fxrewrite.errors import UserInputError
from fxrewrite.runtime.server.protocol import ChatCompletionRequest
from fxrewrite.runtime.server.request_params import structured_outputs_of
from fxrewrite.runtime.server.streaming import ChoiceDelta
from fxrewrite.runtime.server.tools import tool_mode

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """name: the flag's value. starts_in_reasoning: the output begins inside the think block (the prompt
    opened it) rather than as content."""

    name: str
    starts_in_reasoning: bool

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished reply; each None when empty."""
        body = text.removeprefix(START)
        reasoning, found, content = body.partition(END)
        if not found:
            return (body or None, None) if self.starts_in_reasoning else (None, body)
        return reasoning or None, content or None


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("qwen3", False), ReasoningParser("deepseek_r1", True))}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser named by `--reasoning-parser` (None: no parsing); UserInputError naming the choices."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise UserInputError(f"--reasoning-parser {name!r} is not one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def parser_for_request(parser: ReasoningParser | None, request: ChatCompletionRequest) -> ReasoningParser | None:
    """The parser for one request. None under a forced tool call (tool_choice required or named: the grammar
    writes the call from the first token, so there is no reasoning). Under another output constraint
    (response_format, structured_outputs, guided_*), the grammar also governs the output from its first token
    (vLLM applies it after the reasoning ends), so a reply is reasoning only where it closes a think block:
    `qwen3`'s rules."""
    if parser is None or (request.tools and tool_mode(request) in ("named", "required")):
        return None
    if parser.starts_in_reasoning and structured_outputs_of(request) is not None:
        return REASONING_PARSERS["qwen3"]
    return parser


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """One choice's stream: `feed(piece, finished)` -> (reasoning piece, content piece)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.mode = "start"
        self.pending = ""

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        text, self.pending = self.pending + piece, ""
        reasoning = ""
        if self.mode == "start":
            if START.startswith(text) and len(text) < len(START) and not finished:
                self.pending = text  # "" or the start of "<think>": wait for more
                return "", ""
            if text.startswith(START):
                text, self.mode = text[len(START):], "reasoning"
            else:
                self.mode = "reasoning" if self.parser.starts_in_reasoning else "content"
        if self.mode == "reasoning":
            before, found, after = text.partition(END)
            if not found:
                hold = 0 if finished else _partial_tag_len(text, END)
                self.pending = text[len(text) - hold:]
                return text[:len(text) - hold], ""
            reasoning, text, self.mode = before, after, "content"
        return reasoning, text


class ReasoningStream:
    """Per-request streaming state: each choice's splitter and the content it has passed on."""

    def __init__(self, parser: ReasoningParser | None):
        self.parser = parser
        self._splitters: dict[int, ReasoningSplitter] = {}
        self._content: dict[int, str] = {}

    def split(self, d: ChoiceDelta) -> tuple[str, ChoiceDelta]:
        """(reasoning text new in `d`, `d` over the content alone: its choice's text is the content so far)."""
        if self.parser is None:
            return "", d
        index = d.choice.index
        splitter = self._splitters.setdefault(index, ReasoningSplitter(self.parser))
        reasoning, content = splitter.feed(d.text, d.finished)
        before = self._content.get(index, "")
        self._content[index] = so_far = before + content
        choice = replace(d.choice, source=so_far, text_len=len(so_far))
        return reasoning, replace(d, choice=choice, text=content, text_start=len(before))
